"""A failed stage stops only what needs its output (issue 76): the stages that do not need it run on and still start,
the failed one is recorded "failed", those that need it "not run", the pipeline ends with one table of them (exit
status 1 from `python -m lmcal.reproduce`), and a rerun runs only the failed stage and what needs it. Ctrl-C and an
error in the pipeline's own process still stop every stage."""

import json
import sys
from pathlib import Path

import pytest

from lmcal.pipeline import schedule as S
from lmcal.pipeline.schedule import StagesFailed, schedule
from lmcal.utils.lock import LOCK_NAME


@pytest.fixture(autouse=True)
def _no_speed_probe(monkeypatch):
    monkeypatch.setattr(S, "machine_gflops", lambda: 0.0)  # (it imports torch and times a matmul)


def _stage(out: Path, name: str, deps=(), sleep: float = 0.0, write_done: bool = True) -> dict:
    """A process that logs its name to out/ran.txt, sleeps, then exits 3 while out/broken_<name> exists, else writes
    its done file (unless not `write_done`)."""
    done = out / name / "done.txt"
    code = (f"import pathlib, sys, time; out = pathlib.Path({str(out)!r}); "
            f"open(out / 'ran.txt', 'a').write({name!r} + '\\n'); time.sleep({sleep}); "
            f"(out / 'broken_{name}').exists() and sys.exit(3); "
            + (f"d = out / {name!r}; d.mkdir(exist_ok=True); (d / 'done.txt').write_text('ok')" if write_done else ""))
    return {"name": name, "dir": out / name, "done": [done], "deps": list(deps), "cmd": [sys.executable, "-c", code]}


def _plan(out: Path, b_sleep: float = 0.0) -> list[dict]:
    """a (broken while out/broken_a exists), b beside it, c needs a, d needs b, e needs c and d, then the report."""
    def report(cfg, out):
        (out / "results.json").write_text(json.dumps({"ok": 1}))

    stages = [_stage(out, "a"), _stage(out, "b", sleep=b_sleep), _stage(out, "c", ["a"]), _stage(out, "d", ["b"]),
              _stage(out, "e", ["c", "d"])]
    return stages + [{"name": "report", "dir": out, "done": [out / "results.json"], "fn": report,
                      "deps": [st["name"] for st in stages]}]


def _run(out: Path, stages: list[dict], jobs: int = 1) -> None:
    schedule(stages, None, out, {st["name"]: {} for st in stages}, jobs, {})


def _ran(out: Path) -> list[str]:
    path = out / "ran.txt"
    names = path.read_text().split() if path.exists() else []
    path.unlink(missing_ok=True)
    return sorted(names)


def _record(out: Path, name: str) -> dict:
    return json.loads((out / "stages" / f"{name}.json").read_text())


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failed_stage_stops_only_the_stages_that_need_it(jobs, tmp_path, capsys):
    (tmp_path / "broken_a").touch()
    with pytest.raises(StagesFailed) as e:  # jobs=2: b is still running when a fails
        _run(tmp_path, _plan(tmp_path, b_sleep=1.0 if jobs == 2 else 0.0), jobs)
    assert list(e.value.failed) == ["a"]
    assert e.value.not_run == {"c": ["a"], "e": ["a"], "report": ["a"]}
    assert _ran(tmp_path) == ["a", "b", "d"]  # b and d run (d started after a failed, with jobs=1)
    assert all((tmp_path / n / "done.txt").is_file() for n in "bd") and not (tmp_path / "results.json").exists()
    rec = _record(tmp_path, "a")
    assert rec["status"] == "failed" and rec["rc"] == 3 and rec["why"] == "exit status 3"
    assert rec["log"] == str(tmp_path / "logs" / "a.log")
    assert [_record(tmp_path, n)["status"] for n in "bd"] == ["done", "done"]
    assert [_record(tmp_path, n)["status"] for n in ("c", "e", "report")] == ["not run"] * 3
    assert _record(tmp_path, "e")["needs"] == ["a"]
    out = capsys.readouterr().out
    assert "a: failed (exit status 3; log: " in out and "c: not run: needs a" in out and "d: done in" in out


