"""One-parameter exponential families over rows, and their held-out fit.

Per predicted position (a row) a base distribution P over K atoms (the vocabulary, or top-k candidates plus one atom
holding the rest of the mass) and a statistic s on the same atoms define the tilted family

    P_a(w) = P(w) exp(a s(w)) / Z(a),

and a is fitted by the cross-entropy at the true next words y of held-out rows,

    CE(a) = mean_t [ -log P(y) - a s(y) + log Z(a) ],   CE' = mean_t (E_{P_a}[s] - s(y)),   CE'' = mean_t Var_{P_a}[s],

which is convex in a; at a* the mean of s under P_a equals its mean at the true next words. Three fits are this one:
lookahead calibration (s = H_next, core.calibration), the fitted temperature (s = log P, a = 1/T - 1) and the memory
bound's calibration towards the tau-limited model (s = log P~, core.memory). The k-statistic version (below:
`row_terms_k`, `fit_theta`) fits several at once, e.g. the memory bound's P^^beta P~^a, and `onestep_replicates` /
`jackknife_stderr` give block-jackknife standard errors of a quantity computed at the fitted parameters.

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

from lmcal.core.no_minimum import NoFiniteMinimum, no_minimum_label  # noqa: F401  (no_minimum_label: public here)

log = logging.getLogger("lmcal")

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (log P [n, K], s [n, K], log P(y), s(y) [n])


def with_targets(logp: torch.Tensor, s: torch.Tensor, targets: torch.Tensor) -> Rows:
    """Full rows log P [n, V], s [n, V] and next words targets [n] as a group of rows (the targets' values gathered)."""
    y = targets.to(logp.device).long()[:, None]  # [n, 1]
    return logp, s, logp.gather(1, y)[:, 0], s.gather(1, y)[:, 0]


# Row entries per block. On the CPU, 1 MiB of float32 per temporary: the allocator then reuses its memory, while larger
# blocks are mapped and page-faulted afresh at every operation (bench/cpu_blocks.py measures both). On a GPU, large
# blocks: few launches.
CPU_ELEMENTS, CUDA_ELEMENTS = 1 << 18, 1 << 24


def blocks(groups: Iterable[Rows], elements: int | None = None) -> Iterator[Rows]:
    """Each group cut into blocks of about `elements` entries (whole rows, at least one), lazily; None: by the rows'
    device, CPU_ELEMENTS or CUDA_ELEMENTS."""
    for group in groups:
        n, k = group[0].shape
        size = elements or (CUDA_ELEMENTS if group[0].is_cuda else CPU_ELEMENTS)
        rows = max(1, size // max(1, k))
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
def objective(groups: Iterable[Rows], a: float, elements: int | None = None, per_row: bool = False):
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
                          elements: int | None = None) -> tuple[float, float, float]:
    """Exact (CE(a), CE'(a), CE''(a)) in nats from full rows: log P [N, V], s [N, V] (H_next, log P~, ...) and the
    next words targets [N]."""
    return tuple(objective([with_targets(logp_rows, stat_rows, targets)], float(alpha), elements)[:3])


# ---------------------------------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------------------------------


def domain(groups: Iterable[Rows], bound: float, elements: int | None = None) -> tuple[float, float]:
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


def fit_alpha(groups: list[Rows], bound: float = 100.0, elements: int | None = None, clamp: bool = False,
              what: str = "fit") -> float:
    """a* minimising CE(a) of the rows `groups` over [-bound, bound] cut to its domain, by Newton from a = 0.

    If the minimum is not inside the bound (a* = +-inf on degenerate rows, or a nearly flat objective), it raises
    NoFiniteMinimum (a RuntimeError), or with clamp logs a warning and returns the bound itself: the minimum over
    [-bound, bound].
    """
    lo, hi = domain(groups, bound, elements)
    alpha = newton_minimize(lambda a: objective(groups, a, elements)[1:3], lo, hi)
    if bound - abs(alpha) >= 1e-6:
        return alpha
    alpha = math.copysign(bound, alpha)
    if not clamp:
        ce, d1 = objective(groups, alpha, elements)[:2]
        sign = math.copysign(1.0, alpha)
        raise NoFiniteMinimum(what, "alpha", bound, [sign], [alpha], ce, sign * d1)
    drop = objective(groups, 0.0, elements)[0] - objective(groups, alpha, elements)[0]
    log.warning(f"{what}: held-out CE keeps falling up to |alpha| = {bound} (the statistic barely varies between "
                f"words: CE falls by {drop:.2e} nats there); using alpha = {alpha:g}, the minimum over "
                "[-bound, bound]. Fit on more, or more varied, text for a finite alpha*.")
    return alpha


def block_sums(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sums of consecutive blocks of `size` rows of x [N] -> [ceil(N / size)] (the last block may be shorter)."""
    nb = -(-x.numel() // size)
    return torch.cat([x, x.new_zeros(nb * size - x.numel())]).view(nb, size).sum(1)


def stream_block_sums(x: torch.Tensor, streams: int, size: int) -> torch.Tensor:
    """x [n, ...] in t-major order of `streams` parallel streams -> sums over blocks of `size` consecutive positions
    of one stream [streams * ceil(T / size), ...] (the last block of a stream may be shorter): the independent units
    of a standard error when the text is read as several streams."""
    rest = x.shape[1:]
    x = x.reshape(-1, streams, *rest).transpose(0, 1)  # [streams, T, ...]: each stream's positions in order
    T = x.size(1)
    nb = -(-T // size)
    if nb * size > T:
        x = torch.cat([x, x.new_zeros(streams, nb * size - T, *rest)], 1)
    return x.reshape(streams * nb, size, *rest).sum(1)


def sandwich_stderr(g: torch.Tensor, d2: float, cluster_size: int = 1) -> float:
    """Standard error of a* from the per-row gradients g = CE'_t(a*) [N] and d2 = CE''(a*) (inf when d2 = 0).

    a* solves mean_t g_t(a) = 0, so Var a* ~ Var(sum g) / (N CE'')^2; blocks of cluster_size consecutive rows are the
    independent units (batch means, for dependence along the text; 1 = positions independent).
    """
    if not d2 > 0:
        return math.inf
    return math.sqrt(block_sums(g, cluster_size).pow(2).sum().item()) / (g.numel() * d2)


# ---------------------------------------------------------------------------------------------------------------------
# k statistics at once
# ---------------------------------------------------------------------------------------------------------------------
# The same family with a vector statistic s = (s_1, ..., s_k) and parameter theta in R^k:
#     P_theta(w) = P(w) exp(theta . s(w)) / Z(theta),   CE' = mean_t (E_theta[s] - s(y)),   CE'' = mean_t Cov_theta(s),
# still convex in theta. E.g. the memory bound's two-parameter calibration P^^beta P~^alpha is base P^ with
# s = (log P^, log P~) and theta = (beta - 1, alpha). A group of rows is one flat tuple (so `blocks` cuts it):
#     (log P [n, K], log P(y) [n], s(y) [n, k], s_1 [n, K], ..., s_k [n, K]).
# A statistic that is -inf where P > 0 is allowed only with theta_j >= 0 (as above); `fit_theta` refuses it.

RowsK = tuple[torch.Tensor, ...]


def with_targets_k(logp: torch.Tensor, stats: tuple[torch.Tensor, ...], targets: torch.Tensor) -> RowsK:
    """Full rows log P [n, V], statistics s_j [n, V] and next words [n] as one group of k-statistic rows."""
    y = targets.to(logp.device).long()[:, None]  # [n, 1]
    s_y = torch.stack([s.gather(1, y)[:, 0] for s in stats], dim=1)  # [n, k]
    return (logp, logp.gather(1, y)[:, 0], s_y, *stats)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_w a[t, w] b[t, w] for rows [n, K] -> [n]: float64 rows as a batched matrix product (no [n, K]
    temporary); lower precisions summed in float64 (a float32 sum of 10^4 terms drifts by ~1e-6)."""
    if a.dtype == torch.float64:
        return torch.bmm(a[:, None, :], b[:, :, None]).view(-1)
    return (a * b).sum(-1, dtype=torch.float64)


def row_terms_k(rows: RowsK, theta, entropy_terms: bool = True) -> tuple[torch.Tensor | None, ...]:
    """Per-row terms at theta (k floats) of one group:
    (log P_theta [n, K], CE_t [n], CE'_t [n, k], CE''_t [n, k, k], H_t [n], dH_t/dtheta [n, k]),
    H_t the entropy of P_theta and dH_t/dtheta = -Cov_theta(log P_theta, s) (both None unless entropy_terms).

    Computed in the rows' own precision, at least float32 (float64 rows: float64; the sums over a row's K entries are
    then good to ~1e-7 relative for float32 rows, far below any sampling error, at half the memory traffic), and
    returned in float64 but log P_theta."""
    logp, logp_y, s_y, *stats = rows
    base = logp
    dt = torch.promote_types(torch.promote_types(logp.dtype, stats[0].dtype), torch.float32)
    logp, logp_y, s_y = logp.to(dt), logp_y.to(dt), s_y.to(dt)
    # -inf entries (zero probabilities) need masks so that 0 * -inf never appears; rows without any skip them
    masked = any(x.amin().item() == -math.inf for x in (logp, *stats))  # (a reduction: no [n, K] temporary)
    zero_p = torch.isneginf(logp) if masked else None
    t, t_y, shifted = logp, logp_y, []
    for j, (s, a) in enumerate(zip(stats, theta, strict=True)):
        s = logp if s is base else s.to(dt)  # log P itself as a statistic (the temperature): converted once
        top = s.amax(-1)  # [n]: a per-row constant changes nothing (Z absorbs it); subtracted, a * s never overflows
        s, s_j = s - top[:, None], s_y[:, j] - top
        if a != 0.0:  # a = 0 adds nothing (and no 0 * -inf)
            if masked and a < 0 and (torch.isneginf(s) & ~zero_p).any():
                raise ValueError(f"theta_{j} = {a} < 0 is undefined where statistic {j} is -inf (e.g. the limited "
                                 "model gives probability 0) at a word the base model does not give probability 0")
            t = torch.where(zero_p, logp, t + a * s) if masked else t + a * s
            t_y = t_y + a * s_j
        shifted.append((s, s_j))
    top = t.amax(-1, keepdim=True)  # [n, 1]
    p = (t - top).exp_()  # [n, K], unnormalised
    z = p.sum(-1, keepdim=True)
    p.div_(z)  # P_theta
    log_z = (top + z.log())[:, 0]  # [n]
    pos = p > 0 if masked else None  # where P_theta(w) = 0 every term is 0 (not 0 * -inf = nan)
    fin = (lambda x: torch.where(pos, x, 0.0)) if masked else (lambda x: x)
    grads, pcs, cents = [], [], []
    for s, s_j in shifted:
        c = fin(s)
        mean = _rowdot(p, c)  # [n]: E_theta[s_j] (shifted)
        grads.append(mean - s_j)
        m = mean.to(c.dtype)[:, None]
        c = c.sub_(m) if c is not s else c - m  # [n, K], centred: no cancellation
        cents.append(fin(c))
        pcs.append(p * cents[-1])
    k = len(cents)
    hess = logp.new_empty(logp.size(0), k, k)
    for i in range(k):
        for j in range(i, k):
            hess[:, i, j] = hess[:, j, i] = _rowdot(pcs[i], cents[j])
    entropy = d_entropy = None
    if entropy_terms:
        t_fin = fin(t)
        entropy = log_z - _rowdot(p, t_fin)  # H = -E[log P_theta] = log Z - E[t]
        d_entropy = torch.stack([-_rowdot(pc, t_fin) for pc in pcs], dim=1)  # -Cov(t, s_j): sum_w pc = 0
    f64 = lambda x: None if x is None else x.double()
    return t - log_z[:, None], f64(log_z - t_y), f64(torch.stack(grads, dim=1)), f64(hess), f64(entropy), f64(d_entropy)


@torch.no_grad()
def objective_k(groups: Iterable[RowsK], theta,
                elements: int | None = None) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Means over all rows of (CE, CE' [k], CE'' [k, k]) at theta (float64, on CPU)."""
    ce, grad, hess, n = 0.0, 0.0, 0.0, 0
    for blk in blocks(groups, elements):
        _, c, g, h, _, _ = row_terms_k(blk, theta, entropy_terms=False)
        ce, grad, hess = ce + c.sum().item(), grad + g.sum(0).cpu(), hess + h.sum(0).cpu()
        n += c.numel()
    return ce / n, grad / n, hess / n


def _pinv_solve(h: torch.Tensor, g: torch.Tensor, rtol: float = 1e-12) -> torch.Tensor:
    """h^+ g for symmetric PSD h [..., k, k] and g [..., k]: directions where h is (numerically) 0 get no step, so
    a statistic that is constant on every row, or two that are proportional, leave their parameters alone."""
    w, v = torch.linalg.eigh(h)  # [..., k], [..., k, k]
    keep = w > rtol * w.amax(-1, keepdim=True).clamp_min(0)
    inv = torch.where(keep & (w > 0), 1.0 / w, 0.0)
    coef = inv * (v.transpose(-1, -2) @ g[..., None])[..., 0]  # [..., k]: V^T g, scaled by 1 / eigenvalue
    return (v @ coef[..., None])[..., 0]


def fit_theta(groups: list[RowsK], k: int, bound: float = 100.0, elements: int | None = None, tol: float = 1e-12,
              max_iter: int = 100, what: str = "fit", start=None) -> list[float]:
    """theta* minimising CE(theta) of the rows `groups` (k statistics), by damped Newton from `start` (k floats;
    None: theta = 0).

    Each Newton step (pseudo-inverse of CE'', so flat directions stay put) is halved until CE falls by at least
    1e-4 of what its slope promises (Armijo backtracking); convexity makes this converge from any start. Stops when
    |CE'| <= tol in every coordinate or the Newton decrement is below 1e-14 (then after one last step, which needs no
    new pass) or stops falling at the rows' rounding level. Refuses a statistic that is -inf where P > 0 (theta_j < 0
    would be undefined there), and raises NoFiniteMinimum where the minimum is outside |theta_j| < bound.
    """
    for logp, _, s_y, *stats in blocks(groups, elements):
        if torch.isneginf(s_y).any() or any((torch.isneginf(s) & ~torch.isneginf(logp)).any() for s in stats):
            raise ValueError(f"{what}: a statistic is -inf at a word the base model does not give probability 0 "
                             "(e.g. the limited model gives it probability 0); the k-statistic fit needs finite "
                             "statistics there")
    theta = torch.zeros(k, dtype=torch.float64) if start is None else torch.tensor(start, dtype=torch.float64)
    ce, g, h = objective_k(groups, theta.tolist(), elements)
    last = math.inf  # the previous Newton decrement lambda^2 = g . h^+ g
    for _ in range(max_iter):
        if g.abs().max().item() <= tol:
            break
        step = -_pinv_solve(h, g)  # [k]
        dec = -(g @ step).item()  # lambda^2 >= 0: CE falls by about dec / 2 along the full step
        if dec <= 1e-14 * max(1.0, abs(ce)):  # converged: the last step, quadratic, leaves ~dec^2 (no more passes)
            theta = theta + step
            break
        if dec < 1e-6 and dec > last / 4:  # no longer quadratic convergence: the rows' rounding level
            break
        last, t = dec, 1.0
        while True:
            new = theta + t * step
            ce_new, g_new, h_new = objective_k(groups, new.tolist(), elements)
            # Armijo; close to the minimum (dec < 1e-6) the full Newton step is safe, and CE differences there may
            # be rounding (float32 rows)
            if dec < 1e-6 or ce_new <= ce - 1e-4 * t * dec or t < 1e-8:
                break
            t *= 0.5
        if t < 1e-8:  # no descent along the Newton direction: nothing left to gain
            break
        theta, ce, g, h = new, ce_new, g_new, h_new
    if theta.abs().max().item() >= bound:
        raise _beyond(groups, theta, bound, elements, what)
    return theta.tolist()


def _beyond(groups: list[RowsK], theta: torch.Tensor, bound: float, elements: int | None,
            what: str) -> NoFiniteMinimum:
    """fit_theta's outcome where Newton left the box |theta_j| < bound: the direction it was moving in, its point on
    the box's edge (theta scaled back along its ray) and CE and its slope there (one more pass)."""
    top = theta.abs().max().item()
    direction = theta / top  # [k], max-norm 1
    at = direction * bound
    ce, g, _ = objective_k(groups, at.tolist(), elements)
    return NoFiniteMinimum(what, "theta", bound, direction.tolist(), at.tolist(), ce, (g @ direction).item())


def jackknife_stderr(replicates: torch.Tensor) -> float:
    """Delete-one-block jackknife standard error from the B replicates [B] (nan when B < 2 or any is not finite)."""
    nb = replicates.numel()
    if nb < 2 or not torch.isfinite(replicates).all():
        return math.nan
    return math.sqrt((nb - 1) / nb * (replicates - replicates.mean()).pow(2).sum().item())


def onestep_replicates(x_b: torch.Tensor, n_b: torch.Tensor, g_b: torch.Tensor, h_b: torch.Tensor,
                       dx_b: torch.Tensor) -> torch.Tensor:
    """Delete-one-block replicates of mean_t x_t(theta*) with theta refitted on the other blocks, by one Newton
    step from the full fit theta* and x linearised in theta: with the block sums x_b [B], rows n_b [B], CE
    gradients g_b [B, k], Hessians h_b [B, k, k] and dx_t/dtheta sums dx_b [B, k], all at theta*,

        theta_-b = theta* - (sum_{c != b} h_c)^+ sum_{c != b} g_c,
        x_-b = (sum_{c != b} x_c + (sum_{c != b} dx_c) . (theta_-b - theta*)) / sum_{c != b} n_c.

    Exact to first order in theta_-b - theta* (O(1 / B) of the spread); returns [B]."""
    rest = lambda z: z.sum(0, keepdim=True) - z  # sums over the other blocks
    delta = -_pinv_solve(rest(h_b), rest(g_b))  # [B, k]
    return (rest(x_b) + (rest(dx_b) * delta).sum(-1)) / rest(n_b)
