"""α* of the sequence-level calibrated family P̂_α ∝ P̂^(1+α), fitted on held-out text with the sequential Monte Carlo
sampler that generates from it (same particle count, same twist).

On B held-out (prefix, continuation of T words) pairs, CE(α) per word is

    CE(α) = mean_b [-(1+α) log P̂(x_b | prefix_b) + log Z_α(prefix_b)] / T,

convex, and α* solves the moment condition mean_b E_P̂α[log P̂(W) | prefix_b] = mean_b log P̂(x_b | prefix_b)
(lmcal.core.sequence_exact derives both). Solved on one particle system, reweighted across α: a run of smc_generate at
α0 gives, at any α, E_P̂α[log P̂(W)] and log Ẑ_α by reweighting its final particles by P̂(W)^(α - α0)
(lmcal.core.smc.reweighted), a smooth increasing function of α, so a bracketed root finder solves it exactly (the
moment of separate runs at each α jumps where resampling decisions flip, and a root finder stops at a jump). The run
is then repeated at the root (same seed: common random numbers) until the root moves less than the tolerance or a
quarter of its standard error, so the particles are those of the sampler at α* (the root of each run's own draws moves
by about a standard error: a twist that changes with α, or resampling, redraws the paths). The entropy rate of P̂_α*
comes from the same system,

    EntRate(α) = mean_b [-(1+α) E_P̂α[log P̂(W) | prefix_b] + log Ẑ_b(α)] / T,

so CE(α*) - EntRate(α*) = (1+α*) (moment gap) / T, zero at the root up to the tolerance: the paper's CE = EntRate holds
for the numbers reported, and their paired difference is reported with its standard error. Standard errors take the
prefixes as the independent units: α* by the delta method, (standard error of the mean moment gap) / (its slope, the
mean over prefixes of Var_P̂α[log P̂(W)]); CE and EntRate by their per-prefix terms at α*. log Ẑ is biased low by
about half its variance: small with enough particles or a good twist.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from scipy.optimize import brentq

from lmcal.core.smc import SMCResult, Twist, reweighted, smc_generate


@dataclass
class SequenceFit:
    alpha: float
    alpha_stderr: float
    ce: float  # CE(α*) per word, nats
    ce_stderr: float
    entropy_rate: float  # EntRate(P̂_α*) per word, nats
    entropy_rate_stderr: float
    ce_base: float  # CE(0): the plain model on the same continuations, per word
    ce_base_stderr: float
    ce_gain_stderr: float  # standard error of the paired CE(α*) - CE(0)
    slope: float  # d/dα of the mean moment at α*: mean_b Var_P̂α[log P̂(W)], nats² per sequence
    moment_gap: float  # mean_b (E_P̂α[log P̂(W)] - log P̂(x_b)) at α*: 0 up to the root finder's tolerance
    ce_minus_entropy_rate: float  # CE(α*) - EntRate(α*) per word: (1+α*) moment_gap / T
    ce_minus_entropy_rate_stderr: float  # its standard error over prefixes
    mean_log_z: float  # mean_b log Ẑ_b at α*
    mean_ess: float  # mean over prefixes and steps of the run's ESS / particles
    horizon: int
    num_prefixes: int
    particles: int
    evaluations: int  # smc_generate runs
    settled: bool  # the last run's root moved less than the tolerance from where it ran (else max_runs ran out)
    result: SMCResult | None = None  # the last run (at α* up to the tolerance, when settled)
    moment_by_prefix: torch.Tensor | None = None  # [B] E_P̂α*[log P̂(W) | prefix_b], the last run reweighted to α*
    slope_by_prefix: torch.Tensor | None = None  # [B] Var_P̂α*[log P̂(W) | prefix_b]: d/dα of each moment


@torch.no_grad()
def sequence_log_probs(lm, prefixes: torch.Tensor, continuations: torch.Tensor, max_batch: int = 4096
                       ) -> torch.Tensor:
    """log P̂(continuation_b | prefix_b) [B] float64 for prefixes [B, P] and continuations [B, T]."""
    out = []
    for lo in range(0, prefixes.size(0), max_batch):
        text = torch.cat([prefixes[lo:lo + max_batch], continuations[lo:lo + max_batch]], 1)  # [n, P + T]
        state = lm.init_state(text.size(0))
        total = torch.zeros(text.size(0), dtype=torch.float64)
        for i in range(text.size(1) - 1):
            logp, state = lm.step(text[:, i], state)
            if i + 1 >= prefixes.size(1):
                total += logp.gather(1, text[:, i + 1].to(logp.device)[:, None])[:, 0].double().cpu()
        out.append(total)
    return torch.cat(out)


def _stderr(r: SMCResult, alpha: float, y: torch.Tensor) -> float:
    """The delta-method standard error of α* at `alpha` on the system of run r (the module docstring)."""
    m, _, var = reweighted(r, alpha)
    slope = float(var.mean())
    return float((m - y).std() / math.sqrt(y.numel())) / slope if slope > 0 else math.inf


def reach(r: SMCResult, min_ess: float = 0.5, cap: float = 4.0) -> tuple[float, float]:
    """The α interval around the run's own α where its particles, reweighted, keep a mean ESS of at least min_ess of
    their count (at most `cap` on each side; α > -1): where the reweighted moment can be trusted. With one particle a
    prefix, reweighting changes nothing: (α, α)."""
    a0, K = r.alpha, r.final_log_weights.size(1)
    if K < 2:
        return a0, a0

    def ess(a: float) -> float:
        w = (r.final_log_weights + (a - a0) * r.final_path_logp).softmax(-1)
        return float((1.0 / w.pow(2).sum(-1)).mean()) / K

    ends = []
    for sign in (-1.0, 1.0):
        lo, hi = 0.0, 1e-3  # ESS falls as |α - a0| grows: double, then bisect
        while hi < cap and ess(a0 + sign * hi) >= min_ess:
            lo, hi = hi, 2 * hi
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ess(a0 + sign * mid) >= min_ess else (lo, mid)
        ends.append(a0 + sign * lo)
    return max(ends[0], -1 + 1e-6), ends[1]


@dataclass(frozen=True)
class RootSearch:
    """How fit_sequence_alpha searches for α*: its first run at α0 = `start`; settled once the root moves by at most
    max(xtol, a quarter of α*'s standard error), at most `max_runs` runs; `bracket`: where the search starts
    widening from when a run's particles cannot be reweighted (one particle)."""

    bracket: tuple[float, float] = (-0.5, 1.0)
    xtol: float = 1e-3
    start: float = 0.0
    max_runs: int = 12


def fit_sequence_alpha(lm, prefixes: torch.Tensor, continuations: torch.Tensor, *, particles: int = 64,
                       seed: int = 0, search: RootSearch = RootSearch(), max_batch: int = 4096,
                       twist: Twist | None = None, twist_at: Callable[[float], Twist | None] | None = None,
                       progress: bool = False) -> SequenceFit:
    """α* on held-out prefixes [B, P] and their true continuations [B, T] (module docstring): smc_generate(lm,
    prefixes, α0, T, particles=particles, seed=seed, twist=...) from α0 = search.start; the root of its reweighted
    moment within the run's reach (`reach`: where its particles keep half their ESS), or the edge of that reach
    towards the root, and a run there, until the root moves by at most max(search.xtol, a quarter of α*'s standard
    error; the draws of each run move the root by about a standard error), at most search.max_runs runs (the runs'
    own moments bracket the root, and a step outside that bracket bisects it instead). twist: one twist for every α;
    twist_at(α): the twist for the run at α (e.g. the exact time-to-go values at that α). `progress`: a bar for each
    run."""
    B, T = continuations.shape
    if B < 2 or prefixes.size(0) != B:
        raise ValueError(f"need at least 2 prefixes, one per continuation; got {prefixes.size(0)} and {B}")
    if twist is not None and twist_at is not None:
        raise ValueError("give twist or twist_at, not both")
    y = sequence_log_probs(lm, prefixes, continuations, max_batch)  # [B]
    xtol, widen, max_runs = search.xtol, search.bracket[1], search.max_runs
    a0, r, runs, settled = float(search.start), None, 0, False
    below, above = -1.0, math.inf  # the root lies between: runs whose own moment fell short of y, or passed it
    while runs < max_runs:
        r = smc_generate(lm, prefixes, a0, T, particles=particles, seed=seed, max_batch=max_batch,
                         twist=twist_at(a0) if twist_at is not None else twist,
                         progress=progress and f"fit of alpha*, run {runs + 1} at {a0:.5f}, {particles} particles")
        runs += 1
        gap = lambda a: float((reweighted(r, a)[0] - y).mean())  # noqa: B023, E731  (increasing in a)
        below, above = (max(below, a0), above) if gap(a0) < 0 else (below, min(above, a0))
        lo, hi = reach(r)
        inside = lo < hi and gap(lo) <= 0 <= gap(hi)
        if inside:  # the root of this run's reweighted moment, where the reweighting holds
            a1 = brentq(gap, lo, hi, xtol=xtol / 4) if gap(lo) < 0 < gap(hi) else (lo if gap(lo) == 0 else hi)
        else:  # to the edge of the reach towards the root
            a1 = hi if gap(a0) < 0 else lo
        if not below < a1 < above or a1 == a0:  # outside what the runs bracket (or stuck): bisect it, or widen
            a1, inside = (below + above) / 2 if math.isfinite(above) else max(widen, 2 * a0 + 1, below + 1), False
        if inside and abs(a1 - a0) <= max(xtol, _stderr(r, a1, y) / 4):
            settled = True
            break
        a0 = a1
    alpha = a1 if settled else a0  # the last run's own root, or (not settled) the α it ran at
    m, log_z, var = reweighted(r, alpha)  # [B] each: the system of the last run, at α*
    gap = m - y  # [B]
    slope = float(var.mean())
    a1 = 1.0 + alpha
    ce_b = (-a1 * y + log_z) / T  # [B]: each prefix's CE term
    ent_b = (-a1 * m + log_z) / T
    base_b = -y / T

    def se(x: torch.Tensor) -> float:
        return float(x.std() / math.sqrt(B))

    return SequenceFit(alpha, se(gap) / slope if slope > 0 else math.inf, float(ce_b.mean()), se(ce_b),
                       float(ent_b.mean()), se(ent_b), float(base_b.mean()), se(base_b), se(ce_b - base_b), slope,
                       float(gap.mean()), float((ce_b - ent_b).mean()), se(ce_b - ent_b), float(log_z.mean()),
                       float((r.ess / particles).mean()), T, B, int(particles), runs, settled, r, m, var)


def paired_alpha_gap(m1: torch.Tensor, v1: torch.Tensor, a1: float, m2: torch.Tensor, v2: torch.Tensor,
                     a2: float) -> tuple[float, float]:
    """α*1 - α*2 of two fits on the same held-out continuations, and its standard error with the prefixes paired:
    each fit's per-prefix moments m [B] and slopes v [B] at its own root, carried linearly to the midpoint α. The true
    text's log-probabilities are the same in both fits and cancel from the difference, which only the two samplers'
    noise moves: the standard error is that of mean_b (m1_b - m2_b) at one α, over the mean slope."""
    mid = (a1 + a2) / 2
    d = (m1 + v1 * (mid - a1)) - (m2 + v2 * (mid - a2))  # [B]
    slope = float((v1 + v2).mean()) / 2
    se = float(d.std() / math.sqrt(d.numel())) / slope if slope > 0 and d.numel() > 1 else math.inf
    return a1 - a2, se


@dataclass
class ReferenceCheck:
    """A sampler's fitted law against untwisted SMC at many particles on the same held-out prefixes."""

    particles: int  # the reference's
    prefixes: int
    moment_gap: float  # mean_b of the run's E[log P̂(W) | prefix_b] minus the reference's, at α (nats a sequence)
    moment_gap_stderr: float
    alpha_shift: float  # -moment_gap / slope: where the run's root sits against the reference's
    alpha_shift_stderr: float
    tolerance: float  # |alpha_shift| must be shown within this (the fit's own standard error)
    verdict: str  # pass: shown within the tolerance at 2 se; fail: shown beyond it; else undecided


@torch.no_grad()
def reference_check(lm, prefixes: torch.Tensor, run: SMCResult, alpha: float, *, particles: int, tolerance: float,
                    seed: int = 0, max_batch: int = 4096, progress: bool = False) -> ReferenceCheck:
    """Checks the moment α* is fitted on, E_P̂α[log P̂(W) | prefix], of a run (a fit's last run, smc_generate on
    prefixes [B, P] and more) against untwisted SMC at `particles` on those B prefixes, at α. A twist that is wrong
    near the horizon, or made for another α, biases the run's moment by more than its weights correct at its particle
    count; so does a sampler with too few particles, twisted or not. The difference in moments, over the slope, is
    how far the run's α* sits from the reference's: the check passes where that shift's 2-standard-error interval lies
    within ±tolerance, fails where it lies beyond, and is undecided otherwise (the reference's own bias, of order
    1 / particles, is not counted: use many)."""
    B = prefixes.size(0)
    ref = smc_generate(lm, prefixes, alpha, run.tokens.size(1), particles=particles, seed=seed, max_batch=max_batch,
                       progress=progress and f"reference check, untwisted SMC, {particles} particles")
    m_ref, _, var = reweighted(ref, alpha)  # [B] each
    d = reweighted(run, alpha)[0][:B] - m_ref  # [B]: paired by prefix
    gap, gap_se = float(d.mean()), float(d.std() / math.sqrt(B)) if B > 1 else math.inf
    slope = float(var.mean())
    shift, shift_se = (-gap / slope, gap_se / slope) if slope > 0 else (math.nan, math.inf)
    tol = float(tolerance)
    verdict = ("pass" if abs(shift) + 2 * shift_se <= tol else "fail" if abs(shift) - 2 * shift_se > tol
               else "undecided")
    return ReferenceCheck(int(particles), B, gap, gap_se, shift, shift_se, tol, verdict)
