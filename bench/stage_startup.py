"""What a pipeline stage costs before it does its own work, and what a warm worker would save: `make reproduce` runs
every stage as its own process, each importing torch, the stages (matplotlib, SciPy) and Hydra again.

    python bench/stage_startup.py [--ckpt BEST.ckpt] [--reps 5] [--out docs/bench/stage_startup.md]

Three measurements, interleaved (A B C A B C ...) to spread machine noise, medians reported:
- import: `python -c "import lmcal.evaluate"` (a process start and the imports every analysis stage makes);
- fresh: `python -m lmcal.evaluate ckpt=... stages=[] logger=none` in a new process, as the pipeline starts a stage
  (imports, Hydra, reading the checkpoint and its corpus, the model's test cross-entropy);
- warm: the same command run in a child forked from a process that has already imported lmcal.evaluate and run no
  torch operation (a warm worker; a fork after a torch CPU operation deadlocks the child's OpenMP pool, so the worker
  must never compute). The difference fresh - warm is what a warm worker saves a stage.
Without --ckpt a smoke model is trained first (experiment=smoke, one epoch; real PTB through LMCAL_DATA_ROOT, else
a synthetic corpus). The machine's float32 matmul rate, measured in the same run, is printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import matmul_flops

# The warm worker: imports what a stage imports, then forks one child per command line read from stdin, and answers
# each with the child's exit status. It never runs a torch operation (see the module's docstring).
WORKER = r"""
import os, runpy, sys
import lmcal.evaluate  # noqa: F401
print("ready", flush=True)
for line in sys.stdin:
    argv = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        os.setsid()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.argv = argv
        code = 0
        try:
            runpy.run_module("lmcal.evaluate", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


def evaluate_args(ckpt: str, out: Path) -> list[str]:
    data = [f"data_root={os.environ['LMCAL_DATA_ROOT']}"] if os.environ.get("LMCAL_DATA_ROOT") else []
    return [f"ckpt={ckpt}", "stages=[]", "logger=none", *data, f"hydra.run.dir={out}"]


def smoke_checkpoint(folder: Path) -> str:
    data = [f"data.root={os.environ['LMCAL_DATA_ROOT']}"] if os.environ.get("LMCAL_DATA_ROOT") else [
        "data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, n_test: 3000}"]
    subprocess.run([sys.executable, "-m", "lmcal.train", "experiment=smoke", "trainer.max_epochs=1", "logger=none",
                    "analysis.stages=[]", *data, f"hydra.run.dir={folder}"], check=True, capture_output=True)
    return str(folder / "checkpoints" / "best.ckpt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="a checkpoint of python -m lmcal.train (default: train a smoke model first)")
    ap.add_argument("--reps", type=int, default=5)
    add_out_option(ap, "stage_startup")
    args = ap.parse_args()
    emit, lines = tee()
    tmp = Path(tempfile.mkdtemp(prefix="lmcal-startup-"))
    ckpt = args.ckpt or smoke_checkpoint(tmp / "smoke")
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"
    times: dict[str, list[float]] = {"import": [], "fresh": [], "warm": []}
    try:
        for i in range(args.reps):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import lmcal.evaluate"], check=True)
            times["import"].append(time.perf_counter() - t)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "lmcal.evaluate", *evaluate_args(ckpt, tmp / f"fresh{i}")],
                           check=True, capture_output=True)
            times["fresh"].append(time.perf_counter() - t)
            t = time.perf_counter()
            worker.stdin.write("\t".join(["lmcal.evaluate", *evaluate_args(ckpt, tmp / f"warm{i}")]) + "\n")
            worker.stdin.flush()
            rc = int(worker.stdout.readline())
            times["warm"].append(time.perf_counter() - t)
            if rc:
                raise SystemExit(f"the warm worker's child failed (exit status {rc})")
    finally:
        worker.stdin.close()
        worker.wait()
    rate = matmul_flops(seconds=2.0) / 1e9
    med = {k: statistics.median(v) for k, v in times.items()}
    emit(f"Stage start-up ({args.reps} interleaved repetitions, medians; this machine's float32 matmul rate "
         f"{rate:.0f} GFLOP/s, measured in the same run; load average {os.getloadavg()[0]:.1f} at the end):")
    emit("")
    emit("| what | seconds (median) | all repetitions |")
    emit("|---|---:|---|")
    for k, what in (("import", "a process importing lmcal.evaluate"),
                    ("fresh", "a stage process: evaluate stages=[] (imports, Hydra, checkpoint, corpus, test CE)"),
                    ("warm", "the same, forked from a warm worker")):
        emit(f"| {what} | {med[k]:.2f} | {', '.join(f'{x:.2f}' for x in times[k])} |")
    emit("")
    saved = med["fresh"] - med["warm"]
    emit(f"A warm worker would save {saved:.2f} s a stage ({100 * saved / med['fresh']:.0f}% of a stage's start-up); "
         "the smoke profile runs 20 stage processes, two at a time.")
    save_bench(args.out, "Stage start-up: a fresh process against a warm worker", "\n".join(lines))


if __name__ == "__main__":
    main()
