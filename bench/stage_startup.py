"""What a pipeline stage costs before it does its own work, and what a warm worker would save: `make reproduce` runs
every stage as its own process, each importing torch, the stages (matplotlib, SciPy) and Hydra again.

    python bench/stage_startup.py [--ckpt BEST.ckpt] [--reps 5] [--pipeline] [--out docs/bench/stage_startup.md]

Three measurements, interleaved (A B C A B C ...) to spread machine noise, medians reported:
- import: `python -c "import lmcal.evaluate"` (a process start and the imports every analysis stage makes);
- fresh: `python -m lmcal.evaluate ckpt=... stages=[] logger=none` in a new process, as the pipeline starts a stage
  (imports, Hydra, reading the checkpoint and its corpus, the model's test cross-entropy);
- warm: the same command forked by the pipeline's warm worker (lmcal.pipeline.warm, which `make reproduce` uses
  unless warm_worker=false), as the pipeline forks a stage. The difference fresh - warm is what it saves a stage.
With --pipeline, then the whole smoke reproduction (`python -m lmcal.reproduce profile=smoke logger=csv`) twice,
forked by the warm worker and with warm_worker=false, each into a new folder: their wall times, their stages' summed
seconds and whether every number of results.json agrees (tests/test_reproduce.py checks every result file).
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

from bench_args import count  # bench/ is on sys.path when run as a script

from lmcal.pipeline.warm import Worker
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import matmul_flops


def evaluate_args(ckpt: str, out: Path) -> list[str]:
    data = [f"data_root={os.environ['LMCAL_DATA_ROOT']}"] if os.environ.get("LMCAL_DATA_ROOT") else []
    return [f"ckpt={ckpt}", "stages=[]", "logger=none", *data, f"hydra.run.dir={out}"]


def smoke_checkpoint(folder: Path) -> str:
    data = [f"data.root={os.environ['LMCAL_DATA_ROOT']}"] if os.environ.get("LMCAL_DATA_ROOT") else [
        "data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, n_test: 3000}"]
    subprocess.run([sys.executable, "-m", "lmcal.train", "experiment=smoke", "trainer.max_epochs=1", "logger=none",
                    "analysis.stages=[]", *data, f"hydra.run.dir={folder}"], check=True, capture_output=True)
    return str(folder / "checkpoints" / "best.ckpt")


# what differs from run to run (times, rates, dates, folders): the keys tests/test_reproduce.py leaves out
TIMING = {"seconds", "fit_seconds", "rows_seconds", "wall_seconds", "train_seconds", "tokens_per_s",
          "generated_tokens_per_s", "profile", "provenance", "stages", "_runtime", "_timestamp", "ms_per_token",
          "cost_ratio", "generation_ms_per_token", "rollout_seconds", "tail_seconds", "generation_seconds",
          "ms_per_word", "convergence", "wandb_group", "config"}


def _numbers(obj):
    """results.json without what differs from run to run (TIMING)."""
    if isinstance(obj, dict):
        return {k: _numbers(v) for k, v in obj.items() if k not in TIMING}
    return [_numbers(v) for v in obj] if isinstance(obj, list) else obj


def pipeline_rows(tmp: Path, env: dict, emit) -> None:
    """The smoke reproduction forked by the warm worker, then with fresh processes: wall times and agreement."""
    import json

    env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}  # the pipeline gives each stage its share
    runs = {}
    for name, extra in (("warm", []), ("fresh", ["warm_worker=false"])):
        out = tmp / f"reproduce-{name}"
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "lmcal.reproduce", "profile=smoke", f"out={out}", "logger=csv", *extra],
                       check=True, capture_output=True, env=env)
        r = json.loads((out / "results.json").read_text())
        stages = sum(json.loads(p.read_text()).get("seconds", 0.0) for p in (out / "stages").glob("*.json"))
        runs[name] = (time.perf_counter() - t, stages, _numbers(r))
        emit(f"- smoke reproduction, stages {'forked by the warm worker' if name == 'warm' else 'as fresh processes'}"
             f": {runs[name][0]:.0f} s wall, {stages:.0f} s summed over its stages")
    same = runs["warm"][2] == runs["fresh"][2]
    emit(f"- every number of results.json (times, dates and paths aside) the same both ways: {'yes' if same else 'NO'}")
    emit(f"- the warm worker saved {runs['fresh'][0] - runs['warm'][0]:.0f} s of the smoke reproduction's wall time "
         f"({100 * (1 - runs['warm'][0] / runs['fresh'][0]):.0f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="a checkpoint of python -m lmcal.train (default: train a smoke model first)")
    ap.add_argument("--reps", type=count, default=5)
    ap.add_argument("--pipeline", action="store_true", help="also the smoke reproduction, warm against fresh")
    add_out_option(ap, "stage_startup")
    args = ap.parse_args()
    emit, lines = tee()
    tmp = Path(tempfile.mkdtemp(prefix="lmcal-startup-"))
    ckpt = args.ckpt or smoke_checkpoint(tmp / "smoke")
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t = time.perf_counter()
    worker = Worker.start(env)
    first = worker.launch([sys.executable, "-m", "lmcal.evaluate", "--help"], env, tmp / "first.log")
    first.wait()
    start = time.perf_counter() - t  # the worker's own imports, paid once a pipeline
    times: dict[str, list[float]] = {"import": [], "fresh": [], "warm": []}
    try:
        for i in range(args.reps):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import lmcal.evaluate"], check=True)
            times["import"].append(time.perf_counter() - t)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "lmcal.evaluate", *evaluate_args(ckpt, tmp / f"fresh{i}")],
                           check=True, capture_output=True, env=env)
            times["fresh"].append(time.perf_counter() - t)
            t = time.perf_counter()
            rc = worker.launch([sys.executable, "-m", "lmcal.evaluate", *evaluate_args(ckpt, tmp / f"warm{i}")],
                               env, tmp / f"warm{i}.log").wait()
            times["warm"].append(time.perf_counter() - t)
            if rc:
                raise SystemExit(f"the warm worker's stage failed (exit status {rc}); see {tmp / f'warm{i}.log'}")
    finally:
        worker.close()
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
    emit(f"The warm worker saves {saved:.2f} s a stage ({100 * saved / med['fresh']:.0f}% of a stage's start-up), "
         f"after {start:.1f} s of its own imports once a pipeline (overlapping the first stage's); the smoke profile "
         "runs 20 stage processes, two at a time.")
    if args.pipeline:
        emit("")
        pipeline_rows(tmp, env, emit)
    save_bench(args.out, "Stage start-up: a fresh process against a warm worker", "\n".join(lines))


if __name__ == "__main__":
    main()
