"""`make reproduce ARGS='launcher=slurm'`: each stage of the plan submitted as a Slurm job through submitit, its
dependencies as Slurm dependencies (afterok), so that independent stages run side by side on the cluster. This process
watches the jobs: the console shows each stage's state (job id, PENDING/RUNNING/...) and its ETA, records it in
<out>/stages/<stage>.json, and runs the report once every job has finished. A failed job names its log and the
command that reruns it, and the other jobs are cancelled; a rerun submits only what is not done, and a training
killed or requeued resumes from its last.ckpt (its run folder is on the shared filesystem). Settings:
conf/reproduce/launcher/slurm.yaml, overridden as slurm.<key>=... .
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.pipeline.devices import cores_here, device_env, sweep_jobs, thread_env, visible_gpus
from lmcal.pipeline.schedule import check_finished, done_before, inputs_seen, progress_line, stage_command
from lmcal.reporting.results import stage_record
from lmcal.utils.io import write_json_atomic
from lmcal.utils.settings import CONF_DIR

FINAL_OK = "COMPLETED"
FINAL_BAD = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def slurm_defaults() -> DictConfig:
    return OmegaConf.load(CONF_DIR / "reproduce" / "launcher" / "slurm.yaml")


def sweep_env(cmd: list[str], env: dict) -> dict[str, str]:
    """What a job's stage adds to its environment where it is a sweep of local processes (the tau-models under
    local_parallel): its jobs spread over the job's GPUs and its cores (lmcal.pipeline.devices); {} otherwise. An
    OMP_NUM_THREADS of the job's whole cores (the executor's default) is the stage's share, not a user's setting."""
    sweep = sweep_jobs(cmd)
    if sweep < 2:
        return {}
    threads = {k: v for k, v in env.items() if not (k == "OMP_NUM_THREADS" and v == str(cores_here()))}
    return {**thread_env(1, env=threads, sweep=sweep), **device_env(0, visible_gpus(env), 1, sweep=sweep)}


def run_stage(stage: dict, log_path: str) -> int:
    """What each Slurm job runs: the stage's command with its output appended to logs/<stage>.log, as the local
    launcher does. The command is made when the job starts, so that a requeued tau-models job trains only the taus
    without results. A sweep of local processes gets the job's GPUs, one a process in turn (sweep_env). A failure
    raises, so that submitit records it and the job ends FAILED."""
    cmd = stage_command(stage)
    if not cmd:
        return 0
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    env.update(sweep_env(cmd, env))
    with open(log_path, "a") as log:
        log.write(f"\n$ {shlex.join(cmd)}   # Slurm job {os.environ.get('SLURM_JOB_ID')}, restart "
                  f"{os.environ.get('SLURM_RESTART_COUNT', '0')}, on {os.uname().nodename}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
        raise RuntimeError(f"{shlex.join(cmd)} exited with status {rc}; see {log_path}")
    return rc


def check_slurm_tools(what: str = "launcher=slurm submits each stage as a Slurm job",
                      run: str = "`make reproduce ARGS='launcher=slurm ...'`",
                      here: str = "launcher=local to run the stages here") -> None:
    """launcher=slurm needs Slurm's commands on this machine: sbatch (submitit submits with it and checks for srun),
    squeue and scancel (the jobs' states, and cancelling them). Refused in one paragraph before any folder is made;
    `what`, `run` and `here`: the launcher, the command to run on the cluster, the setting that runs it here."""
    missing = [t for t in ("sbatch", "srun", "squeue", "scancel") if shutil.which(t) is None]
    if missing:
        raise LmcalError(f"{what}, but Slurm's {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on "
                         f"this machine's PATH ({os.environ.get('PATH', '')}). Nothing was submitted or made. Run "
                         f"{run} on a node of the cluster (a login node, where sbatch works), or {here}.")


def check_sweep_launcher() -> None:
    """`python -m lmcal.train -m hydra/launcher=slurm_cpu` (or slurm_gpu, any submitit Slurm launcher): Slurm's tools
    on this machine (check_slurm_tools), checked with the sweep's settings before Hydra writes multirun.yaml or any
    job's folder (lmcal.utils.precheck calls the entry point's check_settings with each job's config). Nothing
    outside a Hydra multirun under a Slurm launcher, nor inside a Slurm job (the job's own run of the settings)."""
    if not HydraConfig.initialized() or os.environ.get("SLURM_JOB_ID"):
        return
    hc = HydraConfig.get()
    target = str((hc.get("launcher") or {}).get("_target_") or "")
    if hc.mode != RunMode.MULTIRUN or "submitit" not in target or not target.endswith("SlurmLauncher"):
        return
    name = hc.runtime.choices.get("hydra/launcher") or "slurm_cpu"
    check_slurm_tools(f"hydra/launcher={name} submits each job of the sweep as a Slurm job", "the same command",
                      "hydra/launcher=basic (one job after another) or hydra/launcher=local_parallel to run the jobs "
                      "here")


def executor(s: DictConfig, folder: Path):
    """A submitit SlurmExecutor with the launcher settings `s` (conf/reproduce/launcher/slurm.yaml)."""
    import submitit

    ex = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=int(s.max_requeues))
    params = {"partition": s.partition, "time": int(s.time_min), "cpus_per_task": s.cpus_per_job,
              "gpus_per_node": s.gpus_per_job or None, "mem": f"{s.mem_gb}GB" if s.mem_gb else None,
              "account": s.account, "qos": s.qos, "constraint": s.constraint, "stderr_to_stdout": True,
              "additional_parameters": {"requeue": True, **OmegaConf.to_container(s.additional, resolve=True)},
              # torch's threads: the job's cores (lmcal.pipeline.devices.thread_env's rule), unless the user set theirs
              "setup": [f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{int(s.cpus_per_job)}}}"] if s.cpus_per_job
              else None}
    ex.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return ex


