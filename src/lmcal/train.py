"""Train one language model: `python -m lmcal.train [hydra overrides]`.

`train(cfg)` is a plain function (tests call it through Hydra's compose API); `main` is
the Hydra entry point around it, which turns `LmcalError`s into one-paragraph messages.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from pathlib import Path

import hydra
import pytorch_lightning as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import WandbLogger
from pytorch_lightning.plugins.io import TorchCheckpointIO

from lmcal.core.lookahead import set_memory_budget
from lmcal.errors import LmcalError
from lmcal.models.checkpoint import base_checkpoint, load_base_net, load_net, model_name, read_checkpoint
from lmcal.pipeline.preflight import preflight
from lmcal.pipeline.sizes import model_of
from lmcal.stages.registry import STAGES, check_plan, check_stages, stage_kinds, summary
from lmcal.stages.stage import KINDS
from lmcal.stages.wandb_run import check_online, init_args, log_checkpoint, open_run
from lmcal.training.callbacks import (
    EpochEntropyRateCallback,
    MetricsCallback,
    StagesCallback,
    TrainingProgress,
    progress_bar,
)
from lmcal.training.module import LMModule
from lmcal.training.scale_run import record_training
from lmcal.utils.boundary import explain, fail, run_hydra
from lmcal.utils.budget import tau_too_long
from lmcal.utils.device import apply_precision_policy, cuda_missing
from lmcal.utils.io import atomic_path, write_json_atomic
from lmcal.utils.lock import run_lock, sweep_temp_files
from lmcal.utils.quiet import quiet_third_party
from lmcal.utils.settings import CONF_DIR  # noqa: F401  (the tests' and benches' import)
from lmcal.utils.validate import check_config

log = logging.getLogger("lmcal")
quiet_third_party()  # once per process, before Lightning says anything


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
    args = init_args(OmegaConf.to_container(lg, resolve=True), out,
                     job_type="tau_model" if cfg.model.get("memory_tau") else "train", model=model_name(cfg.model),
                     dataset=cfg.data.name, group=sweep_group(), config=config)
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


def stages_on_command_line() -> bool:
    """Whether analysis.stages was set on the command line (or the run is not a Hydra one: the compose API's
    overrides count as the caller's own choice)."""
    if not HydraConfig.initialized():
        return True
    return any(o.lstrip("+~").split("=")[0] == "analysis.stages"
               for o in OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False))


def applicable_stages(stages: list[str], kind: str, settings: dict[str, dict]) -> list[str]:
    """The stages to run: those a preset lists (conf/experiment) but that do not apply to this kind of model (the
    full model's stages in a tau sweep) are skipped with a one-line note; stages named on the command line
    (analysis.stages=[...]) are kept, and one that does not apply stays an error (check_plan)."""
    if stages_on_command_line():
        return stages
    skip = [n for n in stages if n in STAGES and kind not in stage_kinds(n, settings.get(n))]
    if skip:
        log.info(f"Skipping stage{'s' if len(skip) > 1 else ''} {', '.join(skip)}: the preset lists "
                 f"{'them' if len(skip) > 1 else 'it'}, but {'they do' if len(skip) > 1 else 'it does'} not apply "
                 f"to a {KINDS[kind]} (analysis.stages=[...] chooses the stages).")
    return [n for n in stages if n not in skip]


