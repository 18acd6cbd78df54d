"""Algorithm 2's law at its own α* and why its effect is small.

The headline row is exact lookahead at its own α* where a run measured it (the vocabulary small enough, or a GPU run's
rows beside the stage's), else the stage's own law; each other rule stands beside it at its own α* where one was
fitted, else at the stage's. Why the effect is small is decided by one comparison, fixed here before any number is
read: exact lookahead at its own α* against the stage's rule at the same α, paired, on the last tenth. The
dose-response's rows at other multiples of α* are a dose-response and decide nothing here.
"""

from __future__ import annotations

import math

from lmcal.reporting.claim import Claim, Z, finite, paper_calibration_nats

# A row's α is a rule's own α* when within 1% of it: a GPU run's rows carry α as a multiple of the stage's α*
# rounded to four digits, far finer than α*'s own standard error (about 20% here).
OWN_RTOL = 0.01


def stage_rule(cal: dict) -> str:
    """The stage's candidate rule (its law's label), from its record."""
    if cal.get("rule"):
        return cal["rule"]
    return "exact" if cal.get("topk") is None and cal.get("cover") is None else f"top-{cal['topk']}"


def stage_row(cal: dict) -> dict:
    """The stage's own law at its α* as a law row: its paired change of the last tenth, its generations, and its test
    CE's change (from the two test perplexities; the record keeps no standard error for it)."""
    n, k = cal.get("num_prefixes"), cal.get("samples_per_prefix")
    before, after = cal.get("test_ppl_before"), cal.get("test_ppl_after")
    return {"rule": stage_rule(cal), "device": None, "alpha": cal["alpha"], "own": True, "stage": True,
            "generations": n * k if n and k else None, "tail_diff_nats": cal["tail_diff_nats"],
            "tail_diff_stderr_nats": cal["tail_diff_stderr_nats"], "base_nats": math.log(cal["tail_ppl_before"]),
            "test_ce_diff_nats": math.log(after / before) if finite(after) and finite(before) else None,
            "test_ce_diff_stderr_nats": None, "vs_rule": None, "vs_first_nats": None, "vs_first_stderr_nats": None}


def _dose_row(r: dict, dr: dict, own: bool) -> dict:
    """A dose-response row as a law row (its level before calibration is its own plain generations')."""
    base = r["tail_nats"] - r["tail_diff_nats"] if finite(r.get("tail_nats")) else None
    return {"rule": r["rule"], "device": r.get("device"), "alpha": _alpha(r, dr), "own": own, "stage": False,
            "generations": r.get("generations", dr.get("generations")), "base_nats": base,
            **{k: r.get(k) for k in ("tail_diff_nats", "tail_diff_stderr_nats", "test_ce_diff_nats",
                                     "test_ce_diff_stderr_nats", "vs_first_nats", "vs_first_stderr_nats")},
            "vs_rule": r.get("vs_rule", (dr.get("rules") or [None])[0])}


def _alpha(r: dict, dr: dict) -> float:
    return r["alpha"] if finite(r.get("alpha")) else r["multiple"] * dr["alpha"]


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= OWN_RTOL * abs(b)


def _at_stage_alpha(r: dict, dr: dict, cal: dict) -> bool:
    """Whether a dose-response row is at the stage's α* (its multiple 1, the dose-response's α* being the stage's)."""
    return r.get("multiple") == 1 or _near(_alpha(r, dr), cal["alpha"])


def _own(r: dict, dr: dict, cal: dict) -> bool:
    """Whether a dose-response row is its rule's law at that rule's own α*: the stage's α* for the stage's rule, else
    a fit of that rule (the same device where both name one)."""
    a = _alpha(r, dr)
    if r["rule"] == stage_rule(cal):
        return _at_stage_alpha(r, dr, cal)
    return any(f["rule"] == r["rule"] and (r.get("device") is None or f.get("device") in (None, r["device"]))
               and finite(f.get("alpha")) and _near(a, f["alpha"]) for f in dr.get("extra_fits") or [])


