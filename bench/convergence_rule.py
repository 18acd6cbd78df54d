"""Algorithm 1's convergence rule applied again to finished sequence_calibration stages: for each SMC row, its last
tenth against the row of twice (or half) its particles, paired by prefix, and the verdict with and without the
requirement that agreement be shown (lmcal.stages.smc_study.mark_convergence: the paired difference's 2-standard-error
interval within ±tol nats). Two runs of the same settings whose verdicts differ are what the requirement is for.

    python bench/convergence_rule.py DIR [DIR ...] [--tol 0.1] [--out docs/bench/convergence_rule.md]

Each DIR holds a stage's sequence_calibration.json (and evaluation.json, for the device it ran on); nothing is run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.stages.smc_study import converged_summary, convergence_word, mark_convergence


def _run(folder: Path) -> tuple[str, str]:
    """(date, device) of the stage's run, as its evaluation.json records them ('?' without one)."""
    ev = folder / "evaluation.json"
    if not ev.is_file():
        return "?", "?"
    e = json.loads(ev.read_text())
    prov = e.get("provenance") or {}
    gpu = next((p for p in str(prov.get("machine", "")).split(", ") if p.startswith(("NVIDIA", "AMD Instinct"))), None)
    return str(prov.get("date", "?")), gpu or str(e.get("device", "?"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="folders holding a finished stage's sequence_calibration.json")
    ap.add_argument("--tol", type=float, default=0.1, help="nats within which agreement must be shown")
    add_out_option(ap, "convergence_rule")
    args = ap.parse_args(argv)
    emit, lines = tee()
    summaries = []
    emit(f"| run | date | device | prefixes | twist: heads trained at α | sampler | particles | vs | "
         f"last tenth − other's (nats) | not refuted at 2 se | shown within ±{args.tol:g} nats |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    for folder in args.dirs:
        f = folder / "sequence_calibration.json"
        if not f.is_file():
            sys.exit(f"{f}: no sequence_calibration.json there (a finished stage's folder is needed).")
        result = json.loads(f.read_text())
        study = [r for r in result["rows"] if r["method"] == "smc"]
        date, device = _run(folder)
        sv = next((r for r in result["rows"] if r["method"] == "soft_value"), {})
        heads = (sv.get("refits") or [{}])[0].get("trained_at_alpha")  # the twisted rows' twist depends on it
        mark_convergence(study, None)
        loose = {(r["variant"], r["params"]["particles"]): convergence_word(r) for r in study}
        mark_convergence(study, args.tol)
        summaries.append(f"- {folder.name}: {converged_summary(study)}")
        for r in sorted(study, key=lambda r: (r["variant"] != "twisted", r["params"]["particles"])):
            if r["converged_against"] is None:
                continue
            emit(f"| {folder.name} | {date} | {device} | {result['smc_prefixes']} | "
                 f"{'–' if heads is None else f'{heads:.4f}'} | {r['variant']} | "
                 f"{r['params']['particles']} | {r['converged_against']} | {r['tail_against_nats']:+.3f} ± "
                 f"{r['tail_against_stderr_nats']:.3f} | {loose[(r['variant'], r['params']['particles'])]} | "
                 f"{convergence_word(r)} |")
    emit("")
    emit("Each run's SMC rows target Algorithm 1's law at their own α*; the twisted rows' twist is the soft-value "
         "heads, trained at the largest untwisted count's α*, so runs with other counts twist differently (SMC is "
         "consistent for any twist: the target is the same).")
    emit("")
    emit(f"Not refuted: the paired difference and α*'s within 2 standard errors, both fits settled (the rule before "
         f"`converge_tol`); shown: also |d| + 2 se ≤ {args.tol:g} nats (the rule with `converge_tol: {args.tol:g}`, "
         "the default). A row is called Algorithm 1 only where it is shown.")
    emit("")
    emit(f"Each run with `converge_tol: {args.tol:g}`, as its stage's Markdown would say it:")
    emit("")
    for line in summaries:
        emit(line)
    save_bench(args.out, "Algorithm 1's convergence rule, on finished stages", "\n".join(lines),
               "python bench/convergence_rule.py " + shlex.join(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
