"""One training run's work once its settings have passed (lmcal.train checks them, locks the run folder, then calls
`run`): the data, the module, the callbacks, the logger, Lightning's fit and the records; the stages after training
and their sizes come from the entry point's `analysis_plan`. Kept apart from the entry point so that
`python -m lmcal.train --help` and a refused setting answer before Lightning is imported."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import WandbLogger

from lmcal.errors import LmcalError
from lmcal.models.checkpoint import checkpoint_names, model_name
from lmcal.stages.registry import check_stages, summary
from lmcal.stages.wandb_run import log_checkpoint, use_checkpoint
from lmcal.training.callbacks import (
    EpochEntropyRateCallback,
    MetricsCallback,
    StagesCallback,
    TrainingProgress,
    progress_bar,
)
from lmcal.training.checkpoint_io import AtomicCheckpointIO, check_resume, init_from
from lmcal.training.module import LMModule
from lmcal.training.scale_run import record_training
from lmcal.training.wandb_logger import finish_logger, make_logger
from lmcal.utils.budget import tau_too_long
from lmcal.utils.device import precision_policy
from lmcal.utils.io import write_json_atomic
from lmcal.utils.oom import is_out_of_memory, oom_refusal

log = logging.getLogger("lmcal")


def fit(trainer: pl.Trainer, module, dm, resume: str | None) -> None:
    """trainer.fit, stopped as the rest of lmcal stops: Lightning turns Ctrl-C and SIGTERM (our handler's Stopped,
    lmcal.utils.boundary) into its own message and sys.exit(1); the stop is raised again instead, so that the entry
    point ends with its one line and 130 or 128 + the signal."""
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume)
    except SystemExit as e:
        if isinstance(e.__context__, KeyboardInterrupt):
            raise e.__context__ from None
        raise
    except Exception as e:
        if is_out_of_memory(e) and not isinstance(e, LmcalError):  # (a paragraph naming data.batch_size; a stage's
            # own, during training, names the stage's setting)
            raise oom_refusal(e, "Training", "data", {"batch_size": dm.batch_size}) from e
        raise


def _module(cfg: DictConfig, dm) -> LMModule:
    """The training module for the data `dm`, from the model and optimiser settings."""
    tau, n_train = cfg.model.get("memory_tau"), len(dm.tokens("train"))
    if tau and tau >= n_train:
        raise LmcalError(tau_too_long("model.memory_tau", int(tau), n_train, "training") + " Lower it, or train on "
                         "more text (data.max_train_tokens).")
    return LMModule(net=OmegaConf.to_container(cfg.model, resolve=True), vocab_size=dm.vocab_size,
                    optim=OmegaConf.to_container(cfg.optim, resolve=True), bptt=cfg.data.bptt,
                    data_cfg=OmegaConf.to_container(cfg.data, resolve=True), seed=cfg.seed)


def run_precision(cfg: DictConfig) -> dict:
    """What metrics.json records of the arithmetic: Lightning's trainer.precision (32-true; bf16-mixed autocasts the
    matmuls and the LSTM to bfloat16, the weights, checkpoints and final scores stay float32) and the TF32 flags."""
    return {"trainer": str(cfg.trainer.get("precision", "32-true")), **precision_policy()}


def _callbacks(cfg: DictConfig, out: Path, resume: str | None, stages: list[str], settings: dict,
               base_ckpt: str | None) -> tuple[list, MetricsCallback, StagesCallback]:
    """Checkpoints (best.ckpt; last.ckpt after every epoch, the one a rerun resumes from: its own callback, since
    Lightning's save_last writes it only on an epoch that also writes best.ckpt), metrics.json, the stages after
    training, the progress lines, and the entropy rate every N epochs where asked."""
    ckpt_dir = out / "checkpoints"
    ckpt_cb = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val_loss", mode="min",
                              save_top_k=1, enable_version_counter=False)
    last_cb = ModelCheckpoint(dirpath=ckpt_dir, filename="last", monitor=None, save_top_k=1, every_n_epochs=1,
                              enable_version_counter=False)
    metrics_cb = MetricsCallback(out, extra={"dataset": cfg.data.name, "model": model_name(cfg.model),
                                             "resumed_from": resume, "precision": run_precision(cfg)})
    stages_cb = StagesCallback(out, stages, settings, model_name(cfg.model), base_ckpt)
    callbacks = [ckpt_cb, last_cb, metrics_cb, stages_cb]  # metrics.json is written before any stage runs
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(progress_bar() if sys.stderr.isatty() else TrainingProgress())  # a log: lines with ETAs
    every = (settings.get("entropy_rate") or {}).pop("every_n_epochs", None)
    if every:
        check_stages(["entropy_rate"], "tau" if cfg.model.get("memory_tau") else "full")
        callbacks.append(EpochEntropyRateCallback(out, every, model_name=model_name(cfg.model), corpus=cfg.data.name,
                                                  **settings["entropy_rate"]))
    return callbacks, metrics_cb, stages_cb


def run(cfg: DictConfig, out: Path, analysis_plan: Callable) -> dict:
    """Fit (or resume) into `out`, evaluate the best checkpoint on valid and test, run the stages, write
    metrics.json; returns its metrics. `analysis_plan(cfg, dm)`: the stages after training, their settings and the
    memory stage's base checkpoint, checked against the data before training (lmcal.train's, which sizes them
    through lmcal.pipeline)."""
    t_start = time.perf_counter()
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    dm = instantiate(cfg.data)
    dm.prepare()  # fail early, with the data's own message, before any logger starts
    module = _module(cfg, dm)
    last = out / "checkpoints" / "last.ckpt"
    resume = cfg.get("ckpt_path") or (str(last) if last.is_file() else None)
    if resume:
        check_resume(resume, OmegaConf.to_container(cfg.model, resolve=True), dm.vocab_size)
        log.info(f"Resuming from {resume}")
    stages, settings, base_ckpt = analysis_plan(cfg, dm)
    if cfg.get("init_ckpt") and not resume:
        init_from(module, cfg.init_ckpt)
    callbacks, metrics_cb, stages_cb = _callbacks(cfg, out, resume, stages, settings, base_ckpt)
    logger = make_logger(cfg, out, dm.vocab_size)
    try:
        if logger and not isinstance(logger, WandbLogger):  # W&B got the config when its run opened
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
        if isinstance(logger, WandbLogger):  # the checkpoints it reads (warm start, memory base) as its inputs
            for path in {p for p in (None if resume else cfg.get("init_ckpt"), base_ckpt) if p}:
                use_checkpoint(logger, path, *checkpoint_names(path))
        bar = bool(cfg.trainer.get("enable_progress_bar", True)) and sys.stderr.isatty()  # else TrainingProgress
        trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger, default_root_dir=str(out),
                                          plugins=[AtomicCheckpointIO()], enable_progress_bar=bar)
        fit(trainer, module, dm, resume)
        metrics = metrics_cb.metrics
        if metrics is None:
            raise LmcalError(f"Training stopped before it could be scored; see {out / 'train.log'}.")
        if isinstance(logger, WandbLogger):  # the checkpoint as the run's output: the analyses of it link to it
            log_checkpoint(logger, metrics["best_ckpt"], model_name(cfg.model), cfg.data.name,
                           upload=bool(cfg.logger.get("log_model")))
        metrics.update(summary(stages_cb.results))
        record_training(out, trainer, dm, metrics, stages_cb.results, logger)  # scale.json, after entropy_rate
        if stages:
            metrics["wall_seconds"] = time.perf_counter() - t_start
            write_json_atomic(out / "metrics.json", metrics)
        return metrics
    finally:
        finish_logger(logger)