def law_rows(cal: dict) -> list[dict]:
    """One row per rule, the headline first: each rule's law at its own α* (the one with the most generations), else
    at the stage's α* (own False). The stage's own record stands for its rule unless a row has more generations."""
    dr = cal.get("dose_response") or {}
    rows = [stage_row(cal)]
    for r in [*dr.get("rows", []), *(dr.get("extra_rows") or [])]:
        own = _own(r, dr, cal)
        if own or _at_stage_alpha(r, dr, cal):
            rows.append(_dose_row(r, dr, own))
    best = {}
    for r in rows:  # the stage's row first, so that it wins a tie
        b = best.get(r["rule"])
        if b is None or (r["own"], r["generations"] or 0) > (b["own"], b["generations"] or 0):
            best[r["rule"]] = r
    head = headline(cal, list(best.values()))
    return [head, *(r for r in best.values() if r is not head)]


def headline(cal: dict, rows: list[dict] | None = None) -> dict:
    """Algorithm 2's headline row: exact lookahead at its own α* where the record has it, else the stage's law."""
    rows = law_rows(cal) if rows is None else rows
    exact = next((r for r in rows if r["rule"] == "exact" and r["own"]), None)
    return exact or next(r for r in rows if r["stage"])


def law_name(r: dict) -> str:
    """A law row's rule, with the device of a row another run added."""
    return f"{r['rule']} ({r['device']})" if r.get("device") else r["rule"]


def law_text(r: dict, stage: str) -> str:
    """Which law a row is and at which α: 'exact lookahead at its own α* = -0.0476, NVIDIA H200, 500 generations'."""
    who = "exact lookahead" if r["rule"] == "exact" else r["rule"]
    whose = "its own α*" if r["own"] else f"{stage}'s α*"
    extra = [x for x in (r.get("device"), r["generations"] and f"{r['generations']} generations") if x]
    return ", ".join([f"{who} at {whose} = {r['alpha']:.3g}", *extra])


def _needed(n: int | None, d: float, se: float, z: float) -> int | None:
    """How many generations would put a difference d ± se (of n generations) beyond z standard errors, were it this
    size: the standard error falls as one over the root of the generations."""
    return math.ceil(n * (z * se / d) ** 2) if n and d else None


def _decider(t: dict, n: int | None, stage: str, z: float) -> str:
    """What would decide an undecided comparison: the cheaper of resolving the paired difference and telling exact's
    change from the paper's, in generations, where either is open."""
    if t["below"] and not t["ce_ok"]:
        return "its lower entropy costs test CE: " + (f"{t['ce']:+.4f} ± {t['ce_se']:.4f} nats" if
                                                      finite(t["ce_se"]) else "untested")
    if t["below"]:
        return f"both tests pass, for exact lies below {stage} yet not below the model"
    open_ = []
    if t["paired"] and t["vs"] < 0:
        open_.append((_needed(n, t["vs"], t["vs_se"], z), "paired generations would resolve a difference this size"))
    if finite(t["gap"]) and t["gap"] <= z:
        open_.append((_needed(n, t["d"] - paper_calibration_nats(), t["se"], z),
                      "generations of exact would tell its change from the paper's"))
    if not open_:
        return f"exact is not lower than {stage}, and its own change is shown, short of the paper's"
    m, what = min(open_, key=lambda x: x[0] or math.inf)
    return f"about {m:,} {what}" if m else f"more {what}"


def _tests(ex: dict, stage: str, z: float) -> dict:
    """The comparison's tests on exact lookahead's row at its own α*: its paired difference from the stage's rule
    below -z se (below), its test CE not above the model's by z se (ce_ok), no change of its own beyond z se (none),
    and the paper's effect more than z se away (gap)."""
    d, se, ce, ce_se, vs, vs_se = (ex.get(k) for k in (
        "tail_diff_nats", "tail_diff_stderr_nats", "test_ce_diff_nats", "test_ce_diff_stderr_nats", "vs_first_nats",
        "vs_first_stderr_nats"))
    paired = ex["rule"] != stage and ex.get("vs_rule") == stage and finite(vs) and finite(vs_se) and vs_se > 0
    gap = abs(d - paper_calibration_nats()) / se if finite(d) and finite(se) and se > 0 else math.nan
    return {"d": d, "se": se, "ce": ce, "ce_se": ce_se, "vs": vs, "vs_se": vs_se, "paired": paired, "gap": gap,
            "below": paired and vs < -z * vs_se, "ce_ok": finite(ce) and finite(ce_se) and ce <= z * ce_se,
            "none": finite(gap) and abs(d) <= z * se}


