"""Running a planned pipeline (lmcal.pipeline.plan.plan): each stage its own process with its log in
<out>/logs/<stage>.log, up to `jobs` at once where they do not depend on each other, its completion (or failure)
recorded in <out>/stages/<stage>.json, and a progress line with elapsed times and ETAs from a reference run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from lmcal.errors import LmcalError
from lmcal.pipeline.devices import device_env, free_slot, sweep_jobs, thread_env, visible_gpus
from lmcal.pipeline.eta import floored, plan_left, scaled, stage_line, step_progress
from lmcal.pipeline.signals import end_groups, stage_process_options
from lmcal.pipeline.warm import Worker, takes
from lmcal.reporting.results import not_whole, stage_record
from lmcal.utils.io import read_record, write_json_atomic
from lmcal.utils.progress import clock


def reference_seconds(profile: str) -> tuple[dict[str, float], str]:
    """Each stage's wall time in the reproduction snapshotted into docs/runs/<profile>/ (a run that wrote it, on the
    machine its provenance names), for the ETAs; ({}, '') without one."""
    from lmcal.reporting.docs import DOCS

    path = DOCS / "runs" / profile / "results.json"
    try:
        r = json.loads(path.read_text())
        return {n: float(v["seconds"]) for n, v in r["stages"].items()}, r.get("provenance", {}).get("machine", "")
    except (OSError, ValueError, KeyError, TypeError):
        return {}, ""


def progress_line(name: str, index: int, total: int, elapsed: float, ref: dict[str, float],
                  remaining_after: float | None) -> str:
    """'[3/22] tau_models: 4m10s, about 2m05s left; the pipeline about 40m left': the stage's elapsed time, and ETAs
    from the reference run's times (a stage past its reference time shows only its elapsed time)."""
    line = f"[{index}/{total}] {name}: {clock(elapsed)}"
    if name in ref:
        left = ref[name] - elapsed
        line += f", about {clock(left)} left" if left > 0 else f" (the reference run took {clock(ref[name])})"
        if remaining_after is not None:
            line += f"; the pipeline about {clock(max(left, 0) + remaining_after)} left"
    return line


LINE_EVERY_S = 60.0  # the console's progress lines where stdout is not a terminal (a file, a Slurm log)


def stage_command(stage: dict) -> list[str]:
    """The stage's command; for the tau-models, only those without results (a killed one resumes); [] for none."""
    cmd = list(stage.get("cmd") or [])
    if "taus" in stage:
        todo = [str(t) for t, d in stage["taus"].items() if not (d / "metrics.json").is_file()]
        cmd = cmd[:cmd.index("-m", 2) + 1] + [f"model.memory_tau={','.join(todo)}"] + cmd[cmd.index("-m", 2) + 1:]
        if not todo:
            cmd = []
    return cmd


def machine_gflops() -> float:
    """The float32 matmul rate (GFLOP/s) of this machine now, over half a second: recorded with each stage, so
    that a stage's seconds can be read against the speed the machine had (shared machines vary by a third)."""
    from lmcal.utils.profiling import matmul_flops  # torch, only when a stage is about to run

    return round(matmul_flops(seconds=0.5) / 1e9, 1)


def stage_env(extra: dict | None = None) -> dict:
    """The environment every stage process starts with (forked by the warm worker or not), `extra` added."""
    return {**os.environ, "HYDRA_FULL_ERROR": "1", **(extra or {})}


def launch(stage: dict, out: Path, env: dict | None = None, worker: Worker | None = None) -> dict:
    """Starts a stage's process with its output appended to logs/<name>.log, `env` added to its environment (its
    GPU, its threads), forked by the warm `worker` where it takes the command (lmcal.pipeline.warm): {"proc" (None:
    nothing to run), "cmd", "log", "log_path", "t0"}."""
    log_path = out / "logs" / f"{stage['name']}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd, run = stage_command(stage), {"proc": None, "log": None, "log_path": log_path, "t0": time.perf_counter()}
    run["cmd"] = cmd
    if cmd:
        run["log"] = open(log_path, "a")
        run["log"].write(f"\n$ {shlex.join(cmd)}\n")
        run["log"].flush()
        full_env = stage_env(env)
        if worker is not None and takes(cmd):
            run["proc"] = worker.launch(cmd, full_env, log_path)
        else:
            run["proc"] = subprocess.Popen(cmd, stdout=run["log"], stderr=subprocess.STDOUT, env=full_env,
                                           **stage_process_options())
    return run


