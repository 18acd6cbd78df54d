"""`make reproduce`'s plan: the profile (conf/reproduce/<profile>.yaml with the command line's overrides), the stages in
order with their commands and the files that show them finished, and the settings each stage runs with.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.pipeline.slurm import slurm_defaults
from lmcal.reporting.report_md import report
from lmcal.reporting.results import PAPER_STAGES
from lmcal.stages.registry import STAGES
from lmcal.stages.wandb_run import reproduction_group
from lmcal.utils.rules import PROFILE_RULES, RULES
from lmcal.utils.safe_paths import check_name
from lmcal.utils.settings import CONF_DIR, composed, settings_of
from lmcal.utils.validate import check_config

PROFILES = ("paper", "paper_full", "paper_mini", "cpu", "smoke", "scale", "scale_gpu")  # scale*: pipeline.scale_sweep


def resolve_profile(name: str) -> tuple[str, str | None]:
    """(profile, note): `auto` becomes paper with CUDA, else cpu, with a line saying so."""
    if name == "auto":
        from lmcal.utils.device import auto_profile

        name, why = auto_profile()
        return name, f"{why}; choose another with `make reproduce PROFILE=paper|paper_mini|paper_full|cpu|smoke`."
    if name not in PROFILES:
        raise LmcalError(f"Unknown profile {name!r}: use auto, paper (one GPU, about 5.3 hours), paper_mini (its "
                         "rehearsal in minutes), paper_full (the paper's 500 epochs), cpu or smoke; or scale (the "
                         "scale sweeps on 2 CPU cores) or scale_gpu (on one GPU).")
    return name, None


CLI_ONLY = ("profile", "force", "force_size")  # keys of the command line that are not the profile's settings


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
    if "extends" in profile:  # a profile that differs from another in a few keys lists only those (paper_full)
        parent = profile.pop("extends")
        profile = OmegaConf.merge(OmegaConf.load(CONF_DIR / "reproduce" / f"{parent}.yaml"), profile)
    # every profile runs its stages here (launcher=local: forked by a warm worker, lmcal.pipeline.warm, unless
    # warm_worker=false) or as Slurm jobs (launcher=slurm, slurm.<key>=...), and uploads its checkpoints to W&B only
    # with wandb_log_model=true
    profile = OmegaConf.merge({"launcher": "local", "slurm": slurm_defaults(), "wandb_log_model": False,
                               "warm_worker": True}, profile)
    known = _keys(profile)
    unknown = [k for k in _keys(cli) if k not in known and k not in CLI_ONLY
               and not any(k.startswith(f"{p}.") for p in known)]
    if unknown:
        raise LmcalError(f"Unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (in ARGS or on the "
                         f"command line). The {name} profile (conf/reproduce/{name}.yaml) has: {', '.join(known)}; "
                         "and the command line also takes profile=, force=true (FORCE=1) and force_size=true.")
    cfg = OmegaConf.merge(profile, cli)
    cfg.profile = name
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation now: one that fails is an error before any work
    check_profile(cfg)  # (force=maybe refused before it is read as true)
    cfg.force = bool(cfg.get("force", False))
    if cfg.get("out") is None:
        cfg.out = f"outputs/reproduce/{name}"
    if note:
        print(note, flush=True)
    return cfg


def check_names(cfg: DictConfig) -> None:
    """Every setting of the profile that becomes a folder's name under out (the dataset, the stages, the sweeps) is
    one plain name (lmcal.utils.safe_paths): nothing is planned, written or removed outside out."""
    named = [("dataset", cfg.dataset)] if "dataset" in cfg else []
    named += [(f"stages[{i}]", v) for i, v in enumerate(cfg.get("stages") or [])]
    if cfg.get("transformer"):
        named += [(f"transformer.stages[{i}]", v) for i, v in enumerate(cfg.transformer.get("stages") or [])]
    named += [(f"sweeps.{k} (a sweep's name)", k) for k in (cfg.get("sweeps") or {})]
    for setting, value in named:
        check_name(value, setting)


def check_profile(cfg: DictConfig) -> None:
    """The profile's own values, before any work (check=true and a real run alike): its names (check_names), then
    the ranges of its settings (lmcal.utils.rules: jobs, taus, bootstrap, estimate_for, warm_worker, force, ...)."""
    check_names(cfg)
    check_config(cfg, where=f"The {cfg.get('profile', 'reproduce')} profile: ", rules=RULES | PROFILE_RULES)


def logger_overrides(cfg: DictConfig) -> list[str]:
    """One W&B project and group for every run of a reproduction (offline unless the profile says otherwise)."""
    if cfg.logger == "wandb":
        return ["logger=wandb", f"logger.project={cfg.wandb_project}", f"logger.group={reproduction_group(cfg.out)}",
                f"logger.offline={str(cfg.wandb_offline).lower()}",
                *(["logger.log_model=true"] if cfg.get("wandb_log_model") else [])]
    return [f"logger={cfg.logger}"]


def _corpus_stages(cfg: DictConfig, prefix: str, part, data: str, out: Path, py: list[str],
                   lg: list[str]) -> list[dict]:
    """One corpus's stages (prefix "" for the profile's dataset, "markov_" for the Markov source): its base model,
    its tau-models, the full model's analysis stages (the dataset's only) and a memory bound per tau."""
    stages = []
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
            done = [root / stage / "evaluation.json",
                    *([root / stage / f"{stage}.json"] if stage in PAPER_STAGES else [])]
            stages.append({"name": stage, "dir": root / stage, "done": done,  # (the report reads both)
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
    return stages


def _transformer_stages(tr, dataset: str, out: Path, py: list[str], lg: list[str]) -> list[dict]:
    """A transformer trained here: Table 1's row, its stages, and its memory profile without tau-models."""
    stages = []
    root = out / "transformer"
    base_ckpt = root / "base" / "checkpoints" / "best.ckpt"
    stages.append({"name": "transformer_base", "dir": root / "base", "done": [root / "base" / "metrics.json"],
                   "deps": [], "cmd": py + ["lmcal.train", f"data={dataset}", *tr.base, "analysis.stages=[]",
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
    return stages


def plan(cfg: DictConfig) -> list[dict]:
    """The stages in order: name, command (argv) or in-process function, and the files that show it finished."""
    check_names(cfg)
    out = Path(cfg.out).resolve()
    py = [sys.executable, "-m"]
    lg = logger_overrides(cfg)
    stages = []
    for prefix, part, data in (("", cfg, cfg.dataset), ("markov_", cfg.markov, "markov")):
        stages += _corpus_stages(cfg, prefix, part, data, out, py, lg)
    if cfg.get("transformer"):
        stages += _transformer_stages(cfg.transformer, cfg.dataset, out, py, lg)
    names = [st["name"] for st in stages] + ["report"]
    # inputs: files other runs add that the report reads (the dose-response rows beside calibration.json): when they
    # change, the report runs again though every stage is done
    stages.append({"name": "report", "dir": out, "done": [out / "results.json", out / "REPORT.md"],
                   "inputs": [out / cfg.dataset / "calibration" / "dose_rows_*.json"],
                   "fn": functools.partial(report, names=names), "deps": names[:-1]})
    return told_force_size(stages, cfg)


def told_force_size(stages: list[dict], cfg: DictConfig) -> list[dict]:
    """With force_size=true, each stage's command says so too: its own size checks (the plan check's and the stage
    process's) let through what the user meant."""
    for st in stages if cfg.get("force_size") else ():
        st.get("cmd", []).append("force_size=true")
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
