"""Effect sentences written from numbers and their tests (lmcal.reporting.claims): every branch of every claim on
exact inputs."""

import math

import pytest

from lmcal.reporting import claims as C
from lmcal.reporting.claims_table import claim_row


def test_effect_verdict_branches():
    assert C.effect_verdict(-0.1, 0.04) == "lowers"  # 2.5 se
    assert C.effect_verdict(0.1, 0.04) == "raises"
    assert C.effect_verdict(-0.036, 0.036) == "no_change"  # 1 se: the 500-generation replicate of issue 33
    assert C.effect_verdict(-0.08, 0.04) == "no_change"  # exactly 2 se is not beyond 2 se
    assert C.effect_verdict(-0.1, math.nan) == "untested" and C.effect_verdict(-0.1, None) == "untested"


def test_ppl_points_and_the_papers_figure():
    assert C.ppl_points(math.log(200.0), math.log(0.9)) == pytest.approx(-20.0, abs=1e-9)
    assert C.paper_calibration() == "the paper: -20 points from 93.1 (-0.24 nats)"  # log(73.1 / 93.1) = -0.2419


def test_tail_effect_sentences():
    base = math.log(200.0)
    c = C.tail_effect("Calibration", -0.1, 0.04, base, "the paper: x")
    assert c.verdict == "lowers"
    assert c.sentence == ("Calibration lowers the mean entropy over the last tenth by 0.100 ± 0.040 nats (2.5 "
                          "standard errors; exp of the mean 200.0 → 181.0, -19.0 perplexity points); the paper: x.")
    assert C.tail_effect("T", 0.1, 0.04, base).sentence.startswith("T raises the mean entropy over the last tenth by "
                                                                   "0.100 ± 0.040 nats")
    c = C.tail_effect("Calibration", -0.036, 0.036, base)
    assert c.verdict == "no_change" and c.sentence == (
        "Calibration changes the mean entropy over the last tenth by -0.036 ± 0.036 nats (-7.1 perplexity points), "
        "within 2 standard errors of no change: no effect is shown.")
    c = C.tail_effect("X", -0.1, math.nan, base)
    assert c.verdict == "untested" and "no standard error recorded" in c.sentence


def test_against_temperature_branches():
    # issue 33's numbers: calibration -0.102 ± 0.040, the fitted temperature -0.100 ± 0.033
    c = C.against_temperature("Calibration", -0.102, 0.040, -0.100, 0.033, 0.9901, 4.7518, 4.7501)
    assert c.verdict == "no_better"
    assert c.sentence == ("Calibration is not shown to be better than the fitted temperature (T = 0.9901), the "
                          "baseline every calibration must beat: -0.102 ± 0.040 nats against its -0.100 ± 0.033, a "
                          "difference of -0.002 within 2 (se + se) = 0.146. Test CE 4.7518 against the temperature's "
                          "4.7501 nats.")
    more = C.against_temperature("Head", -0.297, 0.043, -0.100, 0.033)  # -0.197 beyond 0.152
    assert more.verdict == "more" and "by more than the fitted temperature" in more.sentence
    assert "Test CE" not in more.sentence
    assert C.against_temperature("Head", 0.1, 0.01, -0.1, 0.01).verdict == "less"
    assert C.against_temperature("Head", -0.25, 0.04, -0.1, 0.04).verdict == "no_better"  # 0.15 < 2 * 0.08
    assert C.against_temperature("Head", -0.1, None, -0.1, 0.03).verdict == "untested"


def _curve(t1, tail_level, se1, se_tail, n=20):
    """A curve of n steps: t1 at t = 1, tail_level over the last tenth (2 steps), per-step errors se1 and se_tail."""
    return [t1] + [t1] * (n - 3) + [tail_level] * 2, [se1] + [se_tail] * (n - 1)


def test_rise_adds_the_ends_errors_in_quadrature():
    r, se = C.rise(*_curve(4.0, 4.5, 0.03, 0.04), tail=2)
    assert r == pytest.approx(0.5) and se == pytest.approx(0.05)


