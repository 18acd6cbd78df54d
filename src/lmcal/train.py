"""Train one language model: `python -m lmcal.train [hydra overrides]`.

`train(cfg)` is a plain function (tests call it through Hydra's compose API); `main` is
the Hydra entry point around it, which turns `LmcalError`s into one-paragraph messages.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import hydra
import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint

from lmcal.errors import LmcalError
from lmcal.model import evaluate_ce
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
        val_ce, _ = evaluate_ce(net, dm.tokens("valid"), dm.eval_batch_size, dm.bptt)
        test_ce, n_test = evaluate_ce(net, dm.tokens("test"), dm.test_batch_size, dm.bptt)
        state = ckpt.get("lmcal", {})
        metrics = {
            "dataset": cfg.data.name,
            "model": cfg.model.get("_target_"),
            "memory_tau": cfg.model.get("memory_tau"),
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
    try:
        return train(cfg)["val_ce_nats"]
    except LmcalError as e:
        log.error(str(e))
        print(f"\nlmcal: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
