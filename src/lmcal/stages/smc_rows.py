"""The sampler's rows of Algorithm 1 (the sequence_calibration stage): SMC at one particle count, twisted (a soft-value
head as the twist) or untwisted, end to end at that count: its own α*, its generations, its law's last tenth, its own
test CE and its own cost (lmcal.core.smc, lmcal.core.sequence_fit).

One law for every row: P̂_α(w_1..L) ∝ P̂(w_1..L)^(1+α) over L = law_horizon words (2 x the horizon by default), fitted
on validation continuations of L words, generated over L words, read over its first `horizon` words (the curve and the
last tenth), far from its own end, where a law over exactly `horizon` words would steer towards whatever is cheap in
its last few words; and scored on test continuations of L words.

A row's generations are kept as per-generation arrays [n, S] (n prefixes, S generations each) and per-prefix curves
[n, T], so that its statistics are functions of its arrays and a finished row can take more generations at other
seeds, side by side along S, as if drawn at once (extend_row: its α* not fitted again). Prefixes are the independent
units of every standard error.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from lmcal.core.entropy_rate import clustered_mean
from lmcal.core.sequence_fit import RootSearch, fit_sequence_alpha, reference_check, sequence_log_probs
from lmcal.core.smc import entropy_rate, smc_generate, smc_tail_entropy
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")


@dataclass
class StudySetup:
    """What every row of the study shares."""

    lm: object
    prefixes: torch.Tensor  # [n * S, P]: the generations' prefixes, prefix-major (as the per-word rows')
    samples_per_prefix: int
    fit: tuple[torch.Tensor, torch.Tensor]  # validation (prefixes [B, P], continuations [B, L])
    test: tuple[torch.Tensor, torch.Tensor]  # test (prefixes [B, P], continuations [B, L])
    horizon: int  # the words read (curve, last tenth)
    law_horizon: int  # L
    last: int  # the last tenth's words
    plain_tails: dict[int, np.ndarray]  # seed -> [n, S]: the plain model's last-tenth entropies on the same prefixes,
    # at each seed the study's generations drew at (the pairs of every SMC row's)
    plain_ms: float  # the plain model's ms per word on the timing protocol
    timing_prefixes: torch.Tensor  # [m, P] (repeated per sample)
    timing_horizon: int
    timing_repeats: int
    seed: int
    bracket: tuple[float, float]
    xtol: float
    tail_particles: int | None  # the nested runs' particles (None: the row's own count)
    max_batch: int
    smc_seeds: tuple[int, ...]  # the seeds of the SMC rows' generations, S a prefix at each
    check_particles: int  # the reference check's untwisted SMC ...
    check_prefixes: int | None  # ... on the first this many fit windows (None: all)


def _paired(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (x - ref).double()
    return float(d.mean()), float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else math.nan


def study_row(s: StudySetup, k: int, twist_at=None, start_alpha: float = 0.0) -> dict:
    """One row: SMC with k particles, end to end at that count; twisted where twist_at (a TwistAtAlpha: the twist
    made for each α) is given, every run of its fit and its generations with a twist trained at their own α."""
    variant = "twisted" if twist_at is not None else "untwisted"
    lm = twist_at(start_alpha).lm if twist_at is not None else s.lm
    t0 = time.perf_counter()
    fit = fit_sequence_alpha(lm, *s.fit, particles=k, seed=s.seed,
                             search=RootSearch(bracket=s.bracket, xtol=s.xtol, start=start_alpha),
                             max_batch=s.max_batch, twist_at=twist_at, progress=True)
    a = fit.alpha
    twist = twist_at(a) if twist_at is not None else None
    fit_s = time.perf_counter() - t0
    log.info(f"{variant} SMC, {k} particles: alpha* {a:.5f} +- {fit.alpha_stderr:.5f} on {fit.num_prefixes} validation "
             f"continuations ({fit.evaluations} runs{'' if fit.settled else ', not settled'}, {fit_s:.0f} s); CE "
             f"{fit.ce:.4f}, EntRate {fit.entropy_rate:.4f}, the plain model's CE {fit.ce_base:.4f} +- "
             f"{fit.ce_base_stderr:.4f} nats a word")
    check = _reference_check(s, fit)
    gen = join_generations(*(generate(s, lm, k, a, twist, seed) for seed in s.smc_seeds))
    row = {"method": "smc", "variant": variant,
           "params": {"particles": k, "alpha": a, "alpha_stderr": fit.alpha_stderr,
                      **({"twist_alpha": twist_at.alpha} if twist_at is not None else {})},
           **_test_ce(s, lm, k, a, twist),
           "fit": {"ce_nats": fit.ce, "ce_stderr_nats": fit.ce_stderr, "entropy_rate_nats": fit.entropy_rate,
                   "ce_minus_entropy_rate_nats": fit.ce_minus_entropy_rate,
                   "ce_minus_entropy_rate_stderr_nats": fit.ce_minus_entropy_rate_stderr,
                   "ce_base_nats": fit.ce_base, "moment_gap": fit.moment_gap, "slope": fit.slope,
                   "runs": fit.evaluations, "settled": fit.settled,
                   "ess_per_particle": fit.mean_ess, "seconds": fit_s,
                   "moment_by_prefix": fit.moment_by_prefix.tolist(), "slope_by_prefix": fit.slope_by_prefix.tolist()},
           "reference_check": check, **gen}
    if twist_at is not None:
        row["twist_trainings"] = [dict(x) for x in twist_at.trainings]
    ms = min(_ms(lm, s, a, k, twist) for _ in range(s.timing_repeats))
    row |= {"ms_per_token": ms, "cost_ratio": ms / s.plain_ms}
    row.update(generation_columns(row))  # α*'s own noise needs α*'s standard error
    row["seconds"] = time.perf_counter() - t0
    log.info(f"{variant} SMC, {k} particles: alpha* {a:.4f} +- {fit.alpha_stderr:.4f} ({fit.evaluations} runs), last "
             f"tenth {row['tail_ppl']:.1f} +- {row['tail_ppl_stderr']:.1f}, ESS {row['ess_per_particle']:.2f} x K, "
             f"reference check {check['verdict']}, {ms:.3f} ms a word, {row['seconds']:.0f} s")
    return row


def _reference_check(s: StudySetup, fit) -> dict:
    """The row's fitted moment against untwisted SMC at s.check_particles on the first fit windows, at its α*, with
    the fit's own standard error (at least its tolerance) as the bias allowed (lmcal.core.sequence_fit)."""
    n = min(s.fit[0].size(0), s.check_prefixes or s.fit[0].size(0))
    c = reference_check(s.lm, s.fit[0][:n], fit.result, fit.alpha, particles=s.check_particles,
                        tolerance=max(fit.alpha_stderr, s.xtol), seed=s.seed + 5, max_batch=s.max_batch, progress=True)
    return asdict(c)