def failure(stage: dict, rc: int) -> str | None:
    """Why a stage whose process ended with status `rc` failed (its exit status, or the files that show it finished
    and are not there, with any failed.json it left), or None when it finished."""
    missing = [str(p) for p in stage["done"] if not p.is_file()]
    if not rc and not missing:
        return None
    failed = sorted(stage["dir"].rglob("failed.json")) if stage["dir"].is_dir() else []
    why = f"exit status {rc}" if rc else f"it did not write {', '.join(missing)}"
    return why + (f"; see {', '.join(map(str, failed))}" if failed else "")


def check_finished(stage: dict, run: dict, rc: int) -> None:
    """One paragraph if the stage's process failed or left out a file that shows it finished (the Slurm launcher,
    which stops every stage on a failure)."""
    why = failure(stage, rc)
    if why:
        raise LmcalError(f"Stage '{stage['name']}' failed ({why}). Its log is {run['log_path']}. Rerun it alone "
                         f"with:\n  {shlex.join(run['cmd'])}\nor rerun the pipeline, which skips the finished stages.")


def needed_failures(name: str, by_name: dict[str, dict], failed: dict) -> list[str]:
    """The failed stages that stage `name` needs the output of, directly or through the stages it depends on."""
    needs, seen, todo = set(), set(), list(by_name[name]["deps"])
    while todo:
        dep = todo.pop()
        if dep in seen:
            continue
        seen.add(dep)
        if dep in failed:
            needs.add(dep)
        elif dep in by_name:
            todo.extend(by_name[dep]["deps"])
    return sorted(needs, key=list(by_name).index)


def _cell(text: str) -> str:
    """Text as one cell of a Markdown table: on one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def failure_table(failed: dict[str, dict], not_run: dict[str, list[str]]) -> str:
    """What failed, one row a stage (why, its log, the command that reruns it alone), then the stages not run
    because a stage they need failed: the pipeline's last word when it did not finish."""
    rows = [f"| {n} | {_cell(f['why'])} | {f['log']} | {_cell(f['cmd'])} |" for n, f in failed.items()]
    rows += [f"| {n} | not run: needs {', '.join(needs)} | | |" for n, needs in not_run.items()]
    k, m = len(failed), len(not_run)
    head = (f"{k} stage{'s' if k > 1 else ''} failed" + (f", and {m} that need{'s' if m == 1 else ''} "
                                                           f"{'it' if k == 1 else 'them'} did not run" if m else "")
            + "; the other stages finished:")
    return "\n".join([head, "", "| stage | why | log | rerun it alone |", "|---|---|---|---|", *rows, "",
                      "Rerun the pipeline (the same command) once fixed: it runs these and skips the finished stages."])


class StagesFailed(LmcalError):
    """Stages that failed, and those not run because they need one: raised once every other stage has finished.
    `failed` maps each failed stage to its why, log and command; `not_run`, each stage not run to what it needs."""

    def __init__(self, failed: dict[str, dict], not_run: dict[str, list[str]]):
        super().__init__(failure_table(failed, not_run))
        self.failed, self.not_run = failed, not_run


def finished_file(path: Path) -> bool:
    """A file that shows a stage finished: there, and, for JSON (results.json, metrics.json...), whole: it parses,
    and holds every key its readers need with its type (lmcal.reporting.results.not_whole). A file that is not whole
    means "not done", with a warning naming it."""
    if not path.is_file():
        return False
    if path.suffix != ".json":
        return True
    r = read_record(path)
    why = not_whole(path, r) if r is not None else None
    if why:
        print(f"warning: {path} is not whole ({why}); taking its stage as not done, so it runs again.",
              file=sys.stderr, flush=True)
    return r is not None and why is None


