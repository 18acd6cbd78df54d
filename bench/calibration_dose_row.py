"""One more row of the calibration stage's dose-response, from a finished calibration stage: a candidate rule's law
(by default exact lookahead, every word; V model steps a generated word, so best on a GPU) at the stage's multiples
of its alpha*, on the same prefixes, seeds and test tokens, with its own plain generations to pair with.

    python bench/calibration_dose_row.py --ckpt CKPT --calibration RUN/ptb/calibration/calibration.json \
        [--rule exact | --topk K | --cover C [--cover-max N]] [--multiples 1 3 10] [--fit] [--device cuda] \
        [--out RUN/ptb/calibration/dose_rows_exact.json]

Writes a JSON of rows in the stage's own format ({"device", "rows": [...], ...}); a reproduction's report takes every
dose_rows_*.json beside calibration.json into its dose-response table, figure and verdict
(lmcal.pipeline.results.calibration_dose), each row marked with its device: regenerate the report with
`python -m lmcal.reproduce profile=cpu out=RUN` (its stages are done, so only the report runs again). --fit also fits
the rule's own alpha* on the stage's fit text (reported beside, not used: the rows use the stage's alphas).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import torch

from lmcal.core.calibration import fit_lookahead_calibration
from lmcal.core.lookahead_law import make_rule
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.models.step_lm import as_step_lm
from lmcal.pipeline.docs import provenance
from lmcal.stages.dose_response import dose_response
from lmcal.stages.targets import load_checkpoint_and_data
from lmcal.utils.io import write_json_atomic


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--calibration", required=True, help="the calibration stage's calibration.json")
    ap.add_argument("--data-root")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    rule = ap.add_mutually_exclusive_group()
    rule.add_argument("--rule", choices=["exact"], default="exact")
    rule.add_argument("--topk", type=int)
    rule.add_argument("--cover", type=float)
    ap.add_argument("--cover-max", type=int)
    ap.add_argument("--tail-samples", type=int, default=None, help="default: the stage's")
    ap.add_argument("--multiples", type=float, nargs="+", help="default: the stage's dose-response multiples")
    ap.add_argument("--fit", action="store_true", help="also fit the rule's own alpha* on the stage's fit text")
    ap.add_argument("--out", required=True, help="the rows' JSON (dose_rows_<name>.json beside calibration.json)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cal = json.loads(open(args.calibration).read())
    dr = cal.get("dose_response")
    if not dr:
        sys.exit(f"lmcal: error: {args.calibration} has no dose_response: run the calibration stage with "
                 "analysis.calibration.dose_response set first.")
    r = make_rule(args.topk, args.cover, args.cover_max, args.tail_samples or cal.get("tail_samples") or 16)
    torch.set_grad_enabled(False)
    net, _, dm = load_checkpoint_and_data(args.ckpt, args.data_root, args.device)
    lm = as_step_lm(net)
    valid, test_tokens = dm.tokens("valid"), dm.tokens("test")
    prefixes = random_prefixes(valid, cal["num_prefixes"], cal["prefix_len"], seed=cal["seed"])[:dr["num_prefixes"]]
    tokens = dr.get("score_tokens")
    test = batchify(test_tokens[:tokens] if tokens else test_tokens, dr.get("score_streams", cal["score_streams"]))
    out = dose_response(lm, cal["alpha"], [r], args.multiples or dr["multiples"], prefixes, cal["horizon"],
                        dr["samples_per_prefix"], test, seed=cal["seed"], epsilon=cal.get("uniform_weight", 0.0))
    if out["test_tokens"] != dr["test_tokens"]:
        sys.exit(f"lmcal: error: scored {out['test_tokens']} test positions where the stage scored "
                 f"{dr['test_tokens']}: the checkpoint or data root is not the stage's.")
    own = None
    if args.fit:
        streams = cal["fit_streams"]  # the stage's fit text: its positions per stream after min_context tokens
        fit_len = (cal["fit_tokens"] // streams + max(1, cal["min_context"])) * streams
        fit = fit_lookahead_calibration(lm, batchify(valid[:fit_len], streams), r.topk, cal.get("uniform_weight", 0.0),
                                        tail_samples=r.tail_samples, min_context=cal["min_context"], seed=cal["seed"],
                                        cover=r.cover, cover_max=r.cover_max, progress=True)
        if fit.n_tokens != cal["fit_tokens"]:
            sys.exit(f"lmcal: error: fitted {fit.n_tokens} positions where the stage fitted {cal['fit_tokens']}.")
        own = {"alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr, "fit_ce_before_nats": fit.ce_before,
               "fit_ce_after_nats": fit.ce_after, "fit_tokens": fit.n_tokens}
    device = torch.cuda.get_device_name() if str(args.device).startswith("cuda") else f"{args.device}"
    drop = ("tail_nats_per_generation", "vs_first_nats", "vs_first_stderr_nats")  # paired with its own run only
    result = {"device": device, "rule": r.label, "calibration": args.calibration,
              "rows": [{k: v for k, v in row.items() if k not in drop} for row in out["rows"]],
              "plain_tail_nats": out["plain_tail_nats"], "own_fit": own, "seconds": time.perf_counter() - t0,
              "provenance": provenance("python " + shlex.join(sys.argv))}
    write_json_atomic(args.out, result)
    for row in result["rows"]:
        print(f"{row['rule']} at {row['multiple']:g} alpha* = {row['alpha']:.4f}: last tenth "
              f"{row['tail_diff_nats']:+.3f} +- {row['tail_diff_stderr_nats']:.3f} nats vs its plain generations; "
              f"test CE {row['test_ce_nats']:.4f} ({row['test_ce_diff_nats']:+.4f} +- "
              f"{row['test_ce_diff_stderr_nats']:.4f}); {row['generation_seconds']:.0f} s of generation")
    if own:
        print(f"its own alpha* {own['alpha']:.4f} +- {own['alpha_stderr']:.4f} (the stage's {cal['alpha']:.4f})")
    print(f"{result['seconds']:.0f} s in all on {device}; {args.out}")


if __name__ == "__main__":
    main()
