"""`make reproduce` end to end: stages whose recorded settings changed, clearing what FORCE redoes, and the run itself
under the output folder's lock.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.pipeline.check import check
from lmcal.pipeline.plan import plan, stage_settings
from lmcal.pipeline.schedule import StagesFailed, reference_seconds, schedule
from lmcal.pipeline.slurm import check_slurm_tools, schedule_slurm
from lmcal.reporting.results import PAPER_STAGES, stage_record
from lmcal.stages.registry import check_stages
from lmcal.stages.wandb_run import check_online
from lmcal.utils.io import read_record, write_text_atomic
from lmcal.utils.lock import check_output_folder, run_lock, sweep_temp_files
from lmcal.utils.safe_paths import check_no_links
from lmcal.utils.settings import differences
from lmcal.utils.validate import check_config


def stale_stages(stages: list[dict], current: dict, out: Path, force: bool) -> dict[str, list[str] | None]:
    """The stages to redo because their recorded settings differ from `current`, with those downstream of them:
    {name: tau keys to redo, or None for the whole stage}. Without `force`, any such stage is an error listing the
    stages and keys that differ."""
    changed, taus_now = {}, []
    for st in stages:
        rec = out / "stages" / f"{st['name']}.json"
        record = stage_record(rec, warn=False)  # none, or one that is not whole: not done (the schedule warns)
        if record is None:
            continue
        old, now = record["settings"], current[st["name"]]
        if "taus" in st:
            taus_now += tau_changes(st["name"], old, now)
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
            (f" ({'; '.join(taus_now)})" if taus_now else "") + ", rerun with FORCE=1 (make reproduce ... FORCE=1, "
            "or force=true on the command line); or give another "
            "out=DIR for a separate reproduction.")
    return redo


def tau_changes(name: str, old: dict, now: dict) -> list[str]:
    """What a change of taus does to the tau stage `name` ({tau: settings} recorded and now): the taus it trains
    anew, and those it no longer reports (their folders are kept)."""
    added = sorted(now.keys() - old.keys(), key=int)
    dropped = sorted(old.keys() - now.keys(), key=int)
    return ([f"{name} trains tau={', '.join(added)} anew"] if added else []) + (
        [f"tau={', '.join(dropped)} of {name} is kept on disk but no longer reported"] if dropped else [])


def clear_stages(stages: list[dict], redo: dict[str, list[str] | None], out: Path) -> None:
    """Removes what the stages to redo (stale_stages: {name: taus or None}) wrote, so that they run again from scratch
    (for the tau-models, only the given taus): every folder is checked first (removable), and one that is not lmcal's
    to remove refuses the lot before anything is removed."""
    todo = []
    for name, taus in redo.items():
        stage = next(st for st in stages if st["name"] == name)
        dirs = [stage["taus"][int(t)] for t in taus] if taus else [] if "fn" in stage else [stage["dir"]]
        dirs = [d for d in dirs if d.exists() or d.is_symlink()]
        for d in dirs:
            removable(d, stage, out / "stages" / f"{name}.json", out)
        todo.append((stage, dirs))
    for stage, dirs in todo:
        (out / "stages" / f"{stage['name']}.json").unlink(missing_ok=True)
        for d in dirs:
            print(f"{stage['name']}: removing {d} to redo it (FORCE)", flush=True)
            shutil.rmtree(d)


def removable(d: Path, stage: dict, record: Path, out: Path) -> None:
    """Refuses (LmcalError) to remove `d` for FORCE unless it is a folder strictly inside `out` (no .., no link on the
    way) and the stage's record (<out>/stages/<stage>.json) names it, or the folder it lies in, as the stage's own
    (compared under `out`, so that a moved reproduction's records still count)."""
    norm, real = Path(os.path.normpath(d)), Path(d).resolve()
    own = Path(os.path.normpath(stage["dir"]))
    if not norm.is_relative_to(out) or norm == out or real != norm or d.is_symlink() or not d.is_dir():
        why = (f"it resolves to {real}, which is not a folder strictly inside the output folder {out}"
               if real != norm or not norm.is_relative_to(out) or norm == out else "it is not a plain folder")
    else:
        rec = read_record(record, warn=False) or {}
        was = Path(os.path.normpath(str(rec.get("dir", "")))).parts
        rel = own.relative_to(out).parts if own.is_relative_to(out) and own != out else ()
        ok = bool(rel) and tuple(was[-len(rel):]) == rel and norm.is_relative_to(own)
        why = None if ok else f"lmcal's record of that stage ({record}) does not say the stage made it"
    if why:
        raise LmcalError(f"FORCE would remove {d} to redo the stage {stage['name']}, but {why}. lmcal removes only "
                         "what its own stages made inside out. Nothing was removed or run. Move that folder away "
                         "yourself if it is to go, or give another out=DIR for a separate reproduction.")


def check_quotable(out: Path) -> None:
    """The stages get their folders as Hydra overrides (hydra.run.dir=<out>/...): a path Hydra's override grammar
    cannot read is refused before any folder is made, not after."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = str(out / "base")
    try:
        (o,) = OverridesParser.create().parse_overrides([f"hydra.run.dir={path}"])
        why = None if o.value() == path else f"it reads as {o.value()!r}"
    except Exception as e:
        why = " ".join(str(e).split())[:160]
    if why:
        raise LmcalError(f"out={out} cannot be passed to the stages: Hydra cannot read that path in an override "
                         f"({why}). Nothing was made. Choose a folder whose path has only letters, digits and / . _ - "
                         "(no non-ASCII letters, quotes, brackets, commas, = or ~).")


@contextmanager
def exit_when_stages_fail():
    """Stages that failed once the others finished (StagesFailed) end the process with their table on stderr and
    exit status 1: the run went wrong, unlike bad input (one paragraph, exit 2), and a rerun resumes it."""
    try:
        yield
    except StagesFailed as e:
        print(e, file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def reproduce(cfg: DictConfig) -> dict:
    """The whole pipeline: every check before the output folder is touched, then the stages under its lock; stages
    that fail end it with their table and exit status 1 once the others have finished (exit_when_stages_fail)."""
    if cfg.get("launcher", "local") not in ("local", "slurm"):
        raise LmcalError(f"launcher={cfg.launcher} is not a launcher: launcher=local runs the stages on this machine "
                         "(jobs=N at once), launcher=slurm submits each as a Slurm job (settings: slurm.<key>=..., "
                         "see conf/reproduce/launcher/slurm.yaml).")
    if cfg.get("launcher", "local") == "slurm":
        check_slurm_tools()
    check_config(cfg)  # the profile's own values (taus), before the folder is touched
    if cfg.get("logger") == "wandb" and not cfg.get("wandb_offline", True):
        check_online({"_target_": "WandbLogger", "offline": False}, "wandb_offline=false")
    check_stages(list(cfg.stages), "full")
    if cfg.get("transformer"):
        check_stages(list(cfg.transformer.stages), "full")
    missing = [n for n in PAPER_STAGES if n not in cfg.stages]
    if missing:
        raise LmcalError(f"stages= must include {', '.join(PAPER_STAGES)}: the report is built on them (missing: "
                         f"{', '.join(missing)}). Add stages after them, e.g. stages=[{','.join(PAPER_STAGES)},NEW].")
    out = Path(cfg.out).resolve()
    check_quotable(out)  # before the check, which composes every stage's command with paths under out
    check_output_folder(out)
    check_no_links(out, "output folder")  # (logs/, stages/, the stages' folders: nothing written through a link)
    estimates: dict[str, float] = {}
    check(cfg, estimates)  # every stage composed and sized against its model, before the folder is touched
    with run_lock(out, "reproduction"):
        sweep_temp_files(out)  # half-written files of a run that was killed
        stages = plan(cfg)
        current = {st["name"]: stage_settings(st, cfg) for st in stages}  # every stage checked before any runs
        clear_stages(stages, stale_stages(stages, current, out, bool(cfg.get("force"))), out)
        profile = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "force"])
        write_text_atomic(out / "profile.yaml", OmegaConf.to_yaml(profile))
        ref, ref_machine = reference_seconds(cfg.profile)
        print(f"ETAs from the {cfg.profile} reproduction in docs/runs/{cfg.profile} ({ref_machine})," if ref else
              "ETAs: the plan check's estimates,", "scaled to this machine as stages finish; each running stage also "
              "shows its current step's time left.", flush=True)
        t_all = time.perf_counter()
        if cfg.get("launcher", "local") == "slurm":  # each stage a Slurm job (lmcal.pipeline.slurm)
            schedule_slurm(stages, cfg, out, current, ref)
        else:
            with exit_when_stages_fail():
                schedule(stages, cfg, out, current, max(1, int(cfg.get("jobs", 1))), ref, estimates)
        print(f"Finished in {time.perf_counter() - t_all:.0f} s: {out / 'REPORT.md'}", flush=True)
    return json.loads((out / "results.json").read_text())
