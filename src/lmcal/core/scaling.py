"""Entropy miscalibration against scale: the gap between the entropy of a model's generations and its log loss on
true text, and the power law it follows across a family of models.

For one model, the gap (Cao, Valiant & Liang, NeurIPS 2025, "entropy calibration error") is

    gap = mean entropy over the last tenth of the generations' horizon - test cross-entropy   (nats per token)

with the last tenth's mean taken per prefix (generations from one prefix are a cluster) and the test cross-entropy's
own error from blocks of consecutive test tokens. Across models the gap is fitted as gap = A x^b, x the parameters,
the training tokens or the test cross-entropy, by least squares on log gap against log x (as CVL fit it) over every
run, with b's t-interval on the fit's residual degrees of freedom (n runs - coefficients; none stated below MIN_DF).
A run whose gap is <= 0 has no logarithm: rather than leave it out (a selection on the outcome) no power law is fitted
then, and the signed gap's trend, gap = a + b log x, takes every run. A bootstrap over the runs and, within each, its
prefixes (its test cross-entropy redrawn within its standard error) is kept as a cross-check.

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


MIN_SPREAD = 1.1  # the least ratio of largest to smallest x an exponent is read off (test CEs span ~1.3)
MIN_DF = 2  # the fewest residual degrees of freedom a fit is stated with (on 1, t's 97.5% quantile is 12.7)


@dataclass
class LinearFit:
    """Ordinary least squares of y [n] on a design [n, p]: each coefficient's standard error, from the residuals,
    and its t-interval on df = n - p residual degrees of freedom."""

    coef: np.ndarray  # [p]
    stderr: np.ndarray  # [p]
    ci: np.ndarray  # [p, 2]: coef -/+ t_crit stderr
    df: int
    t_crit: float  # t's (1 + level) / 2 quantile on df degrees of freedom
    level: float
    sigma: float  # the residuals' standard deviation, sqrt(RSS / df)


def ols_t(A: np.ndarray, y: np.ndarray, level: float = 0.95) -> LinearFit:
    """Least squares of y [n] on the columns of A [n, p] with t-intervals at `level`; ValueError when the runs leave
    fewer than MIN_DF residual degrees of freedom or A's columns are collinear."""
    from scipy import stats

    A, y = np.asarray(A, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n, p = A.shape
    df = n - p
    if df < MIN_DF:
        raise ValueError(f"df < {MIN_DF}: {n} runs and {p} coefficients leave {df} residual degree(s) of freedom; "
                         f"it needs at least {p + MIN_DF} runs")
    if np.linalg.matrix_rank(A) < p:
        raise ValueError(f"the {n} runs' x are collinear: {p} coefficients cannot be told apart")
    pinv = np.linalg.pinv(A)  # [p, n]
    coef = pinv @ y
    resid = y - A @ coef
    sigma = math.sqrt(float(resid @ resid) / df)
    se = sigma * np.sqrt((pinv ** 2).sum(axis=1))  # sqrt(diag(sigma^2 (A'A)^-1)), as (A'A)^-1 = pinv pinv'
    t = float(stats.t.ppf((1 + level) / 2, df))
    return LinearFit(coef, se, np.column_stack([coef - t * se, coef + t * se]), df, t, level, sigma)


def check_spread(X: np.ndarray, names: list[str]) -> None:
    """ValueError when an x [n, K] > 0 spans less than a factor of MIN_SPREAD (runs that saw 640,000 and 639,980
    tokens gave an 'exponent' of +2,814): no axis to read a trend off."""
    flat = [k for k, s in zip(names, np.ptp(np.log(X), axis=0), strict=True) if s < math.log(MIN_SPREAD)]
    if flat:
        raise ValueError(f"the runs are too alike in {', '.join(flat)} (less than a factor of {MIN_SPREAD:g} "
                         "apart) to fit a trend against it")


@dataclass
class PowerLawFit:
    """gap = exp(intercept) prod_k x_k^exponents[k], fitted on log gap against the log x_k over every run; each
    exponent's interval is OLS's t-interval on df residual degrees of freedom, the bootstrap's a cross-check."""

    exponents: dict[str, float]
    intercept: float
    ci: dict[str, tuple[float, float]]  # the t-interval at `level`
    stderr: dict[str, float]  # OLS's, from the residuals
    level: float  # the intervals' coverage, e.g. 0.95
    n_runs: int  # every run: none is left out
    df: int  # n_runs - (exponents + 1)
    t_crit: float
    bootstrap_ci: dict[str, tuple[float, float]] = field(default_factory=dict)  # percentile, at `level`
    bootstrap_stderr: dict[str, float] = field(default_factory=dict)  # the replicates' standard deviation
    replicates: int = 0  # bootstrap replicates that gave exponents
    failed_replicates: int = 0  # replicates that could not: a drawn gap <= 0, too few distinct runs, collinear


def log_linear_fit(xs: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """Least squares of log y on [1, log x_1, ..., log x_K]: (intercept, exponents) [K + 1], or None when the runs
    cannot determine them: fewer than K + 2 (a line through K + 1 points has no residual to judge it by), an x that
    spans less than a factor of MIN_SPREAD, or x's collinear. xs [n, K] > 0, y [n] > 0. The bootstrap's fit."""
    logx = np.log(np.asarray(xs, dtype=np.float64))  # [n, K]
    A = np.column_stack([np.ones(len(y)), logx])  # [n, K + 1]
    if len(y) < A.shape[1] + 1 or (np.ptp(logx, axis=0) < math.log(MIN_SPREAD)).any():
        return None
    if np.linalg.matrix_rank(A) < A.shape[1]:
        return None
    return np.linalg.lstsq(A, np.log(y), rcond=None)[0]


def design(x: dict[str, list[float]]) -> tuple[list[str], np.ndarray]:
    """(names, X [R, K]) of the x's, each > 0 and spanning a factor of MIN_SPREAD."""
    names = list(x)
    X = np.column_stack([np.asarray(x[k], dtype=np.float64) for k in names])  # [R, K]
    if not (X > 0).all():
        raise ValueError(f"a trend against log x needs x > 0; got {x}")
    check_spread(X, names)
    return names, X


def fit_power_law(x: dict[str, list[float]], tails: list[np.ndarray], test_ce: list[float],
                  test_ce_stderr: list[float | None], n_boot: int = 2000, level: float = 0.95,
                  seed: int = 0, sign: float = 1.0) -> PowerLawFit:
    """The power law gap = A prod_k x_k^b_k over runs i: x {name: [R] values > 0} (one exponent each: parameters,
    training tokens, ...), tails[i] [N_i] run i's last-tenth entropy per prefix, test_ce [R] and its standard errors
    [R] (None or nan: none known). sign = -1 fits the entropy deficit -gap instead (a family whose generations are
    all less entropic than its test CE), in the same way.

    Every run enters: OLS of log gap on [1, log x] over all R runs (the seeds of one cell each a run: see
    lmcal.reporting.scale_report.fit_group), each exponent with its t-interval on R - K - 1 degrees of freedom. A run
    whose gap is <= 0 has no logarithm, and leaving it out would select the runs on the outcome: then no power law
    is fitted (ValueError; signed_trend takes every run), nor with fewer than MIN_DF degrees of freedom. The bootstrap
    (a cross-check) draws R runs with replacement, within each its N_i prefixes with replacement, and its test CE
    from a normal of its standard error; a replicate with a drawn gap <= 0, or whose runs cannot determine every
    exponent, fails."""
    names, X = design(x)
    tails = [np.asarray(t, dtype=np.float64) for t in tails]
    ce = np.asarray(test_ce, dtype=np.float64)
    ce_se = np.array([s if s is not None and math.isfinite(s) else 0.0 for s in test_ce_stderr], dtype=np.float64)
    g = sign * (np.array([t.mean() for t in tails]) - ce)  # [R]
    if (g <= 0).any():
        y = "gap" if sign > 0 else "-gap"
        raise ValueError(f"runs {np.flatnonzero(g <= 0).tolist()} have {y} <= 0 ({y}s {np.round(g, 4).tolist()} "
                         "nats): a power law cannot take them, and leaving them out would select on the outcome")
    ols = ols_t(np.column_stack([np.ones(len(g)), np.log(X)]), np.log(g), level)
    boot, failed = bootstrap_exponents(X, tails, ce, ce_se, sign, n_boot, seed)
    lo_q, hi_q = (1 - level) / 2, (1 + level) / 2
    return PowerLawFit(
        {k: float(ols.coef[j + 1]) for j, k in enumerate(names)}, float(ols.coef[0]),
        {k: (float(ols.ci[j + 1, 0]), float(ols.ci[j + 1, 1])) for j, k in enumerate(names)},
        {k: float(ols.stderr[j + 1]) for j, k in enumerate(names)}, level, len(g), ols.df, ols.t_crit,
        {k: tuple(float(v) for v in np.quantile(boot[:, j], [lo_q, hi_q])) if len(boot) else (math.nan, math.nan)
         for j, k in enumerate(names)},
        {k: float(boot[:, j].std(ddof=1)) if len(boot) > 1 else math.nan for j, k in enumerate(names)},
        len(boot), failed)


def bootstrap_exponents(X: np.ndarray, tails: list[np.ndarray], ce: np.ndarray, ce_se: np.ndarray, sign: float,
                        n_boot: int, seed: int) -> tuple[np.ndarray, int]:
    """(exponents [replicates, K], failed replicates) of fit_power_law's bootstrap over runs and their prefixes."""
    rng = np.random.default_rng(seed)
    R = X.shape[0]
    boot, failed = [], 0
    for _ in range(n_boot):
        runs = rng.integers(0, R, R)  # [R]
        gb = np.array([tails[i][rng.integers(0, tails[i].size, tails[i].size)].mean() for i in runs])
        gb = sign * (gb - ce[runs] - ce_se[runs] * rng.standard_normal(R))
        c = log_linear_fit(X[runs], gb) if (gb > 0).all() else None
        if c is None:
            failed += 1
        else:
            boot.append(c[1:])
    return np.asarray(boot).reshape(-1, X.shape[1]), failed


def signed_trend(x: dict[str, list[float]], y: list[float], level: float = 0.95) -> tuple[list[str], LinearFit]:
    """(names, fit) of the signed gap's trend y = a + sum_k b_k log x_k over every run, whatever its sign: OLS with
    t-intervals (coef [1 + K]: a, then b_k in nats per unit of log x_k). ValueError as ols_t, or when an x spans less
    than a factor of MIN_SPREAD."""
    names, X = design(x)
    return names, ols_t(np.column_stack([np.ones(X.shape[0]), np.log(X)]), y, level)


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