def test_the_table_names_each_failed_stage_its_log_its_command_and_what_did_not_run(tmp_path):
    (tmp_path / "broken_a").touch()
    plan = _plan(tmp_path)
    plan[1] = _stage(tmp_path, "b", write_done=False)  # exits 0 without its done file: failed too
    with pytest.raises(StagesFailed) as e:
        _run(tmp_path, plan)
    table = str(e.value)
    assert table.startswith("2 stages failed, and 4 that need them did not run")
    assert "| stage | why | log | rerun it alone |" in table
    assert f"| a | exit status 3 | {tmp_path / 'logs' / 'a.log'} | {sys.executable} -c " in table
    assert f"| b | it did not write {tmp_path / 'b' / 'done.txt'} | {tmp_path / 'logs' / 'b.log'} |" in table
    assert table.split("|---|---|---|---|\n")[1].split("\n\n")[0].splitlines()[2:] == [  # in plan order
        "| c | not run: needs a | | |", "| d | not run: needs b | | |", "| e | not run: needs a, b | | |",
        "| report | not run: needs a, b | | |"]
    assert _record(tmp_path, "b")["status"] == "failed" and _record(tmp_path, "b")["rc"] == 0


def test_a_rerun_after_the_fix_runs_the_failed_stage_and_what_needs_it(tmp_path, capsys):
    (tmp_path / "broken_a").touch()
    with pytest.raises(StagesFailed):
        _run(tmp_path, _plan(tmp_path))
    _ran(tmp_path)
    (tmp_path / "broken_a").unlink()
    _run(tmp_path, _plan(tmp_path))
    assert _ran(tmp_path) == ["a", "c", "e"]
    out = capsys.readouterr().out
    assert "b: done before, skipped" in out and "d: done before, skipped" in out and "report: running" in out
    assert all(_record(tmp_path, n)["status"] == "done" for n in ("a", "b", "c", "d", "e", "report"))
    assert json.loads((tmp_path / "results.json").read_text()) == {"ok": 1}


def test_an_error_in_the_report_still_raises(tmp_path):
    def report(cfg, out):
        raise RuntimeError("a bug in the report")

    plan = _plan(tmp_path)
    plan[-1]["fn"] = report
    with pytest.raises(RuntimeError, match="a bug in the report"):
        _run(tmp_path, plan)


def test_ctrl_c_still_stops_every_running_stage(tmp_path, monkeypatch):
    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(S, "LINE_EVERY_S", 0.0)
    monkeypatch.setattr(S, "_show_progress", interrupt)  # Ctrl-C while b runs
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, [_stage(tmp_path, "b", sleep=60), _stage(tmp_path, "d", ["b"])])
    assert "d" not in _ran(tmp_path) and _record(tmp_path, "b")["status"] == "started"  # b ended, d never began
    assert not (tmp_path / "b" / "done.txt").exists()


def test_the_entry_point_prints_the_table_and_exits_1(tmp_path, monkeypatch, capsys):
    from lmcal import reproduce as entry
    from lmcal.pipeline import reproduce as P

    out = tmp_path / "out"
    monkeypatch.setattr(P, "check", lambda cfg, estimates: None)  # the smoke profile's checks compose its stages
    monkeypatch.setattr(P, "plan", lambda cfg: _plan(out))
    monkeypatch.setattr(P, "stage_settings", lambda stage, cfg: {})
    out.mkdir()
    (out / "broken_a").touch()
    with pytest.raises(SystemExit) as e:
        entry.main(["profile=smoke", f"out={out}", "logger=none", "warm_worker=false"])
    err = capsys.readouterr().err
    assert e.value.code == 1, err
    assert "1 stage failed, and 3 that need it did not run" in err and "| c | not run: needs a | | |" in err
    assert "lmcal: error" not in err and not (out / LOCK_NAME).exists()
    with pytest.raises(SystemExit) as e:  # bad input is still exit 2
        entry.main(["profile=nonesuch"])
    assert e.value.code == 2
