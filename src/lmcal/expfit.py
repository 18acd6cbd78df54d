"""One-parameter exponential families over rows, and their held-out fit.

Per predicted position (a row) a base distribution P over K atoms (the vocabulary, or top-k candidates plus one atom
holding the rest of the mass) and a statistic s on the same atoms define the tilted family

    P_a(w) = P(w) exp(a s(w)) / Z(a),

and a is fitted by the cross-entropy at the true next words y of held-out rows,

    CE(a) = mean_t [ -log P(y) - a s(y) + log Z(a) ],   CE' = mean_t (E_{P_a}[s] - s(y)),   CE'' = mean_t Var_{P_a}[s],

which is convex in a; at a* the mean of s under P_a equals its mean at the true next words. Three fits are this one:
lookahead calibration (s = H_next, lmcal.calibration), the fitted temperature (s = log P, a = 1/T - 1) and the memory
bound's calibration towards the tau-limited model (s = log P~, lmcal.memory).

Zeros are allowed. P(w) = 0 stays 0 for every a. s(w) = -inf (P~(w) = 0) gives w weight 0 for a > 0, but infinite
weight for a < 0 where P(w) > 0: there a < 0 is undefined and the fit keeps a >= 0. s(y) = -inf at a true next word
makes CE(a > 0) infinite: the fit keeps a <= 0.

Rows come in groups (log P [n, K], s [n, K], log P(y) [n], s(y) [n]) of any float dtype and device. Every reduction
runs in float64, on blocks of about `elements` entries at a time, so the temporaries stay small however many rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import torch

log = logging.getLogger("lmcal")

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (log P [n, K], s [n, K], log P(y), s(y) [n])


def with_targets(logp: torch.Tensor, s: torch.Tensor, targets: torch.Tensor) -> Rows:
    """Full rows log P [n, V], s [n, V] and next words targets [n] as a group of rows (the targets' values gathered)."""
    y = targets.to(logp.device).long()[:, None]  # [n, 1]
    return logp, s, logp.gather(1, y)[:, 0], s.gather(1, y)[:, 0]


def blocks(groups: Iterable[Rows], elements: int) -> Iterator[Rows]:
    """Each group cut into blocks of about `elements` entries (whole rows, at least one), lazily."""
    for group in groups:
        n, k = group[0].shape
        rows = max(1, elements // max(1, k))
        for i in range(0, n, rows):
            yield tuple(x[i:i + rows] for x in group)


# ---------------------------------------------------------------------------------------------------------------------
# The family and its per-row terms
# ---------------------------------------------------------------------------------------------------------------------


def tilt(logp: torch.Tensor, s: torch.Tensor, a: float) -> torch.Tensor:
    """Unnormalised log P_a = log P + a s [..., K], with P(w) = 0 staying 0 (and a = 0 giving P itself, so 0 * -inf
    never appears). Raises for a < 0 where s = -inf at a word with P(w) > 0: its weight would be infinite."""
    if a == 0.0:
        return logp
    zero_p = torch.isneginf(logp)
    if a < 0 and (torch.isneginf(s) & ~zero_p).any():
        raise ValueError(f"alpha = {a} < 0 is undefined where the statistic is -inf (e.g. the limited model gives "
                         "probability 0) at a word the base model does not give probability 0")
    return torch.where(zero_p, logp, logp + a * s)  # a > 0: -inf where s = -inf; where P = 0 it stays -inf


def tilted(logp: torch.Tensor, s: torch.Tensor, a: float) -> torch.Tensor:
    """log P_a [..., K] in float64, normalised."""
    t = tilt(logp.double(), s.double(), float(a))
    return t - t.logsumexp(-1, keepdim=True)


def row_terms(logp: torch.Tensor, s: torch.Tensor, logp_y: torch.Tensor, s_y: torch.Tensor, a: float):
    """Per-row float64 terms at a of rows log P, s [n, K] and targets log P(y), s(y) [n]:
    (log P_a [n, K], CE_t [n], CE'_t [n], CE''_t [n], E_{P_a}[s] [n])."""
    logp, s, logp_y, s_y = logp.double(), s.double(), logp_y.double(), s_y.double()
    # A per-row constant in s leaves P_a and every derivative unchanged (Z absorbs it). With the row max subtracted a
    # constant statistic is exactly 0, so CE' = CE'' = 0 exactly there, and a * s never overflows.
    top = s.amax(-1)  # [n]
    s, s_y = s - top[:, None], s_y - top
    t = tilt(logp, s, a)  # [n, K]
    log_z = t.logsumexp(-1)  # [n]
    logp_a = t - log_z[:, None]  # [n, K]
    p = logp_a.exp()
    pos = p > 0  # where P_a(w) = 0 the terms p * s are 0 (not 0 * -inf = nan)
    mean = torch.where(pos, p * s, 0.0).sum(-1)  # [n]: E_{P_a}[s] (shifted)
    var = torch.where(pos, p * (s - mean[:, None]) ** 2, 0.0).sum(-1)  # [n], centred: no cancellation
    return logp_a, log_z - tilt(logp_y, s_y, a), mean - s_y, var, mean + top


@torch.no_grad()
def objective(groups: Iterable[Rows], a: float, elements: int = 1 << 22, per_row: bool = False):
    """Means over all rows of (CE, CE', CE'', E_{P_a}[s]) at a, as floats. With per_row, also CE'_t of every row
    [N] float64 on CPU, the per-position gradients of the sandwich standard error."""
    sums, n, d1s = torch.zeros(4, dtype=torch.float64), 0, []
    for blk in blocks(groups, elements):
        _, ce, d1, d2, mean = row_terms(*blk, a)
        sums += torch.stack([ce.sum(), d1.sum(), d2.sum(), mean.sum()]).cpu()
        n += ce.numel()
        if per_row:
            d1s.append(d1.cpu())
    means = (sums / n).tolist()
    return (means, torch.cat(d1s)) if per_row else means


def calibration_objective(logp_rows: torch.Tensor, stat_rows: torch.Tensor, targets: torch.Tensor, alpha: float,
                          elements: int = 1 << 22) -> tuple[float, float, float]:
    """Exact (CE(a), CE'(a), CE''(a)) in nats from full rows: log P [N, V], s [N, V] (H_next, log P~, ...) and the
    next words targets [N]."""
    return tuple(objective([with_targets(logp_rows, stat_rows, targets)], float(alpha), elements)[:3])


# ---------------------------------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------------------------------


def domain(groups: Iterable[Rows], bound: float, elements: int = 1 << 22) -> tuple[float, float]:
    """The interval where CE(a) can be finite and minimal: [-bound, bound], cut to a >= 0 when s = -inf at a word with
    P > 0 (a < 0 undefined) and to a <= 0 when s = -inf at a true next word (CE(a > 0) = +inf)."""
    lo, hi = -bound, bound
    for logp, s, _, s_y in blocks(groups, elements):
        if lo < 0 and (torch.isneginf(s) & ~torch.isneginf(logp)).any():
            lo = 0.0
        if hi > 0 and torch.isneginf(s_y).any():
            hi = 0.0
    return lo, hi


def newton_minimize(fun, lo: float, hi: float, tol: float = 1e-12, max_iter: int = 200) -> float:
    """Minimise a convex function on [lo, hi] given fun(a) -> (f'(a), f''(a)), from 0 (or the nearest end).

    Each evaluation moves one end of the bracket to a (by the sign of f'); a Newton step that would leave the bracket,
    or f'' <= 0 (a flat objective) or nan, is replaced by bisection, so it always converges.
    """
    a = min(max(0.0, lo), hi)
    for _ in range(max_iter):
        if lo == hi:
            return lo
        d1, d2 = fun(a)
        if abs(d1) <= tol:
            return a
        lo, hi = (lo, a) if d1 > 0 else (a, hi)
        new = a - d1 / d2 if d2 > 0 else math.nan  # nan fails the bracket test below
        new = new if lo < new < hi else 0.5 * (lo + hi)
        if abs(new - a) <= 1e-15 * max(1.0, abs(a)):
            return new
        a = new
    return a


def fit_alpha(groups: list[Rows], bound: float = 100.0, elements: int = 1 << 22, clamp: bool = False,
              what: str = "fit") -> float:
    """a* minimising CE(a) of the rows `groups` over [-bound, bound] cut to its domain, by Newton from a = 0.

    If the minimum is not inside the bound (a* = +-inf on degenerate rows, or a nearly flat objective), it raises a
    RuntimeError, or with clamp logs a warning and returns the bound itself: the minimum over [-bound, bound].
    """
    lo, hi = domain(groups, bound, elements)
    alpha = newton_minimize(lambda a: objective(groups, a, elements)[1:3], lo, hi)
    if bound - abs(alpha) >= 1e-6:
        return alpha
    if not clamp:
        raise RuntimeError(f"{what}: CE(alpha) has its minimum at or beyond |alpha| = {bound}; degenerate rows?")
    alpha = math.copysign(bound, alpha)
    drop = objective(groups, 0.0, elements)[0] - objective(groups, alpha, elements)[0]
    log.warning(f"{what}: held-out CE keeps falling up to |alpha| = {bound} (the statistic barely varies between "
                f"words: CE falls by {drop:.2e} nats there); using alpha = {alpha:g}, the minimum over "
                "[-bound, bound]. Fit on more, or more varied, text for a finite alpha*.")
    return alpha


def block_sums(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sums of consecutive blocks of `size` rows of x [N] -> [ceil(N / size)] (the last block may be shorter)."""
    nb = -(-x.numel() // size)
    return torch.cat([x, x.new_zeros(nb * size - x.numel())]).view(nb, size).sum(1)


def sandwich_stderr(g: torch.Tensor, d2: float, cluster_size: int = 1) -> float:
    """Standard error of a* from the per-row gradients g = CE'_t(a*) [N] and d2 = CE''(a*) (inf when d2 = 0).

    a* solves mean_t g_t(a) = 0, so Var a* ~ Var(sum g) / (N CE'')^2; blocks of cluster_size consecutive rows are the
    independent units (batch means, for dependence along the text; 1 = positions independent).
    """
    if not d2 > 0:
        return math.inf
    return math.sqrt(block_sums(g, cluster_size).pow(2).sum().item()) / (g.numel() * d2)
