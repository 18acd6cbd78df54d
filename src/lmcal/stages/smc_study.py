"""Algorithm 1's convergence study, part of the sequence_calibration stage: SMC at each particle count, twisted (a
soft-value head as the twist) and untwisted, on the same prefixes and seeds, each with its own α*, its own law's last
tenth, its own test CE and its own cost (lmcal.core.smc, lmcal.core.sequence_fit).

One law for every row: P̂_α(w_1..L) ∝ P̂(w_1..L)^(1+α) over L = law_horizon words (2 x the horizon by default), fitted
on validation continuations of L words, generated over L words, read over its first `horizon` words (the curve and the
last tenth), far from its own end, where a law over exactly `horizon` words would steer towards whatever is cheap in
its last few words; and scored on test continuations of L words. Every part of a row runs at the row's own particle
count and twist: the fit, the generations, the nested runs of the last tenth, the test CE.

A row is Algorithm 1 only where it has converged: its last tenth and α* agree with those of the row with twice (or,
for the largest count, half) its particles, at 2 standard errors (the last tenth paired by prefix: same prefixes and
seeds), and both fits found their own root (lmcal.core.sequence_fit: settled). Agreement must also be shown, not
merely not refuted: the paired difference's 2-standard-error interval lies within ±`tol` nats (0.1 by default, about
the goal's 10% in perplexity). On 20 prefixes the nested-SMC last tenth's paired standard error is 0.16-0.26 nats
(0.14-0.16 on 60), and two GPU runs of the same target law (docs/bench/convergence_rule.md: twisted by heads trained
at a different α) found 64 and 128 particles to agree in one and not in the other: an interval of ±0.5 nats proves
nothing. Otherwise its label says it has not converged (they disagree) or that convergence is not shown (too few
prefixes to tell).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from lmcal.core.entropy_rate import clustered_mean
from lmcal.core.sequence_fit import fit_sequence_alpha, sequence_log_probs
from lmcal.core.smc import smc_generate
from lmcal.stages.rows import GENERATION_KEYS
from lmcal.stages.smc_generations import (
    StudySetup,
    drawn_seeds,
    generate,
    generation_columns,
    join_generations,
    nested_tail,
)
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")
Z = 2.0  # standard errors within which K and 2K particles agree


def _paired(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (x - ref).double()
    return float(d.mean()), float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else math.nan


def study_row(s: StudySetup, k: int, twist=None, start_alpha: float = 0.0) -> dict:
    """One row: SMC with k particles (twist: a SoftValueTwist, or None), end to end at that count."""
    lm = twist.lm if twist is not None else s.lm
    variant = "twisted" if twist is not None else "untwisted"
    t0 = time.perf_counter()
    fit = fit_sequence_alpha(lm, *s.fit, particles=k, seed=s.seed, bracket=s.bracket, xtol=s.xtol,
                             max_batch=s.max_batch, twist=twist, start=start_alpha, progress=True)
    a = fit.alpha
    fit_s = time.perf_counter() - t0
    log.info(f"{variant} SMC, {k} particles: alpha* {a:.5f} +- {fit.alpha_stderr:.5f} on {fit.num_prefixes} validation "
             f"continuations ({fit.evaluations} runs{'' if fit.settled else ', not settled'}, {fit_s:.0f} s); CE "
             f"{fit.ce:.4f}, EntRate {fit.entropy_rate:.4f}, the plain model's CE {fit.ce_base:.4f} +- "
             f"{fit.ce_base_stderr:.4f} nats a word")
    gen = join_generations(*(generate(s, lm, k, a, twist, seed) for seed in s.smc_seeds))
    # test CE at this count: log Ẑ on test continuations (biased low by about half its variance, estimated from two
    # independent runs: E[(log Ẑ1 - log Ẑ2)^2] / 2 = Var log Ẑ)
    y = sequence_log_probs(s.lm, *s.test, s.max_batch)  # [B]
    runs = [smc_generate(lm, s.test[0], a, s.law_horizon, particles=k, seed=s.seed + j, twist=twist,
                         max_batch=s.max_batch, progress=f"test CE, run {j - 1} of 2, {k} particles").log_z
            for j in (2, 3)]
    L = s.law_horizon
    ce = (-(1 + a) * y + runs[0]) / L  # [B]: per word
    ce_diff = _paired(ce, -y / L)
    bias = -float((runs[0] - runs[1]).pow(2).mean()) / 4 / L  # -Var(log Ẑ) / 2, per word
    ms = min(_ms(lm, s, a, k, twist) for _ in range(s.timing_repeats))
    row = {"method": "smc", "variant": variant,
           "params": {"particles": k, "alpha": a, "alpha_stderr": fit.alpha_stderr},
           "test_ce_nats": float(ce.mean()), "test_ce_diff_nats": ce_diff[0], "test_ce_diff_stderr_nats": ce_diff[1],
           "test_ce_bias_nats": bias, "test_ce_prefixes": int(y.numel()),
           "fit": {"ce_nats": fit.ce, "entropy_rate_nats": fit.entropy_rate,
                   "ce_minus_entropy_rate_nats": fit.ce_minus_entropy_rate,
                   "ce_minus_entropy_rate_stderr_nats": fit.ce_minus_entropy_rate_stderr,
                   "ce_base_nats": fit.ce_base, "moment_gap": fit.moment_gap, "slope": fit.slope,
                   "runs": fit.evaluations, "settled": fit.settled,
                   "ess_per_particle": fit.mean_ess, "seconds": fit_s},
           "ms_per_token": ms, "cost_ratio": ms / s.plain_ms, **gen}
    row.update(generation_columns(row))  # α*'s own noise needs α*'s standard error
    row["seconds"] = time.perf_counter() - t0
    log.info(f"{variant} SMC, {k} particles: alpha* {a:.4f} +- {fit.alpha_stderr:.4f} ({fit.evaluations} runs), last "
             f"tenth {row['tail_ppl']:.1f} +- {row['tail_ppl_stderr']:.1f}, ESS {row['ess_per_particle']:.2f} x K, "
             f"{ms:.3f} ms a word, {row['seconds']:.0f} s")
    return row


def remeasure(s: StudySetup, prefixes: torch.Tensor, k: int, twist, alpha: float, seed: int) -> tuple[float, float]:
    """An SMC row's last tenth (level, standard error) on other prefixes [n, P] and seed, at its fitted α."""
    level, se = clustered_mean(fresh_tails(twist.lm if twist is not None else s.lm, prefixes, k, twist, alpha, seed,
                                           samples_per_prefix=s.samples_per_prefix, horizon=s.horizon,
                                           law_horizon=s.law_horizon, last=s.last, tail_particles=s.tail_particles,
                                           max_batch=s.max_batch))  # of [n, S]
    return float(level), float(se)


