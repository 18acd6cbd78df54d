"""The W&B logger of `python -m lmcal.train`: Lightning's WandbLogger opened with the setup every lmcal run shares
(lmcal.stages.wandb_run), a multirun job's group and name suffix, and the run closed whatever happened."""

from __future__ import annotations

from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.loggers import WandbLogger

from lmcal.models.checkpoint import model_name
from lmcal.stages.wandb_run import init_args, multirun_member, open_run


def make_logger(cfg: DictConfig, out: Path, vocab_size: int | None = None):
    """The run's logger: Lightning's WandbLogger with the W&B setup every run shares (lmcal.stages.wandb_run:
    name, job type `train` or `tau_model`, tags, group, mode passed explicitly, the run id kept in the folder so a
    resumed training continues its run), or the configured other logger (CSV), or none. The W&B run's config is the
    composed config once (Lightning's copy of the module's hyper-parameters would repeat it at the top level), with
    model.vocab_size the corpus's."""
    lg = cfg.get("logger")
    if not lg or lg.get("_target_") is None:
        return False
    config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    if vocab_size is not None:
        config["model"]["vocab_size"] = vocab_size
    group, suffix = multirun_member()
    args = init_args(OmegaConf.to_container(lg, resolve=True), out,
                     job_type="tau_model" if cfg.model.get("memory_tau") else "train", model=model_name(cfg.model),
                     dataset=cfg.data.name, group=group, config=config, suffix=suffix)
    if args is None:
        return instantiate(lg)
    class ConfigOnceWandbLogger(WandbLogger):
        def log_hyperparams(self, params, *args, **kwargs) -> None:  # the run's config is given when it opens
            pass

    run = open_run(args)  # opened here, with the mode in its arguments: WandbLogger(offline=True) sets $WANDB_MODE
    run.define_metric("trainer/global_step")  # as WandbLogger does for the runs it opens itself
    run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
    return ConfigOnceWandbLogger(experiment=run, project=args["project"], name=args["name"], id=args["id"],
                                 save_dir=args["dir"])


def finish_logger(logger) -> None:
    """Close the W&B run whatever happened, so offline runs are complete and syncable."""
    if isinstance(logger, WandbLogger):
        import wandb

        wandb.finish()  # not logger.experiment, which would open a run that never started
