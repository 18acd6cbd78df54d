"""The remaining tracebacks and run-ons of issue 77 (item 5), each one paragraph (or argparse's one error), exit 2,
nothing written: a training sweep under a Slurm launcher on a machine without Slurm, the benchmarks' counts and the
files they read; and a pipeline whose `make` is killed ends itself and its stages within seconds, whatever its
stages do with SIGTERM (a subprocess plays make)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcal.pipeline.signals import ORPHAN_EXIT_S, ORPHAN_GRACE_S, gone
from tests.test_hostile_inputs import SYNTHETIC, assert_one_paragraph, run

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_a_training_sweep_under_a_slurm_launcher_without_slurm_writes_nothing(tmp_path):
    if shutil.which("sbatch") or shutil.which("srun"):
        pytest.skip("Slurm's tools are on this machine")
    sweep = tmp_path / "multi"
    r = run("lmcal.train", ["-m", "hydra/launcher=slurm_cpu", "experiment=smoke", "logger=none", *SYNTHETIC,
                            "model.memory_tau=2,4", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert_one_paragraph(r, "hydra/launcher=slurm_cpu submits each job of the sweep as a Slurm job", "sbatch",
                         "hydra/launcher=basic")
    assert "Could not detect" not in r.stderr and not sweep.exists()  # no multirun.yaml, no job folder


def _bench(script, *args, cwd):
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "WANDB_MODE": "disabled"})


def test_the_benchmarks_counts_are_positive_integers():
    sys.path.insert(0, str(BENCH))
    try:
        import argparse

        from bench_args import count, count_or_zero, positive, share
    finally:
        sys.path.remove(str(BENCH))
    assert (count("3"), count_or_zero("0"), positive("0.5"), share("1")) == (3, 0, 0.5, 1.0)
    for fn, bad in ((count, "-3"), (count, "0"), (count, "2.5"), (count_or_zero, "-1"), (positive, "0"),
                    (positive, "nan"), (share, "1.5")):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(bad)
    for script in sorted(BENCH.glob("*.py")):  # every count of every benchmark a user runs
        text = script.read_text()
        assert "type=int" not in text, f"{script.name}: an integer option without its range (bench_args.count)"


def test_a_negative_count_is_argparses_error_not_all_but_three(tmp_path):
    r = _bench("calibration_topk.py", "--ckpt", str(tmp_path / "none.ckpt"), "--timing-prefixes", "-3", cwd=tmp_path)
    assert r.returncode == 2 and "argument --timing-prefixes: -3 is not a count" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_calibration_json_without_its_keys_is_named_before_the_checkpoint_loads(tmp_path):
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"alpha": "high", "num_prefixes": 20}))
    r = _bench("calibration_topk.py", "--ckpt", str(tmp_path / "none.ckpt"), "--calibration", str(cal), cwd=tmp_path)
    assert_one_paragraph(r, str(cal), "its alpha is a text ('high')")


@pytest.mark.parametrize("result, needle", [({"rows": []}, "its rows is an empty list"),
                                            ([1, 2], "a JSON list"),
                                            ({"rows": [{"method": "smc", "params": {}}], "reference_test_ppl": 1.0,
                                              "law_horizon": 4, "fit_prefixes": 2, "smc_prefixes": 2,
                                              "particles": [4], "seconds": 1.0}, "lacks the key params.particles")])
def test_a_sequence_calibration_json_of_the_wrong_shape_is_one_line(result, needle, tmp_path):
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sequence_calibration.json").write_text(json.dumps(result))
        runs.append(str(tmp_path / name))
    r = _bench("sequence_calibration.py", "--runs", *runs, cwd=tmp_path)
    assert_one_paragraph(r, str(tmp_path / "a" / "sequence_calibration.json"))
    assert needle in r.stderr or (needle == "a JSON list" and "not an object" in r.stderr), r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1


# -- a pipeline whose make is killed -------------------------------------------------------------------------------

STAND_IN = """
import os, signal, subprocess, sys, time
from pathlib import Path
from lmcal.pipeline.signals import end_groups, stage_process_options, watch_parent
from lmcal.utils.boundary import stop_on_signals

out, stuck = Path(sys.argv[1]), sys.argv[2] == "stuck"
watch_parent(int(os.environ["LMCAL_WATCH_PID"]), every=0.2, exit_after=float(sys.argv[3]))
with stop_on_signals():
    if stuck:  # a main thread that no SIGTERM reaches (a call that does not return to Python)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stage = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(600)"], **stage_process_options())
    (out / "pids").write_text(f"{os.getpid()} {stage.pid}")
    try:
        while True:
            time.sleep(0.2)
    except KeyboardInterrupt:  # as lmcal.pipeline.schedule does: its stages ended with their grace (20 s)
        end_groups([stage])
        sys.exit(143)
"""

MAKE = ("import os, subprocess, sys, time; subprocess.Popen([sys.executable, *sys.argv[1:]], env={**os.environ, "
        "'LMCAL_WATCH_PID': str(os.getpid())}); time.sleep(600)")


@pytest.mark.parametrize("stuck", [False, True])
def test_a_pipeline_whose_make_is_killed_ends_within_seconds(stuck, tmp_path):
    """kill -9 of make: the pipeline (its stage ignoring SIGTERM) is gone within a few seconds: its stage gets
    ORPHAN_GRACE_S, not its usual 20 s; a pipeline whose main thread does not stop ends itself ORPHAN_EXIT_S later."""
    script = tmp_path / "pipeline.py"
    script.write_text(STAND_IN)
    exit_after = 2.0 if stuck else ORPHAN_EXIT_S
    make = subprocess.Popen([sys.executable, "-c", MAKE, str(script), str(tmp_path), "stuck" if stuck else "ok",
                             str(exit_after)], cwd=tmp_path, start_new_session=True, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "pids").exists():
            assert time.time() < deadline and make.poll() is None
            time.sleep(0.1)
        pipeline, stage = map(int, (tmp_path / "pids").read_text().split())
        make.kill()
        make.wait()
        t0 = time.time()
        limit = (exit_after if stuck else ORPHAN_GRACE_S) + 6
        while not (gone(pipeline) and gone(stage)) and time.time() - t0 < 60:
            time.sleep(0.1)
        took = time.time() - t0
        assert gone(pipeline) and gone(stage), "the pipeline or its stage is still running a minute later"
        assert took < limit, f"the pipeline took {took:.1f} s to end (at most {limit:g} s)"
        err = make.stderr.read()
        assert "(make, process" in err, err[-2000:]
        assert ("did not stop within" in err) == stuck, err[-2000:]
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