def fresh_tails(lm, prefixes: torch.Tensor, k: int, twist, alpha: float, seed: int, *, samples_per_prefix: int,
                horizon: int, law_horizon: int, last: int, tail_particles: int | None, max_batch: int,
                first: int = 0) -> np.ndarray:
    """The law's last tenth [n, S] of S generations from each prefix [n, P] at seed, by SMC at k particles (twisted by
    `twist` or not) and nested runs at tail_particles (None: k). `first`: the index of prefixes[0] among the prefixes
    one call would have been given: prefixes measured in parts, each told its first, give what one call gives."""
    S = samples_per_prefix
    p = prefixes.repeat_interleave(S, 0)  # [n * S, P]
    r = smc_generate(lm, p, alpha, law_horizon, particles=k, seed=seed, twist=twist, max_batch=max_batch,
                     progress=f"SMC, {k} particles, fresh prefixes", first_id=first * S)
    return nested_tail(lm, p, r, k, alpha, twist, seed, horizon=horizon, last=last, tail_particles=tail_particles,
                       max_batch=max_batch, samples_per_prefix=S, first_id=first * S)


def _ms(lm, s: StudySetup, alpha: float, k: int, twist) -> float:
    """ms per returned word on the timing protocol (the plain model's timing runs the same generations)."""
    p = s.timing_prefixes.repeat_interleave(s.samples_per_prefix, 0)
    r = smc_generate(lm, p, alpha, s.timing_horizon, particles=k, seed=s.seed, twist=twist, max_batch=s.max_batch)
    return 1000.0 * r.seconds / r.tokens.numel()


def _alpha_gap(r: dict, other: dict) -> tuple[float, float]:
    """Two SMC rows' α* difference and its standard error (independent fits)."""
    a, b = r["params"], other["params"]
    return a["alpha"] - b["alpha"], math.hypot(a["alpha_stderr"], b["alpha_stderr"])