def _verdict(ex: dict | None, stage: str, z: float) -> tuple[str, str]:
    """(verdict, sentence) of the comparison fixed in advance, from exact lookahead's row at its own α*."""
    undecided = "Whether the approximation or the model limits calibration here is undecided: "
    if ex is None:
        return "undecided", (f"{undecided}exact lookahead at its own α* is not in the record. Its rows, paired with "
                             f"{stage}'s at the same α, would decide it.")
    t, p = _tests(ex, stage, z), paper_calibration_nats()
    approximation, model = t["below"] and t["ce_ok"], t["none"] and t["gap"] > z
    if approximation and not model:
        return "approximation", (
            f"The approximation is the limit: exact lookahead lowers the last tenth {abs(t['vs']):.3f} ± "
            f"{t['vs_se']:.3f} nats below {stage} (paired, {abs(t['vs']) / t['vs_se']:.1f} standard errors). Its test "
            f"CE moves {t['ce']:+.4f} ± {t['ce_se']:.4f} nats, not worse than the model's.")
    if model and not approximation:
        return "model", (f"The model is the limit: exact lookahead changes the last tenth by {t['d']:+.3f} ± "
                         f"{t['se']:.3f} nats, within {z:g} standard errors of no change and {t['gap']:.1f} standard "
                         f"errors short of the paper's {p:+.2f}.")
    why = [f"exact minus {stage} is {t['vs']:+.3f} ± {t['vs_se']:.3f} nats, paired" if t["paired"] else
           "the stage's law is exact lookahead, so no approximation limits it" if stage == "exact" else
           f"exact's row is not paired with {stage}'s generations",
           f"exact against the model is {t['d']:+.3f} ± {t['se']:.3f} nats, {t['gap']:.1f} standard errors from the "
           f"paper's {p:+.2f}", _decider(t, ex.get("generations"), stage, z)]
    return "undecided", undecided + "; ".join(why) + "."


def calibration_limit(cal: dict, z: float = Z) -> Claim:
    """Why calibration's effect is small, from the comparison fixed in advance (the module's): exact lookahead at its
    own α* against the stage's rule at the same α, paired, on the last tenth.

    - 'approximation': exact lowers the last tenth below the stage's rule by more than z paired standard errors, and
      its test CE is not worse than the model's by more than z standard errors;
    - 'model': exact lookahead shows no change beyond z standard errors while lying more than z from the paper's
      effect;
    - 'undecided' where neither holds, or both (exact below the stage's rule yet not below the model), saying what
      would decide it.

    The approximation table's noise-free shift at α* is kept beside it in numbers, as context."""
    stage = stage_rule(cal)
    rows = law_rows(cal)
    ex = next((r for r in rows if r["rule"] == "exact" and r["own"]), None)
    v, sentence = _verdict(ex, stage, z)
    if ex is not None:
        against = "the model" if stage == "exact" else f"{stage} at the same α, paired"
        sentence += (f" The comparison, fixed in advance: exact lookahead against {against}, on the last tenth. Its "
                     f"row: {law_text(ex, stage)}.")
    ap = cal.get("approximation") or {}
    j = ap["multiples"].index(1) if 1 in ap.get("multiples", []) else 0
    shifts = {r["rule"]: r for r in ap.get("rows", [])}
    e, cheap = shifts.get("exact"), shifts.get(stage)
    return Claim("calibration_limit", v, sentence, {
        "exact_shift": e["shift_nats"][j] if e else None, "exact_shift_se": e["shift_stderr_nats"][j] if e else None,
        "kept": cheap["kept"][j] if cheap else None, "rule": stage, "alpha": ex["alpha"] if ex else None,
        "d": ex.get("vs_first_nats") if ex else None, "se": ex.get("vs_first_stderr_nats") if ex else None,
        "exact_d": ex["tail_diff_nats"] if ex else None, "exact_se": ex["tail_diff_stderr_nats"] if ex else None})
