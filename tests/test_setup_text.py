"""Each section's setup as a table row, and its departures from the paper in short notes
(lmcal.reporting.setup_text)."""

from lmcal.reporting import setup_text as S


def test_setup_row_states_what_is_recorded_and_dashes_the_rest():
    s = {"num_prefixes": 100, "samples_per_prefix": 3, "prefix_len": 100, "horizon": 200, "seed": 0,
         "fit_tokens": 10000, "test_tokens": 9990, "epsilon": 0, "rule": "top-16", "topk": 16, "tail_samples": 16}
    assert S.setup_row("calibration", "AWD-LSTM", s) == (
        "| calibration | AWD-LSTM | 100 × 100 words | 300 (3 each) | 200 | top-16, shared tail tilt (16 draws), "
        "ε = 0 | 10,000 / 9,990 | 0 |")
    assert S.setup_row("Table 1", "M", {"num_generations": 500, "horizon": 700}) == \
        "| Table 1 | M | – | 500 | 700 | the model | – / – | – |"
    assert S.law({"rule": "exact"}) == "exact lookahead"
    notes = S.departures(s)
    assert notes[0].startswith("Horizon 200, not the paper's 700") and notes[1].startswith("ε = 0")
    assert notes[2].startswith("One top-16 law fits, scores and generates: the top 16 words")
    assert S.departures({"horizon": 700, "rule": "exact"}) == []


def test_entrate_note_explains_two_entrates_of_one_model():
    er = {"horizon": 700, "num_generations": 500, "stderr_nats": [0.1], "entrate_ppl": 202.4}
    cal = {"horizon": 200, "num_prefixes": 100, "samples_per_prefix": 3, "stderr_nats_before": [0.05],
           "entrate_ppl_before": 187.6}
    assert S.entrate_note(er, cal) == ("EntRate is the last step's entropy, which rises with the horizon: 187.6 ± 9.4 "
                                       "here (horizon 200), 202.4 ± 20.2 in Table 1 (horizon 700).")
    assert S.entrate_note(er, {**cal, "horizon": 700, "num_prefixes": 100, "samples_per_prefix": 5}) is None


def test_tau_models_and_tail_levels():
    assert S.tau_models_sentence(True, ["trainer.max_epochs=1"]).startswith(
        "The τ-models are warm-started from the base model and trained with `trainer.max_epochs=1`")
    assert S.tau_models_sentence(False, None) == "The trained τ-models are trained from scratch, as in the paper."
    assert S.tail_level(5.0, 0.05) == "5.000 ± 0.050 (exp 148.4 ± 7.4)"


def test_the_setup_table_has_a_row_a_stage_and_short_notes():
    r = {"base": {"model": "M"}, "entropy_rate": {"horizon": 200, "num_generations": 300, "stderr_nats": [0.1],
                                                  "entrate_ppl": 100.0},
         "calibration": {"horizon": 200, "num_generations": 300, "rule": "exact", "stderr_nats_before": [0.1],
                         "entrate_ppl_before": 90.0},
         "decoders_setup": {"horizon": 200, "seed": 1, "calibration_reused": True}}
    lines = S.setup_lines(r)
    assert lines[:2] == S.SETUP_HEADER and lines[2].startswith("| Table 1 | M |")
    assert "| calibration | M | – | 300 | 200 | exact lookahead |" in lines[3]
    assert "each decoder, calibration's reused" in lines[4]
    assert all(len(n.split()) <= 25 for n in lines if n and not n.startswith("|"))