def mark_convergence(rows: list[dict], tol: float | None = 0.1) -> None:
    """Sets each SMC row's "converged" (True, False, or None where no row of twice or half its particles exists),
    "converged_against" (that count) and "convergence" ('agrees', 'disagrees', 'not shown' or None): K agrees with
    2K (else, for the largest K, with K / 2) when the paired last tenth and α* differ by at most Z standard errors,
    both fits settled, and the last tenth's difference d ± se is shown small: |d| + Z se <= tol nats (None: no
    such requirement). 'not shown': no disagreement found, but the interval reaches beyond ±tol."""
    for variant in ("untwisted", "twisted"):
        by_k = {r["params"]["particles"]: r for r in rows if r.get("variant") == variant}
        for k, r in by_k.items():
            other = by_k.get(2 * k) or (by_k.get(k // 2) if k % 2 == 0 else None)
            r["converged"], r["converged_against"], r["convergence"] = None, None, None
            if other is None:
                continue
            d, d_se = clustered_mean(np.asarray(r["tail_nats_per_generation"])
                                     - np.asarray(other["tail_nats_per_generation"]))
            da, da_se = _alpha_gap(r, other)
            agree = bool(abs(d) <= Z * d_se and abs(da) <= Z * da_se and r["fit"]["settled"]
                         and other["fit"]["settled"])  # and both fits found their own root
            shown = bool(tol is None or abs(d) + Z * d_se <= tol)
            r["converged"] = agree and shown
            r["convergence"] = "disagrees" if not agree else "agrees" if shown else "not shown"
            r["converged_against"], r["convergence_tol_nats"] = other["params"]["particles"], tol
            r["tail_against_nats"], r["tail_against_stderr_nats"] = float(d), float(d_se)


# what two runs of the study must share for their rows to be one study: the prefixes, seeds and test words (as every
# comparison stage's), the law, its fit, the last tenth's nested runs, the convergence rule, and (for twisted rows) the
# heads that twist them
SAME_STUDY = ("model", "corpus", *GENERATION_KEYS, "smc_prefixes", "law_horizon", "fit_prefixes",
              "fit_windows_overlap", "tail_steps", "smc_seeds",
              "tail_particles", "converge_tol", "reference_test_ce_nats")


def same_value(a, b, rel: float = 1e-7) -> bool:
    """Whether two settings or results read from two runs are the same: floats at a relative tolerance (a run on
    one thread and one on two sum in other orders, so a reference CE differs in its ninth digit), all else exactly."""
    if isinstance(a, float) or isinstance(b, float):
        return (isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
                and not isinstance(b, bool) and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y, rel) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k], rel) for k in a)
    return a == b


def study_differences(a: dict, b: dict, keys) -> list[str]:
    """The settings (of `keys`) in which two runs of the study differ, each as 'key A against B' (the SMC seeds of a
    run from before they were kept: its stage seed)."""
    def get(r: dict, k: str):
        return drawn_seeds(r) if k == "smc_seeds" else r.get(k)

    return [f"{k} {get(a, k)!r} against {get(b, k)!r}" for k in keys if not same_value(get(a, k), get(b, k))]


def join_study(result: dict, other: dict, where: str = "the other run") -> list[dict]:
    """Adds to `result` (a sequence_calibration stage's result) the study rows of `other`, a run of the same study at
    other particle counts (a long study grown one count at a time: rows are pure functions of their prefixes and
    seeds, whatever the batching), and marks every row's convergence again. Returns the rows added; raises ValueError,
    one paragraph, where the two runs are not one study."""
    new = [r for r in other["rows"] if r["method"] == "smc"]
    keys = SAME_STUDY + (("sv_alpha", "soft_value_alpha") if any(r["variant"] == "twisted" for r in new) else ())
    differ = study_differences(result, other, keys)
    if not same_value(result["rows"][0]["tail_nats"], other["rows"][0]["tail_nats"]):  # the plain model's, same draws
        differ.append("the plain model's last tenth")
    if differ:
        raise ValueError(f"{where} is not the same study, so its rows cannot join this one's: {', '.join(differ)} "
                         "(run it with the same settings, sv_alpha given, and other particle counts).")
    have = {(r["variant"], r["params"]["particles"]) for r in result["rows"] if r["method"] == "smc"}
    twice = sorted(r["params"]["particles"] for r in new if (r["variant"], r["params"]["particles"]) in have)
    if twice:
        raise ValueError(f"{where} ran particle counts this study has already ({twice}): join runs of other counts.")
    at = next(i for i, r in enumerate(result["rows"]) if r["method"] == "smc")
    study = sorted([r for r in result["rows"] if r["method"] == "smc"] + new,
                   key=lambda r: (r["variant"] != "untwisted", r["params"]["particles"]))
    result["rows"] = result["rows"][:at] + study + [r for r in result["rows"][at:] if r["method"] != "smc"]
    result["particles"] = sorted(set(result["particles"]) | set(other["particles"]))
    result["untwisted"] = any(r["variant"] == "untwisted" for r in study)
    mark_convergence(study, result.get("converge_tol"))
    for r in study:
        r["label"] = label(r)
    for g in (result.get("goal"), result.get("twisted_check")):  # the goal rows' names follow their rows'
        if g and g.get("method") == "smc" and (row := study_row_of(g, study)):
            g["label"] = row["label"]
    result["convergence"] = converged_summary(study)
    return new