def test_drift_branches():
    before = _curve(4.0, 4.6, 0.03, 0.04)  # rises 0.6 ± 0.05
    risen = _curve(4.0, 4.5, 0.03, 0.04)  # rises 0.5 ± 0.05
    flat = _curve(4.0, 4.05, 0.03, 0.04)  # rises 0.05 ± 0.05
    c = C.drift("Calibration", before, flat, 2, (-0.55, 0.05))
    assert c.verdict == "flattens" and c.sentence.startswith("Calibration flattens the drift: from t = 1 to the last "
                                                             "tenth the entropy changes by +0.050 ± 0.050 nats "
                                                             "with calibration (no drift shown)")
    fall = _curve(4.0, 3.9, 0.03, 0.04)  # a fall is stated as the change it is, not as a negative rise
    assert "changes by -0.100 ± 0.050 nats with calibration (a fall)" in C.drift("Calibration", before, fall, 2,
                                                                                 (-0.7, 0.05)).sentence
    c = C.drift("Calibration", before, risen, 2, (-0.117, 0.046))  # issue 33: 0.46 against 0.57 still rises
    assert c.verdict == "less_drift" and c.sentence.startswith("Calibration lowers the drift but does not flatten it")
    assert C.drift("Calibration", before, risen, 2, (-0.05, 0.046)).verdict == "still_rises"
    assert C.drift("Calibration", before, flat, 2, (-0.05, 0.046)).verdict == "not_shown"


def test_within_branches():
    ref = 100.0
    assert C.within("A", math.log(105.0), 0.01, ref).verdict == "within"  # 103-107
    c = C.within("A", math.log(148.2), 0.02, ref)  # 142-154: all above 110
    assert c.verdict == "not_within"
    assert c.sentence.startswith("A is not within 10% of the test perplexity: 148.2 ± 3.0")
    assert C.within("A", math.log(80.0), 0.02, ref).verdict == "not_within"  # all below 90
    assert C.within("A", math.log(108.0), 0.05, ref).verdict == "undecided"  # 97.7-119.4
    c = C.within("A", math.log(108.0), None, ref)
    assert c.verdict == "untested" and "no standard error recorded" in c.sentence


def test_tail_level_prefers_the_clustered_error_then_bounds_it():
    assert C.tail_level({"tail_nats": 5.0, "tail_stderr_nats": 0.05, "tail_ppl": 1.0}) == (5.0, 0.05)
    level, se = C.tail_level({"tail_ppl": math.exp(5.0), "stderr_nats": [1.0] * 18 + [0.2, 0.4]})
    assert level == pytest.approx(5.0) and se == pytest.approx(0.3)  # the mean of the last 2 of 20 steps
    assert C.tail_level({"tail_ppl": math.exp(5.0)}) == (pytest.approx(5.0), None)


def _head(k, d, se, beta=None, tail_ppl=150.0, **extra):
    params = {"horizon_k": k, "discount": 0.95, "alpha": -0.01} | ({"beta": beta} if beta else {})
    return {"method": "future_entropy" + ("_temperature" if beta else ""), "params": params, "tail_diff_nats": d,
            "tail_diff_stderr_nats": se, "tail_ppl": tail_ppl, **extra}


def test_heads_against_the_fitted_temperature():
    temp = {"method": "fitted_temperature", "params": {"temperature": 0.99}, "tail_diff_nats": -0.100,
            "tail_diff_stderr_nats": 0.033}
    rows = [{"method": "model", "params": {}}, _head(100, -0.297, 0.043, beta=1.01), _head(5, -0.116, 0.042), temp]
    (c,) = C.heads_claims(rows)
    assert c.verdict == "more" and c.numbers == {"more": 1, "heads": 2}
    assert "Of the 2 future-entropy rows, 1 lowers" in c.sentence and "K=100, γ=0.95, with β (-0.297 ± 0.043)" in \
        c.sentence
    (c,) = C.heads_claims([rows[0], rows[2], temp])
    assert c.verdict == "no_better" and c.sentence.startswith("None of the 1 future-entropy rows is better than")
    assert C.heads_claims([rows[0], rows[2]]) == []  # no temperature: nothing to claim


