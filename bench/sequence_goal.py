"""Algorithm 1's goal rows on a checkpoint, measured where their standard errors can decide: the sequence_calibration
stage with the cpu profile's settings (analysis=cpu), the goal rows measured again on 200 fresh prefixes (the profile
measures them on as many as their own, 20 for the SMC rows, whose 117.3 +- 15.7 could not decide), its convergence
table, and the verdicts REPORT.md writes (within 10% of the test perplexity at 2 standard errors, or not, or
undecided: lmcal.reporting.claims.sequence_goal_claims).

    python bench/sequence_goal.py [--ckpt outputs/reproduce/cpu/ptb/base/checkpoints/best.ckpt] \
        [--future-entropy outputs/reproduce/cpu/ptb/future_entropy/future_entropy.json] \
        [--goal-prefixes 200] [--dir outputs/bench/sequence_goal] [--add DIR ...] [--out docs/bench/sequence_goal.md] \
        [-- overrides]

The stage runs as `make reproduce PROFILE=cpu` runs it (python -m lmcal.evaluate, in its own process: 47 minutes
on 2 cores, most of them the goal rows on 200 prefixes); where --dir holds its finished output already, that output is
read and nothing is run again. --add joins the study rows of finished runs of the same study at other particle counts
(a study grown one count at a time, e.g. particles=[32] after [4,8,16]: lmcal.stages.smc_study.join_study), and the
convergence is decided again on all of them; the goal rows stay those of --dir's run, and a row that converges only in
the joined study is tested against the goal on the study's own prefixes.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

from lmcal.reporting.claims import sequence_goal_claims, units_to_decide, within
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.stages.sequence_report import seeds_phrase, sequence_table
from lmcal.stages.smc_study import join_study, law_rate, study_row_of


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, help="the model's checkpoint (a make reproduce base; needed unless --dir "
                                              "holds the finished stage)")
    ap.add_argument("--future-entropy", type=Path, help="the future_entropy stage's JSON, for its row among the goal's")
    ap.add_argument("--dir", type=Path, default=Path("outputs/bench/sequence_goal"), help="the stage's output folder")
    ap.add_argument("--add", type=Path, action="append", default=[], help="a finished run of the same study at other "
                                                                         "particle counts, whose rows join --dir's")
    ap.add_argument("--goal-prefixes", type=int, default=200, help="fresh prefixes the goal rows are measured on")
    ap.add_argument("--title", default="Algorithm 1's goal rows on the cpu profile's PTB model", help="the page's")
    ap.add_argument("overrides", nargs="*", help="more overrides of python -m lmcal.evaluate (after --)")
    add_out_option(ap, "sequence_goal")
    args = ap.parse_args(argv)
    emit, lines = tee()
    result_file = args.dir / "sequence_calibration.json"
    cmd = [sys.executable, "-m", "lmcal.evaluate", f"ckpt={args.ckpt}", "analysis=cpu",
           "stages=[sequence_calibration]", f"analysis.sequence_calibration.goal_prefixes={args.goal_prefixes}",
           "logger=none", f"hydra.run.dir={args.dir}", *args.overrides,
           *([f"analysis.sequence_calibration.future_entropy_json={args.future_entropy}"] if args.future_entropy
             else [])]
    if not result_file.is_file():
        if args.ckpt is None:
            sys.exit(f"{result_file} is not there, so the stage must run: give --ckpt, the model's checkpoint.")
        print("running:", shlex.join(cmd), flush=True)
        if subprocess.run(cmd).returncode:
            sys.exit(f"the sequence_calibration stage failed; its log is in {args.dir}")
    result = json.loads(result_file.read_text())
    for key in ("goal", "twisted_check"):  # a run older than 67d6b6e: its goal rows' α* spread is its study row's
        g = result.get(key) or {}
        if g.get("method") == "smc" and g.get("tail_alpha_stderr_nats") is None:
            row = study_row_of(g, result["rows"])
            g["tail_alpha_stderr_nats"] = row.get("tail_alpha_stderr_nats") if row else None
    before = {(r["variant"], r["params"]["particles"]) for r in result["rows"] if r["method"] == "smc"
              and r.get("converged")}
    runs = {args.dir: result}  # each run's result, read once
    for d in args.add:
        other = d / "sequence_calibration.json"
        if not other.is_file():
            sys.exit(f"{other} is not there: --add takes the folder of a finished run of the same study.")
        runs[d] = json.loads(other.read_text())
        try:
            join_study(result, runs[d], str(d))
        except ValueError as e:
            sys.exit(str(e))
    for d, run in runs.items():
        ev = d / "evaluation.json"  # the stage's own provenance, where python -m lmcal.evaluate ran it
        ran = json.loads(ev.read_text()).get("provenance") or {} if ev.is_file() else {}
        if ran:
            which = " (joined: --add)" if d != args.dir else ""
            emit(f"The stage{which}: `{ran.get('command')}` · {ran.get('date')} · "
                 f"{ran.get('machine')} · commit {ran.get('commit')} ({run['seconds'] / 60:.0f} minutes).")
            emit("")
    emit(f"Model: {result['model']} on {result['corpus']}, test perplexity {result['reference_test_ppl']:.1f}. "
         f"Settings: particles {result['particles']}, SMC rows from {result['smc_prefixes']} prefixes, the goal "
         f"rows measured again on {result.get('goal_prefixes') or result['smc_prefixes']} fresh ones, horizon "
         f"{result['horizon']} (law over {result['law_horizon']} words).")
    emit("")
    # the stage's tables and sentences, as this commit writes them from the rows it wrote (sequence_table)
    joined = [r for r in result["rows"] if r["method"] == "smc" and r.get("converged")
              and (r["variant"], r["params"]["particles"]) not in before]
    emit(sequence_table(result).rstrip())
    emit("")
    emit("Verdicts (lmcal.reporting.claims, as REPORT.md writes them):")
    emit("")
    for c in sequence_goal_claims(result):
        emit(f"- {c.sentence}")
    checks = {g["label"]: g for g in (result.get("goal"), result.get("twisted_check")) if g and "label" in g}
    for g in checks.values():  # an undecided verdict (a row that is both goal and twisted check, once): what decides it
        n = g.get("prefixes") and units_to_decide(g["tail_nats"], g["tail_stderr_nats"], g["prefixes"],
                                                        g["test_ppl"])
        if n:
            per = g["generations"] // g["prefixes"]
            emit(f"- At its level ({g['tail_ppl']:.1f}), the verdict on {g['label']} would be decided by about {n:,} "
                 f"fresh prefixes ({n * per:,} generations, {per} a prefix), if each prefix's spread stays what these "
                 f"{g['prefixes']:,} show (lmcal.reporting.claims.units_to_decide; goal_prefixes={n}).")
    for r in joined:  # converged in the joined study only: not among the goal's candidates when --dir's stage chose
        emit("- " + within(f"{r['label']}, converged in the joined study, on the study's own "
                           f"{result['smc_prefixes']} prefixes and {seeds_phrase(result)} (not fresh ones; its test CE "
                           f"{r['test_ce_diff_nats']:+.4f} ± {r['test_ce_diff_stderr_nats']:.4f} nats against the "
                           "model's),", r["tail_nats"], r["tail_stderr_nats"], result["reference_test_ppl"]).sentence)
    emit("")
    for line in level_section(result):
        emit(line)
    save_bench(args.out, args.title, "\n".join(lines),
               command="python bench/sequence_goal.py " + shlex.join(argv if argv is not None else sys.argv[1:]))


def level_section(result: dict) -> list[str]:
    """Where each SMC row's last tenth sits against the cross-entropies, in perplexity: the validation CE its fit
    matched on its own windows, and the law's entropy rate over all its L words there (equal at the root); that rate
    from the study's prefixes; the last tenth, read inside the law; the test perplexity the goal compares with. And
    the three differences that take the last tenth from the test perplexity, with their standard errors (unpaired
    where the rows keep no per-generation pairs)."""
    rows = [r for r in result["rows"] if r["method"] == "smc" and law_rate(r)[0] is not None]
    if not rows:
        return []
    test = result["reference_test_ce_nats"]
    out = ["Where each SMC row's level sits, in perplexity (exp of nats a word): the validation CE its fit matched on "
           f"{result['fit_prefixes']} validation continuations and its law's entropy rate over all L = "
           f"{result['law_horizon']} words there (equal at the root); that rate from the study's "
           f"{result['smc_prefixes']} prefixes; the last tenth, read inside the law; the test perplexity. Then the "
           "steps from the test CE to the last tenth, in nats, ± one standard error:", "",
           "| row | α* | fit: validation CE | fit: EntRate | EntRate, study prefixes | last tenth | test | "
           "validation − test CE | study − fit EntRate | last tenth − study EntRate |", "|" + "---|" * 10]
    for r in rows:
        f, (rate, rate_se) = r["fit"], law_rate(r)
        tail, tail_se = r["tail_nats"], r["tail_stderr_nats"]
        inside_se = "" if rate_se is None else f" ± {math.hypot(tail_se, rate_se):.3f}"
        out.append(f"| {r['label']} | {r['params']['alpha']:.5f} ± {r['params']['alpha_stderr']:.5f} | "
                   f"{math.exp(f['ce_nats']):.1f} | {math.exp(f['entropy_rate_nats']):.1f} | "
                   f"{math.exp(rate):.1f}{'' if rate_se is None else f' ± {math.exp(rate) * rate_se:.1f}'} | "
                   f"{math.exp(tail):.1f} ± {math.exp(tail) * tail_se:.1f} | {math.exp(test):.1f} | "
                   f"{f['ce_nats'] - test:+.3f} | {rate - f['entropy_rate_nats']:+.3f} | {tail - rate:+.3f}"
                   f"{inside_se} |")
    if any(law_rate(r)[1] is None for r in rows):
        out += ["", "A row grown from a run that kept no per-generation entropy rates shows its rate over all L words "
                "as the generation-weighted mean of its runs', without a standard error."]
    return out


if __name__ == "__main__":
    main()
