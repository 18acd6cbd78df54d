"""On a real (single-node, loopback) Slurm cluster: `make reproduce ARGS='launcher=slurm'` end to end, a stage's job
cancelled with scancel (the pipeline stops naming its log and command; the rerun resumes the training from its
last.ckpt), a running job requeued with scontrol (it resumes within the run), results.json equal to a local run's;
and the tau-model multirun through Hydra's submitit launcher. Every claim is read from Slurm's own records: the
job-completion log (JobCompType=jobcomp/filetxt) and scontrol."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DATA_ROOT, HAVE_PTB

pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_PTB, reason="the pipeline reproduces PTB results: set LMCAL_DATA_ROOT")]

REPO = Path(__file__).resolve().parents[2]
VARYING = ("seconds", "wall", "time", "path", "_per_s", "ms_per", "provenance", "profile", "stages", "_runtime",
           "_timestamp", "cost_ratio")


def comparable(obj):
    """A results.json less what differs from run to run: wall times, rates, paths, the stage records."""
    if isinstance(obj, dict):
        return {k: comparable(v) for k, v in obj.items() if not any(w in k for w in VARYING)}
    return [comparable(v) for v in obj] if isinstance(obj, list) else obj


def _env(extra=None):
    src = str(REPO / "src")
    return {**os.environ, "LMCAL_DATA_ROOT": DATA_ROOT, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra or {})}


# sequence_calibration left out: on main (27a3317) it stops with KeyError 'tail_nats_per_generation' when it reuses the
# decoders stage's fitted-temperature row, whatever the launcher; the tier checks the launcher, not that stage.
STAGES = "stages=[entropy_rate,calibration,decoders,future_entropy]"


def _reproduce(out, *extra):
    return [sys.executable, "-m", "lmcal.reproduce", "profile=smoke", f"out={out}", "logger=csv", STAGES, *extra]


SLURM = ["launcher=slurm", "slurm.cpus_per_job=1", "slurm.poll_s=2", "slurm.time_min=60"]


def jobcomp(cluster) -> list[dict]:
    """Slurm's job-completion log: one {key: value} per job end (a requeue too)."""
    path = cluster["dir"] / "jobcomp.log"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines]


def wait_for(path: Path, proc, seconds=900):
    deadline = time.time() + seconds
    while not path.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    if not path.is_file():
        exited = proc.poll() is not None
        said = "".join(stream.read() or "" for stream in (proc.stdout, proc.stderr) if stream and exited)
        raise AssertionError(f"{path} did not appear (the pipeline exited {proc.poll()}):\n{said[-4000:]}")


