"""A record is read only when it is whole (issue 77, item 3): every JSON file lmcal reads back goes through one check
(lmcal.utils.records), and a hostile value (another type, NaN or Infinity, an integer beyond 64 bits, nesting 100,000
deep, an empty list where a fit needs one, a file too large or not UTF-8) is one paragraph naming the file and the
key, with nothing written. In-process for every reader; through `python -m lmcal.report` and `python -m lmcal.docs
--snapshot` in subprocesses, where the exit code, stderr and the files left matter."""

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from lmcal.errors import LmcalError
from lmcal.utils import records
from tests.test_hostile_inputs import assert_one_paragraph, run

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "cpu_results_2026-11-24.json"
DEEP = "[" * 100_000 + "]" * 100_000
# a value put where a number belongs (JSON text, as a file would hold it)
HOSTILE = {"text": '"many"', "list": "[]", "object": "{}", "bool": "true", "null": "null", "nan": "NaN",
           "inf": "Infinity", "-inf": "-Infinity", "overflow": "1e400", "huge_int": str(10**400), "deep": DEEP}
H = "@@hostile@@"

MEMORY = {"tau": 5, "corpus": "ptb", "model": "m", "ce_limited_nats": H, "mi_upper_bound_nats": 0.5,
          "mi_stderr_nats": 0.01, "alpha": 0.001, "alpha_stderr": 0.002, "entropy_calibrated_nats": 4.5,
          "test_tokens": 100, "cluster_size": 10}
ROW = {"method": "plain", "params": {}, "entrate_ppl": 120.0, "test_ce_nats": 4.8, "zero_prob_fraction": 0.0,
       "test_ce_mixed_nats": 4.8, "test_ce_kept_nats": 4.8, "entropy_t1_nats": H, "entropy_last_nats": 4.9,
       "stderr_nats": [0.01, 0.02]}


def scale(**kw) -> dict:
    r = {"model": "m", "family": "f", "corpus": "c", "unit": "word", "params": 1000, "train_tokens": 10000,
         "test_ce_nats": 3.0, "tail_nats": 3.2, "tail_stderr_nats": 0.1, "gap_nats": 0.2, "gap_stderr_nats": 0.1,
         "tail_nats_per_prefix": [3.1, 3.3], "effects": {}, "num_prefixes": 2, "samples_per_prefix": 1,
         "prefix_len": 5, "horizon": 10}
    return r | kw


def _entropy_rate() -> dict:
    return {"horizon": 3, "num_generations": 2, "curve_nats": [1.0, 2.0, 3.0], "stderr_nats": [0.1, 0.1, 0.1],
            "entrate_ppl": H, "test_ppl": 20.0}


def _results() -> dict:
    r = json.loads(FIXTURE.read_text())
    r["entropy_rate"]["test_ppl"] = H
    return r


def _text(record, raw: str) -> str:
    return json.dumps(record).replace(json.dumps(H), raw)


def _snapshot(folder: Path) -> Path:
    (folder / "REPORT.md").write_text("# r\n")
    from lmcal.reporting.docs import check_snapshot

    return check_snapshot(folder)


def _bench(folder: Path):
    from lmcal.reporting.docs import bench_rows

    return bench_rows(folder)


def _readers():
    """(name, file under the folder, a whole record with H where a number belongs, the read of the folder)."""
    from lmcal.reporting import results, runs_table, scale_report, tabulate
    from lmcal.stages import stage

    return [
        ("memory.json", "memory.json", MEMORY, lambda d: tabulate.collect_memory([d])),
        ("decoders.json", "decoders.json", {"corpus": "ptb", "rows": [ROW]}, lambda d: tabulate.collect_decoders([d])),
        ("scale.json", "scale.json", scale(test_ce_nats=H), lambda d: scale_report.collect_scale([d])),
        ("metrics.json (runs table)", "metrics.json", {"val_ppl": 2.0, "test_ppl": 2.0, "wall_seconds": H},
         lambda d: runs_table.collect_runs([d])),
        ("metrics.json (scale wall time)", "metrics.json", {"wall_seconds": H}, scale_report.run_seconds),
        ("entropy_rate.json (reproduction)", "entropy_rate.json", _entropy_rate(),
         lambda d: results.read_json(d / "entropy_rate.json")),
        ("evaluation.json (stage profile)", "evaluation.json",
         {"entropy_rate": {"profile": {"seconds": H, "spans": {}}}}, results.stage_profile),
        ("dose rows", "dose_rows_gpu.json", {"rows": [{"multiple": 1.0}], "own_fit": {"alpha": 1.0}, "device": H},
         results.dose_row_files),
        ("results.json (docs snapshot)", "results.json", _results(), _snapshot),
        ("bench summary", "bench/study.json", {"label": "x", "tail_nats": H, "test_ppl": 60.0}, _bench),
        ("a stage's result (analysis.<stage>.<use>_json)", "sequence_calibration.json", {"law_horizon": H},
         lambda d: stage.read_result(str(d / "sequence_calibration.json"), "sequence_calibration", "extend_json")),
    ]


