"""The W&B run of an analysis process, opened with wandb itself (analysis processes never import Lightning), and
logging to it or to the run behind training's Lightning WandbLogger.
"""

from __future__ import annotations

from pathlib import Path


def wandb_run(logger_cfg, config: dict | None = None):
    """The W&B run of an analysis entry point, from the logger node (conf/logger) that training gives Lightning's
    WandbLogger, opened with wandb itself so that these processes never import Lightning; False for any other logger
    (the stages' results are in their JSON files)."""
    node = dict(logger_cfg or {})
    if not str(node.pop("_target_", "")).endswith("WandbLogger"):
        return False
    import wandb

    offline, save_dir = node.pop("offline", False), node.pop("save_dir", None)
    node.pop("log_model", None)
    Path(save_dir or ".").mkdir(parents=True, exist_ok=True)
    return wandb.init(**node, dir=save_dir, mode="offline" if offline else "online", resume="allow", config=config)


def finish_run(run) -> None:
    """Close the W&B run whatever happened, so offline runs are complete and syncable."""
    if run:
        run.finish()


def wandb_log(logger, scalars: dict | None = None, images: dict | None = None, tables: dict | None = None) -> None:
    """Log to a W&B run, or the one behind a Lightning WandbLogger; a no-op for any other logger."""
    run = logger.experiment if type(logger).__name__ == "WandbLogger" else logger
    if type(run).__name__ != "Run":
        return
    import wandb

    payload = dict(scalars or {})
    payload.update({k: wandb.Image(str(v)) for k, v in (images or {}).items()})
    payload.update({k: wandb.Table(columns=cols, data=rows) for k, (cols, rows) in (tables or {}).items()})
    run.log(payload)
