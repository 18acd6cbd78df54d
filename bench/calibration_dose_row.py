"""More rows of the calibration stage's dose-response, from a finished calibration stage: candidate rules' laws
(by default exact lookahead, every word: V model steps a generated word, so best on a GPU) at the stage's multiples
of its alpha*, on the same prefixes, seeds and test tokens, with their own plain generations to pair with.

    python bench/calibration_dose_row.py --ckpt CKPT --calibration RUN/ptb/calibration/calibration.json \
        [--rules exact top-16 cover-0.95 ...] [--multiples 1 3 10] [--num-prefixes N] [--samples-per-prefix S] \
        [--fit [RULE]] [--device cuda] --out RUN/ptb/calibration/dose_rows_<name>.json

A rule is top-K, cover-C, cover-C-MAX (at most MAX candidates) or exact; the first is the one the others are paired
with (vs_first: the same prefixes and uniforms in this run). --num-prefixes / --samples-per-prefix: the first N of the
stage's prefixes, S generations each (default: the stage's dose-response's; e.g. 100 and 3 for the main rows' 300).
Writes a JSON of rows in the stage's own format ({"device", "rows": [...], ...}); a reproduction's report takes every
dose_rows_*.json beside calibration.json into its dose-response table, figure and verdict
(lmcal.reporting.results.calibration_dose), each row marked with its device: regenerate the report with
`python -m lmcal.reproduce profile=cpu out=RUN` (its stages are done, so only the report runs again).
--fit [RULE] also fits that rule's (default: the first's) own alpha* on the stage's fit text, after the rows are
written (reported beside, not used: the rows use the stage's alphas).

    python bench/calibration_dose_row.py --calibration DIR/calibration.json --report docs/bench/NAME.md

--report alone (no --ckpt) runs nothing: it writes the stage's approximation table and dose-response with every
dose_rows_*.json beside calibration.json as further rows, and the verdict REPORT.md would write from them
(lmcal.reporting.calibration_limit), for a stage whose reproduction is not at hand.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from lmcal.core.calibration import fit_lookahead_calibration
from lmcal.core.lookahead_law import make_rule
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.errors import LmcalError
from lmcal.models.step_lm import as_step_lm
from lmcal.reporting.calibration_limit import calibration_limit
from lmcal.reporting.docs import provenance, save_bench
from lmcal.reporting.report_md import calibration_limit_markdown
from lmcal.reporting.results import calibration_dose, dose_row_files
from lmcal.stages.dose_response import dose_response, rule_from_text
from lmcal.stages.targets import load_checkpoint_and_data
from lmcal.utils.boundary import boundary
from lmcal.utils.device import apply_precision_policy
from lmcal.utils.io import read_json, write_json_atomic


def main(argv: list[str] | None = None) -> None:
    with boundary():
        run(argv)


def run(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="the stage's checkpoint (required unless --report alone)")
    ap.add_argument("--calibration", required=True, help="the calibration stage's calibration.json")
    ap.add_argument("--data-root")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rules", nargs="+", default=["exact"], help="top-K, cover-C, cover-C-MAX or exact")
    ap.add_argument("--tail-samples", type=int, default=None, help="default: the stage's")
    ap.add_argument("--multiples", type=float, nargs="+", help="default: the stage's dose-response multiples")
    ap.add_argument("--num-prefixes", type=int, help="default: the stage's dose-response's")
    ap.add_argument("--samples-per-prefix", type=int, help="default: the stage's dose-response's")
    ap.add_argument("--fit", nargs="?", const="first", metavar="RULE",
                    help="also fit a rule's own alpha* on the stage's fit text (default: the first rule's)")
    ap.add_argument("--out", help="the rows' JSON (dose_rows_<name>.json beside calibration.json)")
    ap.add_argument("--report", help="a Markdown page: the stage's tables with the rows beside it, and the verdict")
    args = ap.parse_args(argv)
    if args.ckpt is None or args.out is None:
        if args.report is None or args.ckpt or args.out:
            ap.error("give --ckpt and --out to measure rows (and --report to write them up), or --report alone")
        return report(args.calibration, args.report, argv)
    t0 = time.perf_counter()
    try:
        cal = read_json(args.calibration)
    except ValueError as e:
        raise LmcalError(f"{args.calibration} is not a calibration stage's JSON ({e}).") from None
    dr = cal.get("dose_response")
    if not dr:
        raise LmcalError(f"{args.calibration} has no dose_response: run the calibration stage with "
                 "analysis.calibration.dose_response set first.")
    m = args.tail_samples or cal.get("tail_samples") or 16
    rules = [make_rule(x.topk, x.cover, x.cover_max, m) for x in map(rule_from_text, args.rules)]
    r = rules[0]
    torch.set_grad_enabled(False)
    apply_precision_policy()  # TF32 off, as the stage ran (lmcal.utils.device)
    net, _, dm = load_checkpoint_and_data(args.ckpt, args.data_root, args.device)
    lm = as_step_lm(net)
    valid, test_tokens = dm.tokens("valid"), dm.tokens("test")
    n = args.num_prefixes or dr["num_prefixes"]
    if n > cal["num_prefixes"]:
        raise LmcalError(f"--num-prefixes {n}: the stage drew {cal['num_prefixes']} prefixes.")
    prefixes = random_prefixes(valid, cal["num_prefixes"], cal["prefix_len"], seed=cal["seed"])[:n]
    tokens = dr.get("score_tokens")
    test = batchify(test_tokens[:tokens] if tokens else test_tokens, dr.get("score_streams", cal["score_streams"]))
    out = dose_response(lm, cal["alpha"], rules, args.multiples or dr["multiples"], prefixes, cal["horizon"],
                        args.samples_per_prefix or dr["samples_per_prefix"], test, seed=cal["seed"],
                        epsilon=cal.get("uniform_weight", 0.0))
    if out["test_tokens"] != dr["test_tokens"]:
        raise LmcalError(f"scored {out['test_tokens']} test positions where the stage scored "
                 f"{dr['test_tokens']}: the checkpoint or data root is not the stage's.")
    device = torch.cuda.get_device_name() if str(args.device).startswith("cuda") else f"{args.device}"
    drop = ("tail_nats_per_generation",)
    result = {"device": device, "rules": [x.label for x in rules], "calibration": args.calibration,
              "rows": [{k: v for k, v in row.items() if k not in drop} for row in out["rows"]],
              "plain_tail_nats": out["plain_tail_nats"], "own_fit": None, "seconds": time.perf_counter() - t0,
              "provenance": provenance("python " + shlex.join(sys.argv))}
    write_json_atomic(args.out, result)  # the rows are kept even if the fit below does not finish
    for row in result["rows"]:
        print(f"{row['rule']} at {row['multiple']:g} alpha* = {row['alpha']:.4f}: last tenth "
              f"{row['tail_diff_nats']:+.3f} +- {row['tail_diff_stderr_nats']:.3f} nats vs its plain generations; "
              f"test CE {row['test_ce_nats']:.4f} ({row['test_ce_diff_nats']:+.4f} +- "
              f"{row['test_ce_diff_stderr_nats']:.4f}); {row['generation_seconds']:.0f} s of generation", flush=True)
    if args.fit:
        x = r if args.fit == "first" else rule_from_text(args.fit)
        f = make_rule(x.topk, x.cover, x.cover_max, m)
        streams = cal["fit_streams"]  # the stage's fit text: its positions per stream after min_context tokens
        fit_len = (cal["fit_tokens"] // streams + max(1, cal["min_context"])) * streams
        fit = fit_lookahead_calibration(lm, batchify(valid[:fit_len], streams), f.topk, cal.get("uniform_weight", 0.0),
                                        tail_samples=f.tail_samples, min_context=cal["min_context"], seed=cal["seed"],
                                        cover=f.cover, cover_max=f.cover_max, progress=True)
        if fit.n_tokens != cal["fit_tokens"]:
            raise LmcalError(f"fitted {fit.n_tokens} positions where the stage fitted {cal['fit_tokens']}.")
        result["own_fit"] = {"rule": f.label, "alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr,
                             "fit_ce_before_nats": fit.ce_before, "fit_ce_after_nats": fit.ce_after,
                             "fit_tokens": fit.n_tokens}
        result["seconds"] = time.perf_counter() - t0
        write_json_atomic(args.out, result)
        print(f"{f.label}'s own alpha* {fit.alpha:.4f} +- {fit.alpha_stderr:.4f} (the stage's {cal['alpha']:.4f})")
    print(f"{result['seconds']:.0f} s in all on {device}; {args.out}")
    if args.report:
        report(args.calibration, args.report, argv)


def report(calibration: str, md: str, argv: list[str] | None) -> None:
    """The stage's approximation table and dose-response with the dose_rows_*.json beside it, and the verdict."""
    path = Path(calibration)
    try:
        cal = read_json(path)
    except ValueError as e:
        raise LmcalError(f"{path} is not a calibration stage's JSON ({e}).") from None
    if not (cal.get("approximation") and cal.get("dose_response")):
        raise LmcalError(f"{path} has no approximation table or dose-response: run the calibration stage with "
                         "analysis.calibration.approximation and dose_response set first.")
    found = dose_row_files(path.parent)
    cal |= calibration_dose(cal, found)
    extra = cal["dose_response"]["extra_rows"]
    if not extra:
        raise LmcalError(f"{path.parent} holds no dose_rows_*.json beside calibration.json: measure rows first.")
    claim = calibration_limit(cal["approximation"], cal["dose_response"], extra)
    setup = (f"The calibration stage (α* = {cal['alpha']:.4f} ± {cal['alpha_stderr']:.4f}; test perplexity "
             f"{cal['test_ppl_before']:.1f}), with {len(extra)} rows from another run beside its own "
             f"({', '.join(sorted({r['device'] for r in extra}))}).")
    runs = [f"- `{p.name}`: `{f['provenance'].get('command')}` · {f['provenance'].get('date')} · "
            f"{f['provenance'].get('machine')} · commit {f['provenance'].get('commit')} ({f['seconds']:.0f} s)"
            for p, f in found if f.get("provenance")]
    body = "\n".join([setup, "", "The other runs:", "", *runs, "", *calibration_limit_markdown(cal)[:-2],
                      f"Verdict ({claim.verdict}): {claim.sentence}"])
    save_bench(md, "Lookahead calibration's dose-response with rows from another run", body,
               command="python bench/calibration_dose_row.py " + shlex.join(argv if argv is not None else sys.argv[1:]))
    print(body)


if __name__ == "__main__":
    main()
