"""One W&B setup for every run: `init_args` gives the keyword arguments of `wandb.init`, which training hands to
Lightning's WandbLogger and analysis, report and tabulation processes to `wandb.init` itself (these never import
Lightning), so every run has the same project, mode, name, job type, tags and group.

The mode is passed explicitly (offline unless logger.offline=false), never through $WANDB_MODE: Lightning's
`offline=True` sets WANDB_MODE=dryrun, which wandb no longer reads once another run has started in the process
(it then asks for an API key). A run's id is kept in its folder (`wandb_run_id`), so a resumed training, or a rerun
in the same folder, continues its W&B run.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from pathlib import Path
from urllib.parse import urlparse

from lmcal.errors import LmcalError

ID_FILE = "wandb_run_id"
_ID = re.compile(r"[a-z0-9]{8,32}")


def slug(text: str) -> str:
    """A display name as a run-name part ('AWD-LSTM 400/1150/3, tau=5': awd-lstm-400-1150-3-tau5)."""
    return re.sub(r"[^a-z0-9.]+", "-", str(text).lower().replace("tau=", "tau")).strip("-")


def metric_key(key: str) -> str:
    """A W&B key of letters, digits and _ . - / only, each part of a label kept readable: 'top_p (p=0.9)' ->
    'top_p_p0.9', 'future_entropy (horizon_k=5, discount=0.95)' -> 'future_entropy_horizon_k5_discount0.95',
    'calibration: entrate_ppl' -> 'calibration/entrate_ppl'."""
    key = str(key).replace(": ", "/").replace(" (", "_").replace(", ", "_").replace("=", "").replace(")", "")
    return "/".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", part).strip("_") for part in key.split("/"))


def run_name(job: str, model: str | None = None, dataset: str | None = None) -> str:
    """`<job>-<model>-<dataset>`, one rule for every run: the job (train, tau_model, the stages, memory-window, report),
    the model with its tau (`awd-lstm-400-1150-3-tau5`: a tau-model's, or the window's), then the dataset."""
    return "-".join([job, *(slug(x) for x in (model, dataset) if x)])


def sweep_suffix(values: dict[str, str]) -> str | None:
    """A sweep member's part of its run name: its values of the keys its sweep varies, in order ('1.1-20000'), so
    members that differ only in budget or amount are told apart. The model and data presets (and a Hugging Face
    model's path) are left out: the name has the model and the dataset already."""
    named = ("model", "data", "model.name_or_path")
    return "-".join(p for k, v in values.items() if k.lstrip("+~") not in named and (p := slug(v))) or None


def wandb_group(logger) -> str | None:
    """The W&B group of a run (a W&B run, or Lightning's WandbLogger around one); None for any other logger."""
    def kind(x):  # by class name, subclasses too (train's logger subclasses WandbLogger): no Lightning import here
        return {c.__name__ for c in type(x).__mro__}

    run = logger.experiment if "WandbLogger" in kind(logger) else logger
    return getattr(run, "group", None) if "Run" in kind(run) else None


def multirun_member() -> tuple[str | None, str | None]:
    """(W&B group, name suffix) of a Hydra multirun's job: the sweep's group, `multirun-<sweep folder>`, and the
    job's values of the keys the sweep varies (the preset's hydra.sweeper.params and the command line's comma lists,
    as the sweep's multirun.yaml records them; none where the name has them already, as a Hugging Face family's
    paths), or its job number where no swept key is known. (None, None) outside a multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None, None
    hc = HydraConfig.get()
    parser = OverridesParser.create()
    swept = set(hc.sweeper.get("params") or {})  # the preset's keys
    try:  # the command line as the sweep was launched: its comma lists, and the preset's keys it fixed (values only)
        record = OmegaConf.load(Path(hc.sweep.dir) / "multirun.yaml")
        launched = parser.parse_overrides(list(record.hydra.overrides.task))
        swept -= {o.get_key_element() for o in launched if not o.is_sweep_override()}
        swept |= {o.get_key_element() for o in launched if o.is_sweep_override()}
    except Exception:  # no record (a launcher that writes none): the preset's keys, or the job number
        pass
    job = {o.get_key_element(): o.get_value_element_as_str() for o in parser.parse_overrides(list(hc.overrides.task))}
    suffix = sweep_suffix({k: v for k, v in job.items() if k in swept}) if swept else str(hc.job.num)
    return f"multirun-{Path(hc.sweep.dir).name}", suffix


def model_group(model: str | None, dataset: str | None) -> str | None:
    """The W&B group of a run outside a reproduction or sweep: its model and dataset (`awd-lstm-400-1150-3-ptb`), so
    that a training and the analyses of its checkpoint are grouped together."""
    return "-".join(slug(x) for x in (model, dataset) if x) or None


def clean_config(config: dict) -> dict:
    """A run's config without the values OmegaConf leaves unset ('???': filled in at run time) and with `tau` as a
    field of its own (the config's `tau` where the entry point set it, else model.memory_tau), for grouping and
    filtering."""
    def clean(node):
        if isinstance(node, dict):
            return {k: clean(v) for k, v in node.items() if v != "???"}
        return [clean(v) for v in node] if isinstance(node, list) else node

    out = clean(config)
    return {**out, "tau": out.get("tau", (out.get("model") or {}).get("memory_tau"))}


def reproduction_group(out: str | Path) -> str:
    """The W&B group of every run of a reproduction, named after its folder (outputs/reproduce/cpu: reproduce-cpu)."""
    return f"reproduce-{Path(out).resolve().name}"


def run_id(out_dir: str | Path) -> str:
    """The W&B id of the run in `out_dir`: the one written there before (checked: 8-32 lower-case letters and
    digits, else a new one), or a new one, written down."""
    path = Path(out_dir) / ID_FILE
    old = path.read_text().strip() if path.is_file() else ""
    if _ID.fullmatch(old):
        return old
    new = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))  # W&B's own form
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new + "\n")
    return new


def init_args(logger_cfg, out_dir: str | Path | None, job_type: str, model: str | None = None,
              dataset: str | None = None, group: str | None = None, tags: tuple[str, ...] = (),
              config: dict | None = None, name: str | None = None, suffix: str | None = None) -> dict | None:
    """`wandb.init` keyword arguments from the logger node (conf/logger/wandb.yaml: project, group, name, offline,
    save_dir) for the run in `out_dir`; None for any other logger. `group` is the default group (a multirun's or a
    reproduction's; else the run folder's name); the node's own group and name win. `suffix` ends the name (a sweep
    member's values; the node's name_suffix wins). `out_dir` None: the node's save_dir."""
    node = dict(logger_cfg or {})
    if not str(node.pop("_target_", "")).endswith("WandbLogger"):
        return None
    import wandb

    offline = node.pop("offline", True)
    save_dir = node.pop("save_dir", None) or out_dir
    out_dir = out_dir or save_dir or "."
    node.pop("log_model", None)
    suffix = node.pop("name_suffix", None) or suffix
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    config = clean_config(dict(config or {}))
    config["data"] = config.get("data") or {"name": dataset}  # every run filterable by dataset and model
    config["model"] = config.get("model") or {"name": model}
    return {"project": node.pop("project", None) or "lmcal",
            "name": node.pop("name", None) or "-".join([run_name(name or job_type, model, dataset),
                                                        *([slug(suffix)] if suffix else [])]),
            "group": node.pop("group", None) or group or model_group(model, dataset) or Path(out_dir).resolve().name,
            "job_type": job_type,
            "tags": sorted({job_type, *(slug(t) for t in (model, dataset) if t), *(t for t in tags if t)}),
            "dir": str(save_dir), "mode": "offline" if offline else "online",
            "id": run_id(out_dir), "resume": "allow", "config": config,
            # the console as the run's Logs tab (files/output.log): what the process printed and logged
            "settings": wandb.Settings(silent=True, console="wrap"), **node}


def _has_api_key(host: str) -> bool:
    """Whether W&B has credentials for `host` without asking: $WANDB_API_KEY (or an identity token file), or a
    `wandb login` entry in ~/.netrc ($NETRC)."""
    import netrc

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        auth = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def check_online(logger_cfg, what: str = "logger.offline=false") -> None:
    """A W&B logger set to log online must have an API key and reach W&B's server: refused at once where either is
    missing, saying what to set (W&B itself would ask for a key on a terminal, or retry for most of a minute).
    Nothing for an offline, disabled or other logger."""
    node = dict(logger_cfg or {})
    if not str(node.get("_target_", "")).endswith("WandbLogger") or node.get("offline", True):
        return
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    fix = (" Nothing was run or written. Log offline instead (logger.offline=true, the default; `wandb sync` uploads "
           "the run later)")
    if not _has_api_key(host):
        raise LmcalError(f"{what} logs to W&B online ({host}), but no W&B API key is set: run `wandb login` (it "
                         f"writes ~/.netrc) or set WANDB_API_KEY.{fix}.")
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        raise LmcalError(f"{what} logs to W&B online, but {host}:{port} cannot be reached from this machine "
                         f"({e.strerror or type(e).__name__}).{fix}, or set WANDB_BASE_URL to a W&B server this "
                         "machine reaches.") from None


def open_run(args: dict | None):
    """A W&B run opened with `init_args`'s arguments (False for None: no W&B run); a run left open in this process
    is finished first."""
    if not args:
        return False
    import wandb

    return wandb.init(**args, reinit="finish_previous")


def wandb_run(logger_cfg, config: dict | None = None, out_dir: str | Path | None = None, **kw):
    """The W&B run of an analysis entry point (`init_args`, then `open_run`); False for any other logger (the
    stages' results are in their JSON files)."""
    return open_run(init_args(logger_cfg, out_dir, config=config, **{"job_type": "evaluate", **kw}))


def finish_run(run) -> None:
    """Close the W&B run whatever happened, so offline runs are complete and syncable."""
    if run:
        run.finish()


def _run_of(logger):
    run = logger.experiment if type(logger).__name__.endswith("WandbLogger") else logger
    return run if type(run).__name__ == "Run" else None


def wandb_log(logger, scalars: dict | None = None, images: dict | None = None, tables: dict | None = None,
              summary: dict | None = None) -> None:
    """Log to a W&B run, or the one behind a Lightning WandbLogger; a no-op for any other logger. `summary` goes to
    the run summary (final numbers), not to its history."""
    run = _run_of(logger)
    if run is None:
        return
    import wandb

    payload = {metric_key(k): v for k, v in (scalars or {}).items()}
    payload.update({metric_key(k): wandb.Image(str(v)) for k, v in (images or {}).items()})
    payload.update({metric_key(k): wandb.Table(columns=cols, data=rows) for k, (cols, rows) in (tables or {}).items()})
    if payload:
        run.log(payload)
    if summary:  # (a key the history holds too is one key: the same name, cleaned alike)
        run.summary.update({metric_key(k): v for k, v in summary.items()})


def log_curves(logger, key: str, step_key: str, steps, curves: dict[str, list], legend: dict | None = None) -> None:
    """Generation curves as data W&B plots and overlays: one history row per step, `step_key` the x axis
    (define_metric), each curve a series `key/<label>`, the label the same in every run (a method's name and the
    settings a user chose, lmcal.stages.rows.method_label: so curves of two runs overlay); also a line-series chart of
    all of them, whose legend may say more (`legend`: label -> text, e.g. with a fitted value)."""
    run = _run_of(logger)
    if run is None or not curves:
        return
    import wandb

    steps, x = [int(s) for s in steps], metric_key(f"{key}/{step_key}")
    series = {metric_key(f"{key}/{label}"): v for label, v in curves.items()}
    run.define_metric(x, hidden=True)
    for name in series:
        run.define_metric(name, step_metric=x)
    for i, s in enumerate(steps):
        run.log({x: s, **{name: float(v[i]) for name, v in series.items()}})
    keys = [(legend or {}).get(label, label) for label in curves]
    ys = [[float(y) for y in v] for v in curves.values()]
    run.log({metric_key(f"{key}/chart"): wandb.plot.line_series(xs=steps, ys=ys, keys=keys, title=key,
                                                                 xname=step_key)})


def log_config(logger, values: dict) -> None:
    """Values a run chose as it went (a fitted alpha or temperature) into its config, where runs are compared by
    them, not into its series' names."""
    run = _run_of(logger)
    if run is not None and values:
        run.config.update(values, allow_val_change=True)


def checkpoint_artifact(path: str | Path, model: str, dataset: str, upload: bool = False):
    """The W&B artifact of a checkpoint, `checkpoint-<model>-<dataset>` (type model): the file itself with `upload`
    (logger.log_model=true), else a reference to its path (nothing uploaded). Both have the same digest (the file's
    MD5), so the training that wrote it and the analyses that read it name the same artifact version."""
    import wandb

    art = wandb.Artifact(f"checkpoint-{slug(model)}-{slug(dataset)}", type="model",
                         metadata={"model": model, "dataset": dataset})
    if upload:
        art.add_file(str(path), name="best.ckpt")
    else:
        art.add_reference(Path(path).resolve().as_uri(), name="best.ckpt")
    return art


def log_checkpoint(logger, path: str | Path, model: str, dataset: str, upload: bool = False) -> None:
    """The training run's checkpoint as its output artifact (checkpoint_artifact)."""
    run = _run_of(logger)
    if run is not None and Path(path).is_file():
        run.log_artifact(checkpoint_artifact(path, model, dataset, upload))


def use_checkpoint(logger, path: str | Path, model: str, dataset: str) -> None:
    """The checkpoint an analysis run reads, as its input artifact: the lineage from the training run to the
    analyses of its checkpoint. wandb refuses use_artifact offline, so an offline run records the use as
    use_artifact does for a new artifact (the artifact, to be used once committed), which `wandb sync` uploads."""
    run = _run_of(logger)
    if run is not None and Path(path).is_file():
        use_artifact(run, checkpoint_artifact(path, model, dataset))


def use_artifact(run, art) -> None:
    """`art` as an input of `run`; offline as use_artifact records a new artifact (to be used once committed)."""
    if run.offline:
        run._log_artifact(art, aliases=[], is_user_created=True, use_after_commit=True)
    else:
        run.use_artifact(art)


def files_artifact(name: str, kind: str, files: list[str | Path]):
    """Result files (results.json, REPORT.md, evaluation.json) as one artifact: its digest is theirs, so a run that
    builds it again from the same files names the same version."""
    import wandb

    art = wandb.Artifact(name, type=kind)
    for f in files:
        if Path(f).is_file():
            art.add_file(str(f), name=Path(f).name)
    return art


def log_files(logger, name: str, kind: str, files: list[str | Path]) -> None:
    """Result files as one artifact of the run (files_artifact), uploaded on sync."""
    run = _run_of(logger)
    if run is not None:
        run.log_artifact(files_artifact(name, kind, files))
