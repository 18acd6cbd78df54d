"""Effect sentences written from numbers and their tests (lmcal.reporting.claims): every branch of every claim on
exact inputs."""

import math

import pytest

from lmcal.reporting import claims as C


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
                                                             "tenth the entropy rises +0.050 ± 0.050 nats")
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


def _limit_inputs(kept_shift, lost_se, vs, vs_se, tail_at_star, se_star=0.05, exact=(-0.03, 0.002)):
    """An approximation table (exact and top-16 at a* and 3a*) and a dose-response (top-16 and cover 0.95 at a*
    and 3a*) with these numbers; alpha* < 0."""
    e, e_se = exact
    ap = {"alpha": -0.05, "multiples": [1, 3], "rows": [
        {"rule": "exact", "shift_nats": [e, 3 * e], "shift_stderr_nats": [e_se, e_se], "lost_nats": [0, 0],
         "lost_stderr_nats": [0, 0], "kept": [1, 1]},
        {"rule": "top-16", "shift_nats": [kept_shift, 3 * kept_shift], "shift_stderr_nats": [e_se, e_se],
         "lost_nats": [kept_shift - e, 3 * (kept_shift - e)], "lost_stderr_nats": [lost_se, lost_se],
         "kept": [kept_shift / e, kept_shift / e]}]}
    row = lambda rule, k, d, v: {"rule": rule, "multiple": k, "tail_diff_nats": d, "tail_diff_stderr_nats": se_star,
                                 "vs_first_nats": v, "vs_first_stderr_nats": vs_se}
    dr = {"rules": ["top-16", "cover 0.95"], "rows": [
        row("top-16", 1, tail_at_star[0], 0.0), row("cover 0.95", 1, tail_at_star[1], vs[0]),
        row("top-16", 3, 0.0, 0.0), row("cover 0.95", 3, vs[1], vs[1])]}
    return ap, dr


