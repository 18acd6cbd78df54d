"""The scale sweep's sentences (lmcal.reporting.scale_report): the gap's fitted exponent against a scale axis, the
signed gap's trend against it, and the trend of a method's effect with the models' strength, written from the numbers
and their tests (lmcal.reporting.claims states the rules)."""

from __future__ import annotations

from dataclasses import dataclass

from lmcal.core.scaling import MIN_DF
from lmcal.reporting.claim import Claim, Z
from lmcal.reporting.claim import finite as _finite


@dataclass(frozen=True)
class ExponentFit:
    """One fitted exponent b (gap ~ x^b) with its `level` interval ci over `runs` runs. interval: 't', OLS's on `df`
    residual degrees of freedom; 'bootstrap', an earlier report's. why_not: why it was not fitted ('' where it was)."""

    b: float
    ci: tuple[float, float]
    level: float
    runs: int | None
    df: int | None = None
    interval: str = "t"
    why_not: str = ""


def scale_exponent(who: str, axis: str, fit: ExponentFit, ref: float | None = None, ref_text: str = "",
                   key: str = "scale_exponent", quantity: str = "the gap") -> Claim:
    """The gap's fitted exponent against `axis` (gap ~ x^b), with its interval: 'falls' (the interval lies below 0),
    'rises' (above), 'flat_not_excluded' (it holds 0), or 'untested' (no interval, or not fitted: fit.why_not);
    beside the reference exponent `ref` (ref_text names it): inside the interval, or the gap falls faster / more
    slowly."""
    b, (lo, hi), df, interval, why_not = fit.b, fit.ci, fit.df, fit.interval, fit.why_not
    pct = f"{100 * fit.level:g}%"
    kind = f"t-interval on {df} df" if interval == "t" else "bootstrap interval"
    if why_not:
        v, how = "untested", f"not fitted ({why_not})"
    elif not (_finite(lo) and _finite(hi)):
        v, how = "untested", f"{b:+.3f} (no interval)"
    else:
        v = "falls" if hi < 0 else "rises" if lo > 0 else "flat_not_excluded"
        how = f"{b:+.3f} ({pct} {kind} {lo:+.3f} to {hi:+.3f}, {fit.runs} runs)"
    q = quantity
    sentence = {
        "falls": f"{who}: {q} falls with {axis} as {axis}^b, b = {how}.",
        "rises": f"{who}: {q} rises with {axis} as {axis}^b, b = {how}.",
        "flat_not_excluded": f"{who}: {q} against {axis} has b = {how}; the interval holds 0: no trend with "
                             f"{axis} is shown.",
        "untested": f"{who}: {q} against {axis} as {axis}^b: {how}; undecided." if why_not else
                    f"{who}: {q} against {axis} has b = {how}: untested.",
    }[v]
    numbers = {"b": b, "lo": lo, "hi": hi, "runs": fit.runs, "df": df, "interval": interval}
    if ref is not None and _finite(ref):
        numbers["ref"] = ref
        sentence += against_reference(numbers, ref, ref_text, q, v)
    return Claim(key, v, sentence, numbers)


def against_reference(numbers: dict, ref: float, ref_text: str, q: str, v: str) -> str:
    """The sentence setting the interval beside the reference exponent; sets numbers['against_ref'] where tested."""
    if v == "untested":
        return f" {ref_text}: {ref:+.3f}."
    lo, hi = numbers["lo"], numbers["hi"]
    if lo <= ref <= hi:
        numbers["against_ref"] = "consistent"
        return f" {ref_text}, {ref:+.3f}, lies inside the interval."
    faster = hi < ref
    numbers["against_ref"] = "faster" if faster else "slower"
    return (f" {ref_text}, {ref:+.3f}, lies {'above' if faster else 'below'} it: {q.split(' (')[0]} falls "
            f"{'faster' if faster else 'more slowly'} here.")


def signed_gap_trend(who: str, axis: str, slope: float, ci: tuple[float, float], level: float, df: int | None,
                     runs: int, key: str = "scale_trend", quantity: str = "the gap", why_not: str = "") -> Claim:
    """The signed gap's trend against log `axis` (gap = a + b log x over every run, whatever its sign), with its
    t-interval on `df` degrees of freedom: 'falls', 'rises', 'flat_not_excluded', or 'untested' (not fitted:
    `why_not`)."""
    lo, hi = ci
    q = quantity
    if why_not or not (_finite(lo) and _finite(hi)):
        why = why_not or "no interval"
        return Claim(key, "untested", f"{who}: {q}'s trend against log {axis}: not fitted ({why}); undecided.",
                     {"b": slope, "lo": lo, "hi": hi, "runs": runs, "df": df})
    v = "falls" if hi < 0 else "rises" if lo > 0 else "flat_not_excluded"
    how = (f"b = {slope:+.4f} nats per unit of log {axis} ({100 * level:g}% t-interval {lo:+.4f} to {hi:+.4f}, "
           f"{df} df, {runs} runs, every run whatever its sign)")
    sentence = {"falls": f"{who}: {q} falls with log {axis}: {how}.",
                "rises": f"{who}: {q} rises with log {axis}: {how}.",
                "flat_not_excluded": f"{who}: {q} against log {axis} has {how}; the interval holds 0: no trend "
                                     f"with {axis} is shown."}[v]
    return Claim(key, v, sentence, {"b": slope, "lo": lo, "hi": hi, "runs": runs, "df": df})


def effect_trend(name: str, slope: float, se: float, runs: int, key: str = "effect_trend", z: float = Z,
                 df: int | None = None) -> Claim:
    """Whether `name`'s paired effect on the last tenth (d, nats; negative lowers it) grows as the models strengthen:
    the weighted slope of d against log test CE, slope ± se. A stronger model has a lower test CE, so a positive slope
    means d falls (the effect grows) as the test CE falls: 'grows' (slope > z se), 'shrinks' (slope < -z se),
    'no_trend' (within), 'untested' (no slope, or df = runs - 2 below MIN_DF)."""
    df = runs - 2 if df is None else df
    if not (_finite(slope) and _finite(se)) or df < MIN_DF:
        why = f"df < {MIN_DF}, " if df < MIN_DF else ""
        return Claim(key, "untested", f"{name}'s effect against the models' strength: untested ({why}{runs} runs).",
                     {"slope": slope, "se": se, "df": df})
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
    return Claim(key, v, sentence, {"slope": slope, "se": se, "runs": runs, "df": df})