READERS = [name for name, *_ in _readers()]
# (the device is a text: that one is no hostile value there; a stage's result is any object of sound numbers)
TEXT_FITS = {"dose rows": {"text"},
             "a stage's result (analysis.<stage>.<use>_json)": {"text", "list", "object", "bool", "null"}}
NULL_FITS = {"memory.json": set(), "metrics.json (runs table)": {"null"}, "metrics.json (scale wall time)": {"null"},
             "entropy_rate.json (reproduction)": {"null"}, "results.json (docs snapshot)": {"null"}}


def _reader(name):
    return next(r for r in _readers() if r[0] == name)


def _whole(name: str, record) -> str:
    """The record, whole: a number where H stands (a device's name for the dose rows)."""
    return _text(record, '"cuda"' if name == "dose rows" else "60.5")


@pytest.mark.parametrize("value", sorted(HOSTILE))
@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_a_hostile_value_in_one_paragraph(reader, value, tmp_path):
    name, file, record, read = _reader(reader)
    if value in TEXT_FITS.get(name, set()) | NULL_FITS.get(name, set()):
        pytest.skip(f"{value} fits that key")
    path = tmp_path / file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_text(record, HOSTILE[value]))
    with pytest.raises(LmcalError) as e:
        read(tmp_path)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg.strip(), msg
    if value != "deep":  # (a nest too deep to parse has no key to name)
        key = next(k for k, v in _flat(record) if v == H)
        assert key in msg, (key, msg)


def _flat(record, key=""):
    items = record.items() if isinstance(record, dict) else enumerate(record) if isinstance(record, list) else ()
    for k, v in items:
        sub = f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}" if key else k
        yield sub, v
        yield from _flat(v, sub)