def study_row_of(g: dict, rows: list[dict]) -> dict | None:
    """The SMC study row that a goal row (a result's "goal" or "twisted_check") measured again: the same params and
    variant (a goal row names its variant only in its label)."""
    return next((r for r in rows if r["method"] == "smc" and r["params"] == g["params"]
                 and (r["variant"] == "twisted") == ("twisted" in g["label"])), None)


def label(r: dict) -> str:
    """A study row's name: Algorithm 1 only where it converged."""
    k, tw = r["params"]["particles"], "twisted SMC" if r.get("variant") == "twisted" else "SMC"
    if r.get("converged"):
        return f"Algorithm 1 ({tw}, {k} particles)"
    if r.get("convergence") == "not shown":
        return f"{tw}, {k} particles, convergence not shown"
    if r.get("converged") is False:
        return f"{tw}, {k} particles, not converged"
    return f"{tw}, {k} particles, convergence not tested"


def convergence_word(r: dict) -> str:
    """A row's verdict in a table's cell: yes, **no**, not shown (no disagreement, too wide to show agreement), or
    not tested (no row of twice or half its particles)."""
    if r.get("convergence") == "not shown":
        return "not shown"
    return {True: "yes", False: "**no**", None: "not tested"}[r.get("converged")]


def study_table(rows: list[dict]) -> str:
    """The convergence table: particles x twisted/untwisted."""
    lines = ["| sampler | particles | α* | exp H, last tenth | ± from α*, nats | exp EntRate, all L words | vs 2K (or "
             "K/2), nats | ESS / K | mean log Ẑ | fit: CE − EntRate | test CE (log Ẑ bias) | ms / word | × model | "
             "converged |", "|" + "---|" * 14]
    for r in sorted(rows, key=lambda r: (r.get("variant") != "twisted", r["params"]["particles"])):
        p, f = r["params"], r["fit"]
        against = ("–" if r.get("converged_against") is None else
                   f"{r['tail_against_nats']:+.3f} ± {r['tail_against_stderr_nats']:.3f} ({r['converged_against']})")
        lines.append(
            f"| {'twisted' if r.get('variant') == 'twisted' else 'untwisted'} | {p['particles']} | {p['alpha']:.4f} ± "
            f"{p['alpha_stderr']:.4f} | {r['tail_ppl']:.1f} ± {r['tail_ppl_stderr']:.1f} | {_from_alpha(r)} | "
            f"{_rate_cell(r)} | {against} | "
            f"{r['ess_per_particle']:.2f} | {r['log_z_mean']:.2f} | {f['ce_minus_entropy_rate_nats']:+.2e} ± "
            f"{f['ce_minus_entropy_rate_stderr_nats']:.1e}{'' if f['settled'] else ' (no root: not settled)'} | "
            f"{r['test_ce_nats']:.4f} ({r['test_ce_bias_nats']:+.4f}) | "
            f"{r['ms_per_token']:.3f} | {r['cost_ratio']:.2f} | {convergence_word(r)} |")
    return "\n".join(lines) + "\n"


def law_rate(r: dict) -> tuple[float | None, float | None]:
    """A row's law entropy rate over all its L words from the study's prefixes (nats a word) and its standard error;
    for a row written before it was recorded, from its surprisal curve and mean log Ẑ, without one."""
    if r.get("law_entropy_rate_nats") is not None:
        return r["law_entropy_rate_nats"], r.get("law_entropy_rate_stderr_nats")
    curve = r.get("law_curve_nats")
    if not curve or r.get("log_z_mean") is None:
        return None, None
    return (1 + r["params"]["alpha"]) * float(np.mean(curve)) + r["log_z_mean"] / len(curve), None


def _rate_cell(r: dict) -> str:
    rate, se = law_rate(r)
    if rate is None:
        return "–"
    ppl = exp_or_inf(rate)
    return f"{ppl:.1f}" + ("" if se is None else f" ± {ppl * se:.1f}")


def _from_alpha(r: dict) -> str:
    """The study table's cell for what α*'s standard error moves the last tenth by: ± slope x se(α*), with the
    slope (d last tenth / dα) and its standard error."""
    if r.get("tail_alpha_stderr_nats") is None:
        return "–"
    se = r.get("tail_alpha_slope_stderr_nats")
    return f"±{r['tail_alpha_stderr_nats']:.3f} (slope {r['tail_alpha_slope_nats']:.0f}" + (
        "" if se is None else f" ± {se:.0f}") + ")"


