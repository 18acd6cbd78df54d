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

from lmcal.calibration import entropy
from lmcal.expfit import block_sums, blocks, fit_alpha, row_terms, sandwich_stderr, tilted, with_targets

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
# Rows
# ---------------------------------------------------------------------------------------------------------------------
# P^_a is the tilted family of lmcal.expfit with base P^ and statistic s = log P~ over the vocabulary; expfit holds the
# objective, the -inf handling (the domain cuts) and the Newton fit.


def _check(full: torch.Tensor, limited: torch.Tensor, targets: torch.Tensor) -> None:
    if full.dim() != 2 or full.shape != limited.shape or targets.shape != full.shape[:1]:
        raise ValueError(f"need log P^ [N, V], log P~ [N, V] and targets [N]; got shapes {tuple(full.shape)}, "
                         f"{tuple(limited.shape)}, {tuple(targets.shape)}")


def _groups(chunks: Iterable[Chunk]):
    """Each checked chunk as expfit rows (log P^, log P~, log P^(y), log P~(y)), lazily."""
    for full, limited, targets in chunks:
        _check(full, limited, targets)
        yield with_targets(full, limited, targets)


@torch.no_grad()
def calibrate_to_limited(full_log_probs: torch.Tensor, limited_log_probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """log P^_a [..., V]: log P^ + a log P~, renormalised (computed in float64, returned in the inputs' dtype)."""
    dtype = torch.promote_types(full_log_probs.dtype, limited_log_probs.dtype)
    return tilted(full_log_probs, limited_log_probs, alpha).to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# The bound
# ---------------------------------------------------------------------------------------------------------------------


def _mean_stderr(x: torch.Tensor, cluster_size: int) -> float:
    """Standard error of mean(x), blocks of cluster_size consecutive rows independent (batch means; 1 = i.i.d.)."""
    dev = block_sums(x - x.mean(), cluster_size)  # [B]: S_b - n_b * mean
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
        groups = list(_groups(chunks))
        if not any(g[2].numel() for g in groups):
            raise ValueError("no rows")
        alpha = fit_alpha(groups, bound, elements, what="memory bound")
    else:
        groups = _groups(chunks)  # streamed: one pass
    alpha = float(alpha)

    parts: dict[str, list[torch.Tensor]] = {}
    for logp, logq, logp_y, logq_y in blocks(groups, elements):
        logp_a, ce, d1, d2, _ = row_terms(logp, logq, logp_y, logq_y, alpha)  # float64, [n, V] and [n]
        terms = {"ce_cal": ce, "entropy": entropy(logp_a), "d1": d1, "d2": d2, "ce_full": -logp_y.double(),
                 "ce_limited": -logq_y.double()}
        for k, v in terms.items():
            parts.setdefault(k, []).append(v.cpu())
    if not parts:
        raise ValueError("no rows")
    rows = {k: torch.cat(v) for k, v in parts.items()}  # each [N] float64
    n = rows["ce_cal"].numel()
    mean = {k: v.mean().item() for k, v in rows.items()}
    alpha_stderr = sandwich_stderr(rows["d1"], mean["d2"], cluster_size) if fitted else math.nan
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
