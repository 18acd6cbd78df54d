"""The analysis's row-wise work on the CPU in blocks of rows, each beside the whole-batch version it replaced, in one
run; and the analysis entry point's start without Lightning.

    python bench/cpu_blocks.py [--rows 10000] [--batch 500] [--repeats 3] [--out docs/bench/cpu_blocks.md]

- fits: `memory.memory_summary` (the memory stage's fits: one- and two-parameter, jackknife, cross-fit) on --rows
  random rows of V = 10,000 words, with expfit's blocks of 2^22 entries (before) and of expfit.CPU_ELEMENTS (now).
- decoder rules: one step's rule on --batch rows of 10,000 (a generation batch), on the whole batch (before) and on
  blocks of rows (`decoders.by_rows`, now).
- entry point: a fresh `python -c "import lmcal.evaluate"` with Lightning (the import it had before) and without.

Each figure is the best of --repeats. The work is memory-bound (no matmul), so the float32 matmul rate is printed as
the machine's reference only. Results are the same bit for bit in both versions (tests/test_decoders.py; the fits
agree to 1e-9).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
from bench_args import count  # bench/ is on sys.path when run as a script

from lmcal.core import decoders as D
from lmcal.core.memory import memory_summary
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import best_of, matmul_flops


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=count, default=10_000)
    ap.add_argument("--batch", type=count, default=500)
    ap.add_argument("--repeats", type=count, default=3)
    add_out_option(ap, "cpu_blocks")
    args = ap.parse_args(argv)
    emit, lines = tee()
    V = 10_000
    gen = torch.Generator().manual_seed(0)
    emit(f"{torch.get_num_threads()} threads, torch {torch.__version__}; float32 matmul "
         f"{matmul_flops(2048) / 1e9:.1f} GFLOP/s (2048^3)\n")
    emit("| work | size | before | now | speed-up |")
    emit("|---|---|---|---|---|")

    full = torch.log_softmax(2.5 * torch.randn(args.rows, V, generator=gen), -1)
    lim = torch.log_softmax(0.8 * full + 0.5 * torch.randn(args.rows, V, generator=gen), -1)
    y = torch.distributions.Categorical(logits=full).sample()
    chunks = [(full, lim, y)]
    old = best_of(lambda: memory_summary(chunks, cluster_size=1000, elements=1 << 22), args.repeats)
    new = best_of(lambda: memory_summary(chunks, cluster_size=1000), args.repeats)
    emit(f"| memory-bound fits (memory_summary) | {args.rows:,} x {V:,} | {old:.2f} s | {new:.2f} s | "
         f"{old / new:.2f}x |")

    logp = torch.log_softmax(2.5 * torch.randn(args.batch, V, generator=gen), -1)
    for name, params in (("top_p", {"p": 0.95}), ("typical", {"mass": 0.95}), ("eta", {"eta_cutoff": 3e-4}),
                         ("min_p", {"min_p": 0.05}), ("top_k", {"k": 50})):
        rule = D.DECODERS[name][0]
        call = lambda lp, rule=rule, params=params: rule(lp, **params)  # noqa: E731
        old = best_of(lambda call=call: call(logp), args.repeats)
        new = best_of(lambda call=call: D.by_rows(call, logp), args.repeats)
        emit(f"| decoder rule {name} | {args.batch} x {V:,} | {1000 * old:.1f} ms | {1000 * new:.1f} ms | "
             f"{old / new:.2f}x |")
    mu = torch.full((args.batch,), 5.0, dtype=torch.float64)
    old = best_of(lambda: D.mirostat_cut(logp, mu), args.repeats)
    new = best_of(lambda: D.by_rows(D.mirostat_cut, logp, mu), args.repeats)
    emit(f"| decoder rule mirostat | {args.batch} x {V:,} | {1000 * old:.1f} ms | {1000 * new:.1f} ms | "
         f"{old / new:.2f}x |")

    start = lambda code: best_of(lambda: subprocess.run([sys.executable, "-c", code], check=True), args.repeats)  # noqa: E731
    old = start("import lmcal.evaluate, pytorch_lightning.loggers")
    new = start("import lmcal.evaluate")
    emit(f"| `python -m lmcal.evaluate` imports | one process | {old:.2f} s | {new:.2f} s | {old / new:.2f}x |")
    emit("\nBefore: blocks of 2^22 entries (fits), whole batches (rules), Lightning's import; now: blocks of "
         "2^18 (fits) and 2^19 (rules) entries, no Lightning. Best of "
         f"{args.repeats}.")
    save_bench(args.out, "CPU blocks of rows", "\n".join(lines),
               command="python bench/cpu_blocks.py" + (f" --out {args.out}" if args.out else ""))


if __name__ == "__main__":
    main()
