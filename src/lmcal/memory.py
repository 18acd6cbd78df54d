"""How much a model's predictions use the distant past: the calibration bound on I_tau (Braverman et al., ICML 2020,
Section 5).

    I_tau = I(W^_t ; W_<t-tau | W_t-tau..t-1)

is the information the model's prediction W^_t draws from tokens more than tau steps back. With P~ the tau-limited
model (it sees only the last tau tokens), calibrate the full model P^ towards it,

    P^_a(w | w_<t) = P^(w | w_<t) * P~(w | w_t-tau..t-1)^a / Z_t(a),

and fit a* by minimising the held-out cross-entropy

    CE(a) = mean_t [ -log P^(w_t) - a log P~(w_t) + log Z_t(a) ],

which is convex (CE' = mean_t (E_{P^_a}[log P~] - log P~(w_t)), CE'' = mean_t Var_{P^_a}[log P~] >= 0); at a* the
mean of log P~ under P^_a matches its mean at the true next words. Then

    I_tau <= CE(P || P~) - H(W^cal_t | W_<t),

the limited model's cross-entropy on the text minus the mean entropy of P^_a* along it (all in nats).

The inputs are precomputed log-probability rows: log P^ [N, V], log P~ [N, V] and the next words [N], or an iterable
of such chunk triples. Zeros (-inf log-probs) are allowed: P~(w) = 0 where P^(w) > 0 makes a < 0 meaningless (that
word would get infinite weight), so the fit then keeps a >= 0, and evaluating at a given a < 0 raises.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (log P^ [n, V], log P~ [n, V], targets [n])


@dataclass
class MemoryBound:
    """The calibration bound on I_tau and what it is made of, in nats, over n_tokens predicted positions."""

    alpha: float  # a* fitted on these rows (fitted=True), or the a it was given
    ce_limited: float  # CE(P || P~): mean -log P~(w_t)
    entropy_calibrated: float  # H(W^cal_t | W_<t): mean entropy of P^_a
    mi_upper_bound: float  # ce_limited - entropy_calibrated
    ce_full: float  # mean -log P^(w_t)
    ce_calibrated: float  # mean -log P^_a(w_t)
    n_tokens: int
    mi_stderr: float  # standard error of mi_upper_bound, a held fixed (blocks of cluster_size rows independent)
    ce_full_stderr: float  # standard error of ce_full, likewise
    alpha_stderr: float  # sandwich standard error of a* (inf when CE'' = 0, nan when a was given)
    fitted: bool


# ---------------------------------------------------------------------------------------------------------------------
# Per-row terms
# ---------------------------------------------------------------------------------------------------------------------


def _check(full: torch.Tensor, limited: torch.Tensor, targets: torch.Tensor) -> None:
    if full.dim() != 2 or full.shape != limited.shape or targets.shape != full.shape[:1]:
        raise ValueError(f"need log P^ [N, V], log P~ [N, V] and targets [N]; got shapes {tuple(full.shape)}, "
                         f"{tuple(limited.shape)}, {tuple(targets.shape)}")


def _tilted(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """Unnormalised log P^_a = a + alpha * b [..., V] (float64), with P^(w) = 0 staying 0 and 0 * log 0 = 0.

    Raises for alpha < 0 when P~(w) = 0 at a word with P^(w) > 0: that word's weight P~^alpha would be infinite.
    """
    zero_p, zero_q = torch.isneginf(a), torch.isneginf(b)
    if alpha == 0.0:
        return a.clone()
    if alpha < 0 and (zero_q & ~zero_p).any():
        raise ValueError(f"alpha = {alpha} < 0 is undefined where the limited model gives probability 0 to a word "
                         "the full model does not")
    return torch.where(zero_p, a, a + alpha * b)  # alpha > 0: -inf where P~ = 0; where P^ = 0 it stays -inf


def _row_terms(full: torch.Tensor, limited: torch.Tensor, targets: torch.Tensor, alpha: float) -> dict:
    """Per-row float64 terms [n] at alpha: ce_cal, entropy, d1, d2 (of CE(a)), ce_full, ce_limited."""
    a, b = full.double(), limited.double()
    y = targets.to(a.device).long()[:, None]  # [n, 1]
    ce_limited = -b.gather(1, y)[:, 0]
    # Shifting log P~ by a per-row constant leaves P^_a unchanged (Z absorbs it) and all derivatives too; with the row
    # max subtracted a uniform P~ is exactly 0, so CE' = CE'' = 0 exactly there, and a * b never overflows.
    b = b - b.amax(-1, keepdim=True)  # [n, V], <= 0
    s = _tilted(a, b, alpha)  # [n, V]
    logp = s - s.logsumexp(-1, keepdim=True)  # [n, V]: log P^_a
    p = logp.exp()
    pos = p > 0  # where P^_a(w) = 0 the terms p * log p, p * b are 0 (not 0 * -inf = nan)
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    mean_b = torch.where(pos, p * b, zero).sum(-1)  # [n]: E_{P^_a}[log P~] (shifted)
    var_b = torch.where(pos, p * (b - mean_b[:, None]) ** 2, zero).sum(-1)  # [n], centred: no cancellation
    return {
        "ce_cal": -logp.gather(1, y)[:, 0],
        "entropy": -torch.where(pos, p * logp, zero).sum(-1),
        "d1": mean_b - b.gather(1, y)[:, 0],
        "d2": var_b,
        "ce_full": -a.gather(1, y)[:, 0],
        "ce_limited": ce_limited,
    }


def _blocks(chunks: Iterable[Chunk], elements: int):
    """Each chunk cut into row blocks of about `elements` entries, so the float64 temporaries stay small."""
    for full, limited, targets in chunks:
        _check(full, limited, targets)
        rows = max(1, elements // max(1, full.size(1)))
        for i in range(0, full.size(0), rows):
            yield full[i:i + rows], limited[i:i + rows], targets[i:i + rows]


def _sums(chunks: Iterable[Chunk], alpha: float, elements: int) -> tuple[float, float, float, int]:
    """(sum CE, sum CE', sum CE'', n) over all rows at alpha."""
    total, n = torch.zeros(3, dtype=torch.float64), 0
    for blk in _blocks(chunks, elements):
        t = _row_terms(*blk, alpha)
        total += torch.stack([t["ce_cal"].sum(), t["d1"].sum(), t["d2"].sum()]).cpu()
        n += blk[2].numel()
    return (*total.tolist(), n)


@torch.no_grad()
def calibration_objective(full_lp: torch.Tensor, limited_lp: torch.Tensor, targets: torch.Tensor,
                          alpha: float, elements: int = 1 << 22) -> tuple[float, float, float]:
    """Exact (CE(a), CE'(a), CE''(a)) in nats of P^_a on rows log P^ [N, V], log P~ [N, V], targets [N]."""
    ce, d1, d2, n = _sums([(full_lp, limited_lp, targets)], float(alpha), elements)
    return ce / n, d1 / n, d2 / n


@torch.no_grad()
def calibrate_to_limited(full_log_probs: torch.Tensor, limited_log_probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """log P^_a [..., V]: log P^ + a log P~, renormalised (computed in float64, returned in the inputs' dtype)."""
    dtype = torch.promote_types(full_log_probs.dtype, limited_log_probs.dtype)
    s = _tilted(full_log_probs.double(), limited_log_probs.double(), float(alpha))
    return (s - s.logsumexp(-1, keepdim=True)).to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------------------------------


def _domain(chunks: list[Chunk], bound: float) -> tuple[float, float]:
    """The interval where CE(a) can be finite and minimal: [-bound, bound], cut to a >= 0 when P~ has a zero where P^
    has mass (a < 0 undefined) and to a <= 0 when P~ gives a true next word probability 0 (CE(a > 0) = +inf)."""
    lo, hi = -bound, bound
    for full, limited, targets in chunks:
        if (torch.isneginf(limited) & ~torch.isneginf(full)).any():
            lo = 0.0
        if torch.isneginf(limited.gather(1, targets.to(limited.device).long()[:, None])).any():
            hi = 0.0
    return lo, hi


def _newton(fun, lo: float, hi: float, tol: float = 1e-12, max_iter: int = 200) -> float:
    """Minimise a convex function on [lo, hi] from fun(a) -> (f', f''), starting at 0 (or the nearest end).

    Each evaluation moves one end of the bracket to a (by the sign of f'); a Newton step that leaves the bracket, or
    f'' <= 0 (a flat objective) or nan, is replaced by bisection, so it always converges.
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


def _fit_alpha(chunks: list[Chunk], bound: float, elements: int) -> float:
    lo, hi = _domain(chunks, bound)

    def fun(a):
        _, d1, d2, n = _sums(chunks, a, elements)
        return d1 / n, d2 / n

    alpha = _newton(fun, lo, hi)
    if bound - abs(alpha) < 1e-6:
        raise RuntimeError(f"CE(alpha) has its minimum at or beyond |alpha| = {bound}; degenerate rows?")
    return alpha


# ---------------------------------------------------------------------------------------------------------------------
# The bound
# ---------------------------------------------------------------------------------------------------------------------


def _block_sums(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sums of consecutive blocks of `size` rows of x [N] -> [ceil(N / size)] (the last block may be shorter)."""
    nb = -(-x.numel() // size)
    return torch.cat([x, x.new_zeros(nb * size - x.numel())]).view(nb, size).sum(1)


def _mean_stderr(x: torch.Tensor, cluster_size: int) -> float:
    """Standard error of mean(x), blocks of cluster_size consecutive rows independent (batch means; 1 = i.i.d.)."""
    dev = _block_sums(x - x.mean(), cluster_size)  # [B]: S_b - n_b * mean
    nb = dev.numel()
    if nb < 2:
        return math.nan
    return math.sqrt(dev.pow(2).sum().item() * nb / (nb - 1)) / x.numel()


@torch.no_grad()
def memory_upper_bound(full_log_probs, limited_log_probs: torch.Tensor | None = None,
                       targets: torch.Tensor | None = None, alpha: float | None = None, *, cluster_size: int = 1,
                       bound: float = 100.0, store_dtype: torch.dtype | None = None, store_device="cpu",
                       elements: int = 1 << 22) -> MemoryBound:
    """The calibration upper bound on I_tau from log-probability rows.

    Inputs: log P^ [N, V], log P~ [N, V] (natural log, rows normalised) and targets [N] long, or, as the only
    positional argument, an iterable of (log P^ [n, V], log P~ [n, V], targets [n]) chunks, consumed once (a
    generator is fine). Rows are positions in text order; `cluster_size` > 1 treats blocks of that many consecutive
    rows as the independent units of the standard errors (batch means, for dependence along the text).

    alpha=None fits a* on these rows (Newton from 0 with a bracket on [-bound, bound]; a flat CE gives a* = 0).
    A given alpha is only evaluated: fit on validation rows, then pass that a for the test rows.

    Memory: evaluating a given alpha streams the chunks, keeping 6 floats per row. The fit needs CE(a) at several a,
    and log Z_t(a) is no finite statistic of the row, so chunks from an iterable are kept (moved to `store_device`,
    cast to `store_dtype` if given): 2 * N * V * (bytes per element), e.g. 2 * 73,760 * 10,000 * 4 = 5.9 GB of
    float32 for the PTB validation set; float16 halves that but rounds log-probs near -20 by up to ~0.008 nats. Whole
    tensors are used in place. The reductions run in float64, about `elements` row entries at a time.

    mi_stderr treats a as fixed: the sampling error of a fitted a* (alpha_stderr) is not propagated into it.
    """
    if isinstance(full_log_probs, torch.Tensor):
        if limited_log_probs is None or targets is None:
            raise TypeError("with a tensor log P^, pass limited_log_probs and targets too")
        chunks: Iterable[Chunk] = [(full_log_probs, limited_log_probs, targets)]
    else:
        if limited_log_probs is not None or targets is not None:
            raise TypeError("with an iterable of (full, limited, targets) chunks, pass no separate tensors")
        chunks = full_log_probs
    if cluster_size < 1:
        raise ValueError(f"cluster_size must be >= 1, got {cluster_size}")

    fitted = alpha is None
    if fitted:
        if not isinstance(chunks, list):  # one pass over the source; the Newton iterations reread the kept rows
            keep = lambda t, dtype: t.detach().to(device=store_device, dtype=dtype)
            chunks = [(keep(f, store_dtype), keep(q, store_dtype), keep(y, None)) for f, q, y in chunks]
        alpha = _fit_alpha(chunks, bound, elements)
    alpha = float(alpha)

    parts: dict[str, list[torch.Tensor]] = {}
    for blk in _blocks(chunks, elements):
        for k, v in _row_terms(*blk, alpha).items():
            parts.setdefault(k, []).append(v.cpu())
    if not parts:
        raise ValueError("no rows")
    rows = {k: torch.cat(v) for k, v in parts.items()}  # each [N] float64
    n = rows["ce_cal"].numel()
    mean = {k: v.mean().item() for k, v in rows.items()}

    if fitted:
        # sandwich: a* solves mean_t g_t(a) = 0 with g_t = CE'_t, so Var a* ~ Var(sum g) / (N CE'')^2
        num = math.sqrt(_block_sums(rows["d1"], cluster_size).pow(2).sum().item())
        alpha_stderr = num / (n * mean["d2"]) if mean["d2"] > 0 else math.inf
    else:
        alpha_stderr = math.nan
    return MemoryBound(
        alpha=alpha,
        ce_limited=mean["ce_limited"],
        entropy_calibrated=mean["entropy"],
        mi_upper_bound=mean["ce_limited"] - mean["entropy"],
        ce_full=mean["ce_full"],
        ce_calibrated=mean["ce_cal"],
        n_tokens=n,
        mi_stderr=_mean_stderr(rows["ce_limited"] - rows["entropy"], cluster_size),
        ce_full_stderr=_mean_stderr(rows["ce_full"], cluster_size),
        alpha_stderr=alpha_stderr,
        fitted=fitted,
    )