def _pairs_not_shown(noisy: list[dict], tol: float) -> str:
    """Each pair K, 2K that shows no disagreement but whose paired difference d ± se reaches beyond ±tol, with the
    generations a row would show agreement with, were d to stay where it is: the standard error falls as
    1 / sqrt(generations), and |d| + Z se must reach tol, which no count does where |d| >= tol (rounded up to 100)."""
    n = len(np.asarray(noisy[0]["tail_nats_per_generation"]).ravel())
    pairs = {}
    for r in noisy:  # one entry a pair, its difference as the smaller count's minus the larger's
        k, other = r["params"]["particles"], r["converged_against"]
        sign = 1.0 if k < other else -1.0
        pairs[(min(k, other), max(k, other))] = (sign * r["tail_against_nats"], r["tail_against_stderr_nats"])
    parts = []
    for (k, other), (d, se) in sorted(pairs.items()):
        if abs(d) >= tol:
            need = f"no number of generations would show agreement while the difference stays at {abs(d):.3f} nats"
        else:
            count = math.ceil(n * (Z * se / (tol - abs(d))) ** 2 / 100) * 100
            need = f"about {count:,} generations a row would show agreement, were the difference to stay where it is"
        parts.append(f"{k} and {other} particles differ by {d:+.3f} ± {se:.3f} nats, and {need}")
    one = len(pairs) == 1
    return (f"{'one pair shows' if one else f'{len(pairs)} pairs show'} no disagreement, but "
            f"{'its' if one else 'each'} paired difference's interval reaches beyond ±{tol:g} nats at {Z:g} standard "
            f"errors with {n:,} generations a row: {'; '.join(parts)}")


def _apart(r: dict, other: dict) -> str:
    """Why K and 2K particles are not one law (mark_convergence's 'disagrees'): their last tenths or α*s differ
    beyond Z standard errors, or a fit found no root, so that its α* is not the law's."""
    k, o = r["params"]["particles"], other["params"]["particles"]
    d, se = r["tail_against_nats"], r["tail_against_stderr_nats"]
    da, da_se = _alpha_gap(r, other)
    why = ([f"{d:+.3f} ± {se:.3f} nats"] if abs(d) > Z * se else []) + (
        [f"α* {da:+.4f} ± {da_se:.4f}"] if abs(da) > Z * da_se else [])
    unsettled = [str(x["params"]["particles"]) for x in (r, other) if not x["fit"]["settled"]]
    no_root = f"the {' and '.join(unsettled)}-particle fit{'s' if len(unsettled) > 1 else ''} found no root"
    if why:
        return f"{k} and {o} particles disagree ({'; '.join(why + ([no_root] if unsettled else []))})"
    return f"{k} and {o} particles are not compared: {no_root} (last tenths {d:+.3f} ± {se:.3f} nats)"


def converged_summary(rows: list[dict]) -> str:
    """Which count converged, per sampler, and what it cost: one sentence."""
    parts = []
    for variant, name in (("twisted", "Twisted SMC"), ("untwisted", "Untwisted SMC")):
        vs = sorted((r for r in rows if r.get("variant") == variant), key=lambda r: r["params"]["particles"])
        if not vs:
            continue
        ok = [r for r in vs if r.get("converged")]
        counts = ", ".join(str(r["params"]["particles"]) for r in vs)
        tol = next((r.get("convergence_tol_nats") for r in vs if r.get("convergence_tol_nats") is not None), None)
        within = f" within ±{tol:g} nats" if tol is not None else ""
        if ok:
            r = ok[0]
            parts.append(f"{name} converged at {r['params']['particles']} particles (agreeing with "
                         f"{r['converged_against']}{within} at {Z:g} standard errors), at {r['ms_per_token']:.3f} ms "
                         f"a word, {r['cost_ratio']:.2f} × plain sampling.")
        else:
            noisy = [r for r in vs if r.get("convergence") == "not shown"]
            why = f" ({_pairs_not_shown(noisy, tol)})" if noisy else ""
            by_k = {r["params"]["particles"]: r for r in vs}
            apart = "; ".join(_apart(r, by_k[r["converged_against"]]) for r in vs if r.get("convergence") ==
                              "disagrees" and r["converged_against"] > r["params"]["particles"])
            parts.append(f"{name} is not shown to converge at any count run ({counts}): no K agrees with 2K{within} at "
                         f"{Z:g} standard errors{why}{'; ' + apart if apart else ''}, so none of its rows is reported "
                         "as Algorithm 1.")
    return " ".join(parts)
