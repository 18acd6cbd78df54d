"""Local entropy-rate calibration with one-step lookahead (Braverman et al., ICML 2020, Algorithm 2).

The calibrated model reweights each candidate next word w by the entropy of what the model would predict after it:

    P_a(w | w_<t) = P(w | w_<t) * exp(a * H_next(w)) / Z_t(a),    H_next(w) = H(P(. | w_<t, w)),

where P is the base model (optionally its eps-mixture with the uniform distribution, (1 - eps) P + eps / V; then the
lookahead entropies are those of the mixture too). The mixture is per token: each next-word distribution is mixed.
The paper mixes whole sequences, (1 - eps) P(w_1..T) + eps U(w_1..T), whose conditionals are not this per-token
mixture. With eps > 0 the "before" model of every comparison is the eps-mixture itself (calibrated(lm, 0, eps=eps)),
so the "before" curve and the "before" cross-entropy come from the same model.

a* minimises the held-out cross-entropy

    CE(a) = mean_t [ -log P(w_t) - a H_next,t(w_t) + log Z_t(a) ],

which is convex in a (CE'' = mean_t Var_{P_a}[H_next] >= 0); at a* the mean of H_next under P_a equals its mean at the
true next words. a < 0 steers generations away from words after which the model is unsure, which counters the upward
drift of the entropy of long generations.

Exact mode (topk None) steps all V candidates per position. Top-k mode steps only a few, and estimates the rest:

- the k most likely words and (in the fit) the true next word y get their exact H_next, so the fit's signal,
  H_next(y) against E_{P_a}[H_next], is never replaced by an average;
- the rest R (its mass P(R)) enters Z_t(a) through m words w_1..w_m drawn with replacement from P restricted to R,
  each an atom of mass P(R) / m carrying its own H_next: Z^_t(a) = sum_exact P(w) e^{a H(w)} + P(R) mean_j e^{a H(w_j)}.

Z^_t(a) and its derivative Z^'_t(a) (= sum P(w) H(w) e^{a H(w)}) are unbiased for every a, and Z^_t(0) = 1 exactly; so
CE(0) is exact and CE'(0) = mean_t (E_P[H] - H(y)) is unbiased. CE(a) (through log Z^) and CE'(a) = Z^'/Z^ - H(y) for
a != 0 are ratios: consistent, with a bias of order 1/m per position that averages over positions no further (the
noise of the draws does, and is part of alpha_stderr). bench/calibration_topk.py measures both against exact mode.

The calibrated StepLM (CalibratedLM) samples from the same estimated distribution: at each step it computes the top-k
exactly, draws m words from the rest, and gives every word w of the rest the estimated mean tilt
e^{a H~} = mean_j e^{a H(w_j)}, so that its normaliser is exactly Z^_t(a) of the fitted family and the rest gets the
family's estimated total mass P(R) e^{a H~} / Z^_t(a), spread over R in proportion to P (one would need every H_next
of R to tilt within it). The true word is not known at generation time, so a test word in R is scored with the
shared tilt: the StepLM's test cross-entropy is that of the model generations are drawn from, not the fit's CE(a).

The draws are a pure function of (seed, the tokens a row has read): each row carries a 32-bit hash of its history,
and draw j uses counter-based uniforms of (seed, hash, j) (lmcal.core.entropy_rate's). So the fit and every step of the
calibrated model are deterministic for a seed, whatever the batching, and rows with other histories get independent
draws.

Everything here runs on the StepLM interface (lmcal.models.step_lm): vocab_size, init_state(B), step(tokens [B],
state) -> (log-probs [B, V], state), select(state, index). Shapes are batch-first per step: rows [B], candidates [K]
or [V].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lmcal.core.expfit import fit_alpha, objective, stream_block_sums
from lmcal.core.lookahead import (
    advance_keys,
    candidate_entropies,
    check_tail,
    draw_tail,
    lookahead_entropies,
    mix_uniform,
    start_keys,
    tail_uniforms,
)
from lmcal.errors import LmcalError
from lmcal.utils.profiling import timed

# ---------------------------------------------------------------------------------------------------------------------
# The objective and its fit
# ---------------------------------------------------------------------------------------------------------------------
# Per predicted position the objective needs the target's (log P(y), H_next(y)) and the distribution of H_next under
# P, kept as K weighted "atoms" (log-weight, H_next): in exact mode the V words; in top-k mode the k most likely words,
# one slot for the true word y (weight 0 when y is among the k) and m tail atoms of weight P(R) / m each (R: all other
# words). P_a is then the tilted family of lmcal.core.expfit with s = H_next over the atoms: log Z(a) =
# logsumexp_j(logw_j + a h_j), CE' = E_{P_a}[h] - h(y), CE'' = Var_{P_a}[h]; exact in exact mode, the unbiased
# importance-sampling estimate of Z(a) of the module docstring in top-k mode.


def stream_block_stderr(g: torch.Tensor, d2: float, streams: int, cluster_size: int) -> float:
    """Sandwich standard error of a* from the per-position gradients g [n] (position order: t-major, `streams`
    streams) and d2 = CE''(a*): blocks of cluster_size consecutive positions of one stream are the independent units
    (dependence along the text; the last block of a stream may be shorter). Var a* ~ sum_blocks (sum g)^2 /
    (n CE'')^2; inf when d2 = 0."""
    if not d2 > 0:
        return math.inf
    return math.sqrt(stream_block_sums(g, streams, cluster_size).pow(2).sum().item()) / (g.numel() * d2)


def _fit(stats: tuple, bound: float, what: str, streams: int = 1, cluster_size: int = 1):
    """Newton's method on the exact objective of the atoms `stats` (see lmcal.core.expfit), from a = 0 and clamped to
    [-bound, bound] with a warning: (a*, CE(0), CE(a*), standard error of a*, positions)."""
    alpha = fit_alpha([stats], bound, clamp=True, what=what)
    ce_before = objective([stats], 0.0)[0]
    (ce_after, _, d2, _), g = objective([stats], alpha, per_row=True)
    return alpha, ce_before, ce_after, stream_block_stderr(g, d2, streams, cluster_size), g.numel()


@dataclass
class CalibrationFit:
    """The fitted a* with its held-out statistics, kept so CE(a) can be evaluated at any a without the model.

    Atoms: logw, h [n, K] float32 on CPU (K = V exact, k + 1 + m top-k), targets' logq_y, h_y [n]; 8*n*K bytes in all.
    In top-k mode CE(a) and its derivatives are those of the estimated Z^(a) of the module docstring.
    """

    alpha: float
    ce_before: float  # CE at a = 0 (of the eps-mixture), nats
    ce_after: float  # CE at a*
    n_tokens: int
    alpha_stderr: float  # sandwich, blocks of cluster_size positions of a stream as units; includes the draws' noise
    topk: int | None
    epsilon: float
    logw: torch.Tensor = field(repr=False)
    h: torch.Tensor = field(repr=False)
    logq_y: torch.Tensor = field(repr=False)
    h_y: torch.Tensor = field(repr=False)
    tail_samples: int = 0  # m (0 in exact mode)
    min_context: int = 0
    cluster_size: int = 1
    seed: int = 0

    def ce_derivatives(self, alpha: float) -> tuple[float, float, float]:
        """(CE(a), CE'(a), CE''(a)) in nats, exact on the stored statistics."""
        return tuple(objective([(self.logw, self.h, self.logq_y, self.h_y)], alpha)[:3])

    def ce_at(self, alpha: float) -> float:
        return self.ce_derivatives(alpha)[0]

    def hnext_means(self, alpha: float) -> tuple[float, float]:
        """(mean over positions of E_{P_a}[H_next], mean H_next at the true next words): equal at a* (moments)."""
        return objective([(self.logw, self.h, self.logq_y, self.h_y)], alpha)[3], self.h_y.double().mean().item()


def _atoms(lm, state, logq: torch.Tensor, y: torch.Tensor, keys: torch.Tensor, topk: int | None, tail_samples: int,
           epsilon: float, seed: int, chunk: int | None):
    """One position's atoms for B rows: (logw [B, K], h [B, K], h_y [B]); logq [B, V] the (eps-mixed) base
    distribution in `state`, y [B] the true next words, keys [B] the rows' history hashes."""
    B, V = logq.shape
    if topk is None:  # every word is an atom, in vocabulary order
        h = lookahead_entropies(lm, state, logq, epsilon, chunk)  # [B, V]
        return logq, h, h.gather(1, y[:, None])[:, 0]
    k = min(topk, V)
    top = logq.topk(k, dim=-1).indices  # [B, k]
    exact = torch.cat([top, y[:, None]], 1)  # [B, k + 1]: the true word is always computed
    m = tail_samples if k < V else 0  # the rest is empty when k = V (and, for a row, when the k and y cover V)
    cand = exact
    if m:
        tail, log_rest = draw_tail(logq, exact, tail_uniforms(seed, keys, m))  # [B, m], [B]
        cand = torch.cat([exact, tail], 1)  # [B, k + 1 + m]
    h = candidate_entropies(lm, state, cand, epsilon, chunk)  # [B, K]
    in_top = top == y[:, None]  # [B, k]
    y_top = in_top.any(1)  # [B]
    # y's own H_next; when y is among the top k, the same number as its top-k atom (bit for bit, whatever the chunking)
    h_y = torch.where(y_top, (h[:, :k] * in_top).sum(1), h[:, k])  # [B]
    logw = torch.cat([logq.gather(1, top), logq.gather(1, y[:, None]).masked_fill(y_top[:, None], -math.inf)], 1)
    if m:
        logw = torch.cat([logw, (log_rest - math.log(m))[:, None].expand(B, m)], 1)  # [B, K]
    return logw, h, h_y


@torch.no_grad()
def lookahead_statistics(lm, tokens: torch.Tensor, topk: int | None = None, epsilon: float = 0.0, *,
                         tail_samples: int = 16, min_context: int = 0, seed: int = 0, chunk: int | None = None,
                         progress: bool = False):
    """One pass over time-major streams tokens [S, B] -> atoms (logw [n, K], h [n, K], logq_y [n], h_y [n]) on CPU,
    in position order t = t0..S-1 (B streams each), t0 = max(1, min_context): the first t0 tokens of every stream are
    read but not predicted, n = (S - t0) * B."""
    S, B = tokens.shape
    t0 = max(1, min_context)
    logw, h, logq_y, h_y = [], [], [], []
    state = lm.init_state(B)
    logp, state = lm.step(tokens[0], state)
    keys = advance_keys(start_keys(B, logp.device), tokens[0])
    steps = range(1, S)
    if progress:
        from lmcal.utils.progress import progress_bar
        steps = progress_bar(steps, desc="lookahead")
    for t in steps:
        y = tokens[t].to(logp.device)  # [B]
        if t >= t0:
            logq = mix_uniform(logp, epsilon)  # [B, V]
            w_t, h_t, hy_t = _atoms(lm, state, logq, y, keys, topk, tail_samples, epsilon, seed, chunk)
            logw.append(w_t.float().cpu())
            h.append(h_t.float().cpu())
            logq_y.append(logq.gather(1, y[:, None])[:, 0].float().cpu())
            h_y.append(hy_t.float().cpu())
        if t < S - 1:
            logp, state = lm.step(y, state)
            keys = advance_keys(keys, y)
    return torch.cat(logw), torch.cat(h), torch.cat(logq_y), torch.cat(h_y)


@timed("fit")
def fit_lookahead_calibration(lm, tokens: torch.Tensor, topk: int | None = None, epsilon: float = 0.0, *,
                              tail_samples: int = 16, min_context: int = 0, seed: int = 0, cluster_size: int = 100,
                              chunk: int | None = None, bound: float = 100.0, progress: bool = False) -> CalibrationFit:
    """Fit a* on held-out time-major streams tokens [S, B]: each stream starts from lm.init_state(B) and its first
    max(1, min_context) tokens are context only, so (S - max(1, min_context)) * B next words are scored
    ((S - 1) * B with min_context 0).

    topk None: exact lookahead. topk k: the k most likely words and the true one exactly, `tail_samples` draws for the
    rest (seeded by `seed`; see the module docstring). alpha_stderr: the sandwich standard error with blocks of
    `cluster_size` consecutive positions of a stream as the independent units.

    Cost: one model step per token plus the lookahead, V (exact) or k + 1 + m (top-k) steps per scored position;
    memory: the atoms, 8 * n * K bytes on CPU. The fit itself is Newton's method on the stored statistics, from a = 0,
    and never touches the model again.
    """
    if tokens.dim() != 2 or tokens.size(0) < 2:
        raise ValueError(f"tokens must be time-major [S, B] with S >= 2, got shape {tuple(tokens.shape)}")
    check_tail(topk, tail_samples)
    if not (isinstance(min_context, int) and min_context >= 0) or tokens.size(0) <= max(1, min_context):
        raise LmcalError(f"min_context={min_context!r}: each fit stream reads that many tokens before any position "
                         f"counts, but the streams are {tokens.size(0)} tokens long. Use a non-negative min_context "
                         "below the stream length (fit_tokens / fit_streams), or longer streams.")
    if isinstance(cluster_size, bool) or not isinstance(cluster_size, int) or cluster_size < 1:
        raise LmcalError(f"cluster_size={cluster_size!r}: positions per block of the standard error must be a "
                         "positive integer.")
    stats = lookahead_statistics(lm, tokens, topk, epsilon, tail_samples=tail_samples, min_context=min_context,
                                 seed=seed, chunk=chunk, progress=progress)
    alpha, ce_before, ce_after, stderr, n = _fit(stats, bound, "lookahead calibration", tokens.size(1), cluster_size)
    return CalibrationFit(alpha, ce_before, ce_after, n, stderr, topk, epsilon, *stats,
                          tail_samples=tail_samples if topk is not None else 0, min_context=min_context,
                          cluster_size=cluster_size, seed=seed)


# ---------------------------------------------------------------------------------------------------------------------
# The calibrated model, and scoring any StepLM
# ---------------------------------------------------------------------------------------------------------------------


class CalibratedLM:
    """P_a as a StepLM. Its state is (the base state, each row's history hash [B]): step advances the base model with
    the fed tokens, then steps candidates from the new state to get H_next: every word (exact, 1 + V base steps per
    row), or the top k and m words drawn from the rest (1 + k + m base steps), the rest then sharing the estimated
    tilt of the module docstring. a = 0 skips the lookahead and is the (eps-mixed) base model exactly."""

    def __init__(self, lm, alpha: float, topk: int | None = None, epsilon: float = 0.0, *, tail_samples: int = 16,
                 seed: int = 0, chunk: int | None = None):
        check_tail(topk, tail_samples)
        self.lm, self.alpha, self.topk, self.epsilon = lm, float(alpha), topk, float(epsilon)
        self.tail_samples, self.seed, self.chunk = tail_samples, seed, chunk
        self.vocab_size = lm.vocab_size
        self.device = getattr(lm, "device", None)

    def init_state(self, batch_size: int):
        return self.lm.init_state(batch_size), start_keys(batch_size, self.device)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state):
        base, keys = state
        logp, base = self.lm.step(tokens, base)  # [B, V]
        keys = advance_keys(keys.to(logp.device), tokens)
        logq = mix_uniform(logp, self.epsilon)
        if self.alpha == 0.0:
            return logq, (base, keys)
        return self._tilted(logq, base, keys).log_softmax(-1), (base, keys)

    def _tilted(self, logq: torch.Tensor, base, keys: torch.Tensor) -> torch.Tensor:
        """log q + a H_next [B, V], unnormalised; in top-k mode the rest's H_next replaced by the shared estimate."""
        B, V = logq.shape
        a = self.alpha
        if self.topk is None or self.topk >= V:
            return logq + a * lookahead_entropies(self.lm, base, logq, self.epsilon, self.chunk)
        m = self.tail_samples
        top = logq.topk(self.topk, dim=-1).indices  # [B, k]
        tail, _ = draw_tail(logq, top, tail_uniforms(self.seed, keys, m))  # [B, m]
        h = candidate_entropies(self.lm, base, torch.cat([top, tail], 1), self.epsilon, self.chunk)  # [B, k + m]
        log_tilt = (a * h[:, self.topk:].double()).logsumexp(-1) - math.log(m)  # [B]: log mean_j e^{a H(w_j)}
        rest = logq + log_tilt.to(logq.dtype)[:, None]  # [B, V]: every word at the shared tilt ...
        return rest.scatter(1, top, logq.gather(1, top) + a * h[:, :self.topk])  # ... the top k at their own

    def select(self, state, index: torch.Tensor):
        base, keys = state
        return self.lm.select(base, index), keys[index.to(keys.device)]