def _test_ce(s: StudySetup, lm, k: int, a: float, twist) -> dict:
    """The row's test CE at its count: log Ẑ on test continuations, paired with the model on the same words (biased
    low by about half log Ẑ's variance, estimated from two independent runs: E[(log Ẑ1 - log Ẑ2)^2] / 2 = Var log Ẑ)."""
    y = sequence_log_probs(s.lm, *s.test, s.max_batch)  # [B]
    runs = [smc_generate(lm, s.test[0], a, s.law_horizon, particles=k, seed=s.seed + j, twist=twist,
                         max_batch=s.max_batch, progress=f"test CE, run {j - 1} of 2, {k} particles").log_z
            for j in (2, 3)]
    L = s.law_horizon
    ce = (-(1 + a) * y + runs[0]) / L  # [B]: per word
    ce_diff = _paired(ce, -y / L)
    return {"test_ce_nats": float(ce.mean()), "test_ce_diff_nats": ce_diff[0], "test_ce_diff_stderr_nats": ce_diff[1],
            "test_ce_bias_nats": -float((runs[0] - runs[1]).pow(2).mean()) / 4 / L, "test_ce_prefixes": int(y.numel())}


def _ms(lm, s: StudySetup, alpha: float, k: int, twist) -> float:
    """ms per returned word on the timing protocol (the plain model's timing runs the same generations)."""
    p = s.timing_prefixes.repeat_interleave(s.samples_per_prefix, 0)
    r = smc_generate(lm, p, alpha, s.timing_horizon, particles=k, seed=s.seed, twist=twist, max_batch=s.max_batch)
    return 1000.0 * r.seconds / r.tokens.numel()


def _per_generation(x: torch.Tensor, n: int, S: int) -> list:
    """[n * S] -> [n, S]."""
    return x.double().numpy().reshape(n, S).tolist()