@pytest.mark.parametrize("damage", ["[]", "NaN", "truncated", "deep", "latin1", "too large"])
@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_a_file_that_is_no_record(reader, damage, tmp_path, monkeypatch):
    name, file, record, read = _reader(reader)
    whole = _whole(name, record)
    text = {"[]": "[]", "NaN": "NaN", "truncated": whole[: len(whole) // 2], "deep": DEEP,
            "latin1": None, "too large": whole}[damage]
    path = tmp_path / file
    path.parent.mkdir(parents=True, exist_ok=True)
    if damage == "latin1":
        path.write_bytes(whole.replace('"', '"caf\xe9', 1).encode("latin-1"))
    else:
        path.write_text(text)
    if damage == "too large":
        monkeypatch.setattr(records, "MAX_BYTES", len(whole) - 1)
    with pytest.raises(LmcalError, match="is not"):
        read(tmp_path)


def test_a_whole_record_is_read_by_every_reader(tmp_path):
    """The records above, whole (a number where H stands), pass: the check refuses only what is not whole."""
    for name, file, record, read in _readers():
        d = tmp_path / name.replace(" ", "_").replace("(", "").replace(")", "")
        (d / file).parent.mkdir(parents=True, exist_ok=True)
        (d / file).write_text(_whole(name, record))
        read(d)


@pytest.mark.parametrize("value", ["text", "nan", "huge_int", "deep", "list"])
def test_a_stage_record_that_is_not_whole_means_not_done(value, tmp_path, capsys):
    """A stage's record under stages/: not done, with a warning naming it (its stage runs again), never a
    traceback."""
    from lmcal.reporting.results import stage_record

    path = tmp_path / "a.json"
    path.write_text(_text({"status": "done", "settings": {}, "seconds": H}, HOSTILE[value]))
    assert stage_record(path) is None
    err = capsys.readouterr().err
    assert f"warning: {path}" in err and "runs again" in err


@pytest.mark.parametrize("pid", [10**30, 0, -1, 2**31, "7", True, 1.5])
def test_a_lock_naming_no_process_holds_nothing(pid, tmp_path, caplog):
    from lmcal.utils.lock import LOCK_NAME, holder_of, live_holder, run_lock, sweep_temp_files

    body = json.dumps({"pid": pid, "host": socket.gethostname(), "what": "training"})
    assert holder_of(body)[0] is None and "pid" in holder_of(body)[1]
    lock = tmp_path / LOCK_NAME
    lock.write_text(body)
    os.utime(lock, (0, 0))  # (older than a lock being written)
    assert live_holder(tmp_path) is None
    (tmp_path / f".x.{10**30}.abcdef12.tmp").write_text("half")
    sweep_temp_files(tmp_path)  # (no OverflowError: no process has that id)
    with run_lock(tmp_path):
        pass
    assert "holds no lmcal lock" in caplog.text and not lock.exists()


def test_a_folder_where_the_lock_goes_is_named_as_such(tmp_path):
    from lmcal.utils.lock import LOCK_NAME, live_holder, run_lock

    (tmp_path / LOCK_NAME).mkdir()
    for call in (lambda: live_holder(tmp_path), lambda: run_lock(tmp_path).__enter__()):
        with pytest.raises(LmcalError, match="is a folder where lmcal's lock file goes"):
            call()


def test_train_refuses_a_lock_folder_before_writing_anything(tmp_path):
    out = tmp_path / "run"
    (out / ".lmcal.lock").mkdir(parents=True)
    r = run("lmcal.train", ["experiment=smoke", "logger=none", "data.name=synthetic", f"hydra.run.dir={out}"],
            tmp_path)
    assert_one_paragraph(r, str(out / ".lmcal.lock"), "is a folder")
    assert [p.name for p in out.iterdir()] == [".lmcal.lock"]  # no .hydra/, no train.log


def test_two_models_memory_rows_are_kept_apart(tmp_path):
    """A smoke reproduction's AWD-LSTM and transformer window rows at one tau: both kept, each its model's."""
    from lmcal.reporting.tabulate import collect_memory, memory_report

    for where, model in (("ptb", "AWD-LSTM"), ("transformer", "Transformer")):
        p = tmp_path / where / "memory" / "window_tau_2" / "memory.json"
        p.parent.mkdir(parents=True)
        p.write_text(_text({**MEMORY, "tau": 2, "limited": "window", "model": model}, "5.0"))
    rows = collect_memory([tmp_path])["ptb"]
    assert sorted(r["model"] for r in rows) == ["AWD-LSTM", "Transformer"]
    rep = memory_report([tmp_path], tmp_path / "out", wandb_mode="disabled")
    assert sorted(r["model"] for r in rep["ptb"]["rows"]) == ["AWD-LSTM", "Transformer"]
    assert "## AWD-LSTM" in (tmp_path / "out" / "memory_ptb.md").read_text()


# -- through the entry points --------------------------------------------------------------------------------------

GOOD = json.dumps(scale())
OTHER = json.dumps(scale(params=3000, train_tokens=30000, tail_nats_per_prefix=[3.0, 3.5]))
METRICS = json.dumps({"val_ppl": 2.0, "test_ppl": 2.0})
REPORT_CASES = {
    "scale NaN": ({"a/scale.json": GOOD.replace('"gap_nats": 0.2', '"gap_nats": NaN'), "b/scale.json": OTHER}, [],
                  "gap_nats"),
    "scale Infinity": ({"a/scale.json": GOOD.replace("3.1, 3.3", "Infinity, 1"), "b/scale.json": OTHER}, [],
                       "tail_nats_per_prefix[0]"),
    "params 0, no tail": ({"a/scale.json": json.dumps(scale(params=0, tail_nats_per_prefix=[])), "b/scale.json": OTHER},
                          [], "params"),
    "empty tail": ({"a/scale.json": json.dumps(scale(tail_nats_per_prefix=[])), "b/scale.json": OTHER}, [],
                   "tail_nats_per_prefix"),
    "params a text": ({"a/scale.json": json.dumps(scale(params="big")), "b/scale.json": OTHER}, [], "params"),
    "params 10**400": ({"a/scale.json": json.dumps(scale(params=10**400)), "b/scale.json": OTHER}, [], "params"),
    "metrics a text": ({"a/metrics.json": json.dumps({"val_ppl": 2.0, "wall_seconds": "long"})}, [], "wall_seconds"),
    "deep scale": ({"a/metrics.json": METRICS, "a/scale.json": DEEP}, [], "scale.json"),
    "deep metrics": ({"a/metrics.json": '{"val_ppl": ' + DEEP + "}"}, [], "metrics.json"),
    "truncated scale": ({"a/metrics.json": METRICS, "a/scale.json": GOOD[:40]}, [], "scale.json"),
    "memory NaN bound, inf alpha": ({"a/memory.json": _text(MEMORY, "5.0").replace('"mi_upper_bound_nats": 0.5',
                                     '"mi_upper_bound_nats": NaN').replace('"alpha": 0.001', '"alpha": Infinity')},
                                    [], "memory.json"),
    "bootstrap -1": ({"a/scale.json": GOOD, "b/scale.json": OTHER}, ["--bootstrap", "-1"], "--bootstrap"),
    "bootstrap 0": ({"a/scale.json": GOOD, "b/scale.json": OTHER}, ["--bootstrap", "0"], "--bootstrap"),
    "bootstrap 1.5": ({"a/scale.json": GOOD, "b/scale.json": OTHER}, ["--bootstrap", "1.5"], "--bootstrap"),
}


@pytest.mark.parametrize("case", sorted(REPORT_CASES))
def test_report_refuses_before_writing_anything(case, tmp_path):
    files, extra, needle = REPORT_CASES[case]
    runs, out = tmp_path / "runs", tmp_path / "out"
    for rel, text in files.items():
        (runs / rel).parent.mkdir(parents=True, exist_ok=True)
        (runs / rel).write_text(text)
    before = sorted(runs.rglob("*"))
    r = run("lmcal.report", [str(runs), "--out", str(out), "--wandb", "disabled", *extra], tmp_path)
    assert_one_paragraph(r, needle)
    assert not out.exists() and sorted(runs.rglob("*")) == before


@pytest.mark.slow
def test_report_refuses_a_huge_scale_json_before_writing_runs_md(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "metrics.json").write_text(METRICS)
    with open(runs / "a" / "scale.json", "w") as f:
        f.write('{"model": "' + "m" * (records.MAX_BYTES + 10) + '"}')
    r = run("lmcal.report", [str(runs), "--out", str(out), "--wandb", "disabled"], tmp_path)
    assert_one_paragraph(r, "scale.json", "MiB")
    assert not out.exists()


SNAPSHOT_CASES = {
    "profile only": json.dumps({"profile": "cpu"}),
    "stages an integer": None,  # (the fixture's, with stages: 3)
    "deep": '{"profile": "cpu", "x": ' + DEEP + "}",
    "NaN": None,
    "huge integer": None,
}


@pytest.mark.parametrize("case", sorted(SNAPSHOT_CASES))
def test_docs_snapshot_checks_the_whole_snapshot_before_touching_docs(case, tmp_path):
    docs, fake = tmp_path / "docs", tmp_path / "FAKE"
    for sub in ("runs", "bench"):
        shutil.copytree(ROOT / "docs" / sub, docs / sub)
    (docs / "RESULTS.md").write_text("the one before\n")
    fake.mkdir()
    whole = json.loads(FIXTURE.read_text()) | {"profile": "cpu"}
    text = SNAPSHOT_CASES[case] or {
        "stages an integer": json.dumps(whole | {"stages": 3}),
        "NaN": json.dumps(whole | {"x": float("nan")}),
        "huge integer": json.dumps(whole | {"dataset": 10**400})}[case]
    (fake / "results.json").write_text(text)
    (fake / "REPORT.md").write_text("# fake\n")
    before = {p: p.read_bytes() for p in docs.rglob("*") if p.is_file()}
    r = run("lmcal.docs", ["--snapshot", str(fake), "--docs", str(docs)], tmp_path)
    assert_one_paragraph(r, str(fake / "results.json"), "nothing was copied")
    assert {p: p.read_bytes() for p in docs.rglob("*") if p.is_file()} == before


def test_docs_refuses_a_bad_snapshot_already_in_docs_before_copying_a_new_one(tmp_path):
    docs, fake = tmp_path / "docs", tmp_path / "FAKE"
    (docs / "runs" / "old").mkdir(parents=True)
    (docs / "runs" / "old" / "results.json").write_text('{"profile": "old", "stages": NaN}')
    (docs / "runs" / "old" / "REPORT.md").write_text("# old\n")
    fake.mkdir()
    (fake / "results.json").write_text(json.dumps(json.loads(FIXTURE.read_text()) | {"profile": "cpu"}))
    (fake / "REPORT.md").write_text("# fake\n")
    r = run("lmcal.docs", ["--snapshot", str(fake), "--docs", str(docs)], tmp_path)
    assert_one_paragraph(r, str(docs / "runs" / "old" / "results.json"), "stages")
    assert sorted(p.name for p in (docs / "runs").iterdir()) == ["old"] and not (docs / "RESULTS.md").exists()


def test_the_report_reads_a_json_it_wrote_itself(tmp_path):
    """What lmcal writes (strict JSON: null and a reason for a non-finite number) is whole to its own readers."""
    from lmcal.utils.io import write_json_atomic

    write_json_atomic(tmp_path / "memory.json", {**MEMORY, "ce_limited_nats": 5.0, "alpha": float("inf")})
    r = records.read(tmp_path / "memory.json", {"alpha": records.Maybe(float)})
    assert r["alpha"] is None and r["alpha_nonfinite"] == "inf"