def calibrated(lm, alpha: float, topk: int | None = None, epsilon: float = 0.0, *, tail_samples: int = 16,
               seed: int = 0, chunk: int | None = None) -> CalibratedLM:
    """The lookahead-calibrated StepLM P_a of `lm` (see CalibratedLM)."""
    return CalibratedLM(lm, alpha, topk, epsilon, tail_samples=tail_samples, seed=seed, chunk=chunk)


@torch.no_grad()
def topk_coverage(cal: CalibratedLM, tokens: torch.Tensor) -> dict:
    """How far the calibrated StepLM in top-k mode is from the fitted family, along time-major streams tokens [S, B]
    (first token context only): the mean mass it gives outside the top k (the words sharing one estimated tilt), and
    the fraction of true next words that fall there (each scored with that shared tilt, where the fit gave it its
    own). In exact mode (topk None or >= V) both are 0 by construction."""
    S, B = tokens.shape
    if cal.topk is None or cal.topk >= cal.vocab_size:
        return {"mass_outside_topk": 0.0, "true_word_outside_topk": 0.0, "positions": (S - 1) * B}
    base, keys = cal.init_state(B)
    mass, outside = [], []
    for t in range(S - 1):
        logp, base = cal.lm.step(tokens[t], base)  # [B, V]: as CalibratedLM.step, keeping the top k it tilts
        keys = advance_keys(keys.to(logp.device), tokens[t])
        logq = mix_uniform(logp, cal.epsilon)
        top = logq.topk(cal.topk, dim=-1).indices  # [B, k]
        logc = cal._tilted(logq, base, keys).log_softmax(-1)  # [B, V]
        mass.append((1 - logc.gather(1, top).exp().sum(-1)).double().cpu())  # [B]
        outside.append((top != tokens[t + 1].to(top.device)[:, None]).all(-1).cpu())  # [B]
    mass, outside = torch.cat(mass), torch.cat(outside)
    return {"mass_outside_topk": mass.mean().item(), "true_word_outside_topk": outside.double().mean().item(),
            "positions": mass.numel()}


