"""`make reproduce`: every result of the paper this project reproduces, in one resumable pipeline.

    python -m lmcal.reproduce [profile=auto|paper|cpu|smoke] [out=DIR] [key=value ...]

The profile (conf/reproduce/<profile>.yaml; `auto` is `paper` with CUDA, else `cpu`) names the overrides of each
stage; `key=value` pairs override the profile (OmegaConf dot-list, e.g. `taus=[5,10]`). Stages, in order:

    base              train the full model (python -m lmcal.train)
    tau_models        train the tau-limited models (a Hydra multirun: hydra/launcher= spreads it)
    entropy_rate      Table 1 row and Figure 2 (python -m lmcal.evaluate stages=[entropy_rate])
    calibration       alpha*, test ppl before/after, Figure 3
    decoders          temperature, top-k, top-p, typical, eta, min-p, Mirostat beside fitted temperature and calibration
    memory_tau<T>     the I_tau bound for each tau, P~ the tau-model
    memory_window_tau<T>  the same with P~ the base model itself on tau-token windows (windows: true)
                      then the same on data=markov (markov_*)
    report            results.json, REPORT.md, memory tables and Figure 4

Each stage runs as its own process (up to `jobs` at once, where they do not depend on each other) with its log in
<out>/logs/<stage>.log and records completion in
<out>/stages/<stage>.json (written atomically, after its outputs). A rerun skips recorded stages, and a training
that was killed resumes from its last checkpoint; the seeds make the results the same as an uninterrupted run's.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.results import PAPER_STAGES, read_json, report
from lmcal.settings import composed, differences, settings_of
from lmcal.stages import STAGES, check_stages
from lmcal.train import CONF_DIR
from lmcal.utils import (
    run_lock,
    write_json_atomic,
    write_text_atomic,
)
from lmcal.validate import check_config

PROFILES = ("paper", "cpu", "smoke")


# ---------------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------------


def resolve_profile(name: str) -> tuple[str, str | None]:
    """(profile, note): `auto` becomes paper with CUDA, else cpu, with a line saying so."""
    if name == "auto":
        import torch

        name = "paper" if torch.cuda.is_available() else "cpu"
        return name, (f"PROFILE=auto: running the '{name}' profile ({'CUDA found' if name == 'paper' else 'no CUDA'}"
                      "); choose another with `make reproduce PROFILE=paper|cpu|smoke`.")
    if name not in PROFILES:
        raise LmcalError(f"Unknown profile {name!r}: use auto, paper, cpu or smoke.")
    return name, None


CLI_ONLY = ("profile", "force")  # keys of the command line that are not the profile's settings


def _keys(node, prefix: str = "") -> list[str]:
    return [k for key, v in node.items()
            for k in (_keys(v, f"{prefix}{key}.") if isinstance(v, DictConfig) else [f"{prefix}{key}"])]


def load_profile(argv: list[str]) -> DictConfig:
    """The profile's config with the command line's dot-list overrides merged on top; a key the profile does not
    have is an error listing those it has."""
    try:
        cli = OmegaConf.from_dotlist(argv)
    except Exception as e:
        raise LmcalError(f"Cannot read the settings {' '.join(argv)}: {str(e).splitlines()[0]}. Give them as "
                         "key=value pairs, e.g. taus=[5,10] out=DIR.") from None
    name, note = resolve_profile(str(cli.get("profile", "auto")))
    profile = OmegaConf.load(CONF_DIR / "reproduce" / f"{name}.yaml")
    known = _keys(profile)
    unknown = [k for k in _keys(cli) if k not in known and k not in CLI_ONLY
               and not any(k.startswith(f"{p}.") for p in known)]
    if unknown:
        raise LmcalError(f"Unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (in ARGS or on the "
                         f"command line). The {name} profile (conf/reproduce/{name}.yaml) has: {', '.join(known)}; "
                         "and the command line also takes profile= and force=true (FORCE=1).")
    cfg = OmegaConf.merge(profile, cli)
    cfg.profile = name
    cfg.force = bool(cfg.get("force", False))
    if cfg.get("out") is None:
        cfg.out = f"outputs/reproduce/{name}"
    if note:
        print(note, flush=True)
    return cfg


# ---------------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------------


def logger_overrides(cfg: DictConfig) -> list[str]:
    """One W&B project and group for every run of a reproduction (offline unless the profile says otherwise)."""
    if cfg.logger == "wandb":
        return ["logger=wandb", f"logger.project={cfg.wandb_project}", f"logger.group=reproduce-{cfg.profile}",
                f"logger.offline={str(cfg.wandb_offline).lower()}"]
    return [f"logger={cfg.logger}"]


def plan(cfg: DictConfig) -> list[dict]:
    """The stages in order: name, command (argv) or in-process function, and the files that show it finished."""
    out = Path(cfg.out).resolve()
    py = [sys.executable, "-m"]
    lg = logger_overrides(cfg)
    stages = []
    for prefix, part, data in (("", cfg, cfg.dataset), ("markov_", cfg.markov, "markov")):
        root = out / (prefix.rstrip("_") or data)
        base_ckpt = root / "base" / "checkpoints" / "best.ckpt"
        stages.append({"name": f"{prefix}base", "dir": root / "base", "done": [root / "base" / "metrics.json"],
                       "deps": [],
                       "cmd": py + ["lmcal.train", f"data={data}", *part.base, "analysis.stages=[]", *lg,
                                    f"task_name={prefix}base", f"hydra.run.dir={root / 'base'}"]})
        taus = list(part.taus)
        tau_dirs = {t: root / "tau" / f"tau_{t}" for t in taus}
        warm = [f"init_ckpt={base_ckpt}"] if part.warm_start else []
        stages.append({"name": f"{prefix}tau_models", "dir": root / "tau", "taus": tau_dirs,
                       "done": [d / "metrics.json" for d in tau_dirs.values()],
                       "deps": [f"{prefix}base"] if part.warm_start else [],
                       "cmd": py + ["lmcal.train", "-m", f"data={data}", *part.tau, *warm, "analysis.stages=[]", *lg,
                                    f"task_name={prefix}tau", f"hydra.sweep.dir={root / 'tau'}",
                                    "hydra.sweep.subdir=tau_${model.memory_tau}"]})
        ev = py + ["lmcal.evaluate", f"ckpt={base_ckpt}", *part.analysis, *lg]
        if not prefix:  # the full model's stages on PTB; on the Markov source the memory bound is what is checked
            for stage in [n for n in STAGES if n in cfg.stages]:  # each in its own run, in the registry's order
                uses = STAGES[stage].uses  # e.g. decoders take their calibration row from the calibration stage
                extra = [f"analysis.{stage}.{u}_json={root / u / (u + '.json')}" for u in uses]
                stages.append({"name": stage, "dir": root / stage, "done": [root / stage / "evaluation.json"],
                               "deps": ["base", *uses],
                               "cmd": ev + [f"stages=[{stage}]", *extra, f"task_name={stage}",
                                            f"hydra.run.dir={root / stage}"]})
        for t, d in tau_dirs.items():
            mdir = root / "memory" / f"tau_{t}"
            stages.append({"name": f"{prefix}memory_tau{t}", "dir": mdir, "done": [mdir / "memory.json"],
                           "deps": [f"{prefix}base", f"{prefix}tau_models"],
                           "cmd": py + ["lmcal.evaluate", f"ckpt={d / 'checkpoints' / 'best.ckpt'}",
                                        f"memory.base_ckpt={base_ckpt}", "stages=[memory]", *part.analysis, *lg,
                                        f"task_name={prefix}memory", f"hydra.run.dir={mdir}"]})
        for t in taus if part.get("windows", False) else []:  # P~ = the base model itself on t-token windows
            wdir = root / "memory" / f"window_tau_{t}"
            stages.append({"name": f"{prefix}memory_window_tau{t}", "dir": wdir, "done": [wdir / "memory.json"],
                           "deps": [f"{prefix}base"],
                           "cmd": py + ["lmcal.evaluate", f"ckpt={base_ckpt}", "stages=[memory]",
                                        "analysis.memory.limited=window", f"analysis.memory.tau={t}", *part.analysis,
                                        *lg, f"task_name={prefix}memory_window", f"hydra.run.dir={wdir}"]})
    tr = cfg.get("transformer")
    if tr:  # a transformer trained here: Table 1's row, its stages, and its memory profile without tau-models
        root = out / "transformer"
        base_ckpt = root / "base" / "checkpoints" / "best.ckpt"
        stages.append({"name": "transformer_base", "dir": root / "base", "done": [root / "base" / "metrics.json"],
                       "deps": [], "cmd": py + ["lmcal.train", f"data={cfg.dataset}", *tr.base, "analysis.stages=[]",
                                                *lg, "task_name=transformer_base", f"hydra.run.dir={root / 'base'}"]})
        ev = py + ["lmcal.evaluate", f"ckpt={base_ckpt}", *tr.analysis, *lg]
        for stage in [n for n in STAGES if n in tr.stages]:
            uses = [u for u in STAGES[stage].uses if u in tr.stages]
            extra = [f"analysis.{stage}.{u}_json={root / u / (u + '.json')}" for u in uses]
            stages.append({"name": f"transformer_{stage}", "dir": root / stage,
                           "done": [root / stage / "evaluation.json"],
                           "deps": ["transformer_base", *[f"transformer_{u}" for u in uses]],
                           "cmd": ev + [f"stages=[{stage}]", *extra, f"task_name=transformer_{stage}",
                                        f"hydra.run.dir={root / stage}"]})
        for t in tr.window_taus:
            wdir = root / "memory" / f"window_tau_{t}"
            stages.append({"name": f"transformer_memory_window_tau{t}", "dir": wdir, "done": [wdir / "memory.json"],
                           "deps": ["transformer_base"],
                           "cmd": ev + ["stages=[memory]", "analysis.memory.limited=window", f"analysis.memory.tau={t}",
                                        "task_name=transformer_memory_window", f"hydra.run.dir={wdir}"]})
    names = [st["name"] for st in stages] + ["report"]
    stages.append({"name": "report", "dir": out, "done": [out / "results.json", out / "REPORT.md"],
                   "fn": functools.partial(report, names=names), "deps": names[:-1]})
    return stages


def clock(seconds: float) -> str:
    """'1h02m', '4m05s', '12s'."""
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def reference_seconds(profile: str) -> tuple[dict[str, float], str]:
    """Each stage's wall time in the reproduction snapshotted into docs/runs/<profile>/ (a run that wrote it, on the
    machine its provenance names), for the ETAs; ({}, '') without one."""
    from lmcal.docs import DOCS

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


def stage_command(stage: dict) -> list[str]:
    """The stage's command; for the tau-models, only those without results (a killed one resumes); [] for none."""
    cmd = list(stage.get("cmd") or [])
    if "taus" in stage:
        todo = [str(t) for t, d in stage["taus"].items() if not (d / "metrics.json").is_file()]
        cmd = cmd[:cmd.index("-m", 2) + 1] + [f"model.memory_tau={','.join(todo)}"] + cmd[cmd.index("-m", 2) + 1:]
        if not todo:
            cmd = []
    return cmd


