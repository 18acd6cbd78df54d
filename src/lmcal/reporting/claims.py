"""Sentences that state an effect ("lowers", "flattens", "within", "not shown to be better than"), written from the
numbers and their tests, never typed. REPORT.md and docs/RESULTS.md take their effect sentences from here.

The tests, all at Z = 2 standard errors:
- an effect d ± se (nats) is shown when |d| > Z se; else it is "within Z standard errors of no change";
- a calibration beats the fitted temperature (the baseline every calibration must beat) only when its effect minus
  the temperature's exceeds Z (se + se_T): the two are paired on the same generations, and whatever their correlation
  the standard error of the difference is at most se + se_T (sd(X - Y) <= sd X + sd Y), so the test is conservative;
- a curve rises (drifts) from t = 1 to the last tenth when that rise exceeds Z times mean(se over the last tenth) +
  se(t = 1), again a bound on its standard error whatever the correlation of the steps;
- a level is within 10% of a reference perplexity when the whole level ± Z se lies within 10% of it, not within when
  none of it does, and undecided otherwise;
- a change of the last tenth rules out the paper's (-0.24 nats) when the two are more than Z se apart;
- Algorithm 2's tail effect and its distance from the paper's are those of its headline law, exact lookahead at its own
  α* where the record has it, else the stage's law (lmcal.reporting.calibration_limit); the drift and the fitted
  temperature's test are the stage's law's, whose curves and decoders' row the record keeps;
- why calibration's effect is small (its approximation or the model) is decided by lmcal.reporting.calibration_limit's
  one comparison fixed in advance, at α* (never from the dose-response at other multiples of α*, nor from one step's
  EntRate, whose standard error is several times the effects here).
Sizes are stated in nats and in perplexity points (exp of the level after minus before), beside the paper's figure
(lmcal.paper). Every function is pure: numbers in, a Claim out.
"""

from __future__ import annotations

import math

from lmcal import paper
from lmcal.reporting.calibration_limit import calibration_limit, headline, law_text, stage_row, stage_rule
from lmcal.reporting.claim import Claim, Z, comparability, paper_calibration_nats
from lmcal.reporting.claim import finite as _finite


def effect_verdict(d: float, se: float | None, z: float = Z) -> str:
    """'lowers' (d < -z se), 'raises' (d > z se), 'no_change' (|d| <= z se), or 'untested' (no standard error)."""
    if not _finite(se) or not _finite(d):
        return "untested"
    return "lowers" if d < -z * se else "raises" if d > z * se else "no_change"


def ppl_points(base_nats: float, d: float) -> float:
    """The change in perplexity points when a level of base_nats moves by d nats: exp(base + d) - exp(base)."""
    return math.exp(base_nats + d) - math.exp(base_nats)


def paper_calibration() -> str:
    """The paper's calibration effect in nats and points: almost 20 points from its EntRate of about 93."""
    base, points = paper.AWD_LSTM_PTB["entrate_ppl"], -paper.CALIBRATION_PPL_DROP
    return f"the paper: {points:+.0f} points from {base:.1f} ({paper_calibration_nats():+.2f} nats)"


def tail_effect(name: str, d: float, se: float, base_nats: float, paper_text: str | None = None,
                key: str = "tail_effect", z: float = Z) -> Claim:
    """`name`'s paired change of the mean entropy over the last tenth, d ± se nats, from a level of base_nats."""
    v = effect_verdict(d, se, z)
    pts = ppl_points(base_nats, d)
    size = (f"{abs(d):.3f} ± {se:.3f} nats ({abs(d) / se:.1f} standard errors; exp of the mean "
            f"{math.exp(base_nats):.1f} → {math.exp(base_nats + d):.1f}, {pts:+.1f} perplexity points)"
            if v != "untested" else f"{d:+.3f} nats (no standard error recorded)")
    sentence = {
        "lowers": f"{name} lowers the mean entropy over the last tenth by {size}.",
        "raises": f"{name} raises the mean entropy over the last tenth by {size}.",
        "no_change": f"{name} changes the mean entropy over the last tenth by {d:+.3f} ± {se:.3f} nats "
                     f"({pts:+.1f} perplexity points), within {z:g} standard errors of no change: no effect is shown.",
        "untested": f"{name} changes the mean entropy over the last tenth by {size}: untested.",
    }[v]
    if paper_text:
        sentence = sentence[:-1] + f"; {paper_text}."
    return Claim(key, v, sentence, {"d": d, "se": se, "base_nats": base_nats})


