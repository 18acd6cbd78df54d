"""Algorithm 1 on the cpu profile's PTB model at two training seeds: the sequence_calibration stage run on each
checkpoint with the cpu settings, its rows side by side, the run-to-run spread, and the goal rows' verdicts counting
every error (the generations' noise, α*'s, and the spread between seeds).

    python bench/sequence_calibration.py --ckpt A/checkpoints/best.ckpt --ckpt B/checkpoints/best.ckpt \
        --work outputs/bench/sequence_calibration [--out docs/bench/sequence_calibration.md]
    python bench/sequence_calibration.py --runs DIR_A DIR_B --out ...    # render runs that finished

Each checkpoint is `python -m lmcal.train data=ptb experiment=cpu 'analysis.stages=[]' logger=none seed=<seed>`.
A finished stage run is kept (its folder holds sequence_calibration.json) and not run again. On the cpu budget α*'s
error from 20 fit windows leaves the verdicts undecided; what would decide them is the same run on a GPU on all 184
disjoint validation windows and more prefixes: `--device cuda --set analysis.sequence_calibration.fit_prefixes=184
--set analysis.sequence_calibration.smc_prefixes=100`. What the page decides
was fixed before the runs: each seed's goal row and fewest-particle twisted row within 10% of the test perplexity,
at 2 standard errors counting every error; the two seeds' rows against their own noise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_args import check_shaped, read_shaped  # bench/ is on sys.path when run as a script

from lmcal.errors import LmcalError
from lmcal.reporting.claims import sequence_goal_claims
from lmcal.reporting.claims_table import claim_row, claims_table
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.reporting.seed_pairs import seed_spread, spread_table, with_spread
from lmcal.stages.sequence_table import study_table
from lmcal.utils.boundary import boundary
from lmcal.utils.io import write_text_atomic
from lmcal.utils.profiling import machine_line
from lmcal.utils.records import Maybe, Of

STAGE = "sequence_calibration"


def run_stage(ckpt: str, folder: Path, extra: list[str], device: str = "cpu") -> Path:
    """The stage on one checkpoint, in `folder` (kept when it finished before)."""
    if not (folder / f"{STAGE}.json").exists():
        cmd = [sys.executable, "-m", "lmcal.evaluate", f"ckpt={ckpt}", f"stages=[{STAGE}]", "analysis=cpu",
               "logger=none", f"device={device}", f"hydra.run.dir={folder}", *extra]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return folder


def _seed(folder: Path) -> str:
    """The training seed of the checkpoint a stage folder ran on, from the checkpoint's run config."""
    cfg = folder / ".hydra" / "overrides.yaml"
    text = cfg.read_text() if cfg.exists() else ""
    ckpt = next((line.split("ckpt=", 1)[1] for line in text.splitlines() if "ckpt=" in line), None)
    train_cfg = Path(ckpt).parent.parent / ".hydra" / "config.yaml" if ckpt else None
    if train_cfg and train_cfg.exists():
        for line in train_cfg.read_text().splitlines():
            if line.startswith("seed:"):
                return line.split(":", 1)[1].strip()
    return folder.name


def setup_table(results: list[dict], seeds: list[str]) -> list[str]:
    lines = ["| training seed | model test ppl | law over | fit windows | SMC prefixes × generations | particles | "
             "reference check | seconds |", "|---|---|---|---|---|---|---|---|"]
    for s, r in zip(seeds, results, strict=True):
        check = next((x["reference_check"]["particles"] for x in r["rows"] if x.get("reference_check")), "–")
        lines.append(f"| {s} | {r['reference_test_ppl']:.1f} | {r['law_horizon']} words | {r['fit_prefixes']} | "
                     f"{r['smc_prefixes']} × {r.get('samples_per_prefix', '–')} | {r['particles']} | untwisted, "
                     f"{check} particles | {r['seconds']:.0f} |")
    return lines


def errors_table(claims: list, labels: list[str]) -> list[str]:
    """The errors each verdict counts, in nats: the generations', α*'s (carried into the level), the spread between
    the seeds, and their total (the ± of the claims table, in nats)."""
    cell = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["| seed | row | generations | α* | run-to-run | total |", "|---|---|---|---|---|---|"]
    for (s, c), label in zip(claims, labels, strict=True):
        n = c.numbers
        lines.append(f"| {s} | {label} | {cell(n.get('generations_se'))} | {cell(n.get('alpha_spread_nats'))} | "
                     f"{cell(n.get('run_to_run_nats'))} | {cell(n.get('se'))} |")
    return lines


def page(results: list[dict], seeds: list[str]) -> tuple[str, str]:
    """The page's body and its one-line result."""
    spread = seed_spread(results[0], results[1])
    claims = [(s, c) for s, r in zip(seeds, results, strict=True) for c in sequence_goal_claims(with_spread(r, spread))]
    rows = [(f"seed {s}: {row[0]}", *row[1:5], "–") for s, c in claims if (row := claim_row(c))]
    labels = [g["label"] for r in results for g in (r.get("goal"), r.get("twisted_check")) if g and "tail_nats" in g]
    body = ["### Setup", "", *setup_table(results, seeds), "",
            "The law that generates is the one fitted and scored: P̂_α ∝ P̂^(1+α) over the law's words, α* fitted "
            "at each row's particle count and twist; twisted rows use a finite-horizon head trained at their own α.",
            "",
            "### Claims", "", *claims_table(rows), "", *errors_table(claims, labels), "",
            "### The two seeds", "", *spread_table(spread, tuple(seeds)), ""]
    for s, r in zip(seeds, results, strict=True):
        body += [f"### Rows, seed {s}", "", study_table([x for x in r["rows"] if x["method"] == "smc"]).rstrip(), ""]
    verdicts = ", ".join(f"seed {s} {c.verdict.replace('_', ' ')}" for s, c in claims)
    return "\n".join(body), f"Algorithm 1's goal rows against the test perplexity, every error counted: {verdicts}."


