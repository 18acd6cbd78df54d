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

Exact mode (topk and cover None) steps all V candidates per position. The other candidate rules (top-k; cover: the
smallest set holding a share of P's mass) step only their candidates and give the rest R one shared tilt estimated
from m words drawn from it (lmcal.core.lookahead_law). That is one law, built by one function (law_atoms) for the fit,
the test scoring and generation alike: the a* fitted is the a* of the law that generates, its fitted CE(a) is the
CE the calibrated StepLM scores on the same text, and a true word in R shares the tilt in the fit as in generation.
bench/calibration_topk.py measures each rule against exact mode; hnext_shifts measures what each keeps of the exact
tilt at states of the model's own generations.

The draws are a pure function of (seed, the tokens a row has read): each row carries a 32-bit hash of its history,
and draw j uses counter-based uniforms of (seed, hash, j) (lmcal.core.entropy_rate's). So the fit and every step of the
calibrated model are deterministic for a seed, whatever the batching; other histories get independent draws.

Everything here runs on the StepLM interface (lmcal.models.step_lm): vocab_size, init_state(B), step(tokens [B],
state) -> (log-probs [B, V], state), select(state, index). Shapes are batch-first per step: rows [B], candidates [K]
or [V].
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from lmcal.core.expfit import fit_alpha, newton_minimize, objective, stream_block_sums
from lmcal.core.lookahead import advance_keys, mix_uniform, start_keys
from lmcal.core.lookahead_law import (
    Rule,
    law_atoms,
    law_log_probs,
    law_objective,
    make_rule,
    target_slots,
)
from lmcal.core.sampling import read_prefix
from lmcal.errors import LmcalError
from lmcal.utils.device import host_blocks
from lmcal.utils.profiling import timed

log = logging.getLogger("lmcal")

# ---------------------------------------------------------------------------------------------------------------------
# The objective and its fit
# ---------------------------------------------------------------------------------------------------------------------
# Per predicted position the objective needs the law's atoms (lmcal.core.lookahead_law: the m tail atoms, then the
# candidates, as (log-weight, H_next)), log P(y) and which atom y is (-1: y is in the rest and shares the tail's tilt).
# In exact mode the atoms are the V words and this is the tilted family of lmcal.core.expfit with s = H_next.


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


def _fit_law(stats: tuple, m: int, bound: float, streams: int, cluster_size: int):
    """a* of the law's held-out CE (Newton's method bracketed by the sign of CE', from a = 0; CE need not be convex
    with a shared tilt) within [-bound, bound], with a warning at the bound: (a*, CE(0), CE(a*), its standard error,
    positions)."""
    alpha = newton_minimize(lambda a: law_objective(stats, m, a)[1:3], -bound, bound)
    ce_before = law_objective(stats, m, 0.0)[0]
    if bound - abs(alpha) < 1e-6:
        alpha = math.copysign(bound, alpha)
        log.warning(f"lookahead calibration: held-out CE keeps falling up to |alpha| = {bound}; using alpha = "
                    f"{alpha:g}, the minimum over [-bound, bound]. Fit on more, or more varied, text.")
    (ce_after, _, d2, _, _), g, _ = law_objective(stats, m, alpha, per_row=True)
    if ce_after > ce_before + 1e-12:  # a stationary point that is no minimum (CE is not convex here): keep a = 0
        log.warning(f"lookahead calibration: the stationary point alpha = {alpha:.4g} has a higher CE than alpha = 0 "
                    f"({ce_after:.6f} > {ce_before:.6f}); using alpha = 0.")
        alpha = 0.0
        (ce_after, _, d2, _, _), g, _ = law_objective(stats, m, alpha, per_row=True)
    return alpha, ce_before, ce_after, stream_block_stderr(g, d2, streams, cluster_size), g.numel()


@dataclass
class CalibrationFit:
    """The fitted a* with its held-out statistics, kept so CE(a) can be evaluated at any a without the model.

    Statistics (lmcal.core.lookahead_law): logw, h [n, K] float32 on CPU (K = V exact; m + the largest candidate set
    otherwise, the m tail atoms first), logq_y [n] and y's atom slot [n] (-1: y in the rest); 8*n*K bytes in all.
    CE(a) is that of the law that generates (CalibratedLM with the same rule and seed) on the fitted positions.
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
    slot: torch.Tensor = field(repr=False)
    tail_samples: int = 0  # m (0 in exact mode)
    min_context: int = 0
    cluster_size: int = 1
    seed: int = 0
    cover: float | None = None
    cover_max: int | None = None
    candidates_mean: float = 0.0  # own-tilt candidates per position, on average (V in exact mode)
    bound: float = 100.0  # |alpha| the fit searched within; alpha at it is no finite minimum (at_bound)

    @property
    def at_bound(self) -> bool:
        """Whether a* is the search's bound: held-out CE still fell there, so a* is the bound, not a minimum."""
        return self.bound - abs(self.alpha) < 1e-6

    @property
    def stats(self) -> tuple:
        return self.logw, self.h, self.logq_y, self.slot

    @property
    def rule(self) -> Rule:
        return make_rule(self.topk, self.cover, self.cover_max, self.tail_samples or None)

    def ce_derivatives(self, alpha: float) -> tuple[float, float, float]:
        """(CE(a), CE'(a), CE''(a)) in nats, exact on the stored statistics."""
        return tuple(law_objective(self.stats, self.tail_samples, alpha)[:3])

    def ce_at(self, alpha: float) -> float:
        return self.ce_derivatives(alpha)[0]

    def per_position_ce(self, alpha: float) -> torch.Tensor:
        """CE_t(a) of every position [n] float64, in position order (t-major)."""
        return law_objective(self.stats, self.tail_samples, alpha, per_row=True)[2]

    def hnext_means(self, alpha: float) -> tuple[float, float]:
        """(mean over positions of E_{P_a}[H_next], mean of the targets' statistic: H_next(y), or the tail's tilted
        mean E_{tail,a}[H_next] where y is in the rest): equal at a* (moments)."""
        return tuple(law_objective(self.stats, self.tail_samples, alpha)[3:5])


def _pad(x: list[torch.Tensor], fill: float) -> torch.Tensor:
    """Per-step [B, K_t] pieces as one [n, max K_t], padded with `fill`."""
    K = max(t.size(1) for t in x)
    return torch.cat([torch.nn.functional.pad(t, (0, K - t.size(1)), value=fill) for t in x])


@torch.no_grad()
def law_positions(lm, tokens: torch.Tensor, rule: Rule, epsilon: float = 0.0, *, min_context: int = 0, seed: int = 0,
                  chunk: int | None = None, progress: bool = False):
    """One pass over time-major streams tokens [S, B], yielding at each scored step t = t0..S-1 (t0 = max(1,
    min_context); the first t0 tokens of every stream are read but not predicted) the law's statistics of its B
    positions: (logw [B, K_t], h [B, K_t], log q(y) [B], y's atom slot [B], candidates [B]), on the model's device."""
    S, B = tokens.shape
    t0 = max(1, min_context)
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
            words, mask, logw, h = law_atoms(lm, state, logq, keys, rule, seed, epsilon, chunk)
            yield logw, h, logq.gather(1, y[:, None])[:, 0], target_slots(words, mask, y, rule.draws), mask.sum(1)
        if t < S - 1:
            logp, state = lm.step(y, state)
            keys = advance_keys(keys, y)


def lookahead_statistics(lm, tokens: torch.Tensor, topk: int | None = None, epsilon: float = 0.0, *,
                         tail_samples: int = 16, min_context: int = 0, seed: int = 0, chunk: int | None = None,
                         progress: bool = False, cover: float | None = None, cover_max: int | None = None):
    """The law's statistics of every scored position of law_positions, kept on CPU: ((logw [n, K], h [n, K], logq_y
    [n], slot [n]), the mean candidates per position), n = (S - t0) * B in position order (t-major)."""
    rule = make_rule(topk, cover, cover_max, tail_samples)
    fills = (-math.inf, 0.0, None, None, None)  # logw and h are [B, K_t] (K_t varies with the rule): padded
    dtypes = (torch.float32, torch.float32, torch.float32, None, torch.float64)
    kept = [[] for _ in fills]  # on the CPU; one copy a statistic per block of steps
    for block in host_blocks(law_positions(lm, tokens, rule, epsilon, min_context=min_context, seed=seed, chunk=chunk,
                                           progress=progress)):
        for k, xs, fill, d in zip(kept, zip(*block, strict=True), fills, dtypes, strict=True):
            x = torch.cat(xs) if fill is None else _pad(list(xs), fill)
            k.append((x if d is None else x.to(d)).cpu())
    logw, h, logq_y, slot, sizes = kept
    return (_pad(logw, -math.inf), _pad(h, 0.0), torch.cat(logq_y), torch.cat(slot)), torch.cat(sizes).mean().item()


@timed("fit")
def fit_lookahead_calibration(lm, tokens: torch.Tensor, rule: Rule | None = None, epsilon: float = 0.0, *,
                              min_context: int = 0, seed: int = 0, cluster_size: int = 100, chunk: int | None = None,
                              bound: float = 100.0, progress: bool = False) -> CalibrationFit:
    """Fit a* on held-out time-major streams tokens [S, B]: each stream starts from lm.init_state(B) and its first
    max(1, min_context) tokens are context only, so (S - max(1, min_context)) * B next words are scored
    ((S - 1) * B with min_context 0).

    rule: the candidate rule (lmcal.core.lookahead_law.Rule, e.g. make_rule(topk=8) or make_rule(cover=0.95,
    cover_max=64)); None, exact lookahead over every word. The words outside the candidates share one tilt from the
    rule's `tail_samples` draws (seeded by `seed`). alpha_stderr: the sandwich standard error with blocks of
    `cluster_size` consecutive positions of a stream as the independent units.

    Cost: one model step per token plus the lookahead, V (exact) or |C| + m steps per scored position; memory: the
    statistics, 8 * n * K bytes on CPU. The fit itself runs on the stored statistics and never touches the model
    again.
    """
    if tokens.dim() != 2 or tokens.size(0) < 2:
        raise ValueError(f"tokens must be time-major [S, B] with S >= 2, got shape {tuple(tokens.shape)}")
    if rule is not None and not isinstance(rule, Rule):
        raise LmcalError(f"rule={rule!r}: the lookahead's candidate rule is a lmcal.core.lookahead_law.Rule (e.g. "
                         "make_rule(topk=8)), or None for exact lookahead.")
    # A Rule built directly skips make_rule's checks: check it here, as every rule the fit uses is.
    rule = make_rule() if rule is None else make_rule(rule.topk, rule.cover, rule.cover_max, rule.tail_samples)
    if not (isinstance(min_context, int) and min_context >= 0) or tokens.size(0) <= max(1, min_context):
        raise LmcalError(f"min_context={min_context!r}: each fit stream reads that many tokens before any position "
                         f"counts, but the streams are {tokens.size(0)} tokens long. Use a non-negative min_context "
                         "below the stream length (fit_tokens / fit_streams), or longer streams.")
    if isinstance(cluster_size, bool) or not isinstance(cluster_size, int) or cluster_size < 1:
        raise LmcalError(f"cluster_size={cluster_size!r}: positions per block of the standard error must be a "
                         "positive integer.")
    stats, size = lookahead_statistics(lm, tokens, rule.topk, epsilon, tail_samples=rule.tail_samples,
                                       min_context=min_context, seed=seed, chunk=chunk, progress=progress,
                                       cover=rule.cover, cover_max=rule.cover_max)
    alpha, ce_before, ce_after, stderr, n = _fit_law(stats, rule.draws, bound, tokens.size(1), cluster_size)
    return CalibrationFit(alpha, ce_before, ce_after, n, stderr, rule.topk, epsilon, *stats,
                          tail_samples=rule.draws, min_context=min_context, cluster_size=cluster_size, seed=seed,
                          cover=rule.cover, cover_max=rule.cover_max, candidates_mean=size, bound=bound)


# ---------------------------------------------------------------------------------------------------------------------
# The calibrated model, and scoring any StepLM
# ---------------------------------------------------------------------------------------------------------------------


class CalibratedLM:
    """P_a as a StepLM: the law of lmcal.core.lookahead_law, the one the fit fitted. Its state is (the base state,
    each row's history hash [B]): step advances the base model with the fed tokens, then steps the rule's candidates
    and tail draws from the new state (exact: every word, 1 + V base steps per row). a = 0 skips the lookahead and is
    the (eps-mixed) base model exactly. `prefill` feeds a prompt to the base model and calibrates its last step only."""

    def __init__(self, lm, alpha: float, topk: int | None = None, epsilon: float = 0.0, *, tail_samples: int = 16,
                 seed: int = 0, chunk: int | None = None, cover: float | None = None, cover_max: int | None = None):
        self.rule = make_rule(topk, cover, cover_max, tail_samples)
        self.lm, self.alpha, self.epsilon = lm, float(alpha), float(epsilon)
        self.topk, self.tail_samples, self.seed, self.chunk = self.rule.topk, self.rule.tail_samples, seed, chunk
        self.vocab_size = lm.vocab_size
        self.device = getattr(lm, "device", None)

    def init_state(self, batch_size: int):
        return self.lm.init_state(batch_size), start_keys(batch_size, self.device)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state):
        base, keys = state
        logp, base = self.lm.step(tokens, base)  # [B, V]
        keys = advance_keys(keys.to(logp.device), tokens)
        return self._law(logp, base, keys), (base, keys)

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor, state):
        """Feeds prompt [B, L] (as L steps would): the base model reads it (its own prefill where it has one), and
        only the distribution after its last token is calibrated; the same result as L steps, L - 1 lookaheads
        fewer."""
        base, keys = state
        logp, base = read_prefix(self.lm, prompt, base)
        for i in range(prompt.size(1)):
            keys = advance_keys(keys.to(logp.device), prompt[:, i])
        return self._law(logp, base, keys), (base, keys)

    def _law(self, logp: torch.Tensor, base, keys: torch.Tensor) -> torch.Tensor:
        logq = mix_uniform(logp, self.epsilon)
        if self.alpha == 0.0:
            return logq
        atoms = law_atoms(self.lm, base, logq, keys, self.rule, self.seed, self.epsilon, self.chunk)
        return law_log_probs(logq, atoms, self.alpha, self.rule.draws)

    def select(self, state, index: torch.Tensor):
        base, keys = state
        return self.lm.select(base, index), keys[index.to(keys.device)]