def test_which_limit_lookahead_calibration_meets():
    # top-16 keeps a fifth of the exact shift, and cover 0.95 lowers the tail beyond top-16 at 3 alpha*: the
    # approximation
    ap, dr = _limit_inputs(-0.006, 0.001, vs=(-0.05, -0.2), vs_se=0.04, tail_at_star=(0.01, -0.06))
    c = C.calibration_limit(ap, dr)
    assert c.verdict == "approximation" and c.sentence.startswith("The approximation is the limit here: at α* = -0.05,"
                                                                  " exact lookahead shifts the expected entropy")
    assert "top-16 keeps 20% (-0.0060; it loses +0.0240 ± 0.0010)" in c.sentence
    assert "cover 0.95 at 3α* changes it by -0.200 ± 0.040 nats beyond top-16 (paired)" in c.sentence
    assert c.numbers["goal_rows"] == 0 and c.sentence.endswith(
        "No rule beyond top-16 moves the last tenth beyond 2 standard errors with a test CE not above the model's; "
        "those that move it: cover 0.95 at 3α*, -0.200 ± 0.050 nats, no test CE.")
    # the goal: a rule beyond the cheapest that moves the last tenth with a test CE not shown above the model's; a
    # move that costs test CE (beyond 2 se) does not meet it, and is named with its test CE
    ce = lambda r, d: r | {"test_ce_diff_nats": d, "test_ce_diff_stderr_nats": 0.001}
    gpu = {"rule": "exact", "multiple": 1.4, "tail_diff_nats": -0.3, "tail_diff_stderr_nats": 0.1, "device": "H200"}
    dr["rows"][3] = ce(dr["rows"][3] | {"tail_diff_nats": -0.2, "tail_diff_stderr_nats": 0.05}, 0.05)
    c = C.calibration_limit(ap, dr, [ce(gpu, 0.0015)])
    assert c.numbers["goal_rows"] == 1 and c.sentence.endswith(
        "Beyond top-16, exact (H200) at 1.4α*, -0.300 ± 0.100 nats, test CE +0.0015 ± 0.0010 moves the last tenth "
        "beyond 2 standard errors with a test CE not above the model's (0.6 standard errors from the paper's -0.24).")
    # two rows meet it: the verb agrees, and each row's distance from the paper's effect is given
    two = [ce(gpu, 0.0015), ce(gpu | {"rule": "cover 0.99", "tail_diff_nats": -0.1, "tail_diff_stderr_nats": 0.02}, 0)]
    c = C.calibration_limit(ap, dr, two)
    assert c.numbers["goal_rows"] == 2 and c.sentence.endswith(
        "-0.100 ± 0.020 nats, test CE +0.0000 ± 0.0010 move the last tenth beyond 2 standard errors with a test CE not "
        "above the model's (0.6, 7.1 standard errors from the paper's -0.24).")
    c = C.calibration_limit(ap, dr, [ce(gpu, 0.0025)])
    assert c.numbers["goal_rows"] == 0 and c.sentence.endswith(
        "those that move it: cover 0.95 at 3α*, -0.200 ± 0.050 nats, test CE +0.0500 ± 0.0010; "
        "exact (H200) at 1.4α*, -0.300 ± 0.100 nats, test CE +0.0025 ± 0.0010.")
    # the rules keep the exact shift and nothing moves at alpha*: the model
    ap, dr = _limit_inputs(-0.028, 0.001, vs=(0.0, -0.03), vs_se=0.04, tail_at_star=(0.01, -0.02))
    c = C.calibration_limit(ap, dr)
    assert c.verdict == "model" and c.sentence.startswith("The model is the limit here:")
    assert "no rule changes the last tenth at α* beyond 2 standard errors (top-16 +0.010 ± 0.050; cover 0.95 " \
           "-0.020 ± 0.050 nats)" in c.sentence
    # an extra row (exact lookahead on a GPU) that shows an effect at alpha* keeps it from "model"
    gpu = {"rule": "exact", "multiple": 1, "tail_diff_nats": -0.2, "tail_diff_stderr_nats": 0.05, "device": "H100"}
    assert C.calibration_limit(ap, dr, [gpu]).verdict == "undecided"
    # the rules lose the shift but more candidates move nothing: undecided, saying what is missing
    ap, dr = _limit_inputs(-0.006, 0.001, vs=(0.0, -0.03), vs_se=0.04, tail_at_star=(0.01, -0.02))
    c = C.calibration_limit(ap, dr)
    assert c.verdict == "undecided" and "no more covering rule moves the last tenth beyond top-16's" in c.sentence
    # the exact shift itself not measured: undecided
    ap, dr = _limit_inputs(-0.001, 0.001, vs=(0.0, 0.0), vs_se=0.04, tail_at_star=(0.0, 0.0), exact=(-0.002, 0.002))
    c = C.calibration_limit(ap, dr)
    assert c.verdict == "undecided" and "the exact shift is not measured (-0.0020 ± 0.0020 nats)" in c.sentence


def test_an_smc_goal_rows_verdict_says_what_its_alpha_s_noise_would_move_it_by():
    # the verdict is on the law at the fitted α* (the model built); α*'s own standard error, times the level's slope,
    # is said beside it, and changes no verdict
    check = {"label": "twisted SMC, 16 particles", "reported_on_seed": 1, "prefixes": 600, "tail_nats": math.log(110),
             "tail_stderr_nats": 0.03, "test_ppl": 115.8, "tail_alpha_stderr_nats": 0.034}
    (c,) = C.sequence_goal_claims({"twisted_check": check})
    (bare,) = C.sequence_goal_claims({"twisted_check": {**check, "tail_alpha_stderr_nats": None}})
    assert c.verdict == bare.verdict == "undecided" and c.numbers["alpha_spread_nats"] == 0.034
    assert c.sentence == bare.sentence[:-1] + ("; that is the law at its fitted α*, and α*'s standard error would move "
                                               "its level by ±0.034 nats (±3%) more.")
