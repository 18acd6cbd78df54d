"""Training throughput of the AWD-LSTM against a plain nn.LSTM stack and the machine's matmul limit, in one run.

    python bench/train_throughput.py [--models small paper] [--reps 3] [--steps 20] [--taus 5 30]
        [--lightning 20 1] [--deterministic] [--out docs/bench/train_throughput.md]

The configurations and the step are those of ../shared/peers/ (which adds fastai's AWD_LSTM; run it for that
column): paper = 400/1150/3 at batch 20, BPTT 70; small = 200/400/3 at batch 32, BPTT 35; V = 10,000; one step =
forward, full-softmax cross-entropy, backward, gradient-norm clipping (0.25), SGD. Implementations:
- plain: stacked torch.nn.LSTM layers, tied decoder, no regularisation (the kernel's ceiling);
- ours: lmcal.models.awd_lstm.AWDLSTM with the AWD dropouts (weight drop, locked, embedding), cross-entropy only
  (equal work);
- ours + AR/TAR: the training loss lmcal.training.module uses;
- tau = T: the limited-memory model's training forward (lmcal.models.awd_lstm.forward_chunked: the window cut into
  T-token
  chunks, each from a zero state), the window rounded to a multiple of T;
- Lightning, reads every N: ours + AR/TAR through the real training path (lightning_throughput), the device read every
  N steps; its ratio to ours + AR/TAR is the Lightning step's overhead.
Repetitions are interleaved (A B C A B C ...) to spread machine noise; the table gives medians. MFU = 6 x
(parameters in matrix multiplies) x tokens/s over the float32 matmul rate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from bench_args import count, count_or_zero  # bench/ is on sys.path when run as a script
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from lmcal.models.awd_lstm import AWDLSTM, ar_tar, forward_chunked, matmul_params, repackage
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import peak_flops
from lmcal.utils.settings import CONF_DIR

CONFIGS = {"paper": ("awd_lstm", 20, 70), "small": ("awd_lstm_small", 32, 35)}  # model preset, batch, BPTT
PEER_DROPOUTS = dict(dropout=0.4, dropouth=0.25, dropouti=0.4, dropoute=0.1, wdrop=0.5)  # the peers' "paper" set


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(model: str, vocab: int, **overrides) -> AWDLSTM:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"model={model}"])
    return instantiate(cfg.model, vocab_size=vocab, **overrides)


class PlainLSTM(nn.Module):
    """Unregularised nn.LSTM layers of the same sizes as an AWDLSTM, tied decoder: the fused kernel's ceiling."""

    def __init__(self, net: AWDLSTM):
        super().__init__()
        self.encoder = nn.Embedding(net.vocab_size, net.emb_size)
        self.rnns = nn.ModuleList(nn.LSTM(r.lstm.input_size, r.lstm.hidden_size) for r in net.rnns)
        self.decoder = nn.Linear(net.emb_size, net.vocab_size)
        self.decoder.weight = self.encoder.weight

    def forward(self, x, hidden):
        out, new = self.encoder(x), []
        for rnn, h in zip(self.rnns, hidden, strict=True):
            out, h = rnn(out, h)
            new.append(h)
        return out, out, new

    def logits(self, out):
        return self.decoder(out)


def throughput(net, steps: int, batch: int, bptt: int, device: str, tau: int | None = None,
               artar: bool = False) -> float:
    net.to(device).train()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    hidden = [(torch.zeros(1, batch, r.hidden_size, device=device),) * 2 for r in net.rnns] \
        if isinstance(net, PlainLSTM) else net.init_hidden(batch)
    V = net.decoder.weight.size(0)
    x = torch.randint(0, V, (bptt, batch), device=device)
    y = torch.randint(0, V, (bptt, batch), device=device)
    for i in range(steps + 2):  # two warm-up steps
        if i == 2:
            sync(device)
            t = time.perf_counter()
        if tau:
            output, raw = forward_chunked(net, x, tau)
        else:
            output, raw, hidden = net(x, repackage(hidden))
        loss = F.cross_entropy(net.logits(output).flatten(0, 1), y.flatten())
        if artar:
            loss = loss + ar_tar(output, raw, 2.0, 1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.25)
        opt.step()
    sync(device)
    return steps * batch * bptt / (time.perf_counter() - t)


