"""One SMC study row's generations (lmcal.stages.smc_study): drawn at one seed from the study's prefixes, kept as
per-generation arrays [n, S] (n prefixes, S generations each) and per-prefix curves [n, T], so that a row's statistics
are functions of its arrays and a finished row can take more generations at other seeds, side by side along S, as if
drawn at once (extend_row: its α* not fitted again). Prefixes are the independent units of every standard error.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from lmcal.core.entropy_rate import clustered_mean
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


def drawn_seeds(result: dict) -> list:
    """The seeds a study's SMC rows drew at, from its result (a run from before smc_seeds was kept: its stage seed)."""
    return result.get("smc_seeds") or [result.get("seed")]


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

    def per_generation(x: torch.Tensor) -> list:  # [n * S] -> [n, S]
        return x.double().numpy().reshape(n, S).tolist()

    return {"smc_seeds": [seed], "tail_nats_per_generation": tail.tolist(),
            "plain_tail_by_generation": s.plain_tails[seed].tolist(),  # the plain model's, same prefixes and seed
            "law_logp_per_generation": per_generation(r.base_logp.sum(1)),  # log P̂ of each generation's L words
            "entropy_rate_by_generation": per_generation(entropy_rate(r)),  # the law's, over all L words
            "ess_by_generation": per_generation((r.ess / k).mean(1)), "log_z_by_generation": per_generation(r.log_z),
            "resamplings_by_generation": per_generation(r.resamplings), "curve_kind": "surprisal",
            # [n, T]: each prefix's mean surprisal of its words over its S generations
            "curve_by_prefix_nats": (-r.base_logp[:, :T]).numpy().reshape(n, S, T).mean(1).tolist(),
            "law_curve_nats": (-r.base_logp).mean(0).tolist(),  # [L]: the surprisal over the whole law, to its end
            "ess_by_step": (r.ess / k).mean(0).tolist(), "generation_seconds": r.seconds,
            "tail_seconds": time.perf_counter() - t1}


# a row's per-generation arrays [n, S], joined side by side along S; per-generation means over [n, T] or [L] (weighted
# by their generations); and the columns that fall back to the parts' weighted means where a part lacks its array
BY_GENERATION = ("tail_nats_per_generation", "plain_tail_by_generation", "law_logp_per_generation",
                 "entropy_rate_by_generation", "ess_by_generation", "log_z_by_generation", "resamplings_by_generation")
MEANS = ("curve_by_prefix_nats", "law_curve_nats", "ess_by_step", "curve_nats", "law_entropy_rate_nats",
         "ess_per_particle", "log_z_mean", "resamplings_per_generation")


def join_generations(*parts: dict) -> dict:
    """One row's generations from several seeds as one (each part [n, S_i] from the same n prefixes, in the order
    given): the per-generation arrays side by side, [n, sum S_i]; the per-prefix and per-step means weighted by each
    part's generations; every column recomputed from them (generation_columns). The first part's other keys (its
    params, fit, test CE, cost) are the row's. An array one part lacks (a row written before it was kept) is left out,
    and its column is the parts' weighted mean, without a standard error."""
    sizes = [np.shape(p["tail_nats_per_generation"]) for p in parts]
    if len({n for n, _ in sizes}) != 1:
        raise ValueError(f"the parts' generations come from different numbers of prefixes: {[n for n, _ in sizes]}")
    w = [S / sum(S for _, S in sizes) for _, S in sizes]
    parts = [{**p, **generation_columns(p)} for p in parts]  # each part's own means, for what an array is missing from
    out = dict(parts[0])
    for key in BY_GENERATION:
        have = all(p.get(key) is not None for p in parts)
        out[key] = np.concatenate([np.asarray(p[key], float) for p in parts], 1).tolist() if have else None
    for key in MEANS:
        have = all(p.get(key) is not None for p in parts)
        out[key] = (sum(wi * np.asarray(p[key], float) for wi, p in zip(w, parts, strict=True)).tolist() if have
                    else None)
    if len(parts) > 1:  # recomputed below where the arrays are whole
        out["law_entropy_rate_stderr_nats"] = None
        out["stderr_nats"] = None if out.get("curve_nats") is None else [math.nan] * len(out["curve_nats"])
    out["smc_seeds"] = [x for p in parts for x in p["smc_seeds"]]
    for key in ("generation_seconds", "tail_seconds"):
        out[key] = sum(p.get(key) or 0.0 for p in parts)
    out.update(generation_columns(out))
    return out