def inputs_seen(stage: dict) -> list[list]:
    """The files matching a stage's `inputs` patterns (files outside the plan that it reads), each as [path, size,
    mtime in ns], in a fixed order: a stage recorded with other inputs than these is not done."""
    files = sorted(p for pattern in stage.get("inputs", []) for p in Path(pattern).parent.glob(Path(pattern).name))
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def done_before(before: dict | None, stage: dict, inputs: list[list]) -> bool:
    """A stage whose record says done, whose done files are whole, and whose inputs (inputs_seen) are those it read
    then: it is skipped (its dependencies not run again: the caller's part)."""
    return (before is not None and before.get("status") == "done" and all(finished_file(p) for p in stage["done"])
            and before.get("inputs", []) == inputs)


def stop(runs: dict) -> None:
    """Ends the stages still running, each with its process group (a failure elsewhere, Ctrl-C, SIGTERM, SIGHUP): a
    rerun resumes them."""
    end_groups([run["proc"] for run in runs.values() if run["proc"] is not None])
    for run in runs.values():
        if run["log"] is not None:
            run["log"].close()


@dataclass
class _Run:
    """A pipeline as it runs: the stages waiting, running and finished, and what the console shows."""

    stages: list[dict]
    cfg: DictConfig | None
    out: Path
    current: dict
    jobs: int
    gpus: list
    warm: bool  # stages forked by a warm worker (lmcal.pipeline.warm), started when first used
    todo: list[dict]
    worker: Worker | None = None
    running: dict = field(default_factory=dict)
    finished: set = field(default_factory=set)
    ran: set = field(default_factory=set)  # stages that ran in this pipeline: what uses their results runs again
    failed: dict = field(default_factory=dict)  # name: {"why", "log", "cmd"}, for the table at the end
    not_run: list = field(default_factory=list)  # stages dropped because a stage they need failed
    number: dict = field(default_factory=dict)  # in the order stages start, so that numbers never jump back
    seconds: dict = field(default_factory=dict)


def _skip(r: _Run, stage: dict, record: Path, rec: dict) -> bool:
    """Whether `stage` is recorded as done with these settings and inputs (and nothing it depends on ran again):
    then it is skipped, its record brought up to date."""
    before = stage_record(record)  # (None when it is not whole: not done, with a warning)
    if r.ran & set(stage["deps"]) or not done_before(before, stage, rec.get("inputs", [])):
        return False
    print(f"[{r.number[stage['name']]}/{len(r.stages)}] {stage['name']}: done before, skipped", flush=True)
    if before.get("settings") != rec["settings"]:  # the tau-models of a longer taus list
        write_json_atomic(record, {**before, **rec})
    return True


def _start(r: _Run, stage: dict) -> None:
    """Starts `stage` (the report in this process, the others as their own processes), or skips it if done."""
    name = stage["name"]
    r.todo.remove(stage)
    r.number[name] = len(r.number) + 1
    record = r.out / "stages" / f"{name}.json"
    rec = {"dir": str(stage["dir"]), "cmd": stage.get("cmd"), "settings": r.current[name],
           **({"inputs": inputs_seen(stage)} if "inputs" in stage else {})}
    if _skip(r, stage, record, rec):
        r.finished.add(name)
        return
    if "fn" not in stage and not r.running:  # the machine's speed as this stage starts (not when another
        rec["matmul_gflop_per_s"] = machine_gflops()  # stage would share the cores with the probe)
    rec["started_at"] = time.time()  # wall-clock: REPORT.md's total is the span the stages covered
    write_json_atomic(record, {"status": "started", **rec})
    r.ran.add(name)
    print(f"[{r.number[name]}/{len(r.stages)}] {name}: running (log: {r.out / 'logs' / (name + '.log')})", flush=True)
    if "fn" in stage:
        t0 = time.perf_counter()
        stage["fn"](r.cfg, r.out)
        r.running[name] = {"t0": t0, "proc": None, "log": None, "rec": rec}
        return
    slot, sweep = free_slot(r.running), sweep_jobs(stage_command(stage))  # sweep: its own jobs side by side
    env = {**thread_env(r.jobs, sweep=sweep), **device_env(slot, r.gpus, r.jobs, sweep=sweep)}
    if r.warm and r.worker is None and takes(stage_command(stage)):
        r.worker = Worker.start(stage_env(thread_env(r.jobs)))
    r.running[name] = launch(stage, r.out, env, r.worker) | {"rec": rec, "slot": slot}


