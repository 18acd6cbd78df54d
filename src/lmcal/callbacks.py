"""Analysis stages as plain functions, and the thin Lightning callbacks that run them after training.

A stage takes a `StepLM` and tensors, writes its JSON/PNG/Markdown atomically into a folder, logs
them to Weights & Biases when a W&B logger is given, and returns its results as a dict.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

from lmcal.entropy_rate import generation_entropy_curve, random_prefixes
from lmcal.errors import LmcalError
from lmcal.lm import LSTMStepLM
from lmcal.model import evaluate_ce, limited_context_ce
from lmcal.module import load_net
from lmcal.plots import entropy_curve_figure
from lmcal.utils import write_json_atomic, write_text_atomic

log = logging.getLogger("lmcal")


def wandb_log(logger, scalars: dict | None = None, images: dict | None = None, tables: dict | None = None) -> None:
    """Log to the W&B run behind a Lightning WandbLogger; a no-op for any other logger."""
    if not logger or type(logger).__name__ != "WandbLogger":
        return
    import wandb

    payload = dict(scalars or {})
    payload.update({k: wandb.Image(str(v)) for k, v in (images or {}).items()})
    payload.update({k: wandb.Table(columns=cols, data=rows) for k, (cols, rows) in (tables or {}).items()})
    logger.experiment.log(payload)


def table1_markdown(rows: list[dict]) -> str:
    """The paper's Table 1 layout: model, corpus, test ppl, EntRate (= exp of the last step's entropy)."""
    lines = ["| model | corpus | test ppl | EntRate |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['corpus']} | {r['test_ppl']:.1f} | {r['entrate_ppl']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def entropy_rate_stage(lm, valid_tokens: torch.Tensor, test_ce_nats: float, out_dir: str | Path, *,
                       num_prefixes: int = 100, samples_per_prefix: int = 5, prefix_len: int = 100,
                       horizon: int = 700, seed: int = 0, max_batch: int = 1024, model_name: str = "model",
                       corpus: str = "ptb", logger=None, name: str = "entropy_rate", **_ignored) -> dict:
    """Entropy of the t-th generated word (Table 1 row, Figure 2): `name`.json, .png and .md in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefixes = random_prefixes(valid_tokens, num_prefixes, prefix_len, seed=seed)
    t0 = time.perf_counter()
    curve = generation_entropy_curve(lm, prefixes, horizon, samples_per_prefix, seed=seed, max_batch=max_batch,
                                     progress=True)
    seconds = time.perf_counter() - t0
    n_gen = prefixes.size(0) * samples_per_prefix
    result = {
        "model": model_name, "corpus": corpus,
        "test_ce_nats": test_ce_nats, "test_ppl": math.exp(test_ce_nats),
        "entrate_nats": float(curve.mean[-1]), "entrate_ppl": math.exp(curve.mean[-1]),
        "curve_nats": curve.mean.tolist(), "stderr_nats": curve.stderr.tolist(),
        "horizon": horizon, "num_prefixes": prefixes.size(0), "samples_per_prefix": samples_per_prefix,
        "num_generations": n_gen, "prefix_len": prefix_len, "seed": seed,
        "seconds": seconds, "generated_tokens_per_s": n_gen * horizon / seconds,
    }
    png = entropy_curve_figure({f"{model_name} generations": (curve.mean, curve.stderr)}, out / f"{name}.png",
                               reference_nats={"test cross-entropy": test_ce_nats},
                               title=f"{model_name} on {corpus}: test ppl {result['test_ppl']:.1f}, "
                                     f"EntRate {result['entrate_ppl']:.1f} (t={horizon})")
    write_text_atomic(out / f"{name}.md", table1_markdown([result]))
    write_json_atomic(out / f"{name}.json", result)
    rows = [[t + 1, float(m), float(se)] for t, (m, se) in enumerate(zip(curve.mean, curve.stderr, strict=True))]
    wandb_log(logger, scalars={f"{name}/entrate_ppl": result["entrate_ppl"], f"{name}/test_ppl": result["test_ppl"]},
              images={f"{name}/figure": png}, tables={f"{name}/curve": (["t", "entropy_nats", "stderr_nats"], rows)})
    log.info(f"{name}: test ppl {result['test_ppl']:.1f}, EntRate {result['entrate_ppl']:.1f} at t={horizon} "
             f"({n_gen} generations, {seconds:.0f} s); {out / (name + '.json')}")
    return result