def sweep_group() -> str | None:
    """A multirun's jobs share one W&B group, named after the sweep folder (None outside a multirun)."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return f"multirun-{Path(HydraConfig.get().sweep.dir).name}"


def finish_logger(logger) -> None:
    """Close the W&B run whatever happened, so offline runs are complete and syncable."""
    if isinstance(logger, WandbLogger):
        import wandb

        wandb.finish()  # not logger.experiment, which would open a run that never started


TRAINABLE = ("AWDLSTM", "GPTLM")  # the networks python -m lmcal.train builds (lmcal.model, lmcal.transformer)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written to a temporary file (named for this process) and renamed: a run killed while saving
    leaves the previous checkpoint whole, so the rerun can resume from it. Read back safely (`read_checkpoint`)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with atomic_path(path) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return read_checkpoint(path, map_location if map_location is not None else "cpu")


def check_resume(path: str, model_cfg: dict, vocab_size: int) -> None:
    """Resuming continues the checkpoint's own network: a run folder resumed with other model settings (a size, tau)
    stops here with the differences, not with a size-mismatch traceback from deep inside Lightning."""
    hp = read_checkpoint(path)["hyper_parameters"]
    was, now = {**hp["net"], "vocab_size": hp["vocab_size"]}, {**model_cfg, "vocab_size": vocab_size}
    diff = [f"model.{k} is {was.get(k)} there, {now.get(k)} now" for k in sorted(set(was) | set(now))
            if was.get(k) != now.get(k)]
    if diff:
        raise LmcalError(f"Cannot resume from {path}: it was trained with other model settings ({'; '.join(diff)})"
                         ". Rerun with the settings it was trained with to continue it, or start a new run in "
                         "another folder (hydra.run.dir=...), or set ckpt_path= to another checkpoint. Nothing "
                         "was changed.")


def init_from(module: LMModule, path: str) -> None:
    """Start from the network weights of another checkpoint (not its optimiser or schedule): warm-starts
    tau-models from the base model in the CPU profile."""
    if not Path(path).is_file():
        raise LmcalError(f"init_ckpt={path} does not exist.")
    net, _ = load_net(path)
    try:
        module.net.load_state_dict(net.state_dict())
    except RuntimeError as e:
        raise LmcalError(f"init_ckpt={path} does not fit this model (different sizes or vocabulary): "
                         f"{str(e).splitlines()[0]}") from None
    log.info(f"Initialised the network from {path}")


def device_count(trainer_cfg) -> int:
    """How many devices (or nodes x devices) `trainer` settings would train on: devices=2, "0,1", [0, 1], -1/"auto"
    (every visible GPU when the accelerator may be a GPU, else 1), times num_nodes."""
    devices, accel = trainer_cfg.get("devices", 1), str(trainer_cfg.get("accelerator", "auto"))
    if devices in (-1, "-1", "auto"):
        import torch

        n = torch.cuda.device_count() if accel in ("auto", "gpu", "cuda") else 1
    elif isinstance(devices, str):
        n = len([d for d in devices.split(",") if d.strip()]) if "," in devices else int(devices)
    elif isinstance(devices, int):
        n = devices
    else:  # a list of device indices
        n = len(devices)
    return max(n, 1) * int(trainer_cfg.get("num_nodes", 1) or 1)


def check_one_device(cfg: DictConfig) -> None:
    """Training runs on one device: refused, before any folder is written, where Lightning would start several."""
    t = cfg.get("trainer") or {}
    n, strategy = device_count(t), str(t.get("strategy", "auto"))
    if n > 1 or any(s in strategy for s in ("ddp", "fsdp", "deepspeed")):
        raise LmcalError(
            f"Training runs on one device, and these settings ask for more (trainer.devices="
            f"{t.get('devices')}, trainer.num_nodes={t.get('num_nodes', 1)}, trainer.strategy={strategy}). The "
            "AWD-LSTM is trained on BPTT streams that carry the hidden state from one window to the next; Lightning's "
            "DistributedSampler would give each process alternate windows, so each carried state would skip the "
            "other's tokens, the learning rate would follow each process's own window lengths and NT-ASGD each "
            "process's own validation loss: a different model, silently. Nothing was run or written. Train on one "
            "device (trainer.devices=1) and use the other devices for the runs that are independent: the tau-models "
            "and the analysis stages, side by side with `make reproduce ARGS='jobs=N'` (one device per running "
            "stage), as Slurm jobs with `make reproduce ARGS='launcher=slurm'`, or a tau-model sweep with "
            "`python -m lmcal.train -m hydra/launcher=slurm_gpu ...`.")


def check_accelerator(cfg: DictConfig) -> None:
    """trainer.accelerator=gpu (or cuda) on a machine without CUDA: refused in the words of the analysis entry point's
    device=cuda (lmcal.utils.device.resolve_device), before any folder is written."""
    import torch

    accel = str((cfg.get("trainer") or {}).get("accelerator", "auto"))
    if accel in ("gpu", "cuda") and not torch.cuda.is_available():
        raise LmcalError(f"trainer.accelerator={accel}, but this machine has no CUDA device torch can use "
                         f"({cuda_missing()}). Nothing was run or written. Train with trainer.accelerator=auto (the "
                         "GPU where there is one, else the CPU) or cpu.")


def check_settings(cfg: DictConfig) -> None:
    """Every check the settings alone allow (no file is read): ranges and sizes, a network this command trains, one
    device, the accelerator, W&B's mode. `python -m lmcal.train` runs it before Hydra writes anything
    (lmcal.utils.precheck), train() again."""
    check_config(cfg)
    if not str((cfg.get("model") or {}).get("_target_") or "").endswith(TRAINABLE):
        raise LmcalError("python -m lmcal.train trains AWD-LSTMs (model=awd_lstm or awd_lstm_small) and transformers "
                         "(model=transformer_small or transformer); a Hugging Face model (model=hf) is analysed as "
                         "it is: python -m lmcal.evaluate model=hf model.name_or_path=FOLDER "
                         "stages=[entropy_rate,calibration,decoders].")
    check_one_device(cfg)
    check_accelerator(cfg)
    check_online(OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else None)


def train(cfg: DictConfig) -> dict:
    """Fit (or resume), evaluate the best checkpoint on valid and test, write metrics.json. Settings are checked
    first (one device only), then the run folder is locked for this process, and the temporary files that killed
    runs left there are swept."""
    check_settings(cfg)
    apply_precision_policy()  # TF32 off, set explicitly (lmcal.utils.device)
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


def _train(cfg: DictConfig, out: Path) -> dict:
    t_start = time.perf_counter()
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    dm = instantiate(cfg.data)
    dm.prepare()  # fail early, with the data's own message, before any logger starts
    tau, n_train = cfg.model.get("memory_tau"), len(dm.tokens("train"))
    if tau and tau >= n_train:
        raise LmcalError(tau_too_long("model.memory_tau", int(tau), n_train, "training") + " Lower it, or train on "
                         "more text (data.max_train_tokens).")
    net_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    module = LMModule(net=net_cfg, vocab_size=dm.vocab_size, bptt=cfg.data.bptt,
                      data_cfg=OmegaConf.to_container(cfg.data, resolve=True),
                      seed=cfg.seed,
                      **OmegaConf.to_container(cfg.optim, resolve=True))

    ckpt_dir = out / "checkpoints"
    ckpt_cb = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val_loss", mode="min",
                              save_top_k=1, enable_version_counter=False)
    # last.ckpt after every epoch, the one a rerun resumes from: its own callback, since Lightning's save_last writes it
    # only on an epoch that also writes best.ckpt (a run killed after epochs that did not improve lost them)
    last_cb = ModelCheckpoint(dirpath=ckpt_dir, filename="last", monitor=None, save_top_k=1, every_n_epochs=1,
                              enable_version_counter=False)
    resume = cfg.get("ckpt_path") or (str(ckpt_dir / "last.ckpt") if (ckpt_dir / "last.ckpt").is_file() else None)
    if resume:
        check_resume(resume, net_cfg, dm.vocab_size)
        log.info(f"Resuming from {resume}")

    tau = cfg.model.get("memory_tau")
    settings = {n: OmegaConf.to_container(cfg.analysis[n], resolve=True) for n in STAGES if n in cfg.analysis}
    stages = applicable_stages(list(cfg.analysis.get("stages") or []), "tau" if tau else "full", settings)
    check_plan(stages, "tau" if tau else "full", settings)  # before training: a misspelt stage or key costs nothing
    every = (settings.get("entropy_rate") or {}).get("every_n_epochs")
    preflight({n: settings[n] for n in STAGES if n in stages or (n == "entropy_rate" and every)},
              model_of(cfg, dm.vocab_size, {s: int(dm.tokens(s).numel()) for s in ("train", "valid", "test")}),
              tau, device="cuda" if str(cfg.trainer.get("accelerator", "auto")) in ("auto", "gpu", "cuda")
              and torch.cuda.is_available() else "cpu", bptt=int(cfg.data.bptt))  # sizes against the model, now
    set_memory_budget(cfg.analysis.get("memory_budget_gb"))  # the lookahead's chunks (lmcal.core.lookahead)
    base_ckpt = base_checkpoint(OmegaConf.to_container(cfg.memory, resolve=True) if cfg.get("memory") else None,
                                cfg.data.name)
    if "memory" in stages and tau:  # (a full model's memory stage, limited=window, is its own base)
        load_base_net(base_ckpt, "cpu", cfg.data.name)  # fail now, not after training
    if cfg.get("init_ckpt") and not resume:
        init_from(module, cfg.init_ckpt)
    metrics_cb = MetricsCallback(out, extra={"dataset": cfg.data.name, "model": model_name(cfg.model),
                                             "resumed_from": resume})
    stages_cb = StagesCallback(out, stages, settings, model_name(cfg.model), base_ckpt)
    callbacks = [ckpt_cb, last_cb, metrics_cb, stages_cb]  # metrics.json is written before any stage runs
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(progress_bar() if sys.stderr.isatty() else TrainingProgress())  # a log: lines with ETAs
    every = (settings.get("entropy_rate") or {}).pop("every_n_epochs", None)
    if every:
        check_stages(["entropy_rate"], "tau" if tau else "full")
        callbacks.append(EpochEntropyRateCallback(out, every, model_name=model_name(cfg.model), corpus=cfg.data.name,
                                                  **settings["entropy_rate"]))

    logger = make_logger(cfg, out, dm.vocab_size)
    try:
        if logger and not isinstance(logger, WandbLogger):  # W&B got the config when its run opened
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
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


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """One run, or one job of a sweep. In a sweep a failing job records why in `failed.json`
    in its own directory and returns, so the other jobs still run."""
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
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


if __name__ == "__main__":
    run_hydra(main)