def generate(s: StudySetup, lm, k: int, alpha: float, twist, seed: int) -> dict:
    """One seed's generations of a row at α, S from each of the study's prefixes: the per-generation arrays [n, S] and
    per-prefix curves [n, T] its columns are computed from (generation_columns), kept in the row so that more seeds
    can join it later (join_generations, extend_row)."""
    variant = "twisted" if twist is not None else "untwisted"
    name = f"{variant} SMC, {k} particles" + ("" if s.smc_seeds == (s.seed,) else f", seed {seed}")
    r = smc_generate(lm, s.prefixes, alpha, s.law_horizon, particles=k, seed=seed, twist=twist, max_batch=s.max_batch,
                     progress=name)
    n, S, T = s.prefixes.size(0) // s.samples_per_prefix, s.samples_per_prefix, s.horizon
    t1 = time.perf_counter()
    tail = law_tail(s, lm, s.prefixes, r, k, alpha, twist, seed)  # [n, S]
    return {"smc_seeds": [seed], "tail_nats_per_generation": tail.tolist(),
            "plain_tail_by_generation": s.plain_tails[seed].tolist(),  # the plain model's, same prefixes and seed
            "law_logp_per_generation": _per_generation(r.base_logp.sum(1), n, S),  # log P̂ of each generation's L words
            "entropy_rate_by_generation": _per_generation(entropy_rate(r), n, S),  # the law's, over all L words
            "ess_by_generation": _per_generation((r.ess / k).mean(1), n, S),
            "log_z_by_generation": _per_generation(r.log_z, n, S),
            "resamplings_by_generation": _per_generation(r.resamplings, n, S), "curve_kind": "surprisal",
            # [n, T]: each prefix's mean surprisal of its words over its S generations
            "curve_by_prefix_nats": (-r.base_logp[:, :T]).numpy().reshape(n, S, T).mean(1).tolist(),
            "law_curve_nats": (-r.base_logp).mean(0).tolist(),  # [L]: the surprisal over the whole law, to its end
            "ess_by_step": (r.ess / k).mean(0).tolist(), "generation_seconds": r.seconds,
            "tail_seconds": time.perf_counter() - t1}


# a row's per-generation arrays [n, S], joined side by side along S; and its means over generations ([n, T] or [L]),
# joined weighted by their generations
BY_GENERATION = ("tail_nats_per_generation", "plain_tail_by_generation", "law_logp_per_generation",
                 "entropy_rate_by_generation", "ess_by_generation", "log_z_by_generation", "resamplings_by_generation")
MEANS = ("curve_by_prefix_nats", "law_curve_nats", "ess_by_step")


def join_generations(*parts: dict) -> dict:
    """One row's generations from several seeds as one (each part [n, S_i] from the same n prefixes, in the order
    given): the per-generation arrays side by side, [n, sum S_i]; the per-prefix and per-step means weighted by each
    part's generations; every column recomputed from them (generation_columns). The first part's other keys (its
    params, fit, test CE, cost) are the row's."""
    sizes = [np.shape(p["tail_nats_per_generation"]) for p in parts]
    if len({n for n, _ in sizes}) != 1:
        raise ValueError(f"the parts' generations come from different numbers of prefixes: {[n for n, _ in sizes]}")
    w = [S / sum(S for _, S in sizes) for _, S in sizes]
    out = dict(parts[0])
    for key in BY_GENERATION:
        out[key] = np.concatenate([np.asarray(p[key], float) for p in parts], 1).tolist()
    for key in MEANS:
        out[key] = sum(wi * np.asarray(p[key], float) for wi, p in zip(w, parts, strict=True)).tolist()
    out["smc_seeds"] = [x for p in parts for x in p["smc_seeds"]]
    for key in ("generation_seconds", "tail_seconds"):
        out[key] = sum(p.get(key) or 0.0 for p in parts)
    out.update(generation_columns(out))
    return out


def generation_columns(g: dict) -> dict:
    """A row's columns that its generations give, from its per-generation arrays (prefixes as clusters): the last
    tenth (level, standard error, difference from the plain model's), the slope in α and what α*'s standard error
    moves the level by, the curve and its standard error (from per-prefix means: none with one prefix), the law's
    entropy rate over all L words, mean ESS / K, log Ẑ and resamplings."""
    tail = np.asarray(g["tail_nats_per_generation"], float)  # [n, S]
    n, S = tail.shape
    level, level_se = clustered_mean(tail)
    diff, diff_se = clustered_mean(tail - np.asarray(g["plain_tail_by_generation"], float))
    out = {"tail_nats": float(level), "tail_stderr_nats": float(level_se), "tail_ppl": exp_or_inf(float(level)),
           "tail_ppl_stderr": exp_or_inf(float(level)) * float(level_se), "generations": n * S,
           "tail_diff_nats": float(diff), "tail_diff_stderr_nats": float(diff_se)}
    slope, slope_se = alpha_slope(tail, np.asarray(g["law_logp_per_generation"], float))
    se_alpha = (g.get("params") or {}).get("alpha_stderr")  # a seed's generations alone have no fit yet
    out |= {"tail_alpha_slope_nats": slope, "tail_alpha_slope_stderr_nats": slope_se,
            "tail_alpha_stderr_nats": None if slope is None or se_alpha is None else abs(slope) * se_alpha}
    c = np.asarray(g["curve_by_prefix_nats"], float)  # [n, T]
    out["curve_nats"] = c.mean(0).tolist()
    out["stderr_nats"] = (c.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.full(c.shape[1], math.nan)).tolist()
    rate, rate_se = clustered_mean(np.asarray(g["entropy_rate_by_generation"], float))
    out |= {"law_entropy_rate_nats": float(rate), "law_entropy_rate_stderr_nats": float(rate_se)}
    for key, col in (("ess_by_generation", "ess_per_particle"), ("log_z_by_generation", "log_z_mean"),
                     ("resamplings_by_generation", "resamplings_per_generation")):
        out[col] = float(np.mean(g[key]))
    return out


