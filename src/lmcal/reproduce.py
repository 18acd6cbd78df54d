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
    transformer_*     a transformer trained on the same text (profile key `transformer`): its stages, and its
                      memory bound on tau-token windows (Table 1's second row, Figure 4's transformer column)
    report            results.json, REPORT.md, memory tables and Figure 4

Each stage runs as its own process (lmcal.pipeline: up to `jobs` at once, where they do not depend on each other)
with its log in <out>/logs/<stage>.log and records completion in <out>/stages/<stage>.json (written atomically,
after its outputs). A rerun skips recorded stages, and a training
that was killed resumes from its last checkpoint; the seeds make the results the same as an uninterrupted run's.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.pipeline import clock, progress_line, reference_seconds, schedule  # noqa: F401  (clock, progress_line: public)
from lmcal.results import PAPER_STAGES, read_json, report
from lmcal.settings import CONF_DIR, composed, differences, settings_of
from lmcal.stages import STAGES, check_stages
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
                # e.g. decoders take their calibration row from the calibration stage, when it runs
                uses = [u for u in STAGES[stage].uses if u in cfg.stages]
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