# what the page reads of each run's sequence_calibration.json (lmcal.utils.records' specs), and of each SMC row
RESULT = {"rows": Of(dict, 1), "reference_test_ppl": float, "law_horizon": int, "fit_prefixes": int,
          "smc_prefixes": int, "particles": list, "seconds": float, "goal?": Maybe(dict), "twisted_check?": Maybe(dict)}
SMC_ROW = {"params": {"particles": int, "alpha": float, "alpha_stderr": float}, "tail_ppl": float,
           "tail_ppl_stderr": float, "ess_per_particle": float, "log_z_mean": float, "test_ce_nats": float,
           "test_ce_bias_nats": float, "ms_per_token": float, "cost_ratio": float,
           "fit": {"ce_minus_entropy_rate_nats": float, "ce_minus_entropy_rate_stderr_nats": float, "settled": bool}}


def read_result(path: Path) -> dict:
    """A run's sequence_calibration.json, whole (RESULT, and SMC_ROW for each SMC row); LmcalError naming the file and
    the key otherwise."""
    what = f"a whole {STAGE} result"
    r = read_shaped(path, RESULT, what)
    for i, row in enumerate(r["rows"]):
        check_shaped(row, {"method": str}, f"{path} (rows[{i}])", what)
        if row["method"] == "smc":
            check_shaped(row, SMC_ROW, f"{path} (rows[{i}])", what)
    return r


def main(argv: list[str] | None = None) -> None:
    with boundary():  # a file of the wrong shape: one line naming it and the key, exit 2
        run(argv)


def run(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", action="append", default=[], help="a checkpoint (give two: two training seeds)")
    ap.add_argument("--work", default="outputs/bench/sequence_calibration", help="where the stage runs go")
    ap.add_argument("--runs", nargs=2, help="two finished stage folders to render instead")
    ap.add_argument("--set", action="append", default=[], help="an override of the stage's run (analysis.*=...)")
    ap.add_argument("--device", default="cpu", help="where the stage runs (cpu, cuda)")
    add_out_option(ap, STAGE)
    args = ap.parse_args(argv)
    if args.runs:
        folders = [Path(x) for x in args.runs]
    elif len(args.ckpt) == 2:
        folders = [run_stage(c, Path(args.work) / f"run_{i}", args.set, args.device) for i, c in enumerate(args.ckpt)]
    else:
        ap.error("give two --ckpt (two training seeds) or --runs DIR_A DIR_B")
    results = [read_result(f / f"{STAGE}.json") for f in folders]
    seeds = [_seed(f) for f in folders]
    emit, lines = tee()
    try:
        body, result = page(results, seeds)
    except (KeyError, TypeError, ValueError) as e:  # deeper than RESULT and SMC_ROW look
        raise LmcalError(f"{' or '.join(str(f / f'{STAGE}.json') for f in folders)} is not a whole {STAGE} "
                         f"result: the page needs {type(e).__name__} {e} of it. Give the files that stage wrote, or "
                         "rerun the stage.") from None
    emit(machine_line("cpu"))
    emit(body)
    command = (f"python bench/sequence_calibration.py --ckpt <seed {seeds[0]}>/checkpoints/best.ckpt --ckpt <seed "
               f"{seeds[1]}>/checkpoints/best.ckpt, each checkpoint from python -m lmcal.train data=ptb experiment=cpu "
               "'analysis.stages=[]' logger=none seed=<seed>")
    save_bench(args.out, "Algorithm 1 (sequence-level calibration) on the cpu model at two training seeds",
               "\n".join(lines), command=command, result=result)
    if args.out:
        summary = summary_row(results[0], seed_spread(results[0], results[1]), seeds[0])
        if summary:
            write_text_atomic(Path(args.out).with_suffix(".json"), json.dumps(summary, indent=1) + "\n")


def summary_row(result: dict, spread: list[dict], seed: str) -> dict | None:
    """The first seed's fewest-particle twisted row (an SMC row of Algorithm 1's law; else its goal row), with every
    error it has, as RESULTS.md's claims table reads a benchmark's summary (lmcal.reporting.docs.bench_rows)."""
    counted = with_spread(result, spread)
    g = counted.get("twisted_check") or counted.get("goal")
    if not g:
        return None
    keys = ("tail_nats", "tail_stderr_nats", "tail_alpha_stderr_nats", "run_to_run_stderr_nats", "test_ppl",
            "prefixes", "generations", "tail_median_nats", "tail_below_2_nats_share")
    return {"label": f"{g['label']}, training seed {seed}, on {g['prefixes']} fresh prefixes", "made_by":
            "bench/sequence_calibration.py", "params": g["params"], **{k: g.get(k) for k in keys}}


if __name__ == "__main__":
    main()