def extend_row(s: StudySetup, row: dict, twist) -> dict:
    """An earlier run's study row with more generations: at its α (not fitted again), from the same prefixes at each
    of s.smc_seeds, joined after its own (join_generations). Its fit, test CE and cost stay the earlier run's."""
    lm = twist.lm if twist is not None else s.lm
    t0 = time.perf_counter()
    more = [generate(s, lm, row["params"]["particles"], row["params"]["alpha"], twist, x) for x in s.smc_seeds]
    out = join_generations(row, *more)
    out["seconds"] = (row.get("seconds") or 0.0) + time.perf_counter() - t0
    k, n_before = row["params"]["particles"], row["generations"]
    log.info(f"{out['variant']} SMC, {k} particles: {n_before} + {out['generations'] - n_before} generations (seeds "
             f"{out['smc_seeds']}), last tenth {out['tail_ppl']:.1f} +- {out['tail_ppl_stderr']:.1f}")
    return out


def alpha_slope(tail: np.ndarray, law_logp: np.ndarray) -> tuple[float | None, float | None]:
    """d/dα of the law's last tenth (nats a word per unit α) and its standard error, from generations [n, S] of one
    law: d/dα E_α[f(W) | prefix] = Cov_α(f(W), log P̂(W) | prefix) for P̂_α ∝ P̂^(1+α), estimated within each prefix
    (its S generations, unbiased) and averaged over prefixes, the independent units. Times α*'s standard error, it is
    how far the level would move had α* been fitted on other continuations: the part of its uncertainty that the
    last tenth's own standard error, conditional on α*, leaves out. (None, None) with one generation a prefix."""
    n, S = tail.shape
    if S < 2:
        return None, None
    f, g = tail - tail.mean(1, keepdims=True), law_logp - law_logp.mean(1, keepdims=True)
    cov = (f * g).sum(1) / (S - 1)  # [n]
    return float(cov.mean()), float(cov.std(ddof=1) / math.sqrt(n)) if n > 1 else None


def law_tail(s: StudySetup, lm, prefixes: torch.Tensor, r, k: int, alpha: float, twist, seed: int) -> np.ndarray:
    """The law's last-tenth entropy [n, S] of the paths r generated from prefixes [n * S, P] at seed: nested SMC runs
    at the study's tail count (the row's own, k, by default)."""
    tail = smc_tail_entropy(lm, prefixes, r, alpha, s.horizon - s.last, s.horizon, particles=s.tail_particles or k,
                            seed=seed + 7, max_batch=s.max_batch, twist=twist, progress=True)
    return tail.numpy().reshape(-1, s.samples_per_prefix)


def remeasure(s: StudySetup, prefixes: torch.Tensor, k: int, twist, alpha: float, seed: int) -> np.ndarray:
    """An SMC row's last tenths [n, S] on other prefixes [n, P] and seed, at its fitted α: S generations from each
    prefix by SMC at k particles (twisted by `twist` or not), and their nested runs."""
    lm = twist.lm if twist is not None else s.lm
    p = prefixes.repeat_interleave(s.samples_per_prefix, 0)  # [n * S, P]
    r = smc_generate(lm, p, alpha, s.law_horizon, particles=k, seed=seed, twist=twist, max_batch=s.max_batch,
                     progress=f"SMC, {k} particles, fresh prefixes")
    return law_tail(s, lm, p, r, k, alpha, twist, seed)


def mixture(tail) -> dict:
    """What a level's mean hides: the median generation's last tenth, and the share of generations below 2 nats
    (a generation stuck repeating itself), from per-generation last tenths [n, S]."""
    t = np.asarray(tail, dtype=np.float64)
    return {"tail_median_nats": float(np.median(t)), "tail_below_2_nats_share": float((t < 2.0).mean())}
