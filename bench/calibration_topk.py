"""Cost and accuracy of the lookahead approximation: alpha* and CE after calibration for top-k vs exact.

    python bench/calibration_topk.py --ckpt outputs/.../best.ckpt [--positions 500] [--ks 16 64 256 1024 0]
    python bench/calibration_topk.py --timing-only [--models awd_lstm_small awd_lstm]

With a checkpoint: fits alpha* on the first validation tokens of the checkpoint's corpus, read as 5 streams,
for each k (0 = exact, the whole vocabulary), and prints alpha*, CE before/after and the wall time. With
--timing-only: the exact lookahead's time per 1,000 positions for random-weight models of both sizes, and its
FLOP utilisation (2 x matmul parameters per candidate step, over the measured float32 matmul FLOP/s).
"""

from __future__ import annotations

import argparse
import time

import torch
from train_throughput import build, matmul_flops  # bench/ is on sys.path when run as a script

from lmcal.calibration import fit_lookahead_calibration, lookahead_statistics
from lmcal.data import batchify
from lmcal.evaluate import load_checkpoint_and_data
from lmcal.lm import LSTMStepLM
from lmcal.model import matmul_params


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt")
    ap.add_argument("--data-root")
    ap.add_argument("--positions", type=int, default=500)
    ap.add_argument("--streams", type=int, default=5)
    ap.add_argument("--ks", type=int, nargs="+", default=[16, 64, 256, 1024, 0])
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--models", nargs="+", default=["awd_lstm_small", "awd_lstm"])
    ap.add_argument("--timing-positions", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    peak = matmul_flops("cpu")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; float32 matmul {peak / 1e9:.1f} GFLOP/s")
    if args.timing_only:
        print("| model | exact lookahead: s per 1,000 positions | candidate steps/s | GFLOP/s | MFU |")
        print("|---|---|---|---|---|")
        for name in args.models:
            net = build(name, 10_000).eval()
            lm = LSTMStepLM(net)
            tokens = torch.randint(0, 10_000, (args.timing_positions // 4 + 1, 4))
            t = time.perf_counter()
            lookahead_statistics(lm, tokens, topk=None)  # the pass; the 1-D fit on its statistics costs nothing
            dt = time.perf_counter() - t
            n = (tokens.size(0) - 1) * tokens.size(1)
            steps_per_s = n * (lm.vocab_size + 1) / dt
            flops = 2 * matmul_params(net) * steps_per_s
            print(f"| {name} | {dt / n * 1000:,.0f} | {steps_per_s:,.0f} | {flops / 1e9:.1f} | "
                  f"{flops / peak:.1%} |")
        return
    net, _, dm = load_checkpoint_and_data(args.ckpt, args.data_root, "cpu")
    lm = LSTMStepLM(net)
    rows = args.positions // args.streams + 1
    tokens = batchify(dm.tokens("valid")[: rows * args.streams], args.streams)  # [rows, streams]
    print(f"{args.ckpt}: {tokens.size(0) - 1} x {args.streams} = {(tokens.size(0) - 1) * args.streams} positions")
    print("| k | alpha* | alpha stderr | CE before (nats) | CE after (nats) | wall (s) |")
    print("|---|---|---|---|---|---|")
    for k in args.ks:
        t = time.perf_counter()
        fit = fit_lookahead_calibration(lm, tokens, topk=k or None)
        label = f"V = {lm.vocab_size} (exact)" if not k else str(k)
        print(f"| {label} | {fit.alpha:.5f} | {fit.alpha_stderr:.5f} | {fit.ce_before:.5f} | {fit.ce_after:.5f} | "
              f"{time.perf_counter() - t:.1f} |", flush=True)


if __name__ == "__main__":
    main()
