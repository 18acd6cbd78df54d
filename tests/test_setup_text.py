"""Each REPORT.md section's setup sentence from its stage's settings (lmcal.reporting.setup_text), on exact inputs."""

from lmcal.reporting import setup_text as S


def test_setup_sentence_states_what_is_recorded_and_the_departures():
    s = {"num_prefixes": 100, "samples_per_prefix": 3, "prefix_len": 100, "horizon": 200, "epsilon": 0.0,
         "fit_tokens": 10000, "test_tokens": 9990, "seed": 0, "topk": 16, "tail_samples": 16}
    text = S.setup_sentence("calibration", "AWD-LSTM", s, [S.topk_departure(s)])
    assert text.startswith("Setup (calibration): AWD-LSTM; 300 generations (100 validation prefixes of 100 words, 3 "
                           "each); horizon 200 words (the paper: 700; shorter here because every method generates "
                           "the whole horizon for each generation, so this stage's time grows with it, and the profile "
                           "keeps to its time budget); ε = 0 (no uniform mixture: the paper mixes ε")
    assert "fitted on 10,000 validation positions; scored on 9,990 test tokens; seed 0; per-token top-16" in text
    assert S.setup_sentence("Table 1", "M", {"num_generations": 500, "horizon": 700}) == \
        "Setup (Table 1): M; 500 generations; horizon 700 words."  # the paper's horizon: no departure to state
    assert S.topk_departure({"topk": None}) is None


def test_entrate_note_explains_two_entrates_of_one_model():
    er = {"horizon": 700, "num_generations": 500, "entrate_ppl": 202.4, "stderr_nats": [0.1] * 700}
    cal = {"horizon": 200, "num_prefixes": 100, "samples_per_prefix": 3, "entrate_ppl_before": 187.6,
           "stderr_nats_before": [0.05] * 200}
    note = S.entrate_note(er, cal)
    assert note.startswith("The uncalibrated model's EntRate here (187.6 ± 9.4: 300 generations, horizon 200) is not "
                           "Table 1's (202.4 ± 20.2: 500 generations, horizon 700)")
    assert S.entrate_note(er, {**cal, "horizon": 700, "num_prefixes": 100, "samples_per_prefix": 5}) is None


def test_tau_models_and_tail_levels():
    assert S.tau_models_sentence(True, ["trainer.max_epochs=1"]).startswith(
        "The trained τ-models are warm-started from the base model and trained with `trainer.max_epochs=1`; the paper "
        "trains them from scratch.")
    assert S.tau_models_sentence(False, None) == "The trained τ-models are trained from scratch, as in the paper."
    assert S.tail_level_sentence("L", 5.0, 0.05) == "L: 5.000 ± 0.050 nats, exp 148.4 ± 7.4"


def test_the_setup_says_the_law_that_generates_is_the_one_fitted():
    """Issue 40: one law for the fit, the test CE and generation, said in the setup sentence for each rule; results
    from before it (no "rule" key) keep the sentence that says their fit was another law."""
    s = {"topk": 16, "tail_samples": 16, "rule": "top-16"}
    assert S.topk_departure(s) == (
        "one top-16 law for the fit, the test CE and generation: the top 16 words get their own tilt and the rest "
        "share one estimated from 16 drawn words (a true word among the rest shares it in the fit too); the paper "
        "tilts every word exactly")
    cover = S.topk_departure({"topk": None, "cover": 0.95, "tail_samples": 16, "rule": "cover 0.95 (at most 512)"})
    assert cover.startswith("one cover 0.95 (at most 512) law for the fit, the test CE and generation: the fewest most "
                            "likely words holding 0.95 of the mass get their own tilt")
    assert S.topk_departure({"topk": None, "rule": "exact"}) == (
        "exact lookahead (every word its own tilt, as the paper's), one law for the fit, the test CE and generation")
    assert S.topk_departure({"topk": 16, "tail_samples": 16}).startswith("per-token top-16 mixture")
    lines = S.calibration_lines({"base": {"model": "M"}, "entropy_rate": {"horizon": 200, "num_generations": 300},
                                 "calibration": {"topk": None, "cover": 0.95, "tail_samples": 16,
                                                 "rule": "cover 0.95", "candidates_mean": 612.4,
                                                 "mass_outside_topk": 0.08, "true_word_outside_topk": 0.05,
                                                 "coverage_positions": 2000, "horizon": 200, "num_prefixes": 100,
                                                 "samples_per_prefix": 3}})
    assert ("Outside the cover 0.95 candidates (612.4 per position on average; over 2,000 test positions): the "
            "calibrated model gives those words, which share one estimated tilt, 0.080 of its mass") in lines[2]
