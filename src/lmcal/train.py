"""Train one language model: `python -m lmcal.train [hydra overrides]`.

`train(cfg)` is a plain function (tests call it through Hydra's compose API); `main` is
the Hydra entry point around it, which turns `LmcalError`s into one-paragraph messages.
"""

from __future__ import annotations

import logging
import math
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

from lmcal.errors import LmcalError
from lmcal.model import evaluate_ce, limited_context_ce
from lmcal.module import LMModule, load_net
from lmcal.utils import write_json_atomic

log = logging.getLogger("lmcal")
PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"
OmegaConf.register_new_resolver("lmcal_root", lambda: str(PROJECT_ROOT), replace=True)


def make_logger(cfg: DictConfig):
    lg = cfg.get("logger")
    if not lg or lg.get("_target_") is None:
        return False
    return instantiate(lg)


def finish_logger(logger) -> None:
    """Close the W&B run whatever happened, so offline runs are complete and syncable."""
    if logger and type(logger).__name__ == "WandbLogger":
        import wandb

        wandb.finish()


def train(cfg: DictConfig) -> dict:
    """Fit (or resume), evaluate the best checkpoint on valid and test, write metrics.json."""
    t_start = time.perf_counter()
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    dm = instantiate(cfg.data)
    dm.prepare()  # fail early, with the data's own message, before any logger starts
    net_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    module = LMModule(net=net_cfg, vocab_size=dm.vocab_size, bptt=cfg.data.bptt,
                      **OmegaConf.to_container(cfg.optim, resolve=True))

    ckpt_dir = out / "checkpoints"
    ckpt_cb = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val_loss", mode="min",
                              save_last=True, save_top_k=1, enable_version_counter=False)
    resume = cfg.get("ckpt_path") or (str(ckpt_dir / "last.ckpt") if (ckpt_dir / "last.ckpt").is_file() else None)
    if resume:
        log.info(f"Resuming from {resume}")

    logger = make_logger(cfg)
    try:
        if logger:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
        trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=[ckpt_cb], logger=logger,
                                          default_root_dir=str(out))
        trainer.fit(module, datamodule=dm, ckpt_path=resume)

        best = ckpt_cb.best_model_path or str(ckpt_dir / "last.ckpt")
        if not Path(best).is_file():
            raise LmcalError(f"Training ended without a checkpoint in {ckpt_dir}; did it run any epoch?")
        net, ckpt = load_net(best)
        device = module.device if module.device.type != "meta" else torch.device("cpu")
        net.to(device)
        tau = net.memory_tau
        if tau:  # a limited-memory model is scored on exactly the tau previous tokens of every position
            val_ce, _ = limited_context_ce(net, dm.tokens("valid"), tau)
            test_ce, n_test = limited_context_ce(net, dm.tokens("test"), tau)
            limited = {"ce_limited_nats": {"valid": val_ce, "test": test_ce},
                       "val_ce_limited_nats": val_ce, "test_ce_limited_nats": test_ce}
        else:
            val_ce, _ = evaluate_ce(net, dm.tokens("valid"), dm.eval_batch_size, dm.bptt)
            test_ce, n_test = evaluate_ce(net, dm.tokens("test"), dm.test_batch_size, dm.bptt)
            limited = {}
        state = ckpt.get("lmcal", {})
        metrics = {
            "dataset": cfg.data.name,
            "model": cfg.model.get("_target_"),
            "memory_tau": tau,
            **limited,
            "true_entropy_rate_nats": dm.prepare().info.get("entropy_rate_nats"),
            "val_ce_nats": val_ce,
            "val_ppl": math.exp(val_ce),
            "test_ce_nats": test_ce,
            "test_ppl": math.exp(test_ce),
            "test_tokens": n_test,
            "params": sum(p.numel() for p in net.parameters()),
            "epochs": trainer.current_epoch,
            "best_epoch": ckpt.get("epoch"),
            "asgd_epoch": module.asgd_epoch,
            "tokens_per_s": module.train_tokens / module.train_seconds if module.train_seconds else None,
            "train_tokens": module.train_tokens,
            "train_seconds": module.train_seconds,
            "wall_seconds": time.perf_counter() - t_start,
            "best_ckpt": str(Path(best).resolve()),
            "device": str(device),
            "resumed_from": resume,
            "checkpoint_train_seconds": state.get("train_seconds"),
        }
        write_json_atomic(out / "metrics.json", metrics)
        if logger:
            logger.log_metrics({f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        log.info(f"val ppl {metrics['val_ppl']:.2f}, test ppl {metrics['test_ppl']:.2f}; "
                 f"metrics in {out / 'metrics.json'}")
        return metrics
    finally:
        finish_logger(logger)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """One run, or one job of a sweep. In a sweep a failing job records why in `failed.json`
    in its own directory and returns, so the other jobs still run."""
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    try:
        return train(cfg)["val_ce_nats"]
    except Exception as e:
        user_error = isinstance(e, LmcalError)
        message = str(e) if user_error else f"{type(e).__name__}: {e}"
        if sweep:
            log.error(f"job {hc.job.num} ({hc.job.override_dirname}) failed: {message}", exc_info=not user_error)
            write_json_atomic(Path(hc.runtime.output_dir) / "failed.json",
                              {"error": message, "traceback": None if user_error else traceback.format_exc(),
                               "overrides": list(hc.overrides.task)})
            return None
        if not user_error:
            raise
        log.error(message)
        print(f"\nlmcal: error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
