"""Local entropy-rate calibration with one-step lookahead (Braverman et al., ICML 2020, Algorithm 2).

The calibrated model reweights each candidate next word w by the entropy of what the model would predict after it:

    P_a(w | w_<t) = P(w | w_<t) * exp(a * H_next(w)) / Z_t(a),    H_next(w) = H(P(. | w_<t, w)),

where P is the base model (optionally its eps-mixture with the uniform distribution, (1 - eps) P + eps / V; then the
lookahead entropies are those of the mixture too). a* minimises the held-out cross-entropy

    CE(a) = mean_t [ -log P(w_t) - a H_next,t(w_t) + log Z_t(a) ],

which is convex in a (CE'' = mean_t Var_{P_a}[H_next] >= 0); at a* the mean of H_next under P_a equals its mean at the
true next words. a < 0 steers generations away from words after which the model is unsure, which counters the upward
drift of the entropy of long generations.

Everything here runs on the StepLM interface (lmcal.lm): vocab_size, init_state(B), step(tokens [B], state) ->
(log-probs [B, V], state), select(state, index). Shapes are batch-first per step: rows [B], candidates [K] or [V].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lmcal.expfit import fit_alpha, objective, sandwich_stderr

# ---------------------------------------------------------------------------------------------------------------------
# The lookahead
# ---------------------------------------------------------------------------------------------------------------------


def mix_uniform(logp: torch.Tensor, epsilon: float, vocab_size: int | None = None) -> torch.Tensor:
    """log((1 - eps) P + eps / V) of log-probs [..., V]; eps = 0 returns logp itself (bit for bit). vocab_size: V
    when logp is not a whole row (e.g. the log-probs of the true next words only, [n]).

    The mixture is per token: each next-word distribution is mixed with the uniform one. The paper mixes whole
    sequences, (1 - eps) P(w_1..T) + eps U(w_1..T), whose conditionals are not this per-token mixture; both keep every
    cross-entropy finite."""
    if epsilon == 0.0:
        return logp
    if not 0.0 < epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    V = vocab_size or logp.size(-1)
    return torch.logaddexp(logp + math.log1p(-epsilon), torch.full_like(logp, math.log(epsilon / V)))


def entropy(logp: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy in nats of each row of log-probs [..., V] -> [...] (0 log 0 = 0); p: logp.exp() if already at hand."""
    p = logp.exp() if p is None else p
    # clamp: p * -inf would be nan where p = 0, and finite log-probs lie far above the dtype's minimum. No branch on
    # the values, so no device sync inside generation loops.
    return -(p * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)


def _candidate_entropies(lm, state, cand: torch.Tensor, epsilon: float, chunk: int) -> torch.Tensor:
    """H of the (eps-mixed) next distribution after feeding candidate cand[b, k] to state row b. cand [B, K] -> [B, K].

    All B*K (row, candidate) pairs are flattened and stepped `chunk` at a time from copies of their row's state.
    """
    B, K = cand.shape
    rows = torch.arange(B, device=cand.device).repeat_interleave(K)  # [B*K]: row b repeated K times
    toks = cand.reshape(-1)  # [B*K]
    h = []
    for i in range(0, B * K, chunk):
        lp, _ = lm.step(toks[i:i + chunk], lm.select(state, rows[i:i + chunk]))  # [c, V]
        h.append(entropy(mix_uniform(lp, epsilon)))  # [c]
    return torch.cat(h).view(B, K)


def _lookahead(lm, state, logq: torch.Tensor, topk: int | None, epsilon: float, chunk: int):
    """The computed part of the lookahead: (cand [B, K], h [B, K], h_rest [B] or None).

    logq [B, V] is the (eps-mixed) base distribution. Exact mode (topk None): cand is every token. Top-k mode: cand is
    each row's k most likely tokens, and h_rest, the value shared by all other tokens, is the logq-weighted mean of h
    over the k computed ones (None when k >= V: nothing is left over).
    """
    B, V = logq.shape
    if topk is None:
        cand = torch.arange(V, device=logq.device).expand(B, V)  # [B, V]
    else:
        if topk < 1:
            raise ValueError(f"topk must be a positive integer or None, got {topk}")
        cand = logq.topk(min(topk, V), dim=-1).indices  # [B, k]
    h = _candidate_entropies(lm, state, cand, epsilon, chunk)  # [B, K]
    if cand.size(1) == V:
        return cand, h, None
    w = logq.gather(1, cand).softmax(-1)  # [B, k]: the top-k mass, renormalised
    return cand, h, (w * h).sum(-1)