def lightning_throughput(net: AWDLSTM, steps: int, batch: int, bptt: int, device: str, read_every: int = 20,
                         deterministic: bool = False, warm: int = 5, val_batches: int = 0,
                         memory_tau: int | None = None) -> dict:
    """The training step as `python -m lmcal.train` runs it: lmcal.training.module.LMModule (AR/TAR, the lr per window,
    the divergence watch, clipping, SGD, its logs) in a Lightning Trainer with a CSV logger and lmcal's progress bar,
    on a stream of random tokens, windows of exactly `bptt`. Lightning reads the device every `read_every` steps
    (trainer.log_every_n_steps). Timed with a device sync at step `warm` and at the end: {tokens_per_s, ms_per_step,
    val_ms_per_batch} (validation over `val_batches` windows of the same size at eval batch 10, when > 0).
    memory_tau: the tau-model's step (lmcal.models.awd_lstm.forward_chunked), bptt a multiple of it."""
    import tempfile

    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger

    from lmcal.training.callbacks import progress_bar
    from lmcal.training.module import LMDataModule, LMModule, OptimConfig

    class Clock(pl.Callback):
        t0 = t1 = v0 = 0.0
        val = 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warm:
                sync(device)
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == warm + steps - 1:
                sync(device)
                self.t1 = time.perf_counter()

        def on_validation_epoch_start(self, trainer, module):
            sync(device)
            self.v0 = time.perf_counter()

        def on_validation_epoch_end(self, trainer, module):
            sync(device)
            self.val = time.perf_counter() - self.v0

    from lmcal.data.corpora import Corpus

    V = net.decoder.weight.size(0)
    n = (steps + warm + 2) * batch * bptt
    g = torch.Generator().manual_seed(0)
    words = lambda k: torch.randint(0, V, (k,), generator=g)  # noqa: E731  (uniform: the work does not depend on it)
    dm = LMDataModule(name="random", batch_size=batch, eval_batch_size=10, bptt=bptt, seed=0, variable_length=False,
                      memory_tau=memory_tau)
    dm.corpus = Corpus("random", [f"w{i}" for i in range(V)], words(n), words(max(1, val_batches) * 10 * bptt + 10),
                       words(1000))
    cfg = {"_target_": "lmcal.models.awd_lstm.AWDLSTM", "emb_size": net.emb_size, "hidden_size": net.hidden_size,
           "num_layers": net.num_layers, "memory_tau": memory_tau, **PEER_DROPOUTS}
    module = LMModule(net=cfg, vocab_size=V, optim=OptimConfig(lr=1.0), bptt=bptt)
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(max_epochs=1, limit_train_batches=steps + warm, limit_val_batches=val_batches,
                             num_sanity_val_steps=0, log_every_n_steps=read_every, logger=CSVLogger(tmp),
                             enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp,
                             accelerator="gpu" if device.startswith("cuda") else "cpu", devices=1,
                             deterministic="warn" if deterministic else False, callbacks=[clock, progress_bar()])
        trainer.fit(module, datamodule=dm)
    seconds = clock.t1 - clock.t0
    return {"tokens_per_s": steps * batch * bptt / seconds, "ms_per_step": 1000 * seconds / steps,
            "val_ms_per_batch": 1000 * clock.val / val_batches if val_batches else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["small", "paper"], choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=count_or_zero, default=0, help="timed steps per repetition (0: 60 small, 20 paper)")
    ap.add_argument("--reps", type=count, default=3)
    ap.add_argument("--vocab", type=count, default=10_000)
    ap.add_argument("--taus", type=count, nargs="*", default=[5, 30],
                    help="also time limited-memory training at these tau (window bptt rounded to a multiple)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lightning", type=count, nargs="*", default=[20, 1], metavar="N",
                    help="also the step through lmcal's Lightning module and Trainer, reading the device every N steps "
                         "(trainer.log_every_n_steps), against the bare loop of the same network (ours + AR/TAR); "
                         "none: skip")
    ap.add_argument("--deterministic", action="store_true",
                    help="also the Lightning step with trainer.deterministic=warn (the training preset's setting)")
    add_out_option(ap, "train_throughput")
    args = ap.parse_args()
    emit, lines = tee()
    torch.manual_seed(0)
    peak = peak_flops(args.device)
    emit(f"device {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}; float32 matmul "
         f"(2048^3, best of 3): {peak / 1e9:.1f} GFLOP/s")
    emit("")
    emit("| config | implementation | batch x BPTT | tokens/s (median) | runs | GFLOP/s | MFU | vs plain | vs ours |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for cfg in args.models:
        preset, batch, bptt = CONFIGS[cfg]
        steps = args.steps or (20 if cfg == "paper" else 60)
        net = build(preset, args.vocab, **PEER_DROPOUTS)
        impls = {"plain": (PlainLSTM(net), bptt, {}), "ours": (net, bptt, {}),
                 "ours + AR/TAR": (net, bptt, {"artar": True})}
        for tau in args.taus:
            impls[f"ours, tau = {tau}"] = (net, max(tau, round(bptt / tau) * tau), {"tau": tau})
        for every in args.lightning:
            impls[f"ours + AR/TAR, Lightning, reads every {every}"] = (net, bptt, {"lightning": every})
        if args.deterministic and args.lightning:
            impls[f"ours + AR/TAR, Lightning, reads every {args.lightning[0]}, deterministic"] = \
                (net, bptt, {"lightning": args.lightning[0], "deterministic": True})
        runs = {k: [] for k in impls}
        for _ in range(args.reps):
            for k, (model, window, kw) in impls.items():
                if "lightning" in kw:
                    runs[k].append(lightning_throughput(model, steps, batch, window, args.device, kw["lightning"],
                                                        kw.get("deterministic", False))["tokens_per_s"])
                else:
                    runs[k].append(throughput(model, steps, batch, window, args.device, **kw))
        med = {k: statistics.median(v) for k, v in runs.items()}
        n_mm = matmul_params(net)
        for k, v in med.items():
            flops = 6 * n_mm * v
            emit(f"| {cfg} | {k} | {batch} x {impls[k][1]} | {v:,.0f} | {', '.join(f'{x:,.0f}' for x in runs[k])} | "
                 f"{flops / 1e9:.1f} | {flops / peak:.1%} | {v / med['plain']:.3f} | {v / med['ours']:.3f} |")
    emit("")
    emit("fastai's AWD_LSTM is measured beside plain and ours by ../shared/peers/run_all.sh (same configurations).")
    if args.lightning:
        emit("The Lightning rows run the step of `python -m lmcal.train` (lmcal.training.module.LMModule in a Trainer "
             "with a CSV logger and lmcal's progress bar) on random tokens in windows of exactly the BPTT length; "
             "their 'vs ours' against 'ours + AR/TAR' (the same work in a bare loop) is the per-step overhead of the "
             "Lightning path.")
    save_bench(args.out, "Training throughput", "\n".join(lines))


if __name__ == "__main__":
    main()