def _seconds(start: str, end: str) -> float | None:
    try:
        return time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S")) - time.mktime(time.strptime(start,
                                                                                            "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # N/A, Unknown
        return None


def job_states(jobs: dict) -> dict[str, tuple[str, float | None]]:
    """{stage: (Slurm state, seconds its last run took once it has ended)} of the submitted jobs: from squeue, which
    lists finished jobs for MinJobAge; else from sacct through submitit where accounting runs; else from the result
    submitit wrote (COMPLETED or FAILED), else UNKNOWN."""
    ids = {str(j.job_id): name for name, j in jobs.items()}
    states = {}
    try:
        r = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%T|%S|%e", "-j", ",".join(ids)],
                           capture_output=True, text=True, timeout=60)
        for line in r.stdout.splitlines():
            jid, state, start, end = (line.split("|") + ["", "", ""])[:4]
            if jid in ids:
                states[ids[jid]] = (state.strip(), _seconds(start, end))
    except (OSError, subprocess.SubprocessError):
        pass
    for name, job in jobs.items():
        if name not in states:
            state = job.state
            if state == "UNKNOWN" and job.paths.result_pickle.exists():
                state = "FAILED" if job.exception() is not None else "COMPLETED"
            states[name] = (state, None)
    return {n: (s.split()[0] if s else "UNKNOWN", secs) for n, (s, secs) in states.items()}


def cancel(jobs: dict) -> None:
    if jobs:
        subprocess.run(["scancel", *[str(j.job_id) for j in jobs.values()]], capture_output=True, timeout=60)