def test_best_head_chosen_on_one_seed_reported_on_another():
    best = _head(20, -0.2, 0.04) | {"chosen_on_seed": 0, "reported_on_seed": 1, "tail_nats": math.log(160.7),
                                    "tail_stderr_nats": 0.05, "candidates": ["a", "b"]}
    (c,) = C.best_head_claims({"best_head": best, "reference_test_ppl": 115.8, "rows": []})
    assert c.verdict == "not_within" and "seed 0" in c.sentence and "measured again on seed 1" in c.sentence
    rows = [_head(1, -0.1, 0.04, tail_ppl=170.0, stderr_nats=[0.05] * 20),
            _head(100, -0.3, 0.04, tail_ppl=148.2, stderr_nats=[0.04] * 20)]
    (c,) = C.best_head_claims({"rows": rows, "reference_test_ppl": 115.8})
    assert c.verdict == "not_within" and "on the same generations it is reported on (so optimistic)" in c.sentence
    assert "K=100" in c.sentence and c.numbers["se"] == pytest.approx(0.04)
    # results.json keeps the chosen rows (future_entropy_best_head, sequence_calibration_goal), so the claims that
    # docs/RESULTS.md writes from it alone are the ones REPORT.md wrote from the stages' own files
    goal = {"method": "soft_value", "chosen_on_seed": 0, "reported_on_seed": 1, "tail_nats": math.log(137.5),
            "tail_stderr_nats": 0.046, "test_ppl": 115.8, "candidates": ["a", "b", "c", "d"]}
    res = {"future_entropy": [{"method": "model", "params": {}, "test_ce_nats": math.log(115.8)}],
           "future_entropy_best_head": best, "sequence_calibration_goal": goal}
    live = [*C.best_head_claims({"best_head": best, "reference_test_ppl": 115.8, "rows": []}),
            *C.sequence_goal_claims({"goal": goal})]
    assert [c.sentence for c in C.results_claims(res)] == [c.sentence for c in live]


def test_memory_flags():
    rows = [{"model": "transformer", "tau": 20, "limited": "window", "delta_ce_nats": -0.0118,
             "delta_ce_stderr_nats": 0.0012, "two_parameter": {"beta": 0.341, "alpha": 0.691}},
            {"model": "transformer", "tau": 10, "limited": "window", "delta_ce_nats": -0.0053,
             "delta_ce_stderr_nats": 0.0029, "two_parameter": {"beta": 1.1, "alpha": 0.0}},  # 1.8 se; beta near 1
            {"tau": 5, "delta_ce_nats": 0.2, "delta_ce_stderr_nats": 0.01}]  # no two-parameter fit recorded
    flags = C.memory_flags(rows)
    assert [(f.key, f.verdict, f.numbers["tau"]) for f in flags] == [
        ("negative_delta_ce", "negative", 20), ("beta_far_from_1", "far", 20),
        ("negative_delta_ce", "negative_not_shown", 10)]
    assert flags[0].sentence == ("Flag (transformer, τ = 20, window P̃): ΔCE = -0.0118 ± 0.0012 nats is below zero "
                                 "beyond 2 standard errors: the τ-limited model predicts these words better than the "
                                 "full one.")
    assert "β* = 0.341, α* = 0.691" in flags[1].sentence
    assert flags[2].sentence.endswith("within 2 standard errors of zero: the τ-limited model predicts these words "
                                      "about as well as the full one.")


def test_against_the_papers_size():
    c = C.against_paper("Calibration", 0.008, 0.044)  # issue 40: +0.008 ± 0.044 against -0.24
    assert c.verdict == "rules_out" and c.sentence == (
        "Calibration's change of the last tenth, +0.008 ± 0.044 nats, rules out the paper's -0.24 nats: it lies 5.7 "
        "standard errors from it.")
    c = C.against_paper("Calibration", -0.15, 0.06)
    assert c.verdict == "consistent" and "does not rule out the paper's -0.24 nats (1.5 standard errors" in c.sentence
    assert C.against_paper("X", -0.1, math.nan).verdict == "untested"


