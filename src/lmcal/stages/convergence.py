"""The convergence rule of Algorithm 1's study (the sequence_calibration stage): which SMC rows are Algorithm 1, said
in one sentence, and which runs are one study, whose rows may join.

A row is Algorithm 1 only where it has converged: its last tenth and α* agree with those of the row with twice (or,
for the largest count, half) its particles, at 2 standard errors, both paired by prefix (the last tenth: same prefixes
and seeds; α*: same validation windows, whose true text cancels from the difference), both fits found their own root
(lmcal.core.sequence_fit: settled), and its reference check (untwisted SMC at many particles on the fit windows) does
not show its fitted moment biased. Agreement must also be shown, not merely not refuted: the paired difference's
2-standard-error interval lies within ±`tol` nats (0.1 by default, about the goal's 10% in perplexity). Otherwise its
label says it has not converged (they disagree, or the reference check fails) or that convergence is not shown.

K against 2K agreeing is not agreement with the K → ∞ law: beside it each row carries the 1/K extrapolation of the
pair (level_∞ = 2 level_2K - level_K), as its difference from the row's own level, with its paired standard error.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lmcal.core.entropy_rate import clustered_mean
from lmcal.core.sequence_fit import paired_alpha_gap
from lmcal.stages.rows import GENERATION_KEYS

Z = 2.0  # standard errors within which K and 2K particles agree


def _alpha_gap(r: dict, other: dict) -> tuple[float, float]:
    """Two SMC rows' α* difference and its standard error, paired by validation window (paired_alpha_gap)."""
    return paired_alpha_gap(*_fit_moments(r), *_fit_moments(other))


def _fit_moments(r: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A row's fit: per-prefix moments [B] and slopes [B] at its α*, and α*."""
    f = r["fit"]
    as64 = lambda key: torch.as_tensor(f[key], dtype=torch.float64)  # noqa: E731
    return as64("moment_by_prefix"), as64("slope_by_prefix"), r["params"]["alpha"]


def _beyond(d: float, d_se: float, k: int, other: int) -> tuple[float, float]:
    """The 1/K extrapolation of a pair's last tenths, minus row K's level, from d = level_K - level_other (paired):
    level_∞ = 2 level_2K - level_K."""
    return (-2 * d, 2 * d_se) if other > k else (d, d_se)


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
            biased = (r.get("reference_check") or {}).get("verdict") == "fail"
            shown = bool(tol is None or abs(d) + Z * d_se <= tol)
            r["converged"] = agree and shown and not biased
            r["convergence"] = ("fails the reference check" if biased else "disagrees" if not agree else
                                "agrees" if shown else "not shown")
            r["converged_against"], r["convergence_tol_nats"] = other["params"]["particles"], tol
            r["tail_against_nats"], r["tail_against_stderr_nats"] = float(d), float(d_se)
            r["alpha_against"], r["alpha_against_stderr"] = float(da), float(da_se)
            r["tail_beyond_nats"], r["tail_beyond_stderr_nats"] = _beyond(float(d), float(d_se), k,
                                                                          other["params"]["particles"])


def label(r: dict) -> str:
    """A study row's name: Algorithm 1 only where it converged."""
    k, tw = r["params"]["particles"], "twisted SMC" if r.get("variant") == "twisted" else "SMC"
    if r.get("converged"):
        return f"Algorithm 1 ({tw}, {k} particles)"
    if r.get("convergence") == "not shown":
        return f"{tw}, {k} particles, convergence not shown"
    if r.get("convergence") == "fails the reference check":
        return f"{tw}, {k} particles, fails the reference check"
    if r.get("converged") is False:
        return f"{tw}, {k} particles, not converged"
    return f"{tw}, {k} particles, convergence not tested"


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
    """The settings (of `keys`) in which two runs of the study differ, each as 'key A against B'."""
    return [f"{k} {a.get(k)!r} against {b.get(k)!r}" for k in keys if not same_value(a.get(k), b.get(k))]


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