def calibrated(lm, alpha: float, topk: int | None = None, epsilon: float = 0.0, *, tail_samples: int = 16,
               seed: int = 0, chunk: int | None = None, cover: float | None = None,
               cover_max: int | None = None) -> CalibratedLM:
    """The lookahead-calibrated StepLM P_a of `lm` (see CalibratedLM)."""
    return CalibratedLM(lm, alpha, topk, epsilon, tail_samples=tail_samples, seed=seed, chunk=chunk, cover=cover,
                        cover_max=cover_max)


@torch.no_grad()
def topk_coverage(cal: CalibratedLM, tokens: torch.Tensor) -> dict:
    """How much of the calibrated law shares the rest's one estimated tilt, along time-major streams tokens [S, B]
    (first token context only): the mean mass it gives outside its candidates, the fraction of true next words that
    fall there, and the mean candidates per position. In exact mode the first two are 0 by construction."""
    S, B = tokens.shape
    if cal.rule.exact or (cal.topk or 0) >= cal.vocab_size:
        return {"mass_outside_topk": 0.0, "true_word_outside_topk": 0.0, "positions": (S - 1) * B,
                "candidates_mean": float(cal.vocab_size)}
    base, keys = cal.init_state(B)
    mass, outside, sizes = [], [], []
    for t in range(S - 1):
        logp, base = cal.lm.step(tokens[t], base)  # [B, V]: as CalibratedLM.step, keeping the candidates
        keys = advance_keys(keys.to(logp.device), tokens[t])
        logq = mix_uniform(logp, cal.epsilon)
        atoms = law_atoms(cal.lm, base, logq, keys, cal.rule, cal.seed, cal.epsilon, cal.chunk)
        words, mask = atoms[:2]
        logc = law_log_probs(logq, atoms, cal.alpha, cal.rule.draws)  # [B, V]
        mass.append((1 - (logc.gather(1, words).exp() * mask).sum(-1)).double())  # [B], kept on the device
        outside.append(target_slots(words, mask, tokens[t + 1].to(words.device), 0) < 0)  # [B]
        sizes.append(mask.sum(1).double())
    mass, outside, sizes = torch.cat(mass).cpu(), torch.cat(outside).cpu(), torch.cat(sizes).cpu()  # one copy
    return {"mass_outside_topk": mass.mean().item(), "true_word_outside_topk": outside.double().mean().item(),
            "positions": mass.numel(), "candidates_mean": sizes.mean().item()}


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
        out.append(logp.gather(1, tokens[t + 1].to(logp.device)[:, None])[:, 0].double())  # [B], on the device
    return torch.cat(out).cpu()  # one copy: 8 (S-1) B bytes


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
    steps = range(S - 1)
    if progress:
        from lmcal.utils.progress import progress_bar
        steps = progress_bar(steps, desc="scoring")

    def rows(state):
        for t in steps:
            logp, state = lm.step(tokens[t], state)  # [B, V]
            yield logp.float()

    held = [torch.cat(block).cpu() for block in host_blocks(rows(lm.init_state(B)))]  # one host copy per block
    return torch.cat(held), tokens[1:].reshape(-1).cpu()  # y in position order t = 1..S-1


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