def _start_ready(r: _Run) -> None:
    """Starts what can start, in plan order: up to `jobs` at once, each once its dependencies have finished (the
    report alone)."""
    for stage in list(r.todo):
        if len(r.running) >= r.jobs or ("fn" in stage and r.running):
            break
        if all(d in r.finished for d in stage["deps"]):
            _start(r, stage)
    if r.todo and not r.running:  # nothing runs and nothing could start: a plan whose deps are not in it
        raise LmcalError(f"Stages {', '.join(st['name'] for st in r.todo)} wait on stages that are not in the "
                         "plan; this is a bug in lmcal.pipeline.plan.plan.")


def _done(r: _Run, name: str, run: dict) -> None:
    """Records a stage that finished."""
    r.seconds[name] = took = time.perf_counter() - run["t0"]
    write_json_atomic(r.out / "stages" / f"{name}.json", {"status": "done", "seconds": took,
                                                          "finished_at": time.time(), **run["rec"]})
    r.finished.add(name)
    print(f"[{r.number[name]}/{len(r.stages)}] {name}: done in {took:.0f} s", flush=True)


def _failed(r: _Run, stage: dict, run: dict, rc: int, why: str) -> None:
    """Records a stage that failed (status "failed", its exit status, why and log) and drops the stages that need
    its output, so that the others go on."""
    name, log = stage["name"], str(run["log_path"])
    r.failed[name] = {"why": why, "log": log, "cmd": shlex.join(run["cmd"])}
    write_json_atomic(r.out / "stages" / f"{name}.json", {
        "status": "failed", "rc": rc, "why": why, "log": log, "seconds": time.perf_counter() - run["t0"],
        "finished_at": time.time(), **run["rec"]})
    print(f"[{r.number[name]}/{len(r.stages)}] {name}: failed ({why}; log: {log})", flush=True)
    _drop_needing(r, name)


def _drop_needing(r: _Run, name: str) -> None:
    """Takes out of the waiting stages those that need stage `name`'s output, directly or not, each recorded and
    shown as "not run: needs <the failed stages>" (a rerun runs them: their record is not "done")."""
    by_name, blocked = {st["name"]: st for st in r.stages}, {name}
    while grown := [st["name"] for st in r.todo if st["name"] not in blocked and blocked & set(st["deps"])]:
        blocked.update(grown)  # until no waiting stage needs a blocked one
    for stage in [st for st in r.todo if st["name"] in blocked]:  # in plan order
        r.todo.remove(stage)
        r.not_run.append(stage["name"])
        needs = needed_failures(stage["name"], by_name, r.failed)
        write_json_atomic(r.out / "stages" / f"{stage['name']}.json", {
            "status": "not run", "needs": needs, "dir": str(stage["dir"]), "cmd": stage.get("cmd"),
            "settings": r.current[stage["name"]]})
        print(f"{stage['name']}: not run: needs {', '.join(needs)}", flush=True)


