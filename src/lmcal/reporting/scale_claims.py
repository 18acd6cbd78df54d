"""The scale sweep's sentences (lmcal.reporting.scale_report): the gap's fitted exponent against a scale axis and the
trend of a method's effect with the models' strength, written from the numbers and their tests (lmcal.reporting.claims
states the rules)."""

from __future__ import annotations

from lmcal.reporting.claim import Claim, Z
from lmcal.reporting.claim import finite as _finite


def scale_exponent(who: str, axis: str, b: float, ci: tuple[float, float], level: float, runs: int,
                   ref: float | None = None, ref_text: str = "", key: str = "scale_exponent",
                   quantity: str = "the gap") -> Claim:
    """The gap's fitted exponent against `axis` (gap ~ x^b), with its bootstrap interval: 'falls' (the interval lies
    below 0), 'rises' (above), 'flat_not_excluded' (it holds 0), or 'untested' (no interval); beside the reference
    exponent `ref` (ref_text names it): inside the interval, or the gap falls faster / more slowly than it."""
    lo, hi = ci
    pct = f"{100 * level:g}%"
    if not (_finite(lo) and _finite(hi)):
        v, how = "untested", f"{b:+.3f} (no bootstrap interval)"
    else:
        v = "falls" if hi < 0 else "rises" if lo > 0 else "flat_not_excluded"
        how = f"{b:+.3f} ({pct} bootstrap interval {lo:+.3f} to {hi:+.3f}, {runs} runs)"
    q = quantity
    sentence = {
        "falls": f"{who}: {q} falls with {axis} as {axis}^b, b = {how}.",
        "rises": f"{who}: {q} rises with {axis} as {axis}^b, b = {how}.",
        "flat_not_excluded": f"{who}: {q} against {axis} has b = {how}; the interval holds 0: no trend with "
                             f"{axis} is shown.",
        "untested": f"{who}: {q} against {axis} has b = {how}: untested.",
    }[v]
    numbers = {"b": b, "lo": lo, "hi": hi, "runs": runs}
    if ref is not None and _finite(ref):
        numbers["ref"] = ref
        if v == "untested":
            sentence += f" {ref_text}: {ref:+.3f}."
        elif lo <= ref <= hi:
            sentence += f" {ref_text}, {ref:+.3f}, lies inside the interval."
            numbers["against_ref"] = "consistent"
        else:
            faster = hi < ref
            sentence += (f" {ref_text}, {ref:+.3f}, lies {'above' if faster else 'below'} it: {q.split(' (')[0]} "
                         f"falls {'faster' if faster else 'more slowly'} here.")
            numbers["against_ref"] = "faster" if faster else "slower"
    return Claim(key, v, sentence, numbers)


def effect_trend(name: str, slope: float, se: float, runs: int, key: str = "effect_trend", z: float = Z) -> Claim:
    """Whether `name`'s paired effect on the last tenth (d, nats; negative lowers it) grows as the models strengthen:
    the weighted slope of d against log test CE, slope ± se. A stronger model has a lower test CE, so a positive slope
    means d falls (the effect grows) as the test CE falls: 'grows' (slope > z se), 'shrinks' (slope < -z se),
    'no_trend' (within), 'untested'."""
    if not (_finite(slope) and _finite(se)):
        return Claim(key, "untested", f"{name}'s effect against the models' strength: untested ({runs} runs).",
                     {"slope": slope, "se": se})
    v = "grows" if slope > z * se else "shrinks" if slope < -z * se else "no_trend"
    trend = (f"slope {slope:+.3f} ± {se:.3f} nats of change per unit of log test CE (weighted by each run's "
             f"standard error, its error widened by the runs' scatter where that is larger), over {runs} runs")
    sentence = {
        "grows": f"{name}: as the models strengthen (lower test CE), its paired change of the last tenth becomes more "
                 f"negative (a larger lowering, or a smaller rise): {trend}.",
        "shrinks": f"{name}: as the models strengthen (lower test CE), its paired change of the last tenth becomes "
                   f"less negative (a smaller lowering, or a larger rise): {trend}.",
        "no_trend": f"{name}'s paired change of the last tenth shows no trend with the models' strength: {trend}, "
                    f"within {z:g} standard errors of none.",
    }[v]
    return Claim(key, v, sentence, {"slope": slope, "se": se, "runs": runs})
