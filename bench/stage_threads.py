"""Two stages side by side on this machine's cores (make reproduce's `jobs: 2`): the smoke model's training, two
processes at once, each with a thread per core (what torch takes by itself) and with cores // 2 threads (what the
pipeline now gives each stage, lmcal.pipeline.devices.thread_env), beside one process alone; in one run, beside the
machine's float32 matmul rate.

    python bench/stage_threads.py [--data-root ../shared/data] [--out docs/bench/stage_threads.md]

Without --data-root (or $LMCAL_DATA_ROOT) the runs train on the synthetic corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train_throughput import matmul_flops  # bench/ is on sys.path when run as a script

from lmcal.reporting.docs import add_out_option, save_bench, tee


def _train(folder: Path, threads: int, data: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lmcal.train", "experiment=smoke", "logger=none", "analysis.stages=[]",
           "trainer.max_epochs=1", "trainer.enable_progress_bar=false", f"hydra.run.dir={folder}", *data]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _side_by_side(root: Path, n: int, threads: int, data: list[str]) -> tuple[float, list[float]]:
    """n trainings at once with `threads` each: (wall seconds, each one's training tokens/s)."""
    t0 = time.perf_counter()
    procs = [_train(root / f"run{i}", threads, data) for i in range(n)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"a training failed: rerun one alone in {root}")
    wall = time.perf_counter() - t0
    return wall, [json.loads((root / f"run{i}" / "metrics.json").read_text())["tokens_per_s"] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default=os.environ.get("LMCAL_DATA_ROOT"))
    add_out_option(ap, "stage_threads")
    args = ap.parse_args()
    data = [f"data.root={args.data_root}"] if args.data_root else [
        "data.name=synthetic", "+data.corpus_kwargs={vocab_size: 10000, n_train: 40000, n_valid: 3000, n_test: 3000}"]
    cores = len(os.sched_getaffinity(0))
    emit, lines = tee()
    emit(f"{cores} cores; float32 matmul {matmul_flops('cpu') / 1e9:.1f} GFLOP/s; the smoke model (experiment=smoke), "
         f"one epoch, {'real PTB' if args.data_root else 'a synthetic corpus of 10,000 words'}")
    emit("")
    emit("| processes at once | threads each | wall (s) | training tokens/s, each |")
    emit("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (n, threads) in enumerate([(1, cores), (2, cores), (2, max(1, cores // 2))]):
            wall, rates = _side_by_side(Path(tmp) / str(i), n, threads, data)
            emit(f"| {n} | {threads} | {wall:.1f} | {', '.join(f'{r:,.0f}' for r in rates)} |")
    save_bench(args.out, "Stages side by side: threads per stage", "\n".join(lines))


if __name__ == "__main__":
    main()