def schedule_slurm(stages: list[dict], cfg: DictConfig, out: Path, current: dict, ref: dict[str, float]) -> None:
    """Submits every stage to run (those recorded as done are skipped, unless a stage they depend on runs again)
    as a job that starts once the jobs of its dependencies have succeeded, then follows them until all are done."""
    s = OmegaConf.merge(slurm_defaults(), cfg.get("slurm") or {})
    ex = executor(s, Path(s.folder) if s.folder else out / "slurm")
    total, index = len(stages), {st["name"]: i for i, st in enumerate(stages, 1)}
    jobs, runs, ran = {}, {}, set()
    try:
        for stage in stages:
            name = stage["name"]
            if "fn" in stage:
                continue
            record = out / "stages" / f"{name}.json"
            rec = {"dir": str(stage["dir"]), "cmd": stage.get("cmd"), "settings": current[name]}
            if not ran & set(stage["deps"]) and done_before(stage_record(record), stage, []):
                print(f"[{index[name]}/{total}] {name}: done before, skipped", flush=True)
                continue
            ran.add(name)
            cmd, log_path = stage_command(stage), out / "logs" / f"{name}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            after = [str(jobs[d].job_id) for d in stage["deps"] if d in jobs]
            ex.update_parameters(job_name=f"lmcal-{name}", dependency=f"afterok:{':'.join(after)}" if after else None)
            job = ex.submit(run_stage, {k: v for k, v in stage.items() if k != "fn"}, str(log_path))
            jobs[name] = job
            runs[name] = {"log_path": log_path, "cmd": cmd, "rec": {**rec, "slurm_job_id": str(job.job_id)},
                          "state": None, "t0": None}
            write_json_atomic(record, {"status": "submitted", **runs[name]["rec"]})
            print(f"[{index[name]}/{total}] {name}: Slurm job {job.job_id}"
                  f"{' after ' + ', '.join(after) if after else ''} (log: {log_path})", flush=True)
        follow(stages, jobs, runs, out, ref, float(s.poll_s), index)
    except BaseException:  # a failed stage, Ctrl-C: the jobs not finished are cancelled; a rerun resubmits them
        cancel({n: j for n, j in jobs.items() if runs[n]["state"] != FINAL_OK})
        raise
    report, record = stages[-1], out / "stages" / "report.json"
    inputs = inputs_seen(report)
    if not ran and done_before(stage_record(record), report, inputs):
        print(f"[{total}/{total}] report: done before, skipped", flush=True)
        return
    print(f"[{total}/{total}] report: running", flush=True)
    t0 = time.perf_counter()
    report["fn"](cfg, out)
    write_json_atomic(record, {"status": "done", "seconds": time.perf_counter() - t0, "dir": str(out), "cmd": None,
                               "settings": current["report"], "inputs": inputs})
    print(f"[{total}/{total}] report: done in {time.perf_counter() - t0:.0f} s", flush=True)


def follow(stages, jobs: dict, runs: dict, out: Path, ref: dict, poll_s: float, index: dict) -> None:
    """Polls the jobs until all have succeeded: prints each change of state, a progress line with ETAs every minute,
    and records each finished stage; raises on a failed one (its log, its Slurm log, the command to rerun it)."""
    total, shown, pending = len(stages), time.perf_counter(), set(jobs)
    by_name = {st["name"]: st for st in stages}
    while pending:
        states = job_states({n: jobs[n] for n in pending})
        now = time.perf_counter()
        for name in sorted(pending, key=index.get):
            (state, took), run = states[name], runs[name]
            if state != run["state"]:
                print(f"[{index[name]}/{total}] {name}: {state} (Slurm job {jobs[name].job_id})", flush=True)
                run["state"] = state
                if state == "RUNNING" and run["t0"] is None:
                    run["t0"] = now
                    write_json_atomic(out / "stages" / f"{name}.json", {"status": "started", **run["rec"]})
            if state == FINAL_OK or state in FINAL_BAD:
                pending.discard(name)
                rc = 0 if state == FINAL_OK else 1
                slurm_log = jobs[name].paths.stdout
                try:
                    check_finished(by_name[name], run, rc)
                except LmcalError as e:
                    raise LmcalError(f"{e} Slurm job {jobs[name].job_id} ended {state}; Slurm's log of the job is "
                                     f"{slurm_log}. `make reproduce ARGS='launcher=slurm ...'` again submits only the "
                                     "stages not done.") from None
                seconds = took if took is not None else now - (run["t0"] or now)
                write_json_atomic(out / "stages" / f"{name}.json", {"status": "done", "seconds": seconds,
                                                                    "slurm_state": state, **run["rec"]})
                print(f"[{index[name]}/{total}] {name}: done in {seconds:.0f} s (Slurm job {jobs[name].job_id})",
                      flush=True)
        running = {n: r for n, r in runs.items() if n in pending and r["state"] == "RUNNING" and r["t0"]}
        if running and now - shown >= 60:
            print("\n".join(progress_line(n, index[n], total, now - r["t0"], ref, None) for n, r in running.items()),
                  flush=True)
            shown = now
        if pending:
            time.sleep(poll_s)
