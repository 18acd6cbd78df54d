"""Nothing written through a symbolic link inside a run or output folder (issue 77): a link where lmcal, Hydra or
Lightning write (checkpoints/, train.log, .hydra/, a reproduction's logs/) is refused before anything is written, in
one paragraph naming the link and where it points, exit 2, and what it points to untouched; and lmcal's own atomic
writers never replace a link. Through the real entry points, in subprocesses, where the exit code and files matter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcal.errors import LmcalError
from lmcal.utils import io
from lmcal.utils.safe_paths import check_no_links, links_inside

SYNTHETIC = ["data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, n_test: 3000}"]
TRAIN = ["experiment=smoke", "logger=none", "trainer.max_epochs=1", *SYNTHETIC]


def run(module, args, cwd, timeout=300):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_refused(r, link: Path, target: Path):
    """Exit 2 and one `lmcal: error:` paragraph, no traceback, naming the link and where it points."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and r.stderr.count("lmcal: error:") == 1, r.stderr[-3000:]
    assert r.stderr.startswith("lmcal: error:"), r.stderr[-3000:]
    assert f"{link} is a symbolic link (to {target})" in r.stderr, r.stderr[-3000:]
    assert "Nothing was written" in r.stderr


def _folders(tmp_path):
    run_dir, elsewhere = tmp_path / "W", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    return run_dir, elsewhere


@pytest.mark.parametrize("kind", ["checkpoints", "train.log", ".hydra"])
def test_train_refuses_a_link_in_its_run_folder_and_writes_nothing(kind, tmp_path):
    run_dir, elsewhere = _folders(tmp_path)
    victim = elsewhere / "victim.txt"
    victim.write_text("precious")
    target = victim if kind == "train.log" else elsewhere
    (run_dir / kind).symlink_to(target)
    r = run("lmcal.train", [*TRAIN, f"hydra.run.dir={run_dir}"], tmp_path)
    assert_refused(r, run_dir / kind, target)
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["victim.txt"]  # no checkpoint, no .hydra/*.yaml there
    assert [p.name for p in run_dir.iterdir()] == [kind]  # nothing else written in the run folder


def test_a_dangling_link_for_the_log_is_refused_and_not_made(tmp_path):
    run_dir, elsewhere = _folders(tmp_path)
    (run_dir / "train.log").symlink_to(elsewhere / "new.log")
    r = run("lmcal.train", [*TRAIN, f"hydra.run.dir={run_dir}"], tmp_path)
    assert_refused(r, run_dir / "train.log", elsewhere / "new.log")
    assert not (elsewhere / "new.log").exists()


