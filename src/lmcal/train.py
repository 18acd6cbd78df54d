"""Train one language model: `python -m lmcal.train [hydra overrides]`.

`train(cfg)` is a plain function (tests call it through Hydra's compose API); `main` is
the Hydra entry point around it, which turns `LmcalError`s into one-paragraph messages. Its parts are in
lmcal.training: the settings' checks (run_checks, with `check_settings`, which lmcal.utils.precheck calls through
this module, and TRAINABLE, device_count), checkpoints (checkpoint_io), the W&B logger (wandb_logger), the module and
callbacks.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from pathlib import Path

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import WandbLogger

from lmcal.core.lookahead import set_memory_budget
from lmcal.errors import LmcalError
from lmcal.models.checkpoint import base_checkpoint, checkpoint_names, load_base_net, model_name
from lmcal.pipeline.devices import apply_job_devices
from lmcal.pipeline.preflight import preflight
from lmcal.pipeline.sizes import model_of
from lmcal.pipeline.slurm import check_sweep_launcher
from lmcal.stages.registry import STAGES, check_plan, check_stages, summary
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
from lmcal.training.run_checks import TRAINABLE, applicable_stages, device_count, training_device  # noqa: F401
from lmcal.training.run_checks import check_settings as check_run_settings
from lmcal.training.scale_run import record_training
from lmcal.training.wandb_logger import finish_logger, make_logger
from lmcal.utils.boundary import explain, fail, run_hydra
from lmcal.utils.budget import tau_too_long
from lmcal.utils.device import TF32, apply_precision_policy, deterministic_cublas, precision_policy
from lmcal.utils.io import write_json_atomic
from lmcal.utils.lock import run_lock, sweep_temp_files
from lmcal.utils.oom import is_out_of_memory, oom_refusal
from lmcal.utils.quiet import quiet_third_party
from lmcal.utils.settings import CONF_DIR

log = logging.getLogger("lmcal")
quiet_third_party()  # once per process, before Lightning says anything


def check_settings(cfg: DictConfig) -> None:
    """Every check the settings alone allow (lmcal.training.run_checks), and a Slurm launcher's tools on this machine
    (`-m hydra/launcher=slurm_cpu`: lmcal.pipeline.slurm.check_sweep_launcher): what lmcal.utils.precheck runs for
    each job before Hydra writes anything."""
    check_run_settings(cfg)
    check_sweep_launcher()


def train(cfg: DictConfig) -> dict:
    """Fit (or resume), evaluate the best checkpoint on valid and test, write metrics.json. Settings are checked
    first (one device only), then the run folder is locked for this process, and the temporary files that killed
    runs left there are swept. cuBLAS's deterministic workspace and the TF32 flags (the `tf32` key) are set first,
    before any CUDA work."""
    deterministic_cublas(cfg.trainer.get("deterministic"))
    check_settings(cfg)
    apply_precision_policy(cfg.get("tf32", TF32))
    out = Path(cfg.paths.output_dir)
    with run_lock(out, "training"):
        sweep_temp_files(out)  # (a checkpoint half written when a run was killed: it holds the lock now)
        return _train(cfg, out)


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


def _analysis_plan(cfg: DictConfig, dm) -> tuple[list[str], dict, str | None]:
    """The stages that run after training, their settings, and the memory stage's base checkpoint: every setting
    and size checked against the model before training (a misspelt stage or key costs nothing)."""
    tau = cfg.model.get("memory_tau")
    settings = {n: OmegaConf.to_container(cfg.analysis[n], resolve=True) for n in STAGES if n in cfg.analysis}
    stages = applicable_stages(list(cfg.analysis.get("stages") or []), "tau" if tau else "full", settings)
    check_plan(stages, "tau" if tau else "full", settings)
    every = (settings.get("entropy_rate") or {}).get("every_n_epochs")
    preflight({n: settings[n] for n in STAGES if n in stages or (n == "entropy_rate" and every)},
              model_of(cfg, dm.vocab_size, {s: int(dm.tokens(s).numel()) for s in ("train", "valid", "test")}),
              tau, device=training_device(cfg.trainer), bptt=int(cfg.data.bptt),
              force=bool(cfg.get("force_size")))  # sizes against the model, now
    set_memory_budget(cfg.analysis.get("memory_budget_gb"))  # the lookahead's chunks (lmcal.core.lookahead)
    base_ckpt = base_checkpoint(OmegaConf.to_container(cfg.memory, resolve=True) if cfg.get("memory") else None,
                                cfg.data.name)
    if "memory" in stages and tau:  # (a full model's memory stage, limited=window, is its own base)
        load_base_net(base_ckpt, "cpu", cfg.data.name, dm.corpus_kwargs, dm.vocab_size)  # now, not after
    return stages, settings, base_ckpt


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


def _train(cfg: DictConfig, out: Path) -> dict:
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
    stages, settings, base_ckpt = _analysis_plan(cfg, dm)
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


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")  # absolute: lmcal-train too
def main(cfg: DictConfig) -> float | None:
    """One run, or one job of a sweep. In a sweep a failing job records why in `failed.json`
    in its own directory and returns, so the other jobs still run."""
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    apply_job_devices(hc.job.num if sweep else 0)  # a side-by-side job's GPU and threads, before CUDA starts
    if sweep:  # a rerun of the job: an earlier failure is no longer its status
        (Path(hc.runtime.output_dir) / "failed.json").unlink(missing_ok=True)
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # every interpolation, before any work
        return train(cfg)["val_ce_nats"]
    except Exception as e:
        explained = explain(e)
        message = explained or f"{type(e).__name__}: {e}"
        if sweep:
            log.error(f"job {hc.job.num} ({hc.job.override_dirname}) failed: {message}", exc_info=not explained)
            write_json_atomic(Path(hc.runtime.output_dir) / "failed.json",
                              {"error": message, "traceback": None if explained else traceback.format_exc(),
                               "overrides": OmegaConf.to_container(hc.overrides.task, resolve=False)})
            return None
        if not explained:
            raise
        log.error(message)
        fail(message)


def cli() -> None:
    """`lmcal-train`: python -m lmcal.train as a command."""
    run_hydra(main)


if __name__ == "__main__":
    cli()