def _cal(vs=(-0.1, 0.04), exact=(-0.1, 0.04), ce=(-0.002, 0.001), fit=True, rule="top-16", stage=(0.02, 0.04)):
    """A calibration record (alpha* = -0.05, its law `rule`) with a dose-response (top-16 and cover 0.95 at 1 and
    10 alpha*) and a GPU run's rows beside it: top-16 and exact at exact's own alpha* = -0.07 (500 generations; exact
    paired with top-16 there, `vs`, and against the model, `exact`, its test CE `ce`) and exact at the stage's
    alpha*; `fit`: whether that run fitted exact's own alpha*."""
    def row(r, a, d, se, v=(0.0, 0.0), c=(0.0, 0.001), n=20, **kw):
        return {"rule": r, "multiple": round(a / -0.05, 4), "alpha": a, "generations": n, "vs_rule": "top-16",
                "tail_nats": 5.2 + d, "tail_diff_nats": d, "tail_diff_stderr_nats": se, "vs_first_nats": v[0],
                "vs_first_stderr_nats": v[1], "test_ce_diff_nats": c[0], "test_ce_diff_stderr_nats": c[1], **kw}

    gpu = {"device": "H200"}
    dr = {"alpha": -0.05, "multiples": [1, 10], "rules": ["top-16", "cover 0.95"], "generations": 20,
          "rows": [row("top-16", -0.05, -0.1, 0.15), row("cover 0.95", -0.05, -0.05, 0.12, (0.05, 0.1)),
                   row("top-16", -0.5, -0.4, 0.2), row("cover 0.95", -0.5, -1.1, 0.2, (-0.7, 0.3), (0.06, 0.02))],
          "extra_rows": [row("top-16", -0.07, 0.0, 0.04, n=500, **gpu),
                         row("exact", -0.07, *exact, vs, ce, n=500, **gpu),
                         row("exact", -0.05, -0.07, 0.17, (-0.2, 0.14), **gpu)],
          "extra_fits": [{"rule": "exact", "device": "H200", "alpha": -0.0700001, "alpha_stderr": 0.01}] if fit else []}
    return {"rule": rule, "alpha": -0.05, "tail_diff_nats": stage[0], "tail_diff_stderr_nats": stage[1],
            "tail_ppl_before": 200.0, "num_prefixes": 100, "samples_per_prefix": 3, "test_ppl_before": 116.0,
            "test_ppl_after": 115.9, "dose_response": dr}


def _sentences(text):
    return [x for x in text.split(". ") if x]


def test_algorithm_2s_headline_is_exact_lookahead_at_its_own_alpha():
    from lmcal.reporting.calibration_limit import headline, law_rows

    cal = _cal()
    rows = law_rows(cal)
    # exact lookahead at its own alpha* heads the rows; each other rule once: top-16 by the stage's own record (more
    # generations than its dose row), cover 0.95 at the stage's alpha* (no fit of its own)
    assert [(r["rule"], r["own"], r["generations"]) for r in rows] == [
        ("exact", True, 500), ("top-16", True, 300), ("cover 0.95", False, 20)]
    assert headline(cal) is not None and headline(cal)["alpha"] == -0.07
    claims = {c.key: c for c in C.calibration_claims({"calibration": _cal_with_curves(cal)})}
    tail = claims["calibration_tail"]
    assert tail.verdict == "lowers" and (tail.numbers["d"], tail.numbers["se"]) == (-0.1, 0.04)
    assert tail.sentence.endswith("The law: exact lookahead at its own α* = -0.07, H200, 500 generations.")
    assert claims["calibration_vs_paper"].numbers["d"] == -0.1
    assert claims["calibration_drift"].numbers["law"] == "top-16 at its own α* = -0.05, 300 generations"
    # without a fit of exact's own alpha*, the stage's law is the headline, and exact at the stage's alpha* is beside it
    cal = _cal(fit=False)
    assert headline(cal)["stage"] and [r["rule"] for r in law_rows(cal)] == ["top-16", "cover 0.95", "exact"]
    tail = next(c for c in C.calibration_claims({"calibration": _cal_with_curves(cal)}) if c.key == "calibration_tail")
    assert tail.verdict == "no_change" and tail.numbers["d"] == 0.02
    # a stage whose law is exact lookahead (a small vocabulary) is its own headline
    assert headline(_cal(rule="exact"))["stage"]


def _cal_with_curves(cal):
    flat = [5.0] * 20
    return cal | {"curve_nats_before": flat, "stderr_nats_before": [0.01] * 20, "curve_nats": flat,
                  "stderr_nats": [0.01] * 20, "tail_steps": 2, "diff_curve_nats": [0.0] * 20,
                  "diff_stderr_nats": [0.01] * 20}


