"""Entropy miscalibration against scale: the gap between the entropy of a model's generations and its log loss on
true text, and the power law it follows across a family of models.

For one model, the gap (Cao, Valiant & Liang, NeurIPS 2025, "entropy calibration error") is

    gap = mean entropy over the last tenth of the generations' horizon - test cross-entropy   (nats per token)

with the last tenth's mean taken per prefix (generations from one prefix are a cluster) and the test cross-entropy's
own error from blocks of consecutive test tokens. Across models the gap is fitted as gap = A x^b, x the parameters,
the training tokens or the test cross-entropy, by least squares on log gap against log x (as CVL fit it), and b's
confidence interval comes from a bootstrap that resamples the runs and, within each, its prefixes (and redraws its
test cross-entropy within its standard error).

Everything here is plain numbers and tensors: no files, no frameworks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from lmcal.core.calibration import target_log_probs
from lmcal.core.expfit import stream_block_sums


def clustered_level(per_prefix: np.ndarray) -> tuple[float, float]:
    """(mean, standard error) of a level measured per prefix [N] (each prefix's mean over its generations): the
    prefixes are the independent units; nan standard error with one prefix."""
    x = np.asarray(per_prefix, dtype=np.float64)
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan
    return float(x.mean()), se


def gap(tail_per_prefix: np.ndarray, test_ce: float, test_ce_stderr: float | None = None) -> dict:
    """The gap of one model: the last tenth's mean entropy over its prefixes [N] minus its test cross-entropy, with
    the standard errors of both and of their difference (independent: generations against fixed test text)."""
    tail, tail_se = clustered_level(tail_per_prefix)
    ce_se = test_ce_stderr if test_ce_stderr is not None and math.isfinite(test_ce_stderr) else 0.0
    return {"tail_nats": tail, "tail_stderr_nats": tail_se, "gap_nats": tail - test_ce,
            "gap_stderr_nats": math.hypot(tail_se, ce_se) if math.isfinite(tail_se) else math.nan}


@torch.no_grad()
def stream_ce(lm, tokens: torch.Tensor, max_len: int = 1000, cluster_size: int = 100,
              max_streams: int = 64) -> tuple[float, float, int]:
    """(cross-entropy, its standard error, tokens scored) of a StepLM on a 1-D token stream [N] read as streams of
    at most `max_len` tokens (a model of bounded context: at most its context), each stream's first token context
    only. The standard error treats blocks of `cluster_size` consecutive positions of one stream as independent;
    streams are scored `max_streams` at a time."""
    max_len = max(2, int(max_len))
    n = tokens.numel() // max_len * max_len
    streams = tokens[:n].view(-1, max_len) if n else tokens.view(1, -1)  # [S, L]: stream s = row s
    sums, counts = [], []
    for lo in range(0, streams.size(0), max_streams):
        chunk = streams[lo:lo + max_streams].t().contiguous()  # [L, B] time-major
        logq = target_log_probs(lm, chunk)  # [(L-1) * B], t-major
        B = chunk.size(1)
        sums.append(stream_block_sums(-logq, B, cluster_size))
        counts.append(stream_block_sums(torch.ones_like(logq), B, cluster_size))
    s, c = torch.cat(sums), torch.cat(counts)  # [blocks]: each block's total loss and its positions
    total = float(c.sum())
    ce = float(s.sum()) / total
    se = math.sqrt(float((s - ce * c).pow(2).sum())) / total  # ratio estimator over blocks
    return ce, se, int(total)


@dataclass
class PowerLawFit:
    """gap = exp(intercept) prod_k x_k^exponents[k], fitted on log gap against the log x_k; each exponent's interval
    is the bootstrap's."""

    exponents: dict[str, float]
    intercept: float
    ci: dict[str, tuple[float, float]]
    stderr: dict[str, float]  # the bootstrap replicates' standard deviation of each exponent
    level: float  # the intervals' coverage, e.g. 0.95
    n_runs: int  # the runs the point estimate used (gap > 0)
    excluded: list[int] = field(default_factory=list)  # runs left out of the point fit: gap <= 0 (no log)
    replicates: int = 0  # bootstrap replicates that gave exponents
    failed_replicates: int = 0  # replicates whose runs of positive gap could not determine them (too few, collinear)


MIN_SPREAD = 1.1  # the least ratio of largest to smallest x an exponent is read off (test CEs span ~1.3)


def log_linear_fit(xs: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """Least squares of log y on [1, log x_1, ..., log x_K]: (intercept, exponents) [K + 1], or None when the runs
    cannot determine them: fewer than K + 2 (a line through K + 1 points has no residual to judge it by), an x that
    spans less than a factor of MIN_SPREAD (runs that saw 640,000 and 639,980 tokens gave an 'exponent' of +2,814),
    or x's collinear. xs [n, K] > 0, y [n] > 0."""
    logx = np.log(np.asarray(xs, dtype=np.float64))  # [n, K]
    A = np.column_stack([np.ones(len(y)), logx])  # [n, K + 1]
    if len(y) < A.shape[1] + 1 or (np.ptp(logx, axis=0) < math.log(MIN_SPREAD)).any():
        return None
    if np.linalg.matrix_rank(A) < A.shape[1]:
        return None
    return np.linalg.lstsq(A, np.log(y), rcond=None)[0]


def fit_power_law(x: dict[str, list[float]], tails: list[np.ndarray], test_ce: list[float],
                  test_ce_stderr: list[float | None], n_boot: int = 2000, level: float = 0.95,
                  seed: int = 0, sign: float = 1.0) -> PowerLawFit:
    """The power law gap = A prod_k x_k^b_k over runs i: x {name: [R] values > 0} (one exponent each: parameters,
    training tokens, ...), tails[i] [N_i] run i's last-tenth entropy per prefix, test_ce [R] and its standard errors
    [R] (None or nan: none known).

    The point estimate fits the runs' own gaps; runs with gap <= 0 have no logarithm and are left out (`excluded`).
    Each bootstrap replicate draws R runs with replacement, within each its N_i prefixes with replacement, and its
    test cross-entropy from a normal of its standard error, then fits the replicate's runs of positive gap (a
    replicate whose runs cannot determine every exponent counts as failed). The intervals are the replicates'
    percentile intervals at `level`. sign = -1 fits the entropy deficit -gap instead (a family whose generations are
    all less entropic than its test CE), in the same way."""
    names = list(x)
    X = np.column_stack([np.asarray(x[k], dtype=np.float64) for k in names])  # [R, K]
    R = X.shape[0]
    if not (X > 0).all():
        raise ValueError(f"a power law needs x > 0; got {x}")
    tails = [np.asarray(t, dtype=np.float64) for t in tails]
    ce = np.asarray(test_ce, dtype=np.float64)
    ce_se = np.array([s if s is not None and math.isfinite(s) else 0.0 for s in test_ce_stderr], dtype=np.float64)
    g = sign * (np.array([t.mean() for t in tails]) - ce)
    pos = g > 0
    coef = log_linear_fit(X[pos], g[pos])
    if coef is None:
        y = "gap" if sign > 0 else "-gap"
        raise ValueError(f"{int(pos.sum())} of {R} runs have a positive {y} ({y}s {np.round(g, 4).tolist()} nats): "
                         f"too few (at least {len(names) + 2}), or too alike in {', '.join(names)} (less than a "
                         f"factor of {MIN_SPREAD:g} apart), to fit {len(names)} exponent(s)")
    rng = np.random.default_rng(seed)
    boot, failed = [], 0
    for _ in range(n_boot):
        runs = rng.integers(0, R, R)  # [R]
        gb = np.array([tails[i][rng.integers(0, tails[i].size, tails[i].size)].mean() for i in runs])
        gb = sign * (gb - ce[runs] - ce_se[runs] * rng.standard_normal(R))
        ok = gb > 0
        c = log_linear_fit(X[runs][ok], gb[ok])
        if c is None:
            failed += 1
        else:
            boot.append(c[1:])
    boot = np.asarray(boot).reshape(-1, len(names))  # [replicates, K]
    lo_q, hi_q = (1 - level) / 2, (1 + level) / 2
    ci = {k: tuple(float(v) for v in np.quantile(boot[:, j], [lo_q, hi_q])) if len(boot) else (math.nan, math.nan)
          for j, k in enumerate(names)}
    sd = {k: float(boot[:, j].std(ddof=1)) if len(boot) > 1 else math.nan for j, k in enumerate(names)}
    return PowerLawFit({k: float(coef[j + 1]) for j, k in enumerate(names)}, float(coef[0]), ci, sd, level,
                       int(pos.sum()), [int(i) for i in np.flatnonzero(~pos)], len(boot), failed)


def weighted_trend(x: np.ndarray, y: np.ndarray, y_se: np.ndarray) -> tuple[float, float]:
    """(slope, its standard error) of weighted least squares of y on x, weights 1 / se^2 (each y's own standard
    error, floored at the median of the positive ones, so that a run whose generations collapsed to one distribution,
    se ~ 0, does not carry the fit alone). The slope's error is the weights' one, scaled up by the residuals where
    they scatter more than the errors allow (reduced chi-square > 1, with three runs or more): runs that differ in
    more than strength must not read as a precise trend. Needs two distinct x."""
    x, y, se = (np.asarray(v, dtype=np.float64) for v in (x, y, y_se))
    positive = se[np.isfinite(se) & (se > 0)]
    floor = float(np.median(positive)) if positive.size else 1e-12
    w = 1.0 / np.maximum(np.nan_to_num(se, nan=floor), floor) ** 2
    xm = (w * x).sum() / w.sum()
    sxx = (w * (x - xm) ** 2).sum()
    ym = (w * y).sum() / w.sum()
    slope = float((w * (x - xm) * (y - ym)).sum() / sxx)
    chi2 = float((w * (y - ym - slope * (x - xm)) ** 2).sum() / (len(x) - 2)) if len(x) > 2 else 1.0
    return slope, float(math.sqrt(max(1.0, chi2) / sxx))