@torch.no_grad()
def lookahead_entropies(lm, state, logp: torch.Tensor, topk: int | None = None, epsilon: float = 0.0,
                        chunk: int = 8192) -> torch.Tensor:
    """H_next(w) for every candidate w of every row: [B, V].

    state: the lm state of B rows; logp [B, V]: the lm's next-token log-probs in that state (raw, eps is applied here).
    Exact (topk None): every candidate is stepped, V forwards per row. Top-k: the k most likely candidates of each
    row are stepped, every other candidate gets their P-weighted mean entropy. At most `chunk` rows per forward.
    """
    logq = mix_uniform(logp, epsilon)
    cand, h, h_rest = _lookahead(lm, state, logq, topk, epsilon, chunk)
    if h_rest is None:
        return torch.empty_like(h).scatter_(1, cand, h)
    return h_rest[:, None].expand_as(logq).clone().scatter_(1, cand, h)  # [B, V]


# ---------------------------------------------------------------------------------------------------------------------
# The objective and its fit
# ---------------------------------------------------------------------------------------------------------------------
# Per predicted position the objective needs the target's (log P(y), H_next(y)) and the distribution of H_next under
# P, which we keep as K weighted "atoms" (log-weight, H_next): in exact mode the V candidates, in top-k mode the k
# computed candidates plus one atom holding the rest of the mass at the shared value. P_a is then the tilted family of
# lmcal.expfit with s = H_next over the atoms, exact for any a: log Z(a) = logsumexp_j(logw_j + a h_j),
# CE' = E_{P_a}[h] - h(y), CE'' = Var_{P_a}[h].


def _fit(stats: tuple, bound: float, what: str) -> tuple[float, float, float, float, int]:
    """Newton's method on the exact objective of the atoms `stats` (see lmcal.expfit), from a = 0 and clamped to
    [-bound, bound] with a warning: (a*, CE(0), CE(a*), sandwich standard error of a*, positions)."""
    alpha = fit_alpha([stats], bound, clamp=True, what=what)
    ce_before = objective([stats], 0.0)[0]
    (ce_after, _, d2, _), g = objective([stats], alpha, per_row=True)
    return alpha, ce_before, ce_after, sandwich_stderr(g, d2), g.numel()


@dataclass
class CalibrationFit:
    """The fitted a* with its held-out statistics, kept so CE(a) can be evaluated at any a without the model.

    Atoms: logw, h [n, K] float32 on CPU (K = V exact, k + 1 top-k), targets' logq_y, h_y [n]; 8*n*K bytes in all.
    """

    alpha: float
    ce_before: float  # CE at a = 0 (of the eps-mixture), nats
    ce_after: float  # CE at a*
    n_tokens: int
    alpha_stderr: float  # sandwich standard error of a*, treating positions as independent
    topk: int | None
    epsilon: float
    logw: torch.Tensor = field(repr=False)
    h: torch.Tensor = field(repr=False)
    logq_y: torch.Tensor = field(repr=False)
    h_y: torch.Tensor = field(repr=False)

    def ce_derivatives(self, alpha: float) -> tuple[float, float, float]:
        """(CE(a), CE'(a), CE''(a)) in nats, exact on the stored statistics."""
        return tuple(objective([(self.logw, self.h, self.logq_y, self.h_y)], alpha)[:3])

    def ce_at(self, alpha: float) -> float:
        return self.ce_derivatives(alpha)[0]

    def hnext_means(self, alpha: float) -> tuple[float, float]:
        """(mean over positions of E_{P_a}[H_next], mean H_next at the true next words): equal at a* (moments)."""
        return objective([(self.logw, self.h, self.logq_y, self.h_y)], alpha)[3], self.h_y.double().mean().item()


@torch.no_grad()
def lookahead_statistics(lm, tokens: torch.Tensor, topk: int | None = None, epsilon: float = 0.0,
                         chunk: int = 8192, progress: bool = False):
    """One pass over time-major streams tokens [S, B] -> atoms (logw [n, K], h [n, K], logq_y [n], h_y [n]) on CPU,
    n = (S-1)*B, in position order t = 1..S-1 (B streams each)."""
    S, B = tokens.shape
    V = lm.vocab_size
    logw, h, logq_y, h_y = [], [], [], []
    state = lm.init_state(B)
    logp, state = lm.step(tokens[0], state)
    steps = range(1, S)
    if progress:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc="lookahead")
    for t in steps:
        y = tokens[t].to(logp.device)  # [B]
        logq = mix_uniform(logp, epsilon)  # [B, V]
        cand, hc, h_rest = _lookahead(lm, state, logq, topk, epsilon, chunk)  # [B, K], [B, K], [B] | None
        if h_rest is None:
            w_t, h_t = logq.gather(1, cand), hc  # every token is an atom
            h_full = torch.empty_like(hc).scatter_(1, cand, hc)  # [B, V]
        else:
            rest = logq.scatter(1, cand, -math.inf).logsumexp(-1)  # [B]: log mass of the tokens not computed
            w_t, h_t = torch.cat([logq.gather(1, cand), rest[:, None]], 1), torch.cat([hc, h_rest[:, None]], 1)
            h_full = h_rest[:, None].expand(B, V).clone().scatter_(1, cand, hc)  # [B, V]
        logw.append(w_t.float().cpu())
        h.append(h_t.float().cpu())
        logq_y.append(logq.gather(1, y[:, None])[:, 0].float().cpu())
        h_y.append(h_full.gather(1, y[:, None])[:, 0].float().cpu())
        if t < S - 1:
            logp, state = lm.step(y, state)
    return torch.cat(logw), torch.cat(h), torch.cat(logq_y), torch.cat(h_y)


