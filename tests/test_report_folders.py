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
    assert r.returncode == 2 and "Traceback" not in r.stderr and "stderr_nats is not a list" in r.stderr


def test_a_stages_folder_outside_a_reproduction_is_still_read(tmp_path):
    """Only a reproduction's record folder is left out: a user's own run folder named stages/ is read."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "decoders.json").write_text(json.dumps({"corpus": "ptb", "model": "m", "rows": [ROW]}))
    assert list(collect_decoders([tmp_path])) == ["ptb"]
