"""Lightning layer: the data module and the training module (AWD recipe with NT-ASGD).

All numerics live in `model.py` and `data.py`; this file wires them into Lightning.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.utils.data import DataLoader, Dataset

from lmcal.data import batching as D
from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import ar_tar, forward_chunked, repackage
from lmcal.training.optim import OptimConfig
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")


class SpanDataset(Dataset):
    """Map-style view of (start, seq_len) windows over a batchified stream [S, B]."""

    def __init__(self, source: torch.Tensor, spans: list[tuple[int, int]]):
        self.source, self.spans = source, spans

    def __len__(self):
        return len(self.spans)

    def __getitem__(self, i):
        return D.get_batch(self.source, *self.spans[i])


class LMDataModule(D.CorpusData, pl.LightningDataModule):
    """Batchified streams; a fresh variable-length BPTT schedule per epoch (the corpus and its splits:
    lmcal.data.batching.CorpusData, which the analysis entry points use without Lightning).

    The schedule is a function of (seed, epoch) only, so a run resumed at an epoch
    boundary sees the same batches as an uninterrupted one. It needs the trainer to
    rebuild the train loader each epoch (trainer.reload_dataloaders_every_n_epochs=1).
    """

    def __init__(self, **kwargs):  # a data config's keys, as Hydra instantiates conf/data
        pl.LightningDataModule.__init__(self)
        D.CorpusData.__init__(self, D.DataConfig(**kwargs))

    def setup(self, stage=None):
        self.prepare()

    def on_device(self, source: torch.Tensor) -> torch.Tensor:
        """The batchified stream [S, B] on the training device, copied once an epoch: its windows are then views
        there, and no step copies its window from pageable host memory (a copy that waits for the device)."""
        trainer = self.trainer
        return source.to(trainer.strategy.root_device) if trainer is not None else source

    def train_dataloader(self):
        source = self.on_device(D.batchify(self.tokens("train"), self.batch_size))
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        spans = list(D.bptt_spans(source.size(0), self.bptt, D.epoch_generator(self.seed, epoch), self.memory_tau,
                                  variable=self.variable_length))
        return DataLoader(SpanDataset(source, spans), batch_size=None, shuffle=False)

    def val_dataloader(self):
        source = self.on_device(D.batchify(self.tokens("valid"), self.eval_batch_size))
        spans = list(D.bptt_spans(source.size(0), self.bptt, multiple_of=self.memory_tau))
        return DataLoader(SpanDataset(source, spans), batch_size=None)


def nt_asgd_should_switch(history: list[float], val_loss: float, nonmono: int) -> bool:
    """NT-ASGD trigger: the current validation loss is worse than the best of all earlier
    epochs except the last `nonmono` ones (`history` holds the earlier epochs' losses)."""
    return len(history) > nonmono and val_loss > min(history[:-nonmono])


class LMModule(pl.LightningModule):
    """AWD-LSTM training: variable-length BPTT with the lr scaled by seq_len/bptt, AR/TAR,
    gradient clipping, SGD switching to averaged SGD (NT-ASGD); validation on the averaged
    weights after the switch. Checkpoints hold the averaged weights in `state_dict` and the
    raw ones in `raw_state_dict`, so every consumer of a checkpoint gets the model that was
    validated, and resuming still continues from the raw iterate. `net`: the network's settings (conf/model);
    `optim`: an OptimConfig or its mapping (conf/train.yaml's optim); `bptt`: the data's window length, which the lr
    is scaled by."""

    def __init__(self, net: dict, vocab_size: int, optim: OptimConfig | dict | None = None, bptt: int = 70,
                 data_cfg: dict | None = None, seed: int = 141):
        super().__init__()
        self.optim = optim if isinstance(optim, OptimConfig) else OptimConfig(**(optim or {}))
        # plain values only: checkpoints are read back with weights_only=True, which unpickles no dataclass; data_cfg
        # too, since analysis of a checkpoint reloads the corpus it was trained on
        self.save_hyperparameters({"net": net, "vocab_size": vocab_size, "optim": self.optim.as_dict(), "bptt": bptt,
                                   "data_cfg": data_cfg, "seed": seed})
        self.net = instantiate(net, vocab_size=vocab_size)
        self.automatic_optimization = False
        self.val_history: list[float] = []
        self.asgd_epoch: int | None = None  # epoch at which averaging started
        self.avg: dict[str, torch.Tensor] | None = None
        self.n_avg = 0
        self.train_seconds, self.train_tokens = 0.0, 0
        self._hidden = None
        self._epoch_t0: float | None = None  # host clock at the epoch's first batch; closed by one sync at its end
        self._watch: torch.Tensor | None = None  # [4] on the device: the first diverged step (flag, batch, ce, loss)
        self.bar_metrics: dict[str, float] = {}  # what the progress bar shows: host floats, read every N steps

    # -- optimisation ---------------------------------------------------------------------------
    def configure_optimizers(self):
        hp = self.optim
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.net.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        if hp.optimizer == "adam":
            return torch.optim.Adam(self.net.parameters(), lr=hp.lr, weight_decay=hp.weight_decay,
                                    betas=hp.betas)
        if hp.optimizer == "adamw":  # decoupled weight decay on the matrices only (not biases, norms, positions' bias)
            named = [(n, p) for n, p in self.net.named_parameters() if p.requires_grad]
            decay = [p for n, p in named if p.dim() >= 2]
            rest = [p for n, p in named if p.dim() < 2]
            return torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=hp.lr, betas=hp.betas,
                                     fused=True)  # one kernel per step instead of a chain of foreach ops
        raise ValueError(f"optim.optimizer must be 'sgd', 'adam' or 'adamw', got {hp.optimizer!r}")

    def on_train_epoch_start(self):
        self._hidden = None  # a new pass over the streams starts from a zero state
        self._epoch_t0 = None

    def on_train_batch_start(self, batch, batch_idx):
        if self._epoch_t0 is None:
            self._epoch_t0 = time.perf_counter()
        # dropout masks from (seed, epoch, batch) alone, not from whatever drew random numbers before (a new
        # DataLoader iterator draws one): a run resumed at an epoch boundary repeats an uninterrupted one exactly
        torch.manual_seed((self.hparams.seed * 1_000_003 + self.current_epoch) * 1_000_003 + batch_idx)

    @property
    def read_every(self) -> int:
        """Steps between host reads of the device (the divergence flag, the logged values, the bar): Lightning's
        trainer.log_every_n_steps. Between them the host only queues work, so on a GPU its Python overlaps the
        kernels instead of waiting for each step's (an .item() a step made the two add)."""
        trainer = self._trainer
        return max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1)) if trainer is not None else 1

    def training_step(self, batch, batch_idx):
        x, y = batch  # [T, B] each
        hp = self.optim
        opt = self.optimizers()
        for g in opt.param_groups:  # longer windows take proportionally larger steps
            g["lr"] = hp.lr * self.lr_factor(batch_idx) * x.size(0) / self.hparams.bptt
        output, raw = self.forward_window(x, "_hidden", detach=True)
        ce = F.cross_entropy(self.net.logits(output).flatten(0, 1), y.flatten())
        loss = ce + ar_tar(output, raw, hp.ar_weight, hp.tar_weight)
        self.watch_divergence(ce.detach(), loss.detach(), batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        # the norm before clipping (inf: no clipping, the norm alone)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), hp.clip or float("inf"))
        opt.step()
        if self.avg is not None:
            self._update_average()
        self.train_tokens += y.numel()
        # device tensors, no prog_bar: Lightning reads them only when it writes its logs (every log_every_n_steps). A
        # Python number is logged only on the steps that read the device anyway: Lightning makes a device tensor of it,
        # a blocking copy that waits for the device as a read does
        self.log_dict({"train/loss": ce.detach(), "train/grad_norm": grad_norm}, on_step=True, on_epoch=False)
        if self.global_step % self.read_every == 0:  # the steps Lightning writes its logs on (its step count)
            self.log("train/lr", opt.param_groups[0]["lr"], on_step=True, on_epoch=False)
            self.read_device(ce.detach())
        return loss

    def read_device(self, ce: torch.Tensor | None = None) -> None:
        """The one host read of the device every `read_every` steps: the divergence flag (raises), and the
        progress bar's loss and tokens/s."""
        self.check_divergence()
        seconds = self.train_seconds + (time.perf_counter() - self._epoch_t0 if self._epoch_t0 is not None else 0.0)
        if ce is not None:
            loss = float(ce)
            self.bar_metrics.update({"train/loss": loss, "train/ppl": exp_or_inf(loss)})
        if seconds > 0:  # the run's mean so far (training steps only, not validation)
            self.bar_metrics["tokens/s"] = self.train_tokens / seconds
            self.log("train/tokens_per_s", self.train_tokens / seconds, on_step=True, on_epoch=False)

    def watch_divergence(self, ce: torch.Tensor, loss: torch.Tensor, batch_idx: int) -> None:
        """Records on the device, without a host read, the first step whose loss is not finite or whose
        cross-entropy is beyond `divergence_factor` x log(V) (a uniform guess costs log(V); a run that far above it
        has diverged). `check_divergence` reads the record every `read_every` steps and before every validation."""
        factor = self.optim.divergence_factor
        bad = ~torch.isfinite(loss)
        if factor:
            bad = bad | (ce > factor * math.log(self.hparams.vocab_size))
        step = torch.stack([torch.ones_like(ce), torch.full_like(ce, batch_idx), ce, loss]).float()  # [4]
        if self._watch is None or self._watch.device != ce.device:
            self._watch = torch.zeros_like(step)
        self._watch = torch.where(bad & (self._watch[0] == 0), step, self._watch)

    def check_divergence(self) -> None:
        """Stop when a step since the last read diverged (see watch_divergence). The read comes before every
        validation, so the checkpoints on disk hold only models validated before it."""
        if self._watch is None:
            return
        flag, batch_idx, ce_value, loss_value = self._watch.tolist()
        if not flag:
            return
        hp, factor = self.optim, self.optim.divergence_factor
        limit = factor * math.log(self.hparams.vocab_size) if factor else None
        why = (f"the training loss is {loss_value} (cross-entropy {ce_value})" if not math.isfinite(loss_value)
               else f"the training cross-entropy is {ce_value:.4g} nats, beyond {factor:g} x log(V) = {limit:.1f}")
        raise LmcalError(
            f"Training diverged at epoch {self.current_epoch}, batch {int(batch_idx)}: {why}. The run stopped "
            f"within {self.read_every} steps of it (trainer.log_every_n_steps: the device is read that often), "
            "before any later model was validated or saved; the checkpoints hold only models validated before it, "
            f"and no analysis ran. Lower the learning rate (optim.lr={hp.lr:g} now) or clip gradients harder "
            f"(optim.clip={hp.clip} now); with optim.optimizer=adam, a rate near 1e-3. "
            f"optim.divergence_factor (now {'null' if factor is None else f'{factor:g}'}) sets how far above log(V) "
            "counts as diverged (null: non-finite losses only).")

    def close_epoch_clock(self) -> None:
        """Adds the epoch's training time, measured to the end of its last step's device work (one sync an
        epoch: the per-step host times of an asynchronous device would miss the work still queued)."""
        if self._epoch_t0 is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.train_seconds += time.perf_counter() - self._epoch_t0
        self._epoch_t0 = None

    def lr_factor(self, batch_idx: int) -> float:
        """The schedule's multiplier: 1 (the AWD recipe), or a cosine decay to 0 over max_epochs
        (`optim.schedule=cosine`, for fixed short budgets); times a linear warm-up over the first
        `optim.warmup_steps` steps (transformers)."""
        sched, warm = self.optim.schedule, self.optim.warmup_steps
        factor = min(1.0, (self.global_step + 1) / warm) if warm else 1.0
        if sched is None:
            return factor
        if sched != "cosine":
            raise ValueError(f"optim.schedule must be null or 'cosine', got {sched!r}")
        trainer = self.trainer
        progress = (self.current_epoch + batch_idx / max(1, trainer.num_training_batches)) / trainer.max_epochs
        return factor * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    def forward_window(self, x: torch.Tensor, state_attr: str, detach: bool):
        """One window [T, B]: the state carried over from the previous window (kept in
        `state_attr`), or, for a limited-memory model, independent tau-chunks from zero states."""
        tau = self.net.memory_tau
        if tau:
            return forward_chunked(self.net, x, tau)
        hidden = getattr(self, state_attr)
        if hidden is None:
            hidden = self.net.init_hidden(x.size(1))
        output, raw, hidden = self.net(x, repackage(hidden) if detach else hidden)
        setattr(self, state_attr, hidden)
        return output, raw

    def on_train_epoch_end(self):
        self.close_epoch_clock()  # an epoch without validation (check_val_every_n_epoch > 1)
        self.check_divergence()

    def on_train_end(self):
        self.close_epoch_clock()

    # -- averaged SGD -----------------------------------------------------------------------------
    @torch.no_grad()
    def _update_average(self):
        self.n_avg += 1
        self._average_to_parameters()  # a guard: a resumed average read onto the CPU, the parameters moved since
        for name, p in self.net.named_parameters():
            self.avg[name].add_(p.detach() - self.avg[name], alpha=1.0 / self.n_avg)

    def _average_to_parameters(self) -> None:
        """Puts each averaged tensor on its parameter's device and dtype. Checkpoints are read onto the CPU, and
        Lightning moves the module to the accelerator only after `on_load_checkpoint`; the average is a plain dict,
        not a buffer, so it does not follow the module there by itself."""
        if self.avg is None:
            return
        for name, p in self.net.named_parameters():
            a = self.avg[name]
            if a.device != p.device or a.dtype != p.dtype:
                self.avg[name] = a.to(device=p.device, dtype=p.dtype)

    def on_train_start(self):
        self._average_to_parameters()  # the module is on its device by now

    def start_averaging(self):
        self.avg = {n: p.detach().clone() for n, p in self.net.named_parameters()}
        self.n_avg = 1
        self.asgd_epoch = self.current_epoch

    @contextmanager
    def averaged_weights(self):
        """Temporarily put the averaged iterate into the network (no-op before the switch)."""
        if self.avg is None:
            yield
            return
        self._average_to_parameters()
        saved = {n: p.detach().clone() for n, p in self.net.named_parameters()}
        with torch.no_grad():
            for n, p in self.net.named_parameters():
                p.copy_(self.avg[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.net.named_parameters():
                    p.copy_(saved[n])

    # -- validation -----------------------------------------------------------------------------
    def on_validation_epoch_start(self):
        if not self.trainer.sanity_checking:
            self.close_epoch_clock()
            self.check_divergence()  # before this epoch's model is validated or saved
        dtype = torch.float32 if self.device.type == "mps" else torch.float64  # (MPS has no float64)
        self._val = [torch.zeros((), device=self.device, dtype=dtype), 0]  # summed on the device, read once
        self._val_hidden = None
        self._avg_ctx = self.averaged_weights()
        self._avg_ctx.__enter__()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        output, _ = self.forward_window(x, "_val_hidden", detach=False)
        nll = F.cross_entropy(self.net.logits(output).flatten(0, 1), y.flatten(), reduction="sum")
        self._val[0] += nll.detach()
        self._val[1] += y.numel()

    def on_validation_epoch_end(self):
        self._avg_ctx.__exit__(None, None, None)
        val_loss = self._val[0].item() / max(self._val[1], 1)  # the one read of the validation
        if not math.isfinite(val_loss):  # never let ModelCheckpoint see it: it would save this model as the best
            raise LmcalError(
                f"Validation at epoch {self.current_epoch} gave a loss of {val_loss}: the model diverged. It was "
                f"not saved; the checkpoints hold only models validated before. Lower the learning rate "
                f"(optim.lr={self.optim.lr:g} now) or clip gradients harder (optim.clip={self.optim.clip} now).")
        self.log_dict({"val/loss": val_loss, "val/ppl": exp_or_inf(val_loss)}, prog_bar=True)
        self.log("val_loss", val_loss, prog_bar=False, logger=False)
        if self.trainer.sanity_checking:
            return
        tps = self.train_tokens / self.train_seconds if self.train_seconds else float("nan")
        log.info(f"epoch {self.current_epoch}: val loss {val_loss:.4f}, val ppl {exp_or_inf(val_loss):.2f}, "
                 f"{self.train_tokens:,} training tokens at {tps:,.0f} tokens/s")
        if self.record_validation(val_loss):
            log.info(f"NT-ASGD: validation loss {val_loss:.4f} is worse than the best before the last "
                  f"{self.optim.nonmono} epochs; averaging the weights from epoch {self.current_epoch} on.")
        self.log("asgd", float(self.avg is not None))

    def record_validation(self, val_loss: float) -> bool:
        """NT-ASGD bookkeeping after one validation; True when averaging starts now."""
        if self.avg is not None:
            return False
        if self.optim.asgd and nt_asgd_should_switch(self.val_history, val_loss, self.optim.nonmono):
            self.start_averaging()
            return True
        self.val_history.append(val_loss)
        return False

    # -- checkpoints ----------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint):
        checkpoint["lmcal"] = {
            "val_history": list(self.val_history), "asgd_epoch": self.asgd_epoch, "n_avg": self.n_avg,
            "train_seconds": self.train_seconds, "train_tokens": self.train_tokens,
        }
        if self.avg is not None:
            checkpoint["raw_state_dict"] = checkpoint["state_dict"]
            with self.averaged_weights():
                checkpoint["state_dict"] = {k: v.clone() for k, v in self.state_dict().items()}

    def on_load_checkpoint(self, checkpoint):
        state = checkpoint.get("lmcal", {})
        self.val_history = list(state.get("val_history", []))
        self.asgd_epoch = state.get("asgd_epoch")
        self.n_avg = state.get("n_avg", 0)
        self.train_seconds = state.get("train_seconds", 0.0)
        self.train_tokens = state.get("train_tokens", 0)
        if "raw_state_dict" in checkpoint:  # resume: average from state_dict, iterate from raw_state_dict
            prefix = "net."
            averaged = checkpoint["state_dict"]
            self.avg = {n: averaged[prefix + n].to(device=p.device, dtype=p.dtype, copy=True)
                        for n, p in self.net.named_parameters()}
            checkpoint["state_dict"] = checkpoint["raw_state_dict"]