def fit_lookahead_calibration(lm, tokens: torch.Tensor, topk: int | None = None, epsilon: float = 0.0,
                              chunk: int = 8192, bound: float = 100.0, progress: bool = False) -> CalibrationFit:
    """Fit a* on held-out time-major streams tokens [S, B]: each stream starts from lm.init_state(B), its first
    token is context only, so (S-1)*B next words are scored.

    Cost: one model step per position plus the lookahead, V (exact) or k (top-k) steps per position; memory: the
    atoms, 8*(S-1)*B*K bytes on CPU (K = V exact, k + 1 top-k). The fit itself is Newton's method on the stored
    statistics, from a = 0, and never touches the model again.
    """
    if tokens.dim() != 2 or tokens.size(0) < 2:
        raise ValueError(f"tokens must be time-major [S, B] with S >= 2, got shape {tuple(tokens.shape)}")
    stats = lookahead_statistics(lm, tokens, topk, epsilon, chunk, progress)
    alpha, ce_before, ce_after, stderr, n = _fit(stats, bound, "lookahead calibration")
    return CalibrationFit(alpha, ce_before, ce_after, n, stderr, topk, epsilon, *stats)


# ---------------------------------------------------------------------------------------------------------------------
# The calibrated model, and scoring any StepLM
# ---------------------------------------------------------------------------------------------------------------------


class CalibratedLM:
    """P_a as a StepLM. Its state is the base state: step advances the base model with the fed tokens, then steps
    every (or every top-k) candidate from the new state to get H_next, so each step costs 1 + V (or 1 + k) base
    steps per row. a = 0 skips the lookahead and is the (eps-mixed) base model exactly."""

    def __init__(self, lm, alpha: float, topk: int | None = None, epsilon: float = 0.0, chunk: int = 8192):
        self.lm, self.alpha, self.topk, self.epsilon, self.chunk = lm, float(alpha), topk, float(epsilon), chunk
        self.vocab_size = lm.vocab_size
        self.device = getattr(lm, "device", None)

    def init_state(self, batch_size: int):
        return self.lm.init_state(batch_size)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state):
        logp, state = self.lm.step(tokens, state)  # [B, V]
        logq = mix_uniform(logp, self.epsilon)
        if self.alpha == 0.0:
            return logq, state
        h = lookahead_entropies(self.lm, state, logp, self.topk, self.epsilon, self.chunk)  # [B, V]
        return (logq + self.alpha * h).log_softmax(-1), state

    def select(self, state, index: torch.Tensor):
        return self.lm.select(state, index)


def calibrated(lm, alpha: float, topk: int | None = None, epsilon: float = 0.0, chunk: int = 8192) -> CalibratedLM:
    """The lookahead-calibrated StepLM P_a of `lm` (see CalibratedLM)."""
    return CalibratedLM(lm, alpha, topk, epsilon, chunk)


@torch.no_grad()
def target_log_probs(lm, tokens: torch.Tensor) -> torch.Tensor:
    """log q(next word) of any StepLM along time-major streams tokens [S, B] (first token context only):
    float64 [(S-1)*B], in position order t = 1..S-1 (B streams each); -inf where q gives the word probability 0."""
    S, B = tokens.shape
    state = lm.init_state(B)
    out = []
    for t in range(S - 1):
        logp, state = lm.step(tokens[t], state)  # [B, V]
        out.append(logp.gather(1, tokens[t + 1].to(logp.device)[:, None])[:, 0].double().cpu())
    return torch.cat(out)


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
# Newton fit (lmcal.expfit) give a = b - 1: CE(b) = mean_t [-b log P(w_t) + log sum_w P(w)^b], convex,
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
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc="scoring")
    for t in steps:
        logp, state = lm.step(tokens[t], state)  # [B, V]
        rows.append(logp.float().cpu())
        ys.append(tokens[t + 1].cpu())
    return torch.cat(rows), torch.cat(ys)


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