def test_why_calibrations_effect_is_small_each_branch():
    # exact lowers the last tenth beyond top-16 (2.5 paired se), its test CE not worse: the approximation
    c = C.calibration_limit(_cal())
    assert claim_row(c)[2:5] == ("-0.100", "0.040", "yes (approximation)")
    assert c.verdict == "approximation" and c.sentence == (
        "The approximation is the limit: exact lookahead lowers the last tenth 0.100 ± 0.040 nats below top-16 "
        "(paired, 2.5 standard errors). Its test CE moves -0.0020 ± 0.0010 nats, not worse than the model's. The "
        "comparison, fixed in advance: exact lookahead against top-16 at the same α, paired, on the last tenth. Its "
        "row: exact lookahead at its own α* = -0.07, H200, 500 generations.")
    assert (c.numbers["d"], c.numbers["se"], c.numbers["alpha"]) == (-0.1, 0.04, -0.07)
    # the same, at a test CE worse beyond 2 se: undecided
    c = C.calibration_limit(_cal(ce=(0.01, 0.002)))
    assert c.verdict == "undecided" and "its lower entropy costs test CE: +0.0100 ± 0.0020 nats" in c.sentence
    # exact shows no change of its own, 7.7 se short of the paper's, and none beyond top-16: the model
    c = C.calibration_limit(_cal(vs=(-0.01, 0.04), exact=(-0.01, 0.03)))
    assert c.verdict == "model" and c.sentence.startswith(
        "The model is the limit: exact lookahead changes the last tenth by -0.010 ± 0.030 nats, within 2 standard "
        "errors of no change and 7.7 standard errors short of the paper's -0.24.")
    # exact shows no change, but the paper's effect is within 2 se of it: undecided, and how many generations
    # would tell the two apart
    c = C.calibration_limit(_cal(vs=(-0.01, 0.04), exact=(-0.1, 0.08)))
    assert c.verdict == "undecided" and "about 637 generations of exact would tell its change from the paper's" \
        in c.sentence
    # a paired difference within 2 se: undecided, saying how many paired generations would resolve one this size
    c = C.calibration_limit(_cal(vs=(-0.05, 0.04), exact=(-0.08, 0.035)))
    assert c.verdict == "undecided" and c.sentence.startswith(
        "Whether the approximation or the model limits calibration here is undecided: exact minus top-16 is -0.050 ± "
        "0.040 nats, paired; exact against the model is -0.080 ± 0.035 nats, 4.6 standard errors from the paper's "
        "-0.24; about 1,280 paired generations would resolve a difference this size.")
    # exact beyond top-16 but no change against the model (top-16 raised it): both tests pass, so undecided
    c = C.calibration_limit(_cal(vs=(-0.1, 0.04), exact=(0.0, 0.03)))
    assert c.verdict == "undecided" and "both tests pass, for exact lies below top-16 yet not below the model" \
        in c.sentence
    # exact lookahead at its own alpha* not in the record: undecided, saying what would decide it
    c = C.calibration_limit(_cal(fit=False))
    assert c.verdict == "undecided" and c.sentence == (
        "Whether the approximation or the model limits calibration here is undecided: exact lookahead at its own α* is "
        "not in the record. Its rows, paired with top-16's at the same α, would decide it.")
    # a stage whose law is exact: no approximation to limit it, the model test alone
    c = C.calibration_limit(_cal(rule="exact", stage=(-0.01, 0.03)))
    assert c.verdict == "model" and c.sentence.endswith("against the model, on the last tenth. Its row: exact "
                                                        "lookahead at its own α* = -0.05, 300 generations.")
    assert claim_row(c)[2:5] == ("-0.010", "0.030", "no (model)")
    c = C.calibration_limit(_cal(rule="exact", stage=(-0.1, 0.03)))
    assert c.verdict == "undecided" and "the stage's law is exact lookahead, so no approximation limits it" \
        in c.sentence


