"""The Lightning callbacks of `python -m lmcal.train`: metrics.json when training ends, the analysis stages on the
best checkpoint (one generic callback over the registry in lmcal.stages), and the entropy-rate curve every N epochs."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytorch_lightning as pl

from lmcal.data.markov import markov_exact_mi
from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import evaluate_ce, limited_context_ce
from lmcal.models.checkpoint import load_base_net, load_net
from lmcal.models.step_lm import as_step_lm
from lmcal.stages.registry import run_stage, run_stages
from lmcal.stages.stage import target
from lmcal.stages.wandb_run import wandb_log
from lmcal.utils.io import write_json_atomic
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")


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
        if tau:  # progress lines: minutes on a large model, after the training's last line
            val_ce, _ = limited_context_ce(net, datamodule.tokens("valid"), tau, progress="scoring valid")
            test_ce, n_test = limited_context_ce(net, datamodule.tokens("test"), tau, progress="scoring test")
        else:
            val_ce, _ = evaluate_ce(net, datamodule.tokens("valid"), datamodule.eval_batch_size, datamodule.bptt,
                                    progress="scoring valid")
            test_ce, n_test = evaluate_ce(net, datamodule.tokens("test"), datamodule.test_batch_size, datamodule.bptt,
                                          progress="scoring test")
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
            "markov_order": trainer.datamodule.prepare().info.get("order"),
            "val_ce_nats": s["val_ce"], "val_ppl": exp_or_inf(s["val_ce"]),
            "test_ce_nats": s["test_ce"], "test_ppl": exp_or_inf(s["test_ce"]), "test_tokens": s["test_tokens"],
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
        if hasattr(net, "save_hf"):  # a transformer: also a Hugging Face folder, loadable with model=hf
            folder = net.save_hf(self.out_dir / "hf", trainer.datamodule.prepare().itos, self.extra.get("model"))
            self.metrics["hf_folder"] = str(folder.resolve())
        write_json_atomic(self.out_dir / "metrics.json", self.metrics)
        final = {f"final/{k}": v for k, v in self.metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if type(trainer.logger).__name__.endswith("WandbLogger"):  # final numbers: the summary, not a history row
            # the validation series' summary is its best value (the checkpoint kept), not the last epoch's
            wandb_log(trainer.logger, summary={**final, "val/ppl": self.metrics["val_ppl"],
                                               "val/loss": self.metrics["val_ce_nats"]})
        elif trainer.logger:
            trainer.logger.log_metrics(final)
        log.info(f"val ppl {self.metrics['val_ppl']:.2f}, test ppl {self.metrics['test_ppl']:.2f}; "
                 f"{self.out_dir / 'metrics.json'}")


class EpochEntropyRateCallback(pl.Callback):
    """The entropy-rate stage on the current (averaged, if NT-ASGD switched) weights every `every_n_epochs` epochs,
    into entropy_rate_epochs/ (analysis.entropy_rate.every_n_epochs)."""

    def __init__(self, out_dir: str | Path, every_n_epochs: int, model_name: str, corpus: str, **settings):
        self.out_dir, self.every_n_epochs, self.settings = Path(out_dir), every_n_epochs, settings
        self.model_name, self.corpus = model_name, corpus

    def on_train_epoch_end(self, trainer, module):  # after the epoch's validation, so val_loss is fresh
        if trainer.sanity_checking or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        val_ce = float(trainer.callback_metrics["val_loss"])
        was_training = module.net.training
        with module.averaged_weights():
            t = target(as_step_lm(module.net), valid=trainer.datamodule.tokens("valid"), test_ce=val_ce,
                       name=self.model_name, corpus=self.corpus)
            run_stage("entropy_rate", t, self.settings, self.out_dir / "entropy_rate_epochs", trainer.logger,
                      as_name=f"entropy_rate_epoch{trainer.current_epoch}")
        module.net.train(was_training)


class StagesCallback(pl.Callback):
    """Runs the analysis stages `stages` (lmcal.stages) on the best checkpoint when training ends; a tau-model's
    memory stage compares it with the full model at `base_ckpt`. Results in `results` ({stage: result})."""

    def __init__(self, out_dir: str | Path, stages: list[str], settings: dict[str, dict], model_name: str,
                 base_ckpt: str | None = None):
        self.out_dir, self.stages, self.settings = Path(out_dir), list(stages), settings
        self.model_name, self.base_ckpt = model_name, base_ckpt
        self.results: dict[str, dict] = {}

    def on_fit_end(self, trainer, module):
        s = best_model_scores(trainer, trainer.datamodule)
        dm = trainer.datamodule
        net, tau = s["net"], s["net"].memory_tau
        target = {"lm": as_step_lm(net), "net": net, "kind": "tau" if tau else "full", "name": self.model_name,
                  "corpus": dm.name, "unit": "word", "valid": dm.tokens("valid"), "test": dm.tokens("test"),
                  "test_ce": s["test_ce"], "bptt": dm.bptt, "ckpt": s["path"]}
        if "memory" in self.stages:  # a full model (limited=window) is its own base
            mtau = (self.settings.get("memory") or {}).get("tau") or tau
            target.update(base=load_base_net(self.base_ckpt, module.device, dm.name, dm.corpus_kwargs,
                                                      dm.vocab_size) if tau else net,
                          base_ckpt=str(self.base_ckpt) if tau else s["path"],
                          exact_mi=markov_exact_mi(dm.prepare().info, mtau) if dm.name == "markov" and mtau else None)
        self.results = run_stages(self.stages, target, self.settings, self.out_dir, trainer.logger)


class TrainingProgress(pl.Callback):
    """The training's progress as log lines where stderr is not a terminal (a reproduction's logs/<stage>.log, a Slurm
    log), in place of the bar: one whenever another tenth of an epoch is done and 5 s have passed, or a minute has
    passed without one, with the time left in the epoch and in the whole training (trainer.max_epochs; NT-ASGD's
    switch or a stop may end it sooner), at the rate measured so far. Counts and clocks only: no device sync."""

    def on_train_start(self, trainer, module):
        self.t0, self.first = time.perf_counter(), trainer.current_epoch
        self.last_t, self.last_batch = self.t0, 0

    def on_train_epoch_start(self, trainer, module):
        self.epoch_t0, self.last_batch = time.perf_counter(), 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        n, done, now = trainer.num_training_batches, batch_idx + 1, time.perf_counter()
        if not isinstance(n, int) or n <= 0:
            return
        if not (((done - self.last_batch) * 10 >= n and now - self.last_t >= 5.0) or now - self.last_t >= 60.0):
            return
        self.last_t, self.last_batch = now, done
        from lmcal.utils.progress import clock

        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        in_epoch = (now - self.epoch_t0) / done * (n - done)
        ran = trainer.current_epoch - self.first + done / n  # epochs (fractions) this process has trained
        left = (f", about {clock((now - self.t0) / ran * (epochs - trainer.current_epoch - done / n))} left in "
                f"all ({epochs} epochs at most)" if epochs else "")
        log.info(f"training: epoch {trainer.current_epoch + 1}{f'/{epochs}' if epochs else ''}, {done}/{n} batches "
                 f"({100 * done / n:.0f}%), {clock(now - self.t0)} in; about {clock(in_epoch)} left in the epoch"
                 f"{left}")


def progress_bar():
    """Lightning's training bar (Rich's when installed, as Lightning picks it) showing the run's tokens/s
    (train/tokens_per_s, logged by LMModule) in place of batches/s, and not Lightning's logger version (the tail of a
    W&B run id)."""
    from pytorch_lightning.callbacks import RichProgressBar, TQDMProgressBar
    from pytorch_lightning.utilities.imports import _RICH_AVAILABLE

    class TokensProgressBar(RichProgressBar if _RICH_AVAILABLE else TQDMProgressBar):
        def get_metrics(self, trainer, module):
            items = super().get_metrics(trainer, module)  # the validation's values: host floats already
            items.pop("v_num", None)
            # the training values as LMModule read them every log_every_n_steps: host floats, so a refresh of the
            # bar never waits for the device
            bar = dict(getattr(module, "bar_metrics", {}))
            tps = bar.pop("tokens/s", items.pop("train/tokens_per_s", None))  # a module that logs it to the bar
            return {**({"tokens/s": f"{tps:,.0f}"} if tps is not None else {}),
                    **{k: f"{v:.3f}" for k, v in bar.items()}, **items}

        def configure_columns(self, trainer):  # Rich: every column but the last, batches/s
            return super().configure_columns(trainer)[:-1]

    return TokensProgressBar()
