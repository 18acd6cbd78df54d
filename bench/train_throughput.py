"""Training throughput of the AWD-LSTM, against a per-step LSTMCell baseline and the machine's matmul limit.

    python bench/train_throughput.py [--steps 8] [--models awd_lstm_small awd_lstm] [--device cpu]

For each model: tokens/s of a full training step (forward, loss with AR/TAR, backward,
clipping, SGD update) at batch 20, bptt 70, on our fused-kernel weight-dropped LSTM and on
a baseline that runs the same model one time step at a time in Python (LSTM cell equations) (what a
weight-drop LSTM falls back to when the fused kernel cannot take the dropped weight).
Model FLOP utilisation = 6 x (parameters in matrix multiplies) x tokens/s over the
measured float32 matmul FLOP/s of this machine.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from lmcal.docs import add_out_option, save_bench, tee
from lmcal.model import AWDLSTM, ar_tar, embedding_dropout, forward_chunked, locked_dropout, matmul_params, repackage
from lmcal.train import CONF_DIR


def matmul_flops(device: str, n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = 0.0
    for _ in range(3):
        for _ in range(2):
            a @ b
        sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t))
    return best


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(model: str, vocab: int) -> AWDLSTM:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"model={model}"])
    return instantiate(cfg.model, vocab_size=vocab)


def cell_forward(net: AWDLSTM, x: torch.Tensor, hidden):
    """The same AWD-LSTM forward, one time step at a time in Python (the baseline)."""
    emb = locked_dropout(embedding_dropout(net.encoder.weight, x, net.dropoute, True), net.dropouti, True)
    inp, new_hidden = emb, []
    for i, rnn in enumerate(net.rnns):
        w_hh = F.dropout(rnn.lstm.weight_hh_l0, rnn.weight_drop, training=True)  # one mask per forward
        h, c = hidden[i][0][0], hidden[i][1][0]
        outs = []
        for t in range(inp.size(0)):
            gates = inp[t] @ rnn.lstm.weight_ih_l0.t() + rnn.lstm.bias_ih_l0 + h @ w_hh.t() + rnn.lstm.bias_hh_l0
            ig, fg, gg, og = gates.chunk(4, 1)
            c = torch.sigmoid(fg) * c + torch.sigmoid(ig) * torch.tanh(gg)
            h = torch.sigmoid(og) * torch.tanh(c)
            outs.append(h)
        raw = torch.stack(outs)
        new_hidden.append((h[None], c[None]))
        inp = locked_dropout(raw, net.dropouth if i < net.num_layers - 1 else net.dropout, True)
    return inp, raw, new_hidden


def throughput(net: AWDLSTM, steps: int, batch: int, bptt: int, device: str, baseline: bool = False,
               tau: int | None = None) -> float:
    net.to(device).train()
    opt = torch.optim.SGD(net.parameters(), lr=1.0, weight_decay=1.2e-6)
    hidden = net.init_hidden(batch)
    x = torch.randint(0, net.vocab_size, (bptt, batch), device=device)
    y = torch.randint(0, net.vocab_size, (bptt, batch), device=device)
    for i in range(steps + 2):  # two warm-up steps
        if i == 2:
            sync(device)
            t = time.perf_counter()
        if baseline:
            output, raw, hidden = cell_forward(net, x, repackage(hidden))
        elif tau:
            output, raw = forward_chunked(net, x, tau)
        else:
            output, raw, hidden = net(x, repackage(hidden))
        loss = F.cross_entropy(net.logits(output).flatten(0, 1), y.flatten()) + ar_tar(output, raw, 2.0, 1.0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.25)
        opt.step()
    sync(device)
    return steps * batch * bptt / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["awd_lstm_small", "awd_lstm"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--baseline-steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--bptt", type=int, default=70)
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--taus", type=int, nargs="*", default=[5, 30],
                    help="also time limited-memory training at these tau (window bptt rounded to a multiple)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_out_option(ap, "train_throughput")
    args = ap.parse_args()
    emit, lines = tee()
    torch.manual_seed(0)
    peak = matmul_flops(args.device)
    emit(f"device {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    emit(f"float32 matmul (2048^3): {peak / 1e9:.1f} GFLOP/s")
    emit("| model | params | matmul params | implementation | tokens/s | GFLOP/s | MFU | vs per-step loop |")
    emit("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        net = build(name, args.vocab)
        n_mm = matmul_params(net)
        n_all = sum(p.numel() for p in net.parameters())
        ours = throughput(net, args.steps, args.batch, args.bptt, args.device)
        base = throughput(net, args.baseline_steps, args.batch, args.bptt, args.device, baseline=True)
        rows = [("fused (ours)", ours), ("per-step loop", base)]
        for tau in args.taus:
            window = max(tau, round(args.bptt / tau) * tau)
            rows.append((f"fused, memory_tau={tau}", throughput(net, args.steps, args.batch, window, args.device,
                                                                tau=tau)))
        for impl, tps in rows:
            flops = 6 * n_mm * tps
            emit(f"| {name} | {n_all / 1e6:.2f}M | {n_mm / 1e6:.2f}M | {impl} | {tps:,.0f} | {flops / 1e9:.1f} | "
                  f"{flops / peak:.1%} | {tps / base:.2f}x |")

    save_bench(args.out, "Training throughput", "\n".join(lines))


if __name__ == "__main__":
    main()