def against_temperature(name: str, d: float, se: float, d_t: float, se_t: float, temperature: float | None = None,
                        ce: float | None = None, ce_t: float | None = None, key: str = "against_temperature",
                        z: float = Z) -> Claim:
    """`name`'s paired tail change d ± se against the fitted temperature's d_t ± se_t (same generations): 'more'
    (it lowers the tail by more than z (se + se_t) beyond the temperature), 'less', 'no_better', or 'untested'."""
    se, se_t = (math.nan if x is None else x for x in (se, se_t))
    diff = d - d_t
    if not all(_finite(x) for x in (d, se, d_t, se_t)):
        v = "untested"
    else:
        v = "more" if diff < -z * (se + se_t) else "less" if diff > z * (se + se_t) else "no_better"
    t = f" (T = {temperature:.4g})" if _finite(temperature) else ""
    pair = f"{d:+.3f} ± {se:.3f} nats against its {d_t:+.3f} ± {se_t:.3f}"
    sentence = {
        "more": f"{name} lowers the last tenth's entropy by more than the fitted temperature{t} does: {pair}, a "
                f"difference of {diff:+.3f} beyond {z:g} (se + se) = {z * (se + se_t):.3f}.",
        "less": f"{name} lowers the last tenth's entropy by less than the fitted temperature{t} does: {pair}, a "
                f"difference of {diff:+.3f} beyond {z:g} (se + se) = {z * (se + se_t):.3f}.",
        "no_better": f"{name} is not shown to be better than the fitted temperature{t}, the baseline every "
                     f"calibration must beat: {pair}, a difference of {diff:+.3f} within {z:g} (se + se) = "
                     f"{z * (se + se_t):.3f}.",
        "untested": f"{name} against the fitted temperature{t}: {pair}; untested (a standard error is missing).",
    }[v]
    if _finite(ce) and _finite(ce_t):
        sentence += f" Test CE {ce:.4f} against the temperature's {ce_t:.4f} nats."
    return Claim(key, v, sentence, {"d": d, "se": se, "d_t": d_t, "se_t": se_t})


def rise(curve: list[float], stderr: list[float], tail: int) -> tuple[float, float]:
    """(mean over the last `tail` steps minus the entropy at t = 1, its standard error) in nats. The tail mean's
    standard error is bounded by the mean of its steps' (whatever their correlation); the two ends are taken as not
    negatively correlated across generations (the same prefix feeds both), so their errors add in quadrature."""
    m = max(1, tail)
    return sum(curve[-m:]) / m - curve[0], math.hypot(sum(stderr[-m:]) / m, stderr[0])


def drift(name: str, before: tuple[list[float], list[float]], after: tuple[list[float], list[float]], tail: int,
          reduction: tuple[float, float], key: str = "drift", z: float = Z) -> Claim:
    """Whether `name` flattens the drift, the rise of the entropy from t = 1 to the last tenth. `reduction`: the
    paired change of that rise (tail difference minus the difference at t = 1) and a bound on its standard error
    (the sum of the two). 'flattens': the rise is shown to fall and what is left of it is not shown (within z se);
    'less_drift': it falls, but a rise is still shown; 'still_rises': no fall is shown and the rise is; 'not_shown':
    neither a fall of the rise nor a rise after is shown."""
    r0, s0 = rise(*before, tail)
    r1, s1 = rise(*after, tail)
    d, se = reduction
    down, up = d < -z * se, r1 > z * s1
    v = ("flattens" if down else "not_shown") if not up else ("less_drift" if down else "still_rises")
    nums = (f"from t = 1 to the last tenth the entropy changes by {r1:+.3f} ± {s1:.3f} nats with {name.lower()} "
            f"({'a rise' if r1 > z * s1 else 'a fall' if r1 < -z * s1 else 'no drift shown'}), against "
            f"{r0:+.3f} ± {s0:.3f} without; the paired change of that change is {d:+.3f} ± {se:.3f}")
    sentence = {
        "flattens": f"{name} flattens the drift: {nums}.",
        "less_drift": f"{name} lowers the drift but does not flatten it: {nums}, and the rise left is beyond {z:g} "
                      "standard errors.",
        "still_rises": f"The drift remains under {name.lower()}: {nums}, within {z:g} standard errors of no change.",
        "not_shown": f"No flattening of the drift is shown: {nums}.",
    }[v]
    return Claim(key, v, sentence, {"rise_before": r0, "se_before": s0, "rise_after": r1, "se_after": s1,
                                    "reduction": d, "reduction_se": se})