def _reap(r: _Run, tty: bool) -> None:
    """Records the stages that have ended: done, or failed (what needs a failed one is then not run)."""
    by_name = {st["name"]: st for st in r.stages}
    for name, run in list(r.running.items()):
        rc = run["proc"].poll() if run["proc"] is not None else 0
        if rc is None:
            continue
        del r.running[name]
        if run["log"] is not None:
            run["log"].close()
        if tty:
            print("\r\033[K", end="")
        why = None if "fn" in by_name[name] else failure(by_name[name], rc)
        if why:
            _failed(r, by_name[name], run, rc, why)
        else:
            _done(r, name, run)


def _show_progress(r: _Run, basis: dict, reference: bool, tty: bool) -> None:
    """Each running stage's time and time left, and the pipeline's."""
    now = time.perf_counter()
    elapsed = {n: now - run["t0"] for n, run in r.running.items()}
    steps = {n: step_progress(run["log_path"]) if run.get("log_path") else None for n, run in r.running.items()}
    expected = floored(scaled(basis, r.seconds, reference=reference), elapsed,
                       {n: s[1] for n, s in steps.items() if s})
    lines = [stage_line(n, r.number[n], len(r.stages), elapsed[n], expected.get(n), steps[n] and steps[n][0])
             for n in r.running]
    left = plan_left(expected, [st["name"] for st in r.todo if "fn" not in st], elapsed, r.jobs)
    if left is not None:
        lines[-1] += f"; the pipeline about {clock(left)} left"
    print(f"\r{'; '.join(lines)}\033[K" if tty else "\n".join(lines), end="" if tty else "\n", flush=True)


def schedule(stages: list[dict], cfg: DictConfig, out: Path, current: dict, jobs: int, ref: dict[str, float],
             estimates: dict[str, float] | None = None) -> None:
    """Runs the stages in plan order, up to `jobs` at once: a stage starts once every stage it depends on has
    finished (the report, in this process, once all have). A stage recorded as done is skipped unless a stage it
    depends on ran again. Every stage process gets the same environment whatever runs beside it, apart from its GPU
    (with several, each running stage gets its own: CUDA_VISIBLE_DEVICES) and its threads: cores // jobs
    (OMP_NUM_THREADS, unless set: lmcal.pipeline.devices.thread_env). A failed stage stops only the stages that need
    its output (they are not run, nor the report); the others go on, and at the end StagesFailed lists them all. A
    rerun resumes. Ctrl-C, SIGTERM or an error in this process stops every stage. The console numbers the stages in
    the order they start, and gives each running stage's times left (lmcal.pipeline.eta) from the reference run's
    stage times `ref`, else the plan check's `estimates`, scaled to this machine as stages finish."""
    gpus = visible_gpus() if jobs > 1 or any(sweep_jobs(stage_command(st)) > 1 for st in stages) else []
    # a warm worker forks the stages on Linux (macOS's system libraries do not survive a fork of a process that
    # loaded them), not where GPUs are handed out (a fork must not follow CUDA's start), not with warm_worker=false
    warm = (sys.platform == "linux" and cfg is not None and bool(cfg.get("warm_worker", False))
            and not (gpus or visible_gpus()))
    r = _Run(stages, cfg, out, current, jobs, gpus, warm, list(stages))
    basis, tty, shown = dict(ref or estimates or {}), sys.stdout.isatty(), time.perf_counter()
    try:
        while r.todo or r.running:
            _start_ready(r)
            time.sleep(0.5 if any(run["proc"] is not None and run["proc"].poll() is None
                                  for run in r.running.values()) else 0)
            _reap(r, tty)
            if r.running and (tty or time.perf_counter() - shown >= LINE_EVERY_S):  # a line a minute in a log
                _show_progress(r, basis, bool(ref), tty)
                shown = time.perf_counter()
    except BaseException:  # Ctrl-C, a kill or an error in this process: the stages go down with the pipeline
        stop(r.running)
        raise
    finally:
        if r.worker is not None:
            r.worker.close()
    if r.failed:
        by_name = {st["name"]: st for st in stages}
        raise StagesFailed(r.failed, {n: needed_failures(n, by_name, r.failed) for n in by_name if n in r.not_run})
