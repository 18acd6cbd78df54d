"""Top-k + tail lookahead against exact lookahead on a trained model: CE(alpha), CE'(alpha) and alpha*.

    python bench/calibration_topk.py --ckpt runs/cpu/ptb/base/checkpoints/best.ckpt [--positions 1000]
        [--topk 16 64] [--tail-samples 16] [--min-context 100] [--out docs/bench/calibration_topk.md]

Reads the first validation tokens of the checkpoint's corpus as --streams streams, each reading --min-context tokens
before its positions count, and fits alpha* on the same --positions positions in every mode: exact (V model steps
per position) and each top-k + tail setting (k + 1 + m steps). For alpha in ALPHAS it prints CE(alpha) and
CE'(alpha) of each approximate mode beside exact mode, and each difference in units of exact alpha*'s standard
error (blocks of --cluster-size positions):

- dCE' / (CE''(alpha) se): how far, in standard errors, the error in CE' would move a root of CE' near alpha;
- dCE / (CE''(a*) se^2 / 2): the error in CE against what CE changes when alpha moves one standard error from a*
  (a constant offset in CE leaves alpha* where it is);
- d alpha* / se.

With --seeds R every top-k + tail setting is fitted R times with other draws: the spread of alpha* over seeds is the
draws' share of its uncertainty, and the mean over seeds shows a bias (its differences are the means over seeds).

Exact mode is timed on one position per stream first; if all positions would take more than --exact-budget seconds
it prints the measured rate and skips it (run it where it fits, e.g. on a GPU with --device cuda). With
--reference K M the differences are then taken against top-K + M-tail instead, M large: the estimator is consistent
(exact as M grows), its seed-to-seed noise falls as 1/sqrt(M) and its bias as 1/M, so a large M stands in for exact
mode at a fraction of its cost. The tables say which reference they use.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from lmcal.core.calibration import fit_lookahead_calibration, lookahead_statistics
from lmcal.data.batching import batchify
from lmcal.models.step_lm import LSTMStepLM
from lmcal.pipeline.docs import save_bench
from lmcal.stages.targets import load_checkpoint_and_data

ALPHAS = (-0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2)


def fit_timed(lm, tokens, topk, m, seed, args):
    t = time.perf_counter()
    fit = fit_lookahead_calibration(lm, tokens, topk=topk, tail_samples=m, min_context=args.min_context,
                                    seed=seed, cluster_size=args.cluster_size, progress=args.progress)
    return fit, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--data-root")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--positions", type=int, default=1000, help="scored positions (a multiple of --streams)")
    ap.add_argument("--streams", type=int, default=10)
    ap.add_argument("--min-context", type=int, default=100)
    ap.add_argument("--cluster-size", type=int, default=100, help="positions per block of the standard error")
    ap.add_argument("--topk", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tail-samples", type=int, nargs="+", default=[16])
    ap.add_argument("--seeds", type=int, default=1, help="fits of each top-k + tail setting, other draws each")
    ap.add_argument("--exact-budget", type=float, default=900.0, help="seconds exact mode may take, projected")
    ap.add_argument("--skip-exact", action="store_true", help="time the approximate modes only")
    ap.add_argument("--reference", type=int, nargs=2, metavar=("K", "M"),
                    help="when exact mode is skipped, compare against top-K + M tail (M large) instead")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 on a machine shared with "
                    "other work, where idle threads spin")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--out", help="write the Markdown tables here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    net, _, dm = load_checkpoint_and_data(args.ckpt, args.data_root, args.device)
    lm = LSTMStepLM(net)
    per_stream = -(-args.positions // args.streams)
    t0 = max(1, args.min_context)
    valid = dm.tokens("valid")
    tokens = batchify(valid[: (t0 + per_stream) * args.streams], args.streams)  # [t0 + per_stream, streams]
    n = (tokens.size(0) - t0) * tokens.size(1)
    lines = [f"`{args.ckpt}`, V = {lm.vocab_size}: {n} validation positions ({args.streams} streams, each after "
             f"{args.min_context} tokens of context), {torch.get_num_threads()} threads on {args.device}, torch "
             f"{torch.__version__}.", ""]

    def emit(line=""):
        print(line, flush=True)
        lines.append(line)

    for line in lines:
        print(line)
    timing = ["| mode | steps per position | wall per fit (s) | positions/s | alpha* (mean over seeds) | "
              "std over seeds | se | std over seeds / se |", "|---|---|---|---|---|---|---|---|"]
    fits = {}
    for k in args.topk:
        for m in args.tail_samples:
            runs = [fit_timed(lm, tokens, k, m, seed, args) for seed in range(args.seeds)]
            fits[(k, m)] = [f for f, _ in runs]
            a = torch.tensor([f.alpha for f in fits[(k, m)]], dtype=torch.float64)
            se = sum(f.alpha_stderr for f in fits[(k, m)]) / args.seeds
            spread = a.std().item() if args.seeds > 1 else float("nan")
            dt = sum(t for _, t in runs) / args.seeds
            timing.append(f"| top-{k} + {m} tail | {k + 1 + m} | {dt:.1f} | {n / dt:.1f} | {a.mean():.5f} | "
                          f"{spread:.5f} | {se:.5f} | {spread / se:.2f} |")
            print(timing[-1], flush=True)
    exact = None
    if not args.skip_exact:
        probe = tokens[: t0 + 1]  # one position per stream
        t = time.perf_counter()
        lookahead_statistics(lm, probe, None, min_context=args.min_context)
        rate = probe.size(1) / (time.perf_counter() - t)  # positions/s (the context reading included)
        projected = n / rate
        emit(f"Exact lookahead: {rate:.3f} positions/s measured on {probe.size(1)} positions "
             f"({lm.vocab_size * rate:,.0f} candidate steps/s); {n} positions would take {projected / 60:.1f} min.")
        if projected <= args.exact_budget:
            exact, dt = fit_timed(lm, tokens, None, 0, 0, args)
            timing.append(f"| exact | {lm.vocab_size} | {dt:.1f} | {n / dt:.2f} | {exact.alpha:.5f} | 0 | "
                          f"{exact.alpha_stderr:.5f} | 0 |")
        else:
            emit(f"Skipped: over the budget of {args.exact_budget:.0f} s (--exact-budget).")
    ref = "exact"
    if exact is None and args.reference:
        k, m = args.reference
        ref = f"top-{k} + {m} tail"
        exact, dt = fit_timed(lm, tokens, k, m, 0, args)
        timing.append(f"| {ref} (reference) | {k + 1 + m} | {dt:.1f} | {n / dt:.2f} | {exact.alpha:.5f} | – | "
                      f"{exact.alpha_stderr:.5f} | – |")
    emit("")
    emit("\n".join(timing))
    if exact is not None:
        se = exact.alpha_stderr
        _, _, d2_star = exact.ce_derivatives(exact.alpha)
        emit("")
        emit(f"Reference ({ref}): alpha* = {exact.alpha:.5f} ± {se:.5f}. Differences from it: dCE' in standard "
             "errors of alpha* is dCE' / (CE''(alpha) se); dCE in units of CE''(a*) se^2 / 2.")
        for (k, m), runs in fits.items():
            alpha = sum(f.alpha for f in runs) / len(runs)
            emit("")
            emit(f"**top-{k} + {m} tail** ({len(runs)} seeds): alpha* = {alpha:.5f}, "
                 f"d alpha* = {alpha - exact.alpha:+.5f} = {(alpha - exact.alpha) / se:+.2f} se")
            emit("")
            emit(f"| alpha | CE {ref} | CE top-k | dCE | dCE (units) | CE' {ref} | CE' top-k | dCE' | dCE' (se) |")
            emit("|---|---|---|---|---|---|---|---|---|")
            for a in (*ALPHAS, exact.alpha):
                ce, d1, d2 = exact.ce_derivatives(a)
                ce_k, d1_k = (sum(f.ce_derivatives(a)[i] for f in runs) / len(runs) for i in (0, 1))
                label = f"a* = {a:.4f}" if a == exact.alpha else f"{a:+.2f}"
                unit_ce = d2_star * se**2 / 2
                emit(f"| {label} | {ce:.5f} | {ce_k:.5f} | {ce_k - ce:+.2e} | {(ce_k - ce) / unit_ce:+.2f} | "
                     f"{d1:+.5f} | {d1_k:+.5f} | {d1_k - d1:+.2e} | {(d1_k - d1) / (d2 * se):+.2f} |")
    save_bench(args.out, "Lookahead: top-k + tail against exact", "\n".join(lines),
               command="python " + shlex.join(sys.argv))


if __name__ == "__main__":
    main()