def best_model_scores(trainer: pl.Trainer, datamodule) -> dict:
    """The best checkpoint (the last if none is better), loaded, with its validation and test
    cross-entropy: full-context scores for an ordinary model, exact tau-context ones for a
    limited-memory model. Cached on the trainer: the metrics and every stage share it."""
    ckpt = trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path
    if not ckpt or not Path(ckpt).is_file():
        raise LmcalError(f"Training ended without a checkpoint in {trainer.checkpoint_callback.dirpath}; "
                         "did it run a whole epoch?")
    cache = trainer.__dict__.setdefault("_lmcal_scores", {})
    if ckpt not in cache:
        net, raw = load_net(ckpt)
        net.to(trainer.lightning_module.device)
        tau = net.memory_tau
        if tau:
            val_ce, _ = limited_context_ce(net, datamodule.tokens("valid"), tau)
            test_ce, n_test = limited_context_ce(net, datamodule.tokens("test"), tau)
        else:
            val_ce, _ = evaluate_ce(net, datamodule.tokens("valid"), datamodule.eval_batch_size, datamodule.bptt)
            test_ce, n_test = evaluate_ce(net, datamodule.tokens("test"), datamodule.test_batch_size, datamodule.bptt)
        cache[ckpt] = {"net": net, "ckpt": raw, "path": ckpt, "val_ce": val_ce, "test_ce": test_ce,
                       "test_tokens": n_test}
    return cache[ckpt]


class MetricsCallback(pl.Callback):
    """Scores the best checkpoint when training ends and writes metrics.json at once, before any
    analysis stage runs, so a failing stage never costs the training results."""

    def __init__(self, out_dir: str | Path, extra: dict | None = None):
        self.out_dir, self.extra = Path(out_dir), dict(extra or {})
        self.t_start = time.perf_counter()
        self.metrics: dict | None = None

    def on_fit_end(self, trainer, module):
        s = best_model_scores(trainer, trainer.datamodule)
        net, tau = s["net"], s["net"].memory_tau
        limited = ({"ce_limited_nats": {"valid": s["val_ce"], "test": s["test_ce"]},
                    "val_ce_limited_nats": s["val_ce"], "test_ce_limited_nats": s["test_ce"]} if tau else {})
        self.metrics = {
            **self.extra,
            "memory_tau": tau,
            **limited,
            "true_entropy_rate_nats": trainer.datamodule.prepare().info.get("entropy_rate_nats"),
            "val_ce_nats": s["val_ce"], "val_ppl": math.exp(s["val_ce"]),
            "test_ce_nats": s["test_ce"], "test_ppl": math.exp(s["test_ce"]), "test_tokens": s["test_tokens"],
            "params": sum(p.numel() for p in net.parameters()),
            "epochs": trainer.current_epoch,
            "best_epoch": s["ckpt"].get("epoch"),
            "asgd_epoch": module.asgd_epoch,
            "tokens_per_s": module.train_tokens / module.train_seconds if module.train_seconds else None,
            "train_tokens": module.train_tokens,
            "train_seconds": module.train_seconds,
            "wall_seconds": time.perf_counter() - self.t_start,
            "best_ckpt": str(Path(s["path"]).resolve()),
            "device": str(module.device),
        }
        write_json_atomic(self.out_dir / "metrics.json", self.metrics)
        if trainer.logger:
            trainer.logger.log_metrics({f"final/{k}": v for k, v in self.metrics.items()
                                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        log.info(f"val ppl {self.metrics['val_ppl']:.2f}, test ppl {self.metrics['test_ppl']:.2f}; "
                 f"{self.out_dir / 'metrics.json'}")


class EntropyRateCallback(pl.Callback):
    """Runs `entropy_rate_stage` on the best checkpoint when training ends, and on the current
    (averaged, if NT-ASGD switched) weights every `every_n_epochs` epochs if set."""

    def __init__(self, out_dir: str | Path, every_n_epochs: int | None = None, at_fit_end: bool = True,
                 **settings):
        self.out_dir, self.every_n_epochs, self.at_fit_end = Path(out_dir), every_n_epochs, at_fit_end
        self.settings = settings
        self.result: dict | None = None

    def on_train_epoch_end(self, trainer, module):  # after the epoch's validation, so val_loss is fresh
        n = self.every_n_epochs
        if not n or trainer.sanity_checking or (trainer.current_epoch + 1) % n:
            return
        val_ce = float(trainer.callback_metrics["val_loss"])
        was_training = module.net.training
        with module.averaged_weights():
            entropy_rate_stage(LSTMStepLM(module.net), trainer.datamodule.tokens("valid"), val_ce,
                               self.out_dir / "entropy_rate_epochs", logger=trainer.logger,
                               name=f"entropy_rate_epoch{trainer.current_epoch}", **self.settings)
        module.net.train(was_training)

    def on_fit_end(self, trainer, module):
        if not self.at_fit_end:
            return
        s = best_model_scores(trainer, trainer.datamodule)
        self.result = entropy_rate_stage(LSTMStepLM(s["net"]), trainer.datamodule.tokens("valid"), s["test_ce"],
                                         self.out_dir, logger=trainer.logger, **self.settings)
