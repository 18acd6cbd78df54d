"""Generated tokens/s of `generation_entropy_curve`: all generations in one batch vs one sample at a time.

    python bench/generation_speed.py [--models awd_lstm_small awd_lstm] [--generations 500] [--horizon 50]

Same model, same prefixes, measured side by side in one run. Weights are random (speed does not depend on
them). FLOP utilisation = 2 x (parameters in matrix multiplies) x generated tokens/s over the measured
float32 matmul FLOP/s (forward only; the prefix feeding is included in the time, not in the token count).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_args import count  # bench/ is on sys.path when run as a script
from train_throughput import build  # bench/ is on sys.path when run as a script

from lmcal.core.entropy_rate import generation_entropy_curve
from lmcal.models.awd_lstm import matmul_params
from lmcal.models.step_lm import LSTMStepLM
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import peak_flops


def generated_per_s(lm, prefixes, horizon, samples, max_batch) -> float:
    t = time.perf_counter()
    generation_entropy_curve(lm, prefixes, horizon, samples, seed=0, max_batch=max_batch)
    return prefixes.size(0) * samples * horizon / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["awd_lstm_small", "awd_lstm"])
    ap.add_argument("--generations", type=count, default=500, help="batched: 100 prefixes x this/100 samples")
    ap.add_argument("--serial-generations", type=count, default=4, help="timed one at a time (batch 1)")
    ap.add_argument("--horizon", type=count, default=50)
    ap.add_argument("--prefix-len", type=count, default=20)
    ap.add_argument("--vocab", type=count, default=10_000)
    add_out_option(ap, "generation_speed")
    args = ap.parse_args()
    emit, lines = tee()
    torch.manual_seed(0)
    peak = peak_flops("cpu")
    emit(f"{torch.get_num_threads()} threads, torch {torch.__version__}; float32 matmul {peak / 1e9:.1f} GFLOP/s")
    emit("| model | mode | generations | tokens/s | GFLOP/s | MFU | speed-up |")
    emit("|---|---|---|---|---|---|---|")
    for name in args.models:
        net = build(name, args.vocab).eval()
        lm, n_mm = LSTMStepLM(net), matmul_params(net)
        prefixes = torch.randint(0, args.vocab, (100, args.prefix_len))
        samples = max(1, args.generations // 100)
        batched = generated_per_s(lm, prefixes, args.horizon, samples, max_batch=100 * samples)
        serial = generated_per_s(lm, prefixes[: args.serial_generations], args.horizon, 1, max_batch=1)
        for mode, n, tps in (("one batch", 100 * samples, batched), ("one at a time", args.serial_generations, serial)):
            emit(f"| {name} | {mode} | {n} | {tps:,.0f} | {2 * n_mm * tps / 1e9:.1f} | {2 * n_mm * tps / peak:.1%} | "
                  f"{tps / serial:.1f}x |")

    save_bench(args.out, "Generation speed", "\n".join(lines))


if __name__ == "__main__":
    main()
