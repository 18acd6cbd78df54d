"""How much a model's predictions use the distant past: the calibration bound on I_tau (Braverman et al., ICML 2020,
Section 5).

    I_tau = I(W^_t ; W_<t-tau | W_t-tau..t-1)

is the information the model's prediction W^_t draws from tokens more than tau steps back. With P~ the tau-limited
model (it sees only the last tau tokens), calibrate the full model P^ towards it,

    P^_a(w | w_<t) = P^(w | w_<t) * P~(w | w_t-tau..t-1)^a / Z_t(a),

and fit a* by minimising the cross-entropy

    CE(a) = mean_t [ -log P^(w_t) - a log P~(w_t) + log Z_t(a) ],

which is convex (CE' = mean_t (E_{P^_a}[log P~] - log P~(w_t)), CE'' = mean_t Var_{P^_a}[log P~] >= 0); at a* the
mean of log P~ under P^_a matches its mean at the true next words. Then

    I_tau <= CE(P || P~) - H(W^cal_t | W_<t),

the limited model's cross-entropy on the text minus the mean entropy of P^_a* along it (all in nats). On the rows a*
is fitted on, the moment condition makes the bound the mean KL(P^_a* || P~) >= 0, so a* is fitted on the very rows
the bound is reported on; its sampling error is carried by the standard error (below), and `crossfit` reports the
bound with a* fitted on the other half of the text as a check of the in-sample optimism.

Two-parameter calibration (temperature=True): P^^beta P~^a / Z, fitted jointly (convex in (beta, a): base P^ and
statistics (log P^, log P~), see lmcal.core.expfit). The bound then belongs to a model calibrated in temperature and in
tau, so a mere sharpening of P^ no longer counts as memory.

Standard errors: the text is cut into blocks of `cluster_size` consecutive rows (the independent units), and the
standard error of the bound is a delete-one-block jackknife with a (and beta) refitted in every replicate, so the
uncertainty of the fit is included. By default each refit is one Newton step from the full fit and the bound is
linearised in the parameters (exact to first order; `jackknife="exact"` refits every replicate, B times the cost).

Inputs are precomputed log-probability rows: log P^ [N, V], log P~ [N, V] and the next words [N], or an iterable of
such chunk triples; `context_rows` makes them from any StepLM (a window P~: the model itself fed only the last tau
tokens). Zeros (-inf log-probs) are allowed in the one-parameter fit: P~(w) = 0 where P^(w) > 0 makes a < 0
meaningless (that word would get infinite weight), so the fit then keeps a >= 0, and evaluating at a given a < 0
raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lmcal.core.context import context_rows, full_context_span  # noqa: F401  (lmcal.memory.context_rows: its home before)
from lmcal.core.expfit import (
    NoFiniteMinimum,
    block_sums,
    blocks,
    fit_alpha,
    fit_theta,
    jackknife_stderr,
    onestep_replicates,
    row_terms_k,
    sandwich_stderr,
    tilted,
    with_targets_k,
)

Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (log P^ [n, V], log P~ [n, V], targets [n])


@dataclass
class MemoryBound:
    """The calibration bound on I_tau and what it is made of, in nats, over n_tokens predicted positions."""

    alpha: float  # a* fitted on these rows (fitted=True), or the a it was given
    ce_limited: float  # CE(P || P~): mean -log P~(w_t)
    entropy_calibrated: float  # H(W^cal_t | W_<t): mean entropy of the calibrated model
    mi_upper_bound: float  # ce_limited - entropy_calibrated
    ce_full: float  # mean -log P^(w_t)
    ce_calibrated: float  # mean -log P^cal(w_t)
    n_tokens: int
    mi_stderr: float  # of mi_upper_bound: jackknife over blocks with the fit redone (fitted), else batch means
    ce_full_stderr: float  # standard error of ce_full (batch means over the blocks)
    alpha_stderr: float  # sandwich standard error of a* (inf when CE'' = 0, nan when a was given)
    fitted: bool
    beta: float = 1.0  # the power of P^ (temperature=True), 1 in the one-parameter family
    beta_stderr: float = 0.0  # sandwich standard error of beta* (0: pinned to 1)
    mi_upper_bound_crossfit: float = math.nan  # each half of the blocks scored with the other half's fit (_crossfit)
    delta_ce: float = math.nan  # CE(P~) - CE(P^): how much worse the tau-limited model predicts
    delta_ce_stderr: float = math.nan  # its standard error (batch means over the blocks)
    n_blocks: int = 0  # blocks of cluster_size rows: the units of every standard error


# ---------------------------------------------------------------------------------------------------------------------
# Rows as expfit groups
# ---------------------------------------------------------------------------------------------------------------------
# The calibrated model is the k-statistic family of lmcal.core.expfit with base P^ and statistics (log P~,) or, with the
# temperature, (log P^, log P~) and theta = (beta - 1, a); log P~(y) is always the last column of s(y).


class _Passes:
    """Rows that the fits reread, one pass per iteration: each pass calls make() afresh (rows given as a function
    are then recomputed on every pass, not kept)."""

    def __init__(self, make: Callable[[], Iterable]):
        self.make = make

    def __iter__(self):
        return iter(self.make())


def _check(full: torch.Tensor, limited: torch.Tensor, targets: torch.Tensor) -> None:
    if full.dim() != 2 or full.shape != limited.shape or targets.shape != full.shape[:1]:
        raise ValueError(f"need log P^ [N, V], log P~ [N, V] and targets [N]; got shapes {tuple(full.shape)}, "
                         f"{tuple(limited.shape)}, {tuple(targets.shape)}")


PASSES: list = []  # the progress of memory_summary's fit: one tick per pass over the rows (each a row_groups call)


def row_groups(chunks: Iterable[Chunk], temperature: bool, size: float = math.inf):
    """(segment index, k-statistic rows) of each chunk, cut into segments of `size` rows along the text (blocks of
    the jackknife, halves of the cross-fit; inf: whole chunks), lazily."""
    for bar in PASSES:
        bar.update(1)
    offset = 0
    for full, limited, targets in chunks:
        _check(full, limited, targets)
        rows = with_targets_k(full, (full, limited) if temperature else (limited,), targets)
        i = 0
        while i < full.size(0):
            seg = int((offset + i) // size)
            j = int(min(full.size(0), (seg + 1) * size - offset))
            yield seg, tuple(x[i:j] for x in rows)
            i = j
        offset += full.size(0)


def _one_param(group):
    """k-statistic rows with k = 1 as the (log P, s, log P(y), s(y)) rows of expfit.fit_alpha."""
    logp, logp_y, s_y, s = group
    return logp, s, logp_y, s_y[:, 0]


@torch.no_grad()
def calibrate_to_limited(full_log_probs: torch.Tensor, limited_log_probs: torch.Tensor, alpha: float,
                         beta: float = 1.0) -> torch.Tensor:
    """log P^_a [..., V]: beta log P^ + a log P~, renormalised (computed in float64, returned in the inputs' dtype)."""
    dtype = torch.promote_types(full_log_probs.dtype, limited_log_probs.dtype)
    if beta == 1.0:
        return tilted(full_log_probs, limited_log_probs, alpha).to(dtype)
    base = tilted(full_log_probs, full_log_probs, beta - 1.0)
    return tilted(base, limited_log_probs, alpha).to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# The bound
# ---------------------------------------------------------------------------------------------------------------------


def mean_stderr(x: torch.Tensor, cluster_size: int) -> float:
    """Standard error of mean(x), blocks of cluster_size consecutive rows independent (batch means; 1 = i.i.d.)."""
    dev = block_sums(x - x.mean(), cluster_size)  # [B]: S_b - n_b * mean
    nb = dev.numel()
    if nb < 2:
        return math.nan
    return math.sqrt(dev.pow(2).sum().item() * nb / (nb - 1)) / x.numel()


@torch.no_grad()
def rows_at(groups, theta, elements: int | None, per_row: bool = True) -> dict[str, torch.Tensor]:
    """Per-row float64 terms at theta on CPU, rows in order: ce_cal, entropy, ce_full, ce_limited [N]; with per_row
    also grad [N, k], hess [N, k, k] and d_entropy [N, k] (the jackknife's)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for _, group in groups:
        for blk in blocks([group], elements):
            _, ce, grad, hess, ent, d_ent = row_terms_k(blk, theta)
            terms = {"ce_cal": ce, "entropy": ent, "ce_full": -blk[1].double(), "ce_limited": -blk[2][:, -1].double()}
            if per_row:
                terms.update(grad=grad, hess=hess, d_entropy=d_ent)
            for k, v in terms.items():  # kept where the rows are, moved to the host once at the end
                parts.setdefault(k, []).append(v)
    if not parts:
        raise ValueError("no rows")
    return {k: torch.cat(v).cpu() for k, v in parts.items()}


def _fit(groups: list, k: int, bound: float, elements: int | None, start=None) -> list[float]:
    """theta* of the calibrated family on `groups` ([(segment, rows)]) by expfit.fit_theta (damped Newton from
    `start`, e.g. a nearby fit); a alone (k = 1) by expfit.fit_alpha where P^ or P~ has zeros (its domain cut keeps
    a >= 0 where a < 0 is undefined)."""
    rows = _Passes(lambda: (g for _, g in groups))
    if k == 1 and any(x.numel() and x.amin().item() == -math.inf for g in rows for x in (g[0], g[2], g[3])):
        return [fit_alpha(_Passes(lambda: map(_one_param, rows)), bound, elements, what="memory bound")]
    return fit_theta(rows, k, bound, elements, what="memory bound", start=start)


def _sandwich(grad: torch.Tensor, hess_mean: torch.Tensor, cluster_size: int) -> list[float]:
    """Sandwich standard errors of theta* from per-row gradients grad [N, k] and mean Hessian [k, k]; blocks of
    cluster_size rows independent. inf where the Hessian is singular (a flat direction)."""
    k = grad.size(1)
    if k == 1:
        return [sandwich_stderr(grad[:, 0], hess_mean[0, 0].item(), cluster_size)]
    w = torch.linalg.eigvalsh(hess_mean)
    if not w.min() > 1e-12 * w.max().clamp_min(0):
        return [math.inf] * k
    gb = torch.stack([block_sums(grad[:, j], cluster_size) for j in range(k)], dim=1)  # [B, k]
    inv = torch.linalg.inv(hess_mean)
    cov = inv @ (gb.T @ gb) @ inv / grad.size(0) ** 2
    return cov.diagonal().sqrt().tolist()


def _jackknife(chunks: Iterable, temperature: bool, rows: dict, theta: list[float], cluster_size: int, exact: bool,
               bound: float, elements: int | None) -> float:
    """Delete-one-block jackknife standard error of the bound, the fit redone in every replicate."""
    x = rows["ce_limited"] - rows["entropy"]  # [N]: the bound's per-row terms
    nb = -(-x.numel() // cluster_size)
    if nb < 2:
        return math.nan
    if exact:
        groups = _Passes(lambda: row_groups(chunks, temperature, cluster_size))
        reps = []
        for b in range(nb):
            rest = _Passes(lambda b=b: (g for g in groups if g[0] != b))
            try:
                r = rows_at(rest, _fit(rest, len(theta), bound, elements, theta), elements, per_row=False)
            except NoFiniteMinimum:  # the other blocks have no finite minimum: no replicate, no standard error
                return math.nan
            reps.append((r["ce_limited"] - r["entropy"]).mean())
        return jackknife_stderr(torch.stack(reps))
    terms = [x, rows["grad"], rows["hess"], rows["d_entropy"]]
    if not all(torch.isfinite(z).all() for z in terms):  # e.g. P~ = 0 at a true next word: CE(P || P~) = inf
        return math.nan
    block = torch.arange(x.numel()) // cluster_size  # [N]
    sums = lambda z: torch.zeros((nb, *z.shape[1:]), dtype=z.dtype).index_add_(0, block, z)  # [B, ...] block sums
    # x_t = -log P~(y) - H_t: dx_t / dtheta = -dH_t / dtheta
    reps = onestep_replicates(sums(x), sums(torch.ones_like(x)), sums(rows["grad"]), sums(rows["hess"]),
                              -sums(rows["d_entropy"]))
    return jackknife_stderr(reps)


def _crossfit(chunks: Iterable, temperature: bool, n: int, cluster_size: int, bound: float, elements: int | None,
              start: list[float]) -> float:
    """The bound over all rows, each half of the blocks scored with the parameters fitted on the other half: the
    in-sample optimism removed (nan with fewer than 2 blocks). The halves are the first B // 2 blocks and the other
    B - B // 2 (with B odd, the last block is in the second half), so every row is scored exactly once; nan where a
    half's CE has no finite minimum."""
    nb = -(-n // cluster_size)
    if nb < 2:
        return math.nan
    groups = _Passes(lambda: row_groups(chunks, temperature, cluster_size))  # segment index = block index
    halves = [_Passes(lambda second=second: (g for g in groups if (g[0] >= nb // 2) == second))
              for second in (False, True)]
    k = 2 if temperature else 1
    total = 0.0
    for fit_on, score_on in ((halves[0], halves[1]), (halves[1], halves[0])):
        try:
            theta = _fit(fit_on, k, bound, elements, start)
        except NoFiniteMinimum:
            return math.nan
        r = rows_at(score_on, theta, elements, per_row=False)
        total += (r["ce_limited"] - r["entropy"]).sum().item()
    return total / n


@torch.no_grad()
def memory_upper_bound(full_log_probs, limited_log_probs: torch.Tensor | None = None,
                       targets: torch.Tensor | None = None, alpha: float | None = None, *, cluster_size: int = 1,
                       bound: float = 100.0, elements: int | None = None, temperature: bool = False,
                       beta: float | None = None, jackknife: str = "onestep", crossfit: bool = True,
                       start: list[float] | None = None) -> MemoryBound:
    """The calibration upper bound on I_tau from log-probability rows.

    Inputs: log P^ [N, V], log P~ [N, V] (natural log, rows normalised) and targets [N] long, or, as the only
    positional argument, an iterable of (log P^ [n, V], log P~ [n, V], targets [n]) chunks, consumed once (a
    generator is fine), or a function returning a fresh iterable of them on every call (streamed, below). Rows are
    positions in text order; blocks of `cluster_size` consecutive rows are the independent units of every standard
    error (for dependence along the text; 1 = positions independent).

    alpha=None fits a* on these rows (temperature=True: beta* and a* jointly), and the bound is reported on the same
    rows. mi_stderr is then the delete-one-block jackknife with the fit redone per replicate: `jackknife="onestep"`
    (one Newton step from the full fit, the bound linearised; the default) or "exact" (B full refits). With crossfit,
    also the bound fitted on the first B // 2 blocks and scored on the rest, and vice versa (two more fits).
    `start`: the fit's first parameters ([beta - 1, alpha] with temperature), e.g. a nearby fit's; None: zeros.
    A given alpha (and, with temperature=True, beta) is only evaluated, streaming the chunks: mi_stderr is then by
    batch means, the parameters held fixed.

    Memory: the fit needs CE at several parameters (log Z_t is no finite statistic of a row), so chunks from an
    iterable are kept on the CPU as they come: 2 * N * V elements (6.6 GB of float32 for the PTB test set; float16
    rounds log-probs near -20 by up to ~0.008 nats). Tensors and lists are used in place (rows to keep on a GPU, or in
    another dtype: a list of them); a function is called once per pass (each Newton step, each check) and nothing is
    kept. The reductions run in float64, about `elements` row entries at a time. The two-parameter fit needs P~ > 0
    wherever P^ > 0.

    Raises lmcal.core.expfit.NoFiniteMinimum where the fitted CE has no minimum inside |alpha| < bound (memory_summary
    records that outcome).
    """
    chunks = chunks_of(full_log_probs, limited_log_probs, targets)
    if cluster_size < 1:
        raise ValueError(f"cluster_size must be >= 1, got {cluster_size}")
    if jackknife not in ("onestep", "exact"):
        raise ValueError(f"jackknife must be 'onestep' or 'exact', got {jackknife!r}")
    fitted = alpha is None
    if not fitted and temperature and beta is None:
        raise ValueError("with temperature=True, a given alpha needs a given beta too")
    if fitted:
        if not isinstance(chunks, list | _Passes):  # one pass over the source; the fits reread the kept rows
            chunks = [tuple(t.detach().cpu() for t in chunk) for chunk in chunks]
        groups = _Passes(lambda: row_groups(chunks, temperature))
        if not any(g[1][1].numel() for g in groups):
            raise ValueError("no rows")
        theta = _fit(groups, 2 if temperature else 1, bound, elements, start)
    else:
        groups = row_groups(chunks, temperature)  # streamed: one pass
        theta = [float(beta) - 1.0, float(alpha)] if temperature else [float(alpha)]
    rows = rows_at(groups, theta, elements, per_row=fitted)
    x = rows["ce_limited"] - rows["entropy"]  # [N]
    if fitted:
        stderr = _sandwich(rows["grad"], rows["hess"].mean(0), cluster_size)
        mi_stderr = _jackknife(chunks, temperature, rows, theta, cluster_size, jackknife == "exact", bound, elements)
        cross = (_crossfit(chunks, temperature, x.numel(), cluster_size, bound, elements, theta) if crossfit
                 else math.nan)
    else:
        stderr, mi_stderr, cross = [math.nan] * len(theta), mean_stderr(x, cluster_size), math.nan
    return bound_of(rows, theta, stderr, mi_stderr, cross, cluster_size, fitted, temperature)


def chunks_of(full_log_probs, limited_log_probs, targets):
    """memory_upper_bound's inputs as chunks: whole tensors as one chunk, a function as a source read again on every
    pass, an iterable as it is."""
    if isinstance(full_log_probs, torch.Tensor):
        if limited_log_probs is None or targets is None:
            raise TypeError("with a tensor log P^, pass limited_log_probs and targets too")
        return [(full_log_probs, limited_log_probs, targets)]
    if limited_log_probs is not None or targets is not None:
        raise TypeError("with an iterable of (full, limited, targets) chunks, pass no separate tensors")
    return _Passes(full_log_probs) if callable(full_log_probs) else full_log_probs


def bound_of(rows: dict, theta: list[float], stderr: list[float], mi_stderr: float, cross: float,
              cluster_size: int, fitted: bool, temperature: bool) -> MemoryBound:
    """The bound and its parts from the rows at the parameters theta ([beta - 1, alpha] or [alpha])."""
    mean = {key: rows[key].mean().item() for key in ("ce_cal", "entropy", "ce_full", "ce_limited")}
    n = rows["ce_limited"].numel()
    return MemoryBound(
        alpha=theta[-1],
        ce_limited=mean["ce_limited"],
        entropy_calibrated=mean["entropy"],
        mi_upper_bound=mean["ce_limited"] - mean["entropy"],
        ce_full=mean["ce_full"],
        ce_calibrated=mean["ce_cal"],
        n_tokens=n,
        mi_stderr=mi_stderr,
        ce_full_stderr=mean_stderr(rows["ce_full"], cluster_size),
        alpha_stderr=stderr[-1],
        fitted=fitted,
        beta=1.0 + theta[0] if temperature else 1.0,
        beta_stderr=stderr[0] if temperature else 0.0,
        mi_upper_bound_crossfit=cross,
        delta_ce=mean["ce_limited"] - mean["ce_full"],
        delta_ce_stderr=mean_stderr(rows["ce_limited"] - rows["ce_full"], cluster_size),
        n_blocks=-(-n // cluster_size),
    )