def test_why_small_is_fixed_before_the_dose_response_is_read():
    """The comparison is fixed in advance: a dose-response row at 10 alpha* (or exact at the stage's alpha*, not its
    own), however strong, changes neither the verdict nor its sentence."""
    for kw in ({}, {"vs": (-0.05, 0.04), "exact": (-0.08, 0.035)}, {"vs": (-0.01, 0.04), "exact": (-0.01, 0.03)},
               {"fit": False}):
        before = C.calibration_limit(_cal(**kw))
        cal = _cal(**kw)
        dr = cal["dose_response"]
        for r in [*dr["rows"], *dr["extra_rows"]]:
            if r["multiple"] == 10 or (r["rule"] == "exact" and r["multiple"] == 1):
                r.update(tail_diff_nats=-3.0, tail_diff_stderr_nats=0.01, vs_first_nats=-2.9,
                         vs_first_stderr_nats=0.01, test_ce_diff_nats=-0.01, test_ce_diff_stderr_nats=0.001)
        dr["extra_rows"].append({**dr["extra_rows"][1], "alpha": -0.7, "multiple": 14.0, "tail_diff_nats": -3.0,
                                 "vs_first_nats": -2.9, "vs_first_stderr_nats": 0.01})
        after = C.calibration_limit(cal)
        assert (after.verdict, after.sentence) == (before.verdict, before.sentence), kw


def test_why_small_sentences_are_short():
    cases = [{}, {"ce": (0.01, 0.002)}, {"vs": (-0.01, 0.04), "exact": (-0.01, 0.03)},
             {"vs": (-0.05, 0.04), "exact": (-0.08, 0.035)}, {"vs": (-0.1, 0.04), "exact": (0.0, 0.03)},
             {"fit": False}, {"rule": "exact", "stage": (-0.1, 0.03)}]
    words = [len(s.split()) for kw in cases for s in _sentences(C.calibration_limit(_cal(**kw)).sentence)]
    assert max(words) <= 60 and sum(words) / len(words) <= 25, words


def test_an_smc_goal_rows_verdict_counts_alpha_s_error_and_says_what_it_leaves_out():
    # the level's interval counts the generations' noise and α*'s standard error times the level's slope: a row shown
    # within 10% on its generations alone is undecided once α*'s error is counted; the run-to-run spread, where a
    # second training seed measured it, is counted too, and where not, the sentence says so
    check = {"method": "smc", "label": "twisted SMC, 16 particles", "reported_on_seed": 1, "prefixes": 600,
             "tail_nats": math.log(115.8), "tail_stderr_nats": 0.02, "test_ppl": 115.8, "tail_alpha_stderr_nats": None}
    (bare,) = C.sequence_goal_claims({"twisted_check": check})
    (c,) = C.sequence_goal_claims({"twisted_check": {**check, "tail_alpha_stderr_nats": 0.05}})
    (both,) = C.sequence_goal_claims({"twisted_check": {**check, "tail_alpha_stderr_nats": 0.01,
                                                        "run_to_run_stderr_nats": 0.06}})
    assert bare.verdict == "within" and c.verdict == "undecided" and both.verdict == "undecided"
    assert c.numbers["se"] == pytest.approx(math.hypot(0.02, 0.05)) and c.numbers["alpha_spread_nats"] == 0.05
    assert "Counted: the generations' noise, α*'s (±0.050 nats). Not counted: the run-to-run spread" in c.sentence
    assert "Not counted: α*'s error; the run-to-run spread" in bare.sentence
    assert both.numbers["se"] == pytest.approx(math.sqrt(0.02 ** 2 + 0.01 ** 2 + 0.06 ** 2))
    assert "Not counted" not in both.sentence


def test_a_model_far_from_the_papers_is_not_compared_with_it():
    from lmcal.reporting.claim import comparability, shown

    assert comparability({"profile": "cpu", "base": {"test_ppl": 115.8}}) is None
    assert "more than 3 times the paper's 58.3" in comparability({"profile": "x", "base": {"test_ppl": 948.1}})
    assert comparability({"profile": "smoke", "base": {"test_ppl": 60.0}}).startswith("a smoke run")
    c = C.not_comparable(C.against_paper("Calibration", -0.01, 0.01), "a smoke run")
    assert c.verdict == "not_comparable" and shown(c.verdict) == "– (not comparable)"
    assert c.sentence.endswith("Not comparable with the paper: a smoke run.")