def within(name: str, level_nats: float, se: float | None, ref_ppl: float, tol: float = 0.10,
           key: str = "within", z: float = Z) -> Claim:
    """Whether `name`'s level (exp of level_nats ± z se) is within `tol` of the reference perplexity ref_ppl."""
    inside = lambda x: abs(math.exp(x) / ref_ppl - 1) <= tol
    ppl = math.exp(level_nats)
    if not _finite(se):
        v = "untested"
        nums = f"{ppl:.1f} (no standard error recorded) against {ref_ppl:.1f}"
    else:
        lo, hi = level_nats - z * se, level_nats + z * se
        outside = math.exp(lo) > (1 + tol) * ref_ppl or math.exp(hi) < (1 - tol) * ref_ppl  # all of it outside
        v = "within" if inside(lo) and inside(hi) else "not_within" if outside else "undecided"
        nums = (f"{ppl:.1f} ± {ppl * se:.1f} ({math.exp(lo):.1f}–{math.exp(hi):.1f} at {z:g} standard errors) against "
                f"{ref_ppl:.1f}")
    pct = f"{100 * tol:.0f}%"
    sentence = {
        "within": f"{name} is within {pct} of the test perplexity: {nums}.",
        "not_within": f"{name} is not within {pct} of the test perplexity: {nums}.",
        "undecided": f"{name} may or may not be within {pct} of the test perplexity (undecided): {nums}.",
        "untested": f"{name} is at {nums}; whether that is within {pct} of the test perplexity is untested.",
    }[v]
    return Claim(key, v, sentence, {"level_nats": level_nats, "se": se, "ref_ppl": ref_ppl})


# ---------------------------------------------------------------------------------------------------------------------
# The claims of a reproduction, from its results.json
# ---------------------------------------------------------------------------------------------------------------------


def _row(rows: list[dict] | None, method: str) -> dict | None:
    return next((d for d in rows or [] if d.get("method") == method), None)


def _with_law(c: Claim, row: dict, stage: str) -> Claim:
    """A calibration claim with the law its numbers come from said at its end and kept in its numbers."""
    law = law_text(row, stage)
    return Claim(c.key, c.verdict, f"{c.sentence} The law: {law}.", {**c.numbers, "law": law, "rule": row["rule"],
                                                                      "alpha": row["alpha"]})


def calibration_claims(r: dict) -> list[Claim]:
    """The calibration section's claims from results.json: the headline law's tail effect beside the paper's and
    whether it rules out the paper's size (lmcal.reporting.calibration_limit.headline), the stage's law's drift,
    why the effect is small (where the stage made a dose-response or an approximation table), and the stage's law
    against the fitted temperature of the decoders stage (paired on the same generations where that stage took
    calibration's, as its rows say)."""
    cal = r["calibration"]
    h, own, stage = headline(cal), stage_row(cal), stage_rule(cal)
    base = h["base_nats"] if _finite(h["base_nats"]) else own["base_nats"]  # a row without its level: the stage's
    out = [_with_law(tail_effect("Calibration", h["tail_diff_nats"], h["tail_diff_stderr_nats"], base,
                                 paper_calibration(), key="calibration_tail"), h, stage),
           _with_law(drift("Calibration", (cal["curve_nats_before"], cal["stderr_nats_before"]),
                           (cal["curve_nats"], cal["stderr_nats"]), cal["tail_steps"],
                           (cal["tail_diff_nats"] - cal["diff_curve_nats"][0],
                            cal["tail_diff_stderr_nats"] + cal["diff_stderr_nats"][0]), key="calibration_drift"),
                     own, stage),
           _with_law(against_paper("Calibration", h["tail_diff_nats"], h["tail_diff_stderr_nats"]), h, stage)]
    if cal.get("approximation") or cal.get("dose_response"):
        out.append(calibration_limit(cal))
    temp, c = _row(r.get("decoders"), "fitted_temperature"), _row(r.get("decoders"), "calibration")
    if temp and c:
        out.append(_with_law(against_temperature("Calibration", c["tail_diff_nats"], c["tail_diff_stderr_nats"],
                                                 temp["tail_diff_nats"], temp["tail_diff_stderr_nats"],
                                                 temp["params"].get("temperature"), c["test_ce_nats"],
                                                 temp["test_ce_nats"], key="calibration_vs_temperature"), own, stage))
    return out


