"""The wall time of a scale profile's sweeps (make reproduce PROFILE=scale), estimated from short timed pieces.

    python bench/scale_sweep.py [--profile scale] [--sweeps awd_lstm ...] [--slice 20000] [--fraction 0.2]
        [--out docs/bench/scale_sweep.md]

For each distinct model of the profile's grids (its jobs differ in their training tokens and training seed only, which
leave the speed alone: one seed a cell is timed) this trains the job's own model and recipe on --slice training tokens
for one epoch, times a validation pass, and runs the job's analysis stages (entropy_rate, calibration, decoders) on that
checkpoint with --fraction of their validation points and fit and test tokens. Each job's time is then its epochs over
its training and validation tokens at the measured rates, plus the final scoring and the record's pass over the test
text, plus its stages' times scaled by 1 / fraction. Printed beside the machine's float32 matmul rate, measured before
and after: on a machine that others share the estimate is as good as that rate is steady.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench_args import count, share  # bench/ is on sys.path when run as a script
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lmcal.pipeline.plan import load_profile
from lmcal.pipeline.scale_sweep import plan_sweeps
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import matmul_flops
from lmcal.utils.settings import CONF_DIR

VALID, TEST = 73_760, 82_430  # PTB's validation and test tokens (the generated sources: their settings)


def composed(entry: str, overrides: list[str], out: Path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(entry, overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    return cfg


def piece(overrides: list[str], slice_tokens: int, fraction: float, tmp: Path) -> dict:
    """One model's timed pieces: training tokens/s, validation tokens/s, each analysis stage's seconds at
    `fraction` of its size."""
    from lmcal.evaluate import evaluate
    from lmcal.models.awd_lstm import evaluate_ce
    from lmcal.models.checkpoint import load_net
    from lmcal.train import train
    from lmcal.training.module import LMDataModule

    base = [o for o in overrides if not o.startswith(("hydra.", "logger"))]
    cfg = composed("train", [*base, f"data.max_train_tokens={slice_tokens}", "trainer.max_epochs=1",
                             "analysis.stages=[]", "logger=none", "trainer.enable_progress_bar=false"], tmp / "train")
    job = composed("train", base, tmp / "job")  # the job as it would run: its analysis and its epochs
    stages = list(job.analysis.stages)
    m = train(cfg)
    net, _ = load_net(m["best_ckpt"])
    dm = LMDataModule(**{k: v for k, v in cfg.data.items() if k != "_target_"})
    dm.prepare()
    valid = dm.tokens("valid")[:20_000]
    t0 = time.perf_counter()
    evaluate_ce(net, valid, dm.eval_batch_size, dm.bptt)
    eval_tps = valid.numel() / (time.perf_counter() - t0)
    ev = composed("evaluate", [f"ckpt={m['best_ckpt']}", f"stages=[{','.join(stages)}]", "logger=none"], tmp / "eval")
    with open_dict(ev):  # the job's own analysis settings, at `fraction` of their sizes
        for k in stages:
            ev.analysis[k] = job.analysis[k]
        er, cal = ev.analysis.entropy_rate, ev.analysis.calibration
        er.num_prefixes = max(2, round(er.num_prefixes * fraction))
        cal.num_prefixes = max(2, round(cal.num_prefixes * fraction))
        for what in ("fit", "score"):  # fewer streams of the same length (a transformer's cost grows with it)
            streams = max(1, round(cal[f"{what}_streams"] * fraction))
            cal[f"{what}_tokens"] = (cal[f"{what}_tokens"] or TEST) // cal[f"{what}_streams"] * streams
            cal[f"{what}_streams"] = streams
    t0 = time.perf_counter()
    res = evaluate(ev)
    stage_s = {n: res[n]["profile"]["seconds"] for n in stages}
    return {"params": m["params"], "train_tps": m["train_tokens"] / m["train_seconds"], "eval_tps": eval_tps,
            "stages_s": stage_s, "other_s": time.perf_counter() - t0 - sum(stage_s.values())}


# overrides that leave a job's speed alone: its jobs share one timed piece (the seeds of a cell would triple the cost)
SPEED_FREE = ("data.max_train_tokens=", "seed=")


def piece_key(sweep: str, overrides: list[str]) -> tuple:
    """The jobs that one timed piece stands for: the same sweep and overrides, whatever their tokens and seed."""
    return sweep, tuple(o for o in overrides if not o.startswith(SPEED_FREE))


def job_seconds(p: dict, epochs: int, train_tokens: int, valid_tokens: int, test_tokens: int, fraction: float) -> tuple:
    """(training, analysis) seconds of one job from its model's pieces."""
    train = epochs * (train_tokens / p["train_tps"] + valid_tokens / p["eval_tps"])
    scoring = (valid_tokens + 2 * test_tokens) / p["eval_tps"]  # best checkpoint's valid and test CE, the record's pass
    return train + scoring, sum(p["stages_s"].values()) / fraction + p["other_s"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="scale", help="a sweep profile of make reproduce (scale, scale_gpu)")
    ap.add_argument("--slice", type=count, default=20_000, help="training tokens of each timed training")
    ap.add_argument("--fraction", type=share, default=0.2, help="share of the analysis' sizes each timed run has")
    ap.add_argument("--sweeps", nargs="+", default=None, help="time these of the profile's sweeps only")
    add_out_option(ap, "scale_sweep")
    args = ap.parse_args(argv)
    emit, lines = tee()
    torch_threads = os.environ.get("OMP_NUM_THREADS", "default")
    rate0 = matmul_flops(seconds=1.0) / 1e9
    cfg = load_profile([f"profile={args.profile}", "logger=none"])
    jobs = [st for st in plan_sweeps(cfg) if "cmd" in st and (not args.sweeps or st["sweep"] in args.sweeps)]
    pieces: dict[tuple, dict] = {}
    rows, totals = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for st in jobs:
            ov = [o for o in st["cmd"][3:] if not o.startswith(("hydra.", "logger"))]
            key = piece_key(st["sweep"], ov)
            if key not in pieces:
                print(f"timing {st['name']} ...", flush=True)
                pieces[key] = piece(ov, args.slice, args.fraction, Path(tmp) / str(len(pieces)))
            p = pieces[key]
            c = composed("train", ov, Path(tmp) / "c")
            corpus = c.data.corpus_kwargs if c.data.name != "ptb" else {}
            full = corpus.get("n_train", 929_589)
            n = min(int(c.data.max_train_tokens or full), full)
            valid, test = (corpus.get("n_valid", VALID), corpus.get("n_test", TEST))
            tr, an = job_seconds(p, int(c.trainer.max_epochs), n, valid, test, args.fraction)
            rows.append((st["name"], p["params"], n, p["train_tps"], p["eval_tps"], tr, an))
            totals[st["sweep"]] = totals.get(st["sweep"], 0.0) + tr + an
    rate1 = matmul_flops(seconds=1.0) / 1e9
    emit(f"{args.profile} profile, torch threads {torch_threads}; float32 matmul {rate0:.1f} GFLOP/s before, "
         f"{rate1:.1f} after; pieces: {args.slice:,} training tokens, {args.fraction:g} of the analysis")
    emit("")
    emit("| job | parameters | training tokens | train tok/s | eval tok/s | training (s) | analysis (s) | job (min) |")
    emit("|---|---|---|---|---|---|---|---|")
    for name, params, n, tps, eps, tr, an in rows:
        emit(f"| {name} | {params:,} | {n:,} | {tps:,.0f} | {eps:,.0f} | {tr:,.0f} | {an:,.0f} | "
             f"{(tr + an) / 60:.1f} |")
    emit("")
    emit("| sweep | estimated wall time |")
    emit("|---|---|")
    for s, t in totals.items():
        emit(f"| {s} | {t / 60:.0f} min |")
    emit(f"| all | {sum(totals.values()) / 60:.0f} min |")
    save_bench(args.out, f"Scale sweep wall time, estimated ({args.profile})", "\n".join(lines))
    print(json.dumps({"minutes": {s: round(t / 60, 1) for s, t in totals.items()}}))


if __name__ == "__main__":
    main()