def test_a_multirun_refuses_a_link_in_its_sweep_folder(tmp_path):
    sweep, elsewhere = _folders(tmp_path)
    (sweep / "multirun.yaml").symlink_to(elsewhere / "m.yaml")
    r = run("lmcal.train", ["-m", *TRAIN, "seed=1,2", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert_refused(r, sweep / "multirun.yaml", elsewhere / "m.yaml")
    assert list(elsewhere.iterdir()) == [] and [p.name for p in sweep.iterdir()] == ["multirun.yaml"]


def test_evaluate_refuses_a_link_in_its_run_folder(tmp_path):
    run_dir, elsewhere = _folders(tmp_path)
    (run_dir / ".hydra").symlink_to(elsewhere)
    r = run("lmcal.evaluate", [f"ckpt={tmp_path / 'x.ckpt'}", "logger=none", f"hydra.run.dir={run_dir}"], tmp_path)
    assert_refused(r, run_dir / ".hydra", elsewhere)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("name", ["logs", "stages", "ptb"])
def test_reproduce_refuses_a_link_in_its_output_folder(name, tmp_path):
    out, elsewhere = _folders(tmp_path)
    (out / name).symlink_to(elsewhere)
    r = run("lmcal.reproduce", ["profile=smoke", f"out={out}", "logger=none"], tmp_path)
    assert_refused(r, out / name, elsewhere)
    assert list(elsewhere.iterdir()) == []
    assert [p.name for p in out.iterdir()] == [name]  # no lock, no profile.yaml, no log


def test_wandbs_own_links_inside_its_folder_are_let_through(tmp_path):
    wandb = tmp_path / "run" / "wandb"
    (wandb / "offline-run-1" / "logs").mkdir(parents=True)
    (wandb / "latest-run").symlink_to("offline-run-1")
    (wandb / "debug.log").symlink_to(Path("offline-run-1") / "logs" / "debug.log")
    run_logs = wandb / "offline-run-20261202_174809-ofgf7c4t" / "logs"
    run_logs.mkdir(parents=True)
    (run_logs / "debug-core.log").symlink_to(tmp_path / "cache" / "core-debug.log")  # to W&B's cache
    check_no_links(tmp_path / "run")
    (wandb / "debug-internal.log").symlink_to(tmp_path / "elsewhere.log")  # one leading out of wandb/: refused
    (wandb / "offline-run-1" / "logs" / "x.log").symlink_to(tmp_path / "x.log")  # not one of W&B's: refused
    assert links_inside(tmp_path / "run") == [wandb / "debug-internal.log", wandb / "offline-run-1" / "logs" / "x.log"]
    with pytest.raises(LmcalError, match="debug-internal.log is a symbolic link"):
        check_no_links(tmp_path / "run")


def test_submitits_own_links_to_its_scripts_are_let_through(tmp_path):
    """submitit leaves .submission_file_<hex>.sh beside each job's script, a link to it; one of that name leading out
    of the folder, or to a folder, is refused like any other."""
    slurm = tmp_path / "out" / "slurm"
    slurm.mkdir(parents=True)
    (slurm / "6_submission.sh").write_text("#!/bin/bash\n")
    (slurm / f".submission_file_{'0a' * 16}.sh").symlink_to(slurm / "6_submission.sh")
    check_no_links(tmp_path / "out", "output folder")
    (tmp_path / "elsewhere.sh").write_text("")
    (slurm / f".submission_file_{'1b' * 16}.sh").symlink_to(tmp_path / "elsewhere.sh")
    (slurm / f".submission_file_{'2c' * 16}.sh").symlink_to(slurm)
    assert sorted(links_inside(tmp_path / "out")) == [slurm / f".submission_file_{'1b' * 16}.sh",
                                                      slurm / f".submission_file_{'2c' * 16}.sh"]


def test_the_run_folder_itself_may_be_a_link(tmp_path):
    real = tmp_path / "real"
    (real / "checkpoints").mkdir(parents=True)
    (tmp_path / "W").symlink_to(real)
    check_no_links(tmp_path / "W")  # (lmcal.utils.lock's folder rule resolves it)


@pytest.mark.parametrize("write", [lambda p: io.write_json_atomic(p, {"a": 1}), lambda p: io.write_text_atomic(p, "x")])
def test_the_atomic_writers_refuse_to_replace_a_link(write, tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    link = tmp_path / "out" / "metrics.json"
    link.parent.mkdir()
    link.symlink_to(victim)
    with pytest.raises(LmcalError, match="metrics.json: it is a symbolic link"):
        write(link)
    assert victim.read_text() == "precious" and link.is_symlink()
    assert [p.name for p in link.parent.iterdir()] == ["metrics.json"]  # no temporary file left


def test_the_atomic_writers_make_their_temporary_file_new(tmp_path, monkeypatch):
    taken = tmp_path / ".metrics.json.1.0000abcd.tmp"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    taken.symlink_to(victim)  # a link planted at the temporary name is not written through (O_EXCL)
    monkeypatch.setattr(io, "temp_path", lambda path: taken)
    with pytest.raises(FileExistsError):
        io.write_json_atomic(tmp_path / "metrics.json", {"a": 1})
    assert victim.read_text() == "precious" and not (tmp_path / "metrics.json").exists()


def test_the_atomic_writers_still_write_plain_files(tmp_path):
    io.write_json_atomic(tmp_path / "a" / "m.json", {"a": 1})
    io.write_json_atomic(tmp_path / "a" / "m.json", {"a": 2})
    assert json.loads((tmp_path / "a" / "m.json").read_text()) == {"a": 2}
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["m.json"]