def against_paper(name: str, d: float, se: float, key: str = "calibration_vs_paper", z: float = Z) -> Claim:
    """Whether `name`'s paired change of the last tenth, d ± se nats, rules out the paper's effect (-0.24 nats):
    'rules_out' when the two are more than z se apart, 'consistent' otherwise, 'untested' without an se."""
    p = paper_calibration_nats()
    if not (_finite(d) and _finite(se) and se > 0):
        return Claim(key, "untested", f"{name}'s change of the last tenth, {d:+.3f} nats, against the paper's "
                     f"{p:+.2f}: untested (no standard error recorded).", {"d": d, "se": se, "paper": p})
    gap = abs(d - p) / se
    v = "rules_out" if gap > z else "consistent"
    sentence = {"rules_out": f"{name}'s change of the last tenth, {d:+.3f} ± {se:.3f} nats, rules out the paper's "
                             f"{p:+.2f} nats: it lies {gap:.1f} standard errors from it.",
                "consistent": f"{name}'s change of the last tenth, {d:+.3f} ± {se:.3f} nats, does not rule out the "
                              f"paper's {p:+.2f} nats ({gap:.1f} standard errors from it)."}[v]
    return Claim(key, v, sentence, {"d": d, "se": se, "paper": p})


def _head_label(d: dict) -> str:
    p = d["params"]
    return f"K={p['horizon_k']}, γ={p['discount']:g}" + (", with β" if "beta" in p else "")


def heads_claims(rows: list[dict] | None) -> list[Claim]:
    """The future-entropy section's claim from its rows (results.json "future_entropy"): which heads lower the last
    tenth's entropy by more than the fitted temperature, each by the conservative paired test above."""
    heads = [d for d in rows or [] if str(d.get("method", "")).startswith("future_entropy")]
    temp = _row(rows, "fitted_temperature")
    if not heads or not temp:
        return []
    tests = [(d, against_temperature(_head_label(d), d["tail_diff_nats"], d["tail_diff_stderr_nats"],
                                     temp["tail_diff_nats"], temp["tail_diff_stderr_nats"])) for d in heads]
    more = [f"{_head_label(d)} ({d['tail_diff_nats']:+.3f} ± {d['tail_diff_stderr_nats']:.3f})"
            for d, c in tests if c.verdict == "more"]
    v = "more" if more else "no_better"
    t = temp["params"].get("temperature")
    base = (f"the fitted temperature{f' (T = {t:.4g})' if _finite(t) else ''}: "
            f"{temp['tail_diff_nats']:+.3f} ± {temp['tail_diff_stderr_nats']:.3f} nats, paired on the same "
            f"generations; a head beats it only by more than {Z:g} (se + se)")
    sentence = (f"Of the {len(heads)} future-entropy rows, {len(more)} "
                f"{'lowers' if len(more) == 1 else 'lower'} the last tenth's entropy by more than "
                f"{base}: {', '.join(more)}." if more else
                f"None of the {len(heads)} future-entropy rows is better than {base}.")
    return [Claim("heads_vs_temperature", v, sentence, {"more": len(more), "heads": len(heads)})]


