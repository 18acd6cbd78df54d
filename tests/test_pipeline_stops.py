"""The pipeline stopped or damaged (issue 29): stage records and results that do not parse mean "not done", with a
warning naming the file; SIGTERM and SIGHUP stop `python -m lmcal.reproduce` as Ctrl-C does: the stages' process
groups ended, the lock and temporary files removed, one line on how to resume, and the rerun not refused."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcal.pipeline.schedule import schedule
from lmcal.pipeline.signals import gone
from lmcal.utils.io import temp_path
from lmcal.utils.lock import LOCK_NAME, sweep_temp_files


def _toy_plan(out: Path) -> list[dict]:
    """Two stages: `a` (a process that writes a/a.json) and the in-process `report` (writes results.json)."""
    def report(cfg, out):
        (out / "results.json").write_text(json.dumps({"ok": 1}))

    a = out / "a"
    return [{"name": "a", "dir": a, "done": [a / "a.json"], "deps": [],
             "cmd": [sys.executable, "-c", f"import pathlib; p = pathlib.Path({str(a)!r}); p.mkdir(exist_ok=True); "
                                           "(p / 'a.json').write_text('{}')"]},
            {"name": "report", "dir": out, "done": [out / "results.json"], "fn": report, "deps": ["a"]}]


def _schedule(out, capsys):
    schedule(_toy_plan(out), None, out, {"a": {}, "report": {}}, 1, {})
    return capsys.readouterr()


@pytest.mark.parametrize("damage", ["truncated", "list"])
def test_a_stage_record_that_does_not_parse_means_not_done(damage, tmp_path, capsys):
    _schedule(tmp_path, capsys)
    rec = tmp_path / "stages" / "a.json"
    rec.write_text(rec.read_text()[:20] if damage == "truncated" else "[1, 2]")
    r = _schedule(tmp_path, capsys)
    assert f"warning: {rec} does not parse" in r.err
    assert "a: running" in r.out and "a: done before" not in r.out
    assert json.loads(rec.read_text())["status"] == "done"


def test_a_truncated_results_json_is_redone_not_skipped(tmp_path, capsys):
    _schedule(tmp_path, capsys)
    res = tmp_path / "results.json"
    res.write_text('{"ok": ')
    r = _schedule(tmp_path, capsys)
    assert f"warning: {res} does not parse" in r.err and "report: running" in r.out
    assert json.loads(res.read_text()) == {"ok": 1}
    assert "done before, skipped" in _schedule(tmp_path, capsys).out  # and a whole one is skipped


def test_the_report_runs_again_when_the_files_other_runs_add_beside_a_stage_change(tmp_path, capsys):
    # e.g. dose_rows_*.json beside calibration.json, after the pipeline finished: the report takes them in on the
    # next run, without FORCE and without running any stage again
    cal = tmp_path / "cal"
    cal.mkdir()

    def report(cfg, out):
        (out / "results.json").write_text(json.dumps({"rows": len(list(cal.glob("dose_rows_*.json")))}))

    def run():
        plan = _toy_plan(tmp_path)
        plan[1] |= {"fn": report, "inputs": [cal / "dose_rows_*.json"]}
        schedule(plan, None, tmp_path, {"a": {}, "report": {}}, 1, {})
        return capsys.readouterr().out, json.loads((tmp_path / "results.json").read_text())["rows"]

    out, rows = run()
    assert "report: running" in out and rows == 0
    out, rows = run()
    assert "report: done before, skipped" in out and rows == 0
    (cal / "dose_rows_gpu.json").write_text("{}")
    (cal / "other.json").write_text("{}")  # not an input
    out, rows = run()
    assert "a: done before, skipped" in out and "report: running" in out and rows == 1
    out, rows = run()
    assert "report: done before, skipped" in out and rows == 1
    (cal / "dose_rows_gpu.json").write_text('{"rows": []}')  # rewritten: another size
    assert "report: running" in run()[0]
    (cal / "dose_rows_gpu.json").unlink()
    out, rows = run()
    assert "report: running" in out and rows == 0


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def test_temporary_files_of_dead_processes_are_swept(tmp_path):
    dead = tmp_path / "x" / f".results.json.{_dead_pid()}.0123abcd.tmp"
    mine = temp_path(tmp_path / "x" / "metrics.json")  # this process, alive: kept
    dead.parent.mkdir()
    dead.write_text("half")
    mine.write_text("half")
    assert sweep_temp_files(tmp_path) == [dead]
    assert not dead.exists() and mine.exists()


def _reproduce(out: Path, tmp_path: Path) -> subprocess.Popen:
    """A smoke reproduction on a synthetic corpus (no PTB needed): its first stages are trainings that take a while."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "lmcal.reproduce", "profile=smoke", f"out={out}", "logger=none",
           "base=[experiment=smoke,data.name=synthetic,trainer.max_epochs=50]"]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _stage_pids(out: Path, timeout: float = 240, old: tuple = ()) -> list[int]:
    """The PIDs of the trainings running under `out`, from their run locks (once both base stages hold theirs; not
    `old` ones, nor locks that processes which ended left behind)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        locks = [p for p in out.rglob(LOCK_NAME) if p.parent != out]
        pids = []
        for lock in locks:
            try:
                pids.append(json.loads(lock.read_text())["pid"])
            except (OSError, ValueError, KeyError):
                pass
        pids = [pid for pid in pids if pid not in old and _alive(pid)]
        if len(pids) >= 2:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"no training started under {out}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_the_pipeline_and_its_stages(sig, tmp_path):
    out = tmp_path / "out"
    p = _reproduce(out, tmp_path)
    children = _stage_pids(out)
    dead = out / f".profile.yaml.{_dead_pid()}.0123abcd.tmp"  # left by a killed run: swept by the next
    dead.write_text("half")
    os.kill(p.pid, sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"Stopped by {signal.Signals(sig).name}: rerun the same command to "
                                            "resume; finished stages are kept.")
    assert "Traceback" not in err
    assert not any(_alive(pid) for pid in children)
    assert not list(out.rglob(LOCK_NAME))  # the pipeline's, and its stages' (they stop as on Ctrl-C too)
    assert not [f for f in out.rglob("*.tmp") if f != dead]
    if sig != signal.SIGTERM:
        return  # the rerun after a stop is the same whichever signal stopped it: checked once

    again = _reproduce(out, tmp_path)  # not refused by a lock, and it sweeps the dead run's temporary file
    _stage_pids(out, old=tuple(children))
    assert again.poll() is None and not dead.exists()
    os.kill(again.pid, signal.SIGTERM)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 128 + signal.SIGTERM and "in use by another" not in err, err[-3000:]


# -- issue 41: records trusted only when whole; stops during training; a pipeline whose make is killed -----------------


def _memory_plan(out: Path) -> list[dict]:
    """One stage whose done file is a memory.json (whole: every key the report reads), then the report."""
    from lmcal.reporting.results import NEEDS

    whole = {k: (5 if k == "tau" else "trained" if k == "limited" else 0.5) for k in NEEDS["memory.json"]}
    a = out / "a"
    return [{"name": "a", "dir": a, "done": [a / "memory.json"], "deps": [],
             "cmd": [sys.executable, "-c", f"import pathlib, json; p = pathlib.Path({str(a)!r}); p.mkdir(exist_ok="
                                           f"True); (p / 'memory.json').write_text(json.dumps({whole!r}))"]},
            {"name": "report", "dir": out, "done": [out / "results.json"], "fn": _toy_plan(out)[1]["fn"],
             "deps": ["a"]}]


@pytest.mark.parametrize("damage", ["{}", '{"tau": "five"}'])
def test_a_result_that_lacks_what_its_readers_need_means_not_done(damage, tmp_path, capsys):
    for _ in range(2):
        schedule(_memory_plan(tmp_path), None, tmp_path, {"a": {}, "report": {}}, 1, {})
    assert "a: done before" in capsys.readouterr().out  # whole: skipped
    res = tmp_path / "a" / "memory.json"
    res.write_text(damage)
    schedule(_memory_plan(tmp_path), None, tmp_path, {"a": {}, "report": {}}, 1, {})
    r = capsys.readouterr()
    assert f"warning: {res} is not whole" in r.err and ("lacks" in r.err or "tau is a str" in r.err)
    assert "a: running" in r.out and json.loads(res.read_text())["tau"] == 5


@pytest.mark.parametrize("record", [{"status": "done", "settings": [1, 2]}, {"settings": {}}, {"status": 3}])
def test_a_stage_record_of_the_wrong_types_means_not_done(record, tmp_path, capsys):
    _schedule(tmp_path, capsys)
    rec = tmp_path / "stages" / "a.json"
    rec.write_text(json.dumps(record))
    r = _schedule(tmp_path, capsys)
    assert f"warning: {rec} is not whole" in r.err and "a: running" in r.out


def test_train_sweeps_the_temporary_files_of_dead_processes(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    dead = _dead_pid()
    half = run / "checkpoints" / f".best.ckpt.{dead}.0123abcd.tmp"
    half.write_bytes(b"half a checkpoint")
    (run / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "what": "training"}))
    r = subprocess.run([sys.executable, "-m", "lmcal.train", "experiment=smoke", "logger=none", *SYNTHETIC,
                        "init_ckpt=/nonexistent_41.ckpt", f"hydra.run.dir={run}"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "WANDB_MODE": "disabled"})
    assert r.returncode == 2 and "init_ckpt=/nonexistent_41.ckpt does not exist" in r.stderr, r.stderr[-2000:]
    assert "taking over a stale lock" in r.stdout + r.stderr and "Removed 1 temporary file" in r.stdout + r.stderr
    assert not half.exists() and not (run / LOCK_NAME).exists()


SYNTHETIC = ["data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, "
                                    "n_test: 3000}"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_training_stopped_during_fit_ends_with_lmcals_line(sig, tmp_path):
    run, err, log = tmp_path / "run", tmp_path / "err.txt", tmp_path / "out.txt"
    with open(err, "w") as f, open(log, "w") as o:
        p = subprocess.Popen([sys.executable, "-m", "lmcal.train", "experiment=smoke", "logger=none", *SYNTHETIC,
                              "trainer.max_epochs=500", "trainer.enable_model_summary=true", "analysis.stages=[]",
                              "trainer.enable_progress_bar=false", f"hydra.run.dir={run}"], cwd=tmp_path, stdout=o,
                             stderr=f, env={**os.environ, "WANDB_MODE": "disabled"},
                             # Ctrl-C's SIGINT as a terminal sends it: a shell's background job (CI started with &)
                             # passes SIGINT on ignored, and Python then never raises KeyboardInterrupt
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.time() + 600
            while "Trainable params" not in log.read_text():  # Lightning's model summary: trainer.fit has started
                assert time.time() < deadline and p.poll() is None, err.read_text()[-2000:]
                time.sleep(0.2)
            time.sleep(2)  # in trainer.fit's loop
            p.send_signal(sig)
            p.wait(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
    text, out = err.read_text(), log.read_text()
    assert p.returncode == (143 if sig == signal.SIGTERM else 130), text[-2000:]
    assert text.strip().splitlines()[-1] == (
        "Stopped by SIGTERM: rerun the same command to resume from the last checkpoint." if sig == signal.SIGTERM
        else "Interrupted: rerun the same command to resume from the last checkpoint.")
    assert "Traceback" not in text
    assert not any(s in text + out for s in ("Received SIGTERM", "Detected KeyboardInterrupt", "Bypassing SIGTERM"))
    assert not (run / LOCK_NAME).exists() and not list(run.rglob("*.tmp"))


@pytest.mark.slow
def test_a_pipeline_whose_make_is_killed_ends_itself(tmp_path):
    """kill -9 of the `make` (here: a stand-in parent that sets LMCAL_WATCH_PID as the Makefile does) under a
    reproduction: the pipeline stops its stages and releases its lock, not running on as an orphan."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lmcal.reproduce", "profile=smoke", f"out={out}", "logger=none",
           "base=[experiment=smoke,data.name=synthetic,trainer.max_epochs=50]"]
    parent = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys; subprocess.Popen(sys.argv[1:], "
                               "env={**os.environ, 'LMCAL_WATCH_PID': str(os.getpid())}); import time; "
                               "time.sleep(3600)", *cmd], cwd=tmp_path, env={**os.environ, "WANDB_MODE": "disabled"},
                              start_new_session=True, stderr=subprocess.PIPE, text=True)
    children = _stage_pids(out)
    pipeline = json.loads((out / LOCK_NAME).read_text())["pid"]
    parent.kill()
    parent.wait()
    deadline = time.time() + 120
    while not gone(pipeline) and time.time() < deadline:
        time.sleep(0.5)
    assert gone(pipeline) and all(gone(pid) for pid in children)
    assert not list(out.rglob(LOCK_NAME))
    err = parent.stderr.read()
    assert "make, process" in err and "Stopped by SIGTERM" in err, err[-2000:]


def test_make_reproduce_tells_the_pipeline_to_watch_make():
    recipe = Path(__file__).resolve().parents[1].joinpath("Makefile").read_text().split("\nreproduce:")[1]
    assert "LMCAL_WATCH_PID=$$PPID" in recipe.split("\n\n")[0]