def generation_columns(g: dict) -> dict:
    """A row's columns that its generations give, from its per-generation arrays (prefixes as clusters): the last
    tenth (level, standard error, difference from the plain model's), the slope in α and what α*'s standard error
    moves the level by, the curve and its standard error (from per-prefix means: none with one prefix), the law's
    entropy rate over all L words, mean ESS / K, log Ẑ and resamplings; a column whose array is absent is left as
    it is."""
    tail = np.asarray(g["tail_nats_per_generation"], float)  # [n, S]
    n, S = tail.shape
    level, level_se = clustered_mean(tail)
    out = {"tail_nats": float(level), "tail_stderr_nats": float(level_se), "tail_ppl": exp_or_inf(float(level)),
           "tail_ppl_stderr": exp_or_inf(float(level)) * float(level_se), "generations": n * S}
    if g.get("plain_tail_by_generation") is not None:
        diff, diff_se = clustered_mean(tail - np.asarray(g["plain_tail_by_generation"], float))
        out |= {"tail_diff_nats": float(diff), "tail_diff_stderr_nats": float(diff_se)}
    slope, slope_se = alpha_slope(tail, np.asarray(g["law_logp_per_generation"], float))
    se_alpha = (g.get("params") or {}).get("alpha_stderr")
    out |= {"tail_alpha_slope_nats": slope, "tail_alpha_slope_stderr_nats": slope_se,
            "tail_alpha_stderr_nats": None if slope is None or se_alpha is None else abs(slope) * se_alpha}
    if g.get("curve_by_prefix_nats") is not None:
        c = np.asarray(g["curve_by_prefix_nats"], float)  # [n, T]
        out["curve_nats"] = c.mean(0).tolist()
        out["stderr_nats"] = (c.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.full(c.shape[1], math.nan)).tolist()
    if g.get("entropy_rate_by_generation") is not None:
        rate, rate_se = clustered_mean(np.asarray(g["entropy_rate_by_generation"], float))
        out |= {"law_entropy_rate_nats": float(rate), "law_entropy_rate_stderr_nats": float(rate_se)}
    for key, col in (("ess_by_generation", "ess_per_particle"), ("log_z_by_generation", "log_z_mean"),
                     ("resamplings_by_generation", "resamplings_per_generation")):
        if g.get(key) is not None:
            out[col] = float(np.mean(g[key]))
    return out


def extend_row(s: StudySetup, row: dict, twist, seeds: list[int]) -> dict:
    """An earlier run's study row (its generations at `seeds`, the earlier run's) with more generations: at its α (not
    fitted again), from the same prefixes at each of s.smc_seeds, joined after its own (join_generations). Its fit,
    test CE and cost stay the earlier run's; a row written before its plain-model pairs were kept gets them from s."""
    lm = twist.lm if twist is not None else s.lm
    t0 = time.perf_counter()
    old = {**row, "smc_seeds": list(seeds)}
    if old.get("plain_tail_by_generation") is None:
        old["plain_tail_by_generation"] = np.concatenate([s.plain_tails[x] for x in seeds], 1).tolist()
    more = [generate(s, lm, row["params"]["particles"], row["params"]["alpha"], twist, x) for x in s.smc_seeds]
    out = join_generations(old, *more)
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
    return nested_tail(lm, prefixes, r, k, alpha, twist, seed, horizon=s.horizon, last=s.last,
                       tail_particles=s.tail_particles, max_batch=s.max_batch, samples_per_prefix=s.samples_per_prefix)


def nested_tail(lm, prefixes: torch.Tensor, r, k: int, alpha: float, twist, seed: int, *, horizon: int, last: int,
                tail_particles: int | None, max_batch: int, samples_per_prefix: int, first_id: int = 0) -> np.ndarray:
    """law_tail's nested runs, from explicit settings (rows from first_id, as smc_generate's)."""
    tail = smc_tail_entropy(lm, prefixes, r, alpha, horizon - last, horizon, particles=tail_particles or k,
                            seed=seed + 7, max_batch=max_batch, twist=twist, progress=True, first_id=first_id)
    return tail.numpy().reshape(-1, samples_per_prefix)