def tail_level(row: dict) -> tuple[float, float | None]:
    """(mean entropy over the last tenth, its standard error) of a comparison row, in nats: the stage's own, clustered
    by prefix (tail_nats, tail_stderr_nats), else exp's log of tail_ppl with the mean of the last tenth's per-step
    standard errors (a bound, whatever their correlation), else None."""
    if _finite(row.get("tail_nats")) and _finite(row.get("tail_stderr_nats")):
        return row["tail_nats"], row["tail_stderr_nats"]
    se = row.get("stderr_nats")
    m = max(1, len(se) // 10) if se else 0
    return math.log(row["tail_ppl"]), (sum(se[-m:]) / m if m else None)


def best_head_claims(fe: dict) -> list[Claim]:
    """The future-entropy section's 'closest to the test perplexity' claim from future_entropy.json: the head chosen
    on one seed's generations and measured again on the next seed's (fe["best_head"]), or, from a stage that did not
    do so, the closest row as measured, said to be chosen on the very generations it is reported on."""
    b, ref = fe.get("best_head"), fe["reference_test_ppl"]
    if b:
        who = (f"The future-entropy row closest to the test perplexity on the generations of seed {b['chosen_on_seed']}"
               f" ({_head_label(b)}, among {len(b['candidates'])}), measured again on seed {b['reported_on_seed']},")
        return [within(who, b["tail_nats"], b["tail_stderr_nats"], ref, key="best_head_within")]
    heads = [d for d in fe["rows"] if str(d["method"]).startswith("future_entropy")]
    if not heads:
        return []
    best = min(heads, key=lambda d: abs(math.log(d["tail_ppl"] / ref)))
    level, se = tail_level(best)
    who = (f"The future-entropy row closest to the test perplexity ({_head_label(best)}), chosen among {len(heads)} "
           "on the same generations it is reported on (so optimistic),")
    return [within(who, level, se, ref, key="best_head_within")]


def sequence_goal_claims(sc: dict | None) -> list[Claim]:
    """The sequence_calibration stage's goal rows: the row closest to the test perplexity among those that are
    Algorithm 1 (converged) or per-word samplers with a test CE not above the model's, chosen on one seed's
    generations and measured again on fresh prefixes and the next seed; the twisted row with the fewest particles,
    measured there too; each within 10% of the test perplexity or not."""
    out = []
    g = (sc or {}).get("goal")
    if g and "tail_nats" in g:
        where = f"{g['reported_on']} and " if g.get("reported_on") else ""
        who = (f"Algorithm 1's stage: the row closest to the test perplexity on the generations of seed "
               f"{g['chosen_on_seed']} ({g.get('label', g['method'])}, among {len(g['candidates'])} rows that are "
               f"Algorithm 1 or per-word samplers with a test CE not above the model's), measured again on {where}"
               f"seed {g['reported_on_seed']},")
        out.append(_every_error(who, g, "sequence_goal_within"))
    c = (sc or {}).get("twisted_check")
    if c and "tail_nats" in c:
        who = (f"The twisted row with the fewest particles ({c['label']}), on {c.get('prefixes', 'the same')} fresh "
               f"prefixes and seed {c['reported_on_seed']},")
        out.append(_every_error(who, c, "sequence_twisted_within"))
    return out


def _every_error(who: str, row: dict, key: str) -> Claim:
    """A goal row against the test perplexity, at Z standard errors that count every error it has: its generations'
    noise; α*'s, carried into the level by its slope (an SMC row's law is the one at its fitted α*, and α* fitted on
    other continuations would move it); and the run-to-run spread where a second training seed measured it. What is
    not counted is said."""
    spread, seeds = row.get("tail_alpha_stderr_nats"), row.get("run_to_run_stderr_nats")
    parts = [x for x in (row["tail_stderr_nats"], spread, seeds) if _finite(x)]
    se = math.sqrt(sum(x * x for x in parts)) if _finite(row["tail_stderr_nats"]) else None
    claim = within(who, row["tail_nats"], se, row["test_ppl"], key=key)
    counted = "the generations' noise" + (f", α*'s (±{spread:.3f} nats)" if _finite(spread) else "") + (
        f", the run-to-run spread (±{seeds:.3f} nats)" if _finite(seeds) else "")
    missing = [] if _finite(seeds) else ["the run-to-run spread (a second training seed would measure it)"]
    if row.get("method") == "smc" and not _finite(spread):
        missing.insert(0, "α*'s error")
    note = f" Counted: {counted}." + (f" Not counted: {'; '.join(missing)}." if missing else "")
    ident = row.get("identity") or {}
    if _finite(ident.get("entropy_rate_nats")) and _finite(ident.get("validation_ce_nats")):
        note += (f" The identity α* sets is another comparison: the law's entropy rate over all its words, "
                 f"{ident['entropy_rate_nats']:.3f} nats, against the validation CE, "
                 f"{ident['validation_ce_nats']:.3f}.")
    return Claim(claim.key, claim.verdict, claim.sentence + note,
                 {**claim.numbers, "alpha_spread_nats": spread, "run_to_run_nats": seeds,
                  "generations_se": row["tail_stderr_nats"]})


def memory_flags(rows: list[dict], beta_far: float = 0.2, z: float = Z) -> list[Claim]:
    """A flag for each memory row (results.json "memory") whose ΔCE = CE(P~) - CE(P^) is below zero (beyond z standard
    errors or not: the τ-limited model predicts at least as well as the full one there), or whose two-parameter fit puts
    beta* more than `beta_far` from 1 (the calibrated model is then largely a re-weighting of P^ itself)."""
    out = []
    for m in rows:
        who = f"{m.get('model', 'awd_lstm')}, τ = {m['tau']}, {m.get('limited', 'trained')} P̃"
        d, se = m.get("delta_ce_nats"), m.get("delta_ce_stderr_nats")
        if _finite(d) and _finite(se) and d < 0:
            shown = d < -z * se
            out.append(Claim("negative_delta_ce", "negative" if shown else "negative_not_shown",
                             f"Flag ({who}): ΔCE = {d:+.4f} ± {se:.4f} nats is below zero"
                             + (f" beyond {z:g} standard errors: the τ-limited model predicts these words better "
                                "than the full one." if shown else f", within {z:g} standard errors of zero: the "
                                "τ-limited model predicts these words about as well as the full one."),
                             {"model": m.get("model"), "tau": m["tau"], "limited": m.get("limited"), "d": d,
                              "se": se}))
        beta = (m.get("two_parameter") or {}).get("beta")
        if _finite(beta) and abs(beta - 1) > beta_far:
            alpha = m["two_parameter"]["alpha"]
            out.append(Claim("beta_far_from_1", "far",
                             f"Flag ({who}): the two-parameter fit has β* = {beta:.3f}, α* = {alpha:.3f}, more than "
                             f"{beta_far:g} from β = 1: its calibrated model P̂^β·P̃^α re-weights P̂ itself, so its "
                             "bound is not that of P̂ calibrated towards P̃ alone.",
                             {"model": m.get("model"), "tau": m["tau"], "limited": m.get("limited"),
                              "beta": beta, "alpha": alpha}))
    return out


def results_claims(r: dict) -> list[Claim]:
    """Every claim that results.json alone supports (docs/RESULTS.md writes them for each snapshot): calibration, the
    future-entropy heads (the best one as chosen on one seed and measured on the next), Algorithm 1's goal row, and
    the memory flags."""
    out = calibration_claims(r) if "calibration" in r else []
    fe = r.get("future_entropy")
    model = _row(fe, "model")
    if fe and model and _finite(model.get("test_ce_nats")):
        out += best_head_claims({"rows": fe, "reference_test_ppl": math.exp(model["test_ce_nats"]),
                                 "best_head": r.get("future_entropy_best_head")})
    out += heads_claims(fe)
    out += sequence_goal_claims({"goal": r.get("sequence_calibration_goal"),
                                 "twisted_check": r.get("sequence_calibration_twisted_check")})
    out += memory_flags(r.get("memory", []))
    why = comparability(r)
    return [not_comparable(c, why) if why and c.key in AGAINST_PAPER else c for c in out]


AGAINST_PAPER = {"calibration_vs_paper"}  # the claims that test a number against the paper's


def not_comparable(c: Claim, why: str) -> Claim:
    """Claim `c` against the paper, for a model that is not comparable with it: its numbers kept, no verdict."""
    return Claim(c.key, "not_comparable", f"{c.sentence} Not comparable with the paper: {why}.", c.numbers)


def claims_markdown(claims: list[Claim]) -> list[str]:
    """The claims as Markdown lines, one paragraph each."""
    return [line for c in claims for line in (c.sentence, "")]
