"""Every future-entropy head (K in {1, 5, 20, 100}, discount in {1, 0.95}) on a trained model, beside the decoders.

    python bench/future_entropy.py --ckpt runs/cpu/ptb/base/checkpoints/best.ckpt
        [--decoders-json runs/cpu/ptb/decoders/decoders.json] [--horizon-k 1 5 20 100] [--discount 1 0.95]
        [--analysis cpu] [--out docs/bench/future_entropy.md] [--keep DIR]

Runs the future_entropy stage (`python -m lmcal.evaluate stages=[future_entropy]`, with the analysis preset's other
settings) with every (K, discount) head, and prints its table: the cpu reproduction runs the discount-0.95 heads only,
to keep within its time; this is the full comparison. Give the decoders stage's result of the same reproduction to
have its rows (same prefixes, seeds and test words) in the table too.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_args import count  # bench/ is on sys.path when run as a script

from lmcal.reporting.docs import save_bench
from lmcal.stages.future_entropy import future_entropy_table
from lmcal.utils.profiling import machine_line


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="a checkpoint of python -m lmcal.train (its base model)")
    ap.add_argument("--decoders-json", default=None, help="the decoders stage's decoders.json (same settings)")
    ap.add_argument("--horizon-k", type=count, nargs="+", default=[1, 5, 20, 100])
    ap.add_argument("--discount", type=float, nargs="+", default=[1.0, 0.95])
    ap.add_argument("--analysis", default="cpu", help="the conf/analysis preset (default cpu)")
    ap.add_argument("--out", default=None, help="save the table for `make docs` (e.g. docs/bench/future_entropy.md)")
    ap.add_argument("--keep", default=None, help="the stage's run folder (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    if not Path(args.ckpt).is_file():
        sys.exit(f"bench/future_entropy.py: --ckpt {args.ckpt} does not exist; train a model first "
                 "(make reproduce PROFILE=cpu writes <out>/ptb/base/checkpoints/best.ckpt).")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.keep or tmp)
        cmd = [sys.executable, "-m", "lmcal.evaluate", f"ckpt={Path(args.ckpt).resolve()}", "stages=[future_entropy]",
               f"analysis={args.analysis}", "logger=none", f"hydra.run.dir={run}",
               f"analysis.future_entropy.horizon_k=[{','.join(map(str, args.horizon_k))}]",
               f"analysis.future_entropy.discount=[{','.join(map(str, args.discount))}]"]
        if args.decoders_json:
            cmd.append(f"analysis.future_entropy.decoders_json={Path(args.decoders_json).resolve()}")
        if subprocess.run(cmd).returncode:
            sys.exit(f"bench/future_entropy.py: the stage failed; its log is in {run} (rerun with --keep DIR)")
        r = json.loads((run / "future_entropy.json").read_text())
    heads = [row for row in r["rows"] if "head" in row]
    quality = ["| K | discount | examples | held-out R² | RMSE (nats) | target mean ± sd (nats) |",
               "|---|---|---|---|---|---|"]
    seen = set()
    for row in heads:
        h = row["head"]
        if (h["horizon_k"], h["discount"]) in seen:
            continue
        seen.add((h["horizon_k"], h["discount"]))
        quality.append(f"| {h['horizon_k']} | {h['discount']:g} | {h['train_examples']:,} | {h['r2']:.3f} | "
                       f"{h['rmse_nats']:.3f} | {h['target_mean_nats']:.2f} ± {h['target_std_nats']:.2f} |")
    body = (f"{machine_line()}\n\n"
            f"{r['model']} on {r['corpus']}: {r['num_prefixes'] * r['samples_per_prefix']} generations of "
            f"{r['horizon']} words; test CE on {r['test_tokens']:,} test words; heads fitted on {r['fit_tokens']:,} "
            f"validation positions, trained on {r['rollout_examples']:,} rollout examples ({r['rollouts']} rollouts, "
            f"{r['rollout_model_steps']:,} model steps); stage time {r['seconds']:.0f} s.\n\n"
            + future_entropy_table(r["rows"], r["reference_test_ce_nats"])
            + "\nThe heads' regression on held-out rollouts (10% of the rollouts):\n\n" + "\n".join(quality) + "\n")
    print(body)
    save_bench(args.out, "Future-entropy heads, every horizon and discount", body,
               "python bench/future_entropy.py " + shlex.join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
