"""The pipeline stopped or damaged (issue 29): stage records and results that do not parse mean "not done", with a
warning naming the file; SIGTERM and SIGHUP stop `python -m lmcal.reproduce` as Ctrl-C does: the stages' process
groups ended, the lock and temporary files removed, one line on how to resume, and the rerun not refused."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcal.pipeline.schedule import schedule
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

    again = _reproduce(out, tmp_path)  # not refused by a lock, and it sweeps the dead run's temporary file
    _stage_pids(out, old=tuple(children))
    assert again.poll() is None and not dead.exists()
    os.kill(again.pid, signal.SIGTERM)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 128 + signal.SIGTERM and "in use by another" not in err, err[-3000:]
