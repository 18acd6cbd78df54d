"""`python -m lmcal.report` over a reproduction's folder: the pipeline's own stage records (<out>/stages/<stage>.json)
share their names with stage results (decoders.json) and are not read as results."""

import json
import subprocess
import sys

from lmcal.reporting.tabulate import collect_decoders

ROW = {"method": "plain", "params": {}, "entrate_ppl": 120.0, "test_ce_nats": 4.8, "zero_prob_fraction": 0.0,
       "test_ce_mixed_nats": 4.8, "test_ce_kept_nats": 4.8, "entropy_t1_nats": 4.7, "entropy_last_nats": 4.9,
       "stderr_nats": [0.01, 0.02]}


def _reproduction(out):
    (out / "ptb" / "decoders").mkdir(parents=True)
    (out / "ptb" / "decoders" / "decoders.json").write_text(json.dumps({"corpus": "ptb", "model": "m", "rows": [ROW]}))
    (out / "stages").mkdir()
    (out / "stages" / "decoders.json").write_text(json.dumps({"status": "done", "seconds": 3.0, "cmd": ["python"],
                                                              "settings": {}}))
    (out / "profile.yaml").write_text("profile: smoke\n")
    return out


def test_a_reproductions_stage_records_are_not_read_as_results(tmp_path):
    out = _reproduction(tmp_path / "smoke")
    rows = collect_decoders([out])
    assert list(rows) == ["ptb"] and [r["path"] for r in rows["ptb"]] == [str(out / "ptb" / "decoders" /
                                                                           "decoders.json")]
    r = subprocess.run([sys.executable, "-m", "lmcal.report", str(out), "--out", str(tmp_path / "report")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "report" / "decoders_ptb.md").is_file()


def test_a_decoders_json_without_what_the_table_reads_is_one_paragraph(tmp_path):
    """A row lacking the t = 1 entropy the table prints: refused naming the key, not a KeyError traceback."""
    (tmp_path / "d").mkdir()
    row = {k: v for k, v in ROW.items() if k != "entropy_t1_nats"}
    (tmp_path / "d" / "decoders.json").write_text(json.dumps({"corpus": "ptb", "model": "m", "rows": [row]}))
    r = subprocess.run([sys.executable, "-m", "lmcal.report", str(tmp_path / "d"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("lmcal: error:") and "entropy_t1_nats" in r.stderr


def test_a_decoders_json_whose_stderr_is_not_a_curve_is_one_paragraph(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "decoders.json").write_text(json.dumps({"corpus": "ptb", "model": "m",
                                                              "rows": [{**ROW, "stderr_nats": 0.01}]}))
    r = subprocess.run([sys.executable, "-m", "lmcal.report", str(tmp_path / "d"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "rows[0].stderr_nats is the number 0.01, not a list" in r.stderr


def test_a_stages_folder_outside_a_reproduction_is_still_read(tmp_path):
    """Only a reproduction's record folder is left out: a user's own run folder named stages/ is read."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "decoders.json").write_text(json.dumps({"corpus": "ptb", "model": "m", "rows": [ROW]}))
    assert list(collect_decoders([tmp_path])) == ["ptb"]


def test_two_runs_of_one_architecture_are_two_models_in_the_decoders_report(tmp_path, monkeypatch):
    """issue 43's scale sweep trains each size on two budgets; their decoders.json share the model's label, and the
    report kept one of each pair (half the models lost). A model is its label and its own test CE: both are kept,
    named apart in the table, one colour each in the figure; a decoder sweep of one checkpoint still keeps its plain
    row once."""
    from lmcal.reporting.tabulate import decoders_report
    from lmcal.stages import plots

    for name, ce in (("small", 6.5), ("large", 5.4), ("large_again", 5.4)):
        (tmp_path / name).mkdir()
        rows = [{**ROW, "method": "model", "test_ce_nats": ce, "test_ce_mixed_nats": ce}]
        (tmp_path / name / "decoders.json").write_text(json.dumps({"corpus": "ptb", "model": "AWD-LSTM 50/100/3",
                                                                   "reference_test_ce_nats": ce, "rows": rows}))
    rows = collect_decoders([tmp_path])["ptb"]
    names = ["AWD-LSTM 50/100/3 (test CE 5.400)", "AWD-LSTM 50/100/3 (test CE 6.500)"]
    assert sorted(r["model"] for r in rows) == names
    figs = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figs.append(fig), real_save(fig, path))[1])
    decoders_report([tmp_path], tmp_path / "out")
    table = (tmp_path / "out" / "decoders_ptb.md").read_text()
    assert "| model | method |" in table and all(f"{n} | model |" in table for n in names)
    legend = [t.get_text() for t in figs[-1].axes[0].get_legend().get_texts()]
    assert legend == [*names, "model"]
