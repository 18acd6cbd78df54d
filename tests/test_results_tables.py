"""Results tables in the manner of lm-evaluation-harness: the table `evaluate` ends with (stage | metric | value | ± se)
and its results file (config, versions, commit); runs.md sorting numbers as numbers and showing the user's own
overrides, dataset, tau, whole status and wall time; the claims table's rows, with a dash for a number not fitted."""

import json
import math

import yaml

from lmcal.reporting.runs_table import runs_report
from lmcal.stages.registry import result_rows
from lmcal.stages.rows import method_label
from lmcal.stages.tables import results_markdown


def _job(root, name, overrides, data="ptb", tau=None, metrics=None, error=None):
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"data": {"name": data}, "model": {"memory_tau": tau}}))
    if metrics is not None:
        (d / "metrics.json").write_text(json.dumps({"dataset": data, "memory_tau": tau, **metrics}))
    if error is not None:
        (d / "failed.json").write_text(json.dumps({"error": error}))
    return d


def test_runs_md_sorts_numbers_as_numbers_and_shows_what_the_user_chose(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    pipeline = ["logger=wandb", "logger.group=reproduce-x", "task_name=tau", f"init_ckpt={tmp_path}/base/best.ckpt",
                "hydra.sweep.dir=/x", "analysis.stages=[]", "memory.base_runs={ptb: /a, markov: /b}"]
    for tau in (10, 20, 5):
        _job(sweep, f"tau_{tau}", ["experiment=smoke", f"model.memory_tau={tau}", *pipeline], tau=tau,
             metrics={"val_ppl": 100.0 + tau, "test_ppl": 90.0 + tau, "wall_seconds": 65.0 * tau})
    long = "model.memory_tau=0 is out of range: " + "a paragraph that goes on " * 10 + "to its end."
    _job(sweep, "tau_0", ["experiment=smoke", "model.memory_tau=0", *pipeline], tau=0, error=long)
    rows = runs_report([sweep], sweep, jobs=True)
    assert [r["memory_tau"] for r in rows] == [0, 5, 10, 20]  # numbers, not text (10, 20, 5)
    table = (sweep / "runs.md").read_text()
    lines = table.splitlines()
    assert lines[0] == "All runs: experiment=smoke"  # the user's overrides only: no logger, group, paths
    assert lines[2] == "| run | dataset | τ | val ppl | test ppl | wall time | status | folder |"
    assert lines[6].startswith("| model.memory_tau=10 | ptb | 10 | 110.00 | 100.00 | 10m50s | ok |")
    assert lines[4].startswith("| model.memory_tau=0 | ptb | 0 | - | - | - |")
    assert f"| failed: {long} |" in lines[4]  # the whole status, not cut mid-word
    assert "base_runs" not in table and "logger" not in table and "init_ckpt" not in table
    assert table in capsys.readouterr().out
    saved = json.loads((sweep / "runs.json").read_text())
    assert saved[1]["shown"] == ["experiment=smoke", "model.memory_tau=5"] and "logger=wandb" in saved[1]["overrides"]


def test_a_sweep_whose_jobs_ran_the_memory_stage_shows_its_bound(tmp_path):
    sweep = tmp_path / "sweep"
    for tau, bound in ((2, 0.1234), (4, 0.2345)):
        d = _job(sweep, f"tau_{tau}", [f"model.memory_tau={tau}", "analysis.stages=[memory]"], tau=tau,
                 metrics={"val_ppl": 50.0, "test_ppl": 55.0})
        (d / "memory.json").write_text(json.dumps({"tau": tau, "mi_upper_bound_nats": bound, "mi_stderr_nats": 0.01}))
    _job(sweep, "tau_8", ["model.memory_tau=8"], tau=8, metrics={"val_ppl": 50.0, "test_ppl": 55.0})
    runs_report([sweep], sweep, jobs=True)
    lines = (sweep / "runs.md").read_text().splitlines()
    head = next(ln for ln in lines if ln.startswith("| run |"))
    assert "| memory bound I_τ (nats) | ± |" in head
    assert any("| 2 | 50.00 | 55.00 | 0.1234 | 0.0100 |" in ln for ln in lines)
    assert any("| 8 | 50.00 | 55.00 | - | - |" in ln for ln in lines)  # a job without the stage


def test_the_results_table_pairs_each_number_with_its_standard_error():
    results = {
        "entropy_rate": {"test_ppl": 150.0, "entrate_ppl": 170.0, "tail_nats": 5.1, "tail_stderr_nats": 0.02},
        "calibration": {"alpha": -0.05, "alpha_stderr": 0.01, "test_ppl_before": 150.0, "test_ppl_after": 149.5,
                        "entrate_ppl_before": 170.0, "entrate_ppl_after": 160.0, "tail_ppl_before": 168.0,
                        "tail_ppl_after": 161.0, "tail_diff_nats": -0.04, "tail_diff_stderr_nats": 0.01},
        "decoders": {"rows": [{"method": "top_p", "params": {"p": 0.9}, "entrate_ppl": 80.0, "test_ce_nats": None,
                               "zero_prob_fraction": 0.1, "tail_diff_nats": -0.7, "tail_diff_stderr_nats": 0.05}]},
        "model": "m", "device": "cpu"}
    rows = result_rows(results)
    assert ("entropy_rate", "tail_nats", 5.1, 0.02) in rows and ("calibration", "alpha", -0.05, 0.01) in rows
    assert ("decoders", "top_p: tail_diff_nats", -0.7, 0.05) in rows
    assert ("entropy_rate", "test_ppl", 150.0, None) in rows
    assert not any("stderr" in m for _, m, _, _ in rows) and not any(s == "model" for s, *_ in rows)
    md = results_markdown(rows).splitlines()
    assert md[0] == "| stage | metric | value | ± se |" and "| calibration | alpha | -0.0500 | ± 0.0100 |" in md


def test_method_labels_keep_what_the_user_chose_and_drop_what_a_fit_chose():
    assert method_label("top_p", {"p": 0.95}) == "top_p (p=0.95)"
    assert method_label("temperature", {"temperature": 0.8}) == "temperature (temperature=0.8)"
    fitted = {"temperature": 1.009, "temperature_stderr": 0.01}
    assert method_label("fitted_temperature", fitted) == "fitted_temperature"
    assert method_label("calibration", {"alpha": -0.6418, "alpha_stderr": 0.1, "topk": 8}) == "calibration"
    assert method_label("future_entropy", {"horizon_k": 5, "discount": 0.95, "alpha": 2.5}) == \
        "future_entropy (horizon_k=5, discount=0.95)"


def test_the_claims_table_prints_a_dash_for_a_number_not_fitted_and_says_why():
    """A scale fit that was not fitted (a gap <= 0, df < 2, or an earlier report that left runs out) has no exponent
    or interval: its row shows dashes, not nan, and its verdict cell the fit's reason; a fitted one its t-interval."""
    from lmcal.reporting.claim import Claim
    from lmcal.reporting.claims_table import claim_row, claim_rows

    why = "1 of 9 runs have gap <= 0: AWD-LSTM 2, seed 143"
    fits = {"params": {"axes": ["params"], "error": why, "sign": 1.0, "n_runs": 9, "df": 7, "interval": "t",
                       "reference": -0.05},
            "data_tokens": {"axes": ["data_tokens"], "sign": -1.0, "n_runs": 9, "df": 7, "interval": "t",
                            "level": 0.95, "exponents": {"data_tokens": -0.5}, "ci": {"data_tokens": [-0.7, -0.3]},
                            "reference": -0.5},
            "train_tokens": {"axes": ["train_tokens"], "sign": 1.0, "n_runs": 4, "exponents": {"train_tokens": 0.1},
                             "ci": {"train_tokens": [0.0, 0.2]}, "level": 0.95, "excluded": ["T 2x128"],
                             "reference": -0.05}}  # an earlier report's, fitted on the runs of positive gap
    rows = claim_rows({"groups": [{"label": "T", "fits": fits}]})
    assert rows[0][:5] == ("T: gap ~ params^b", "-0.050 (CVL)", "–", "–", f"undecided (not fitted: {why})")
    assert rows[1][:5] == ("T: -gap ~ data_tokens^b", "-0.500 (CVL)", "-0.500", "[-0.700, -0.300] (95% t, 7 df)",
                           "yes (falls); against CVL's: consistent")
    assert rows[2][2:4] == ("–", "–") and rows[2][4].startswith("undecided (not fitted: 1 run(s) with gap <= 0")
    assert not any("nan" in cell for row in rows for cell in row)
    c = Claim("best_head_within", "untested", "", {"level_nats": math.nan, "se": math.nan, "ref_ppl": math.nan})
    assert claim_row(c)[1:4] == ("–", "–", "–") and "nan" not in claim_row(c)[0]