@torch.no_grad()
def target_log_probs(lm, tokens: torch.Tensor, progress: bool = False) -> torch.Tensor:
    """log q(next word) of any StepLM along time-major streams tokens [S, B] (first token context only):
    float64 [(S-1)*B], in position order t = 1..S-1 (B streams each); -inf where q gives the word probability 0.
    progress: a progress line now and then ("scoring"), with the time left."""
    from lmcal.utils.progress import progress_bar

    S, B = tokens.shape
    state = lm.init_state(B)
    out = []
    for t in progress_bar(range(S - 1), desc="scoring", disable=not progress, leave=False):
        logp, state = lm.step(tokens[t], state)  # [B, V]
        out.append(logp.gather(1, tokens[t + 1].to(logp.device)[:, None])[:, 0].double().cpu())
    return torch.cat(out)


@timed("scoring")
def score(lm, tokens: torch.Tensor) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) of any StepLM on time-major streams tokens [S, B] (first token context
    only); returns (ce, (S-1)*B)."""
    logq = target_log_probs(lm, tokens)
    return -logq.mean().item(), logq.numel()


# ---------------------------------------------------------------------------------------------------------------------
# Fitted temperature: the second one-parameter calibration
# ---------------------------------------------------------------------------------------------------------------------
# P_b ∝ P^b (b = 1/T) is P * exp((b - 1) log P): the lookahead family with log P itself as the statistic in place of
# H_next. So the same atoms serve, (logw, h) = (log P, log P) over the vocabulary, and the same exact objective and
# Newton fit (lmcal.core.expfit) give a = b - 1: CE(b) = mean_t [-b log P(w_t) + log sum_w P(w)^b], convex,
# CE'' = Var_{P_b}[log P].


@dataclass
class TemperatureFit:
    temperature: float  # T* = 1 / b*
    temperature_stderr: float  # delta method on the sandwich standard error of b*
    ce_before: float  # CE at T = 1, nats
    ce_after: float  # CE at T*
    n_tokens: int


@torch.no_grad()
def next_token_rows(lm, tokens: torch.Tensor, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over time-major streams tokens [S, B] -> (log P rows [n, V] float32 on CPU, next words [n]),
    n = (S-1)*B, in position order t = 1..S-1 (B streams each)."""
    S, B = tokens.shape
    state = lm.init_state(B)
    rows, ys = [], []
    steps = range(S - 1)
    if progress:
        from lmcal.utils.progress import progress_bar
        steps = progress_bar(steps, desc="scoring")
    for t in steps:
        logp, state = lm.step(tokens[t], state)  # [B, V]
        rows.append(logp.float().cpu())
        ys.append(tokens[t + 1].cpu())
    return torch.cat(rows), torch.cat(ys)