def launch(stage: dict, out: Path) -> dict:
    """Starts a stage's process with its output appended to logs/<name>.log: {"proc" (None: nothing to run), "cmd",
    "log", "log_path", "t0"}."""
    log_path = out / "logs" / f"{stage['name']}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd, run = stage_command(stage), {"proc": None, "log": None, "log_path": log_path, "t0": time.perf_counter()}
    run["cmd"] = cmd
    if cmd:
        run["log"] = open(log_path, "a")
        run["log"].write(f"\n$ {shlex.join(cmd)}\n")
        run["log"].flush()
        run["proc"] = subprocess.Popen(cmd, stdout=run["log"], stderr=subprocess.STDOUT,
                                       env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    return run


def check_finished(stage: dict, run: dict, rc: int) -> None:
    """One paragraph if the stage's process failed or left out a file that shows it finished."""
    missing = [str(p) for p in stage["done"] if not p.is_file()]
    if rc or missing:
        failed = sorted(stage["dir"].rglob("failed.json")) if stage["dir"].is_dir() else []
        why = f"exit status {rc}" if rc else f"it did not write {', '.join(missing)}"
        if failed:
            why += f"; see {', '.join(map(str, failed))}"
        raise LmcalError(f"Stage '{stage['name']}' failed ({why}). Its log is {run['log_path']}. Rerun it alone "
                         f"with:\n  {shlex.join(run['cmd'])}\nor rerun the pipeline, which skips the finished stages.")


def stop(runs: dict) -> None:
    """Ends the stages still running (a failure elsewhere, Ctrl-C): a rerun resumes them."""
    for run in runs.values():
        if run["proc"] is not None and run["proc"].poll() is None:
            run["proc"].terminate()
    for run in runs.values():
        if run["proc"] is not None:
            run["proc"].wait()
        if run["log"] is not None:
            run["log"].close()


def stage_settings(stage: dict, cfg: DictConfig) -> dict:
    """The resolved settings `stage` runs with, checked against the range rules ({key: value}; for the tau-models
    {tau: {key: value}}; for the report, the profile keys it reads). Paths inside the output folder are recorded
    relative to it ("<out>/..."), so a moved or copied reproduction still resumes."""
    if "fn" in stage:
        return {"dataset": cfg.dataset, "taus": list(cfg.taus), "markov.taus": list(cfg.markov.taus),
                "windows": bool(cfg.get("windows", False)), "markov.windows": bool(cfg.markov.get("windows", False))}
    entry, overrides = stage["cmd"][2], [a for a in stage["cmd"][3:] if a != "-m"]
    out = str(Path(cfg.out).resolve())

    def checked(extra: list[str]) -> dict:
        c = composed(entry, overrides + extra)
        check_config(c, where=f"Stage '{stage['name']}' (python -m {entry}): ")
        return {k: "<out>" + v[len(out):] if isinstance(v, str) and v.startswith(out + os.sep) else v
                for k, v in settings_of(c).items()}

    if "taus" in stage:
        return {str(t): checked([f"model.memory_tau={t}"]) for t in stage["taus"]}
    return checked([])


def stale_stages(stages: list[dict], current: dict, out: Path, force: bool) -> dict[str, list[str] | None]:
    """The stages to redo because their recorded settings differ from `current`, with those downstream of them:
    {name: tau keys to redo, or None for the whole stage}. Without `force`, any such stage is an error listing the
    stages and keys that differ."""
    changed = {}
    for st in stages:
        rec = out / "stages" / f"{st['name']}.json"
        if not rec.is_file():
            continue
        record = read_json(rec)
        if "settings" not in record:  # a record of an lmcal that did not keep settings: adopt the current ones
            print(f"{st['name']}: recorded without its settings (an older lmcal); taking it as run with the current "
                  "ones.", flush=True)
            write_json_atomic(rec, {**record, "settings": current[st["name"]]})
            continue
        old, now = record["settings"], current[st["name"]]
        if "taus" in st:
            diffs = {t: differences(old[t], now[t]) for t in sorted(old.keys() & now.keys(), key=int)}
            diffs = {t: d for t, d in diffs.items() if d}
            if diffs:
                changed[st["name"]] = [f"tau={t} {line}" for t, d in diffs.items() for line in d], set(diffs)
        elif diff := differences(old, now):
            changed[st["name"]] = diff, None
    redo = {name: taus for name, (_, taus) in changed.items()}
    for st in stages:  # in pipeline order: whatever uses a redone stage's results is redone whole
        if any(d in redo for d in st["deps"]):
            redo[st["name"]] = None
    if changed and not force:
        listed = "; ".join(f"{name} ({', '.join(lines[:6])}{', ...' if len(lines) > 6 else ''})"
                           for name, (lines, _) in changed.items())
        downstream = [n for n in redo if n not in changed]
        raise LmcalError(
            f"The settings of {len(changed)} stage{'s' if len(changed) > 1 else ''} in {out} differ from those "
            f"{'they' if len(changed) > 1 else 'it'} ran with: {listed}. Nothing was run, and the results there are "
            "as they were. To redo " + ("them" if len(changed) > 1 else "it") +
            (f" and the stages that use their results ({', '.join(downstream)})" if downstream else "") +
            ", rerun with FORCE=1 (make reproduce ... FORCE=1, or force=true on the command line); or give another "
            "out=DIR for a separate reproduction.")
    return redo


def clear_stage(stage: dict, taus: set[str] | None, out: Path) -> None:
    """Removes what a stage wrote (for the tau-models, only the given taus), so that it runs again from scratch."""
    (out / "stages" / f"{stage['name']}.json").unlink(missing_ok=True)
    dirs = [stage["taus"][int(t)] for t in taus] if taus else [] if "fn" in stage else [stage["dir"]]
    for d in dirs:
        if d.is_dir() and d.resolve() != out:
            print(f"{stage['name']}: removing {d} to redo it (FORCE)", flush=True)
            shutil.rmtree(d)


def schedule(stages: list[dict], cfg: DictConfig, out: Path, current: dict, jobs: int, ref: dict[str, float]) -> None:
    """Runs the stages in plan order, up to `jobs` at once: a stage starts once every stage it depends on has
    finished (the report, in this process, once all have). A stage recorded as done is skipped unless a stage it
    depends on ran again. Every stage process gets the same environment (threads included) whatever `jobs` is, so
    its results do not depend on what runs beside it. On a failure the others are stopped; a rerun resumes."""
    total, index = len(stages), {st["name"]: i for i, st in enumerate(stages, 1)}
    todo, running, finished, ran = list(stages), {}, set(), set()
    tty, shown = sys.stdout.isatty(), time.perf_counter()
    try:
        while todo or running:
            for stage in list(todo):  # start what can start, in plan order
                name = stage["name"]
                if len(running) >= jobs or ("fn" in stage and running):
                    break
                if any(d not in finished for d in stage["deps"]):
                    continue
                todo.remove(stage)
                record = out / "stages" / f"{name}.json"
                rec = {"dir": str(stage["dir"]), "cmd": stage.get("cmd"), "settings": current[name]}
                if (record.is_file() and read_json(record).get("status") == "done" and not ran & set(stage["deps"])
                        and all(p.is_file() for p in stage["done"])):
                    print(f"[{index[name]}/{total}] {name}: done before, skipped", flush=True)
                    if read_json(record).get("settings") != rec["settings"]:  # the tau-models of a longer taus list
                        write_json_atomic(record, {**read_json(record), **rec})
                    finished.add(name)
                    continue
                write_json_atomic(record, {"status": "started", **rec})
                ran.add(name)  # what uses its results runs again too
                print(f"[{index[name]}/{total}] {name}: running (log: {out / 'logs' / (name + '.log')})", flush=True)
                if "fn" in stage:
                    t0 = time.perf_counter()
                    stage["fn"](cfg, out)
                    run = {"t0": t0, "proc": None, "log": None, "rec": rec}
                else:
                    run = launch(stage, out) | {"rec": rec}
                running[name] = run
            if todo and not running:  # nothing runs and nothing could start: a plan whose deps are not in it
                raise LmcalError(f"Stages {', '.join(st['name'] for st in todo)} wait on stages that are not in the "
                                 "plan; this is a bug in lmcal.reproduce.plan.")
            time.sleep(0.5 if any(r["proc"] is not None and r["proc"].poll() is None for r in running.values())
                       else 0)
            for name, run in list(running.items()):
                rc = run["proc"].poll() if run["proc"] is not None else 0
                if rc is None:
                    continue
                del running[name]
                if run["log"] is not None:
                    run["log"].close()
                stage = stages[index[name] - 1]
                if "fn" not in stage:
                    check_finished(stage, run, rc)
                seconds = time.perf_counter() - run["t0"]
                write_json_atomic(out / "stages" / f"{name}.json", {"status": "done", "seconds": seconds,
                                                                    **run["rec"]})
                finished.add(name)
                if tty:
                    print("\r\033[K", end="")
                print(f"[{index[name]}/{total}] {name}: done in {seconds:.0f} s", flush=True)
            now = time.perf_counter()
            if running and (tty or now - shown >= 60):
                later = [st["name"] for st in todo]
                after = sum(ref[n] for n in later) if all(n in ref for n in later) else None
                lines = [progress_line(n, index[n], total, now - r["t0"], ref, after if len(running) == 1 else None)
                         for n, r in running.items()]
                print(f"\r{'; '.join(lines)}\033[K" if tty else "\n".join(lines), end="" if tty else "\n",
                      flush=True)
                shown = now
    except BaseException:  # a failed stage, Ctrl-C or a kill: the others go down with the pipeline
        stop(running)
        raise


def reproduce(cfg: DictConfig) -> dict:
    check_config(cfg)  # the profile's own values (taus), before the folder is touched
    check_stages(list(cfg.stages), "full")
    if cfg.get("transformer"):
        check_stages(list(cfg.transformer.stages), "full")
    missing = [n for n in PAPER_STAGES if n not in cfg.stages]
    if missing:
        raise LmcalError(f"stages= must include {', '.join(PAPER_STAGES)}: the report is built on them (missing: "
                         f"{', '.join(missing)}). Add stages after them, e.g. stages=[{','.join(PAPER_STAGES)},NEW].")
    out = Path(cfg.out).resolve()
    with run_lock(out, "reproduction"):
        stages = plan(cfg)
        current = {st["name"]: stage_settings(st, cfg) for st in stages}  # every stage checked before any runs
        for name, taus in stale_stages(stages, current, out, bool(cfg.get("force"))).items():
            clear_stage(next(st for st in stages if st["name"] == name), taus, out)
        profile = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "force"])
        write_text_atomic(out / "profile.yaml", OmegaConf.to_yaml(profile))
        ref, ref_machine = reference_seconds(cfg.profile)
        if ref:
            print(f"ETAs from the {cfg.profile} reproduction in docs/runs/{cfg.profile} ({ref_machine}).", flush=True)
        t_all = time.perf_counter()
        schedule(stages, cfg, out, current, max(1, int(cfg.get("jobs", 1))), ref)
        print(f"Finished in {time.perf_counter() - t_all:.0f} s: {out / 'REPORT.md'}", flush=True)
    return json.loads((out / "results.json").read_text())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    try:
        reproduce(load_profile(argv))
    except LmcalError as e:
        print(f"\nlmcal: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nInterrupted: rerun the same command to resume; finished stages are kept.", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