def stage_job(out, name) -> str:
    return json.loads((out / "stages" / f"{name}.json").read_text())["slurm_job_id"]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    t0 = time.time()
    r = subprocess.run(_reproduce(out), env=_env(), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"\nlocal smoke reproduction: {time.time() - t0:.0f} s")
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory):
    """The smoke reproduction through Slurm: the tau-models' job cancelled (scancel) once tau 2 has a checkpoint,
    then the rerun, whose tau-models job is requeued (scontrol requeue) once tau 4 has one."""
    out = tmp_path_factory.mktemp("slurm") / "out"
    env = _env(slurm_cluster["env"])
    t0 = time.time()
    first = subprocess.Popen(_reproduce(out, *SLURM), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    wait_for(out / "ptb" / "tau" / "tau_2" / "checkpoints" / "last.ckpt", first)
    cancelled = stage_job(out, "tau_models")
    subprocess.run(["scancel", cancelled], env=env, check=True)
    stdout1, stderr1 = first.communicate(timeout=300)
    t1 = time.time()
    second = subprocess.Popen(_reproduce(out, *SLURM), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    wait_for(out / "ptb" / "tau" / "tau_4" / "checkpoints" / "last.ckpt", second)
    requeued = stage_job(out, "tau_models")
    subprocess.run(["scontrol", "requeue", requeued], env=env, check=True)
    stdout2, _ = second.communicate(timeout=1500)
    print(f"\nSlurm smoke reproduction: first run {t1 - t0:.0f} s (cancelled), rerun {time.time() - t1:.0f} s "
          f"(with a requeue)\n{stdout2}")
    return {"out": out, "env": env, "cancelled": cancelled, "requeued": requeued, "first": (first.returncode, stdout1,
            stderr1), "second": (second.returncode, stdout2)}


def test_a_cancelled_stage_stops_the_pipeline_naming_its_log_and_command(slurm_run):
    rc, stdout, stderr = slurm_run["first"]
    assert rc == 2 and "Traceback" not in stderr, stderr[-3000:]
    msg = stderr.split("lmcal: error:", 1)[1]
    out = slurm_run["out"]
    assert "Stage 'tau_models' failed" in msg and str(out / "logs" / "tau_models.log") in msg
    assert f"Slurm job {slurm_run['cancelled']} ended CANCELLED" in msg and "-m lmcal.train -m" in msg
    assert "launcher=slurm" in msg


def test_every_stage_ran_as_a_slurm_job_and_the_results_equal_a_local_run(slurm_run, local_run, slurm_cluster):
    rc, stdout = slurm_run["second"]
    assert rc == 0, stdout[-5000:]
    out = slurm_run["out"]
    ended = {}
    for rec in jobcomp(slurm_cluster):
        ended.setdefault(rec["JobId"], []).append(rec["JobState"])
    records = {p.stem: json.loads(p.read_text()) for p in (out / "stages").glob("*.json")}
    assert len(records) == 20
    for name, rec in records.items():
        if name == "report":  # the report runs in the pipeline's own process
            assert "slurm_job_id" not in rec
            continue
        assert rec["status"] == "done" and rec["slurm_state"] == "COMPLETED", name
        assert ended[rec["slurm_job_id"]][-1] == "COMPLETED", (name, ended.get(rec["slurm_job_id"]))
    assert ended[slurm_run["cancelled"]] == ["CANCELLED"]
    results = json.loads((out / "results.json").read_text())
    assert comparable(results) == comparable(local_run)


def test_the_cancelled_and_the_requeued_trainings_resumed_from_last_ckpt(slurm_run, slurm_cluster):
    out, job = slurm_run["out"], slurm_run["requeued"]
    for tau in (2, 4):  # tau 2: killed by scancel, resumed by the rerun; tau 4: killed by the requeue, resumed by it
        m = json.loads((out / "ptb" / "tau" / f"tau_{tau}" / "metrics.json").read_text())
        assert m["resumed_from"] and m["resumed_from"].endswith("last.ckpt"), tau
    ends = [r for r in jobcomp(slurm_cluster) if r["JobId"] == job]
    assert len(ends) == 2 and ends[-1]["JobState"] == "COMPLETED"  # the requeue ended its first run
    show = subprocess.run(["scontrol", "show", "job", job], env=slurm_run["env"], capture_output=True, text=True)
    assert "Restarts=1" in show.stdout and "JobState=COMPLETED" in show.stdout
    log = (out / "logs" / "tau_models.log").read_text()
    assert f"Slurm job {job}, restart 1" in log and f"Slurm job {job}, restart 0" in log


def test_the_tau_models_multirun_through_hydras_slurm_launcher(slurm_cluster, tmp_path, data_overrides):
    """python -m lmcal.train -m hydra/launcher=slurm_cpu: one Slurm job per tau, each with its metrics.json."""
    before = {r["JobId"] for r in jobcomp(slurm_cluster)}
    r = subprocess.run([sys.executable, "-m", "lmcal.train", "-m", "hydra/launcher=slurm_cpu", "experiment=smoke",
                        "logger=none", "analysis.stages=[]", "trainer.max_epochs=1", "data.max_train_tokens=8000",
                        "model.memory_tau=2,3", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                        "hydra.sweep.subdir=tau_${model.memory_tau}", *data_overrides],
                       env=_env(slurm_cluster["env"]), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for tau in (2, 3):
        assert json.loads((tmp_path / "sweep" / f"tau_{tau}" / "metrics.json").read_text())["epochs"] == 1
    deadline = time.time() + 120  # the launcher returns once both results are written; the jobs end just after
    while len(new := [rec for rec in jobcomp(slurm_cluster) if rec["JobId"] not in before]) < 2 and (
            time.time() < deadline):
        time.sleep(1)
    assert len(new) == 2 and all(rec["JobState"] == "COMPLETED" for rec in new)