@timed("fit")
def fit_temperature(lm, tokens: torch.Tensor, bound: float = 100.0, progress: bool = False) -> TemperatureFit:
    """Fit T* of P^(1/T) by held-out cross-entropy on time-major streams tokens [S, B] (first token context only),
    exactly as fit_lookahead_calibration fits a*: one pass collects the rows, Newton's method runs on them.
    Memory: the rows, 4*(S-1)*B*V bytes."""
    if tokens.dim() != 2 or tokens.size(0) < 2:
        raise ValueError(f"tokens must be time-major [S, B] with S >= 2, got shape {tuple(tokens.shape)}")
    rows, y = next_token_rows(lm, tokens, progress)
    rows.clamp_(min=-1e4)  # a word of probability 0 (log -inf) would make 0 * -inf = nan at a = 0; e^-1e4 is 0 too
    logp_y = rows.gather(1, y[:, None].long())[:, 0]  # [n]
    a, ce_before, ce_after, se_b, n = _fit((rows, rows, logp_y, logp_y), bound, "temperature fit (alpha = 1/T - 1)")
    b = 1.0 + a
    if b <= 0:
        raise RuntimeError(f"the fitted inverse temperature {b:.3g} is not positive: the model is worse than uniform")
    return TemperatureFit(1.0 / b, se_b / b**2, ce_before, ce_after, n)

