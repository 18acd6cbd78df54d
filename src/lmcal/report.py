"""Aggregation of per-run results: the paper's Section 5 table and Figure 4, and decoder sweeps.

    python -m lmcal.report outputs/ptb_tau/multiruns/2026-11-22_10-00-00 [more dirs] [--out DIR] [--wandb offline]

Finds every `memory.json` under the given folders (written by the memory stage of each tau run, or by
`python -m lmcal.evaluate stages=[memory]`), groups them by corpus, and writes into --out (default: the first folder)
`memory_<corpus>.md` (ours beside the paper's), `memory_<corpus>.png` (the bound against tau) and
`memory_report.json`, and logs the tables and figures to Weights & Biases (offline by default).

Every `decoders.json` under them (a decoders stage, or each job of a sweep such as `python -m lmcal.evaluate -m
stages=[decoders] decoder=top_p decoder.p=0.8,0.9,0.95`) goes into one table per corpus, `decoders_<corpus>.md`, and
`decoders_<corpus>.png`: each setting's entropy at the horizon against its held-out cost, beside calibration's.

Every training run under them (a folder with `metrics.json`, or a failed sweep job's `failed.json`) goes into one
table, `report_runs.md` and `report_runs.json` (a sweep's own `runs.md` stays as it is): its overrides (or folder),
validation and test perplexity, the memory bound where the run computed one, status and folder.

Every `scale.json` under them (a run whose stages included entropy_rate: `python -m lmcal.train -m experiment=scale`, or
`python -m lmcal.evaluate -m model=hf model.name_or_path=A,B,C stages=[entropy_rate]`) goes into the scale table,
`scale.md`, the log-log figure `scale.png` of the gap against parameters, training tokens and test CE, and the fits
(`scale_report.json`; also as results.json and REPORT.md, which `make docs RUNS=<--out folder>` snapshots into
docs/runs/scale), logged to W&B in the runs' group. Each fit takes every run; each seed of a cell is a run. The power
law's exponent has a t-interval on its residual degrees of freedom, beside Cao, Valiant & Liang's. It is not fitted
below 2 df, or when a run's gap is <= 0; the signed trend, gap = a + b log x, takes every run. A bootstrap is kept as a
cross-check.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from lmcal.errors import LmcalError
from lmcal.utils.boundary import boundary
from lmcal.utils.lock import live_holder, run_lock


def replicates(text: str) -> int:
    """--bootstrap's value: a whole number of replicates, at least 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise LmcalError(f"--bootstrap {text}: the scale fits' bootstrap takes a whole number of replicates, at least "
                         "1 (a bootstrap of none gives no interval). Pass --bootstrap N with N >= 1, or leave it out "
                         "for the default 2000. Nothing was written.")
    return n


def check_out(dirs: list[str], out: Path) -> None:
    """Refuses an output folder a live lmcal run holds (or whose lock's name is taken); warns of inputs held."""
    if held := live_holder(out):
        lock, h = held
        raise LmcalError(f"{out} is held by a live lmcal {h.get('what', 'run')} (process {h.get('pid')} on "
                         f"{h.get('host')}, started {h.get('started', '?')}: {lock}): the tables would be written "
                         "among files that run is still writing, from results it has not finished. Nothing was "
                         "written. Wait for it to end, or write the tables elsewhere with --out DIR.")
    for d in dirs:
        if d != str(out) and (held := live_holder(d)):
            print(f"warning: {d} is held by a live lmcal {held[1].get('what', 'run')} ({held[0]}): its results "
                  "may not all be there yet, so the tables may be partial.", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lmcal.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="sweep or run folders holding metrics.json, memory.json or decoders.json "
                                            "files (searched recursively)")
    ap.add_argument("--out", help="where to write the tables and figures (default: the first folder)")
    ap.add_argument("--wandb", default="offline", choices=["offline", "online", "disabled"])
    ap.add_argument("--project", default="lmcal")
    ap.add_argument("--group")
    ap.add_argument("--bootstrap", default="2000", help="bootstrap replicates (at least 1) of the scale fits' "
                    "cross-check interval (their stated intervals are t-intervals)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"lmcal.report: reading the records under {', '.join(args.dirs)}...", flush=True)  # before the imports
    from lmcal.reporting.runs_table import collect_runs, runs_report
    from lmcal.reporting.scale_report import collect_scale, log_scale_wandb, scale_report
    from lmcal.reporting.tabulate import collect_decoders, collect_memory, decoders_report, memory_report
    from lmcal.stages.wandb_run import check_online
    from lmcal.utils.io import write_json_atomic

    with boundary():
        n_boot = replicates(args.bootstrap)
        for d in args.dirs:
            if not Path(d).is_dir():
                raise LmcalError(f"{d} is not a folder; pass the sweep (or run) folders that hold memory.json or "
                                 "decoders.json files.")
        out = Path(args.out or args.dirs[0])
        check_out(args.dirs, out)
        if args.wandb == "online":
            check_online({"_target_": "WandbLogger", "offline": False}, "--wandb online")
        # every record read and checked before anything is written: a refused report leaves --out as it was
        runs, found, scale_rows = collect_runs(args.dirs), collect_decoders(args.dirs), collect_scale(args.dirs)
        memory = collect_memory(args.dirs)
        if not (runs or found or scale_rows or memory):
            memory_report(args.dirs, args.out, found={})  # (the paragraph: nothing to report)
        before = _files(out)
        with run_lock(out, "report", advice="--out DIR"):  # (no run starts in it while the tables are written)
            runs_report(args.dirs, out, rows=runs, name="report_runs")  # (a sweep's own runs.md stays as it is)
            decoders = decoders_report(args.dirs, out, found)
            if decoders:
                write_json_atomic(out / "decoders_report.json", decoders)
            scale = scale_report(args.dirs, out, n_boot=n_boot, rows=scale_rows)
            if scale and args.wandb != "disabled":
                log_scale_wandb(scale, out, args.wandb, args.project, args.group)
            if memory:
                memory_report(args.dirs, args.out, args.wandb, args.project, args.group, found=memory)
        after = _files(out)
        written = sorted(name for name, stat in after.items() if before.get(name) != stat)
        print(f"lmcal.report wrote {', '.join(written) or 'nothing'} in {out}", flush=True)


def _files(folder: Path) -> dict[str, tuple[int, int, int]]:
    """{name: (inode, mtime in ns, size)} of the plain files in `folder` (none where it does not exist yet): every
    file lmcal writes is written whole and renamed into place, so a file written anew has a new inode."""
    if not folder.is_dir():
        return {}
    return {p.name: (s.st_ino, s.st_mtime_ns, s.st_size) for p in folder.iterdir()
            if not p.name.startswith(".") and p.is_file() and not p.is_symlink() and (s := p.stat())}


if __name__ == "__main__":
    main()
