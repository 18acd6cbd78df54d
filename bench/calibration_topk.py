"""Candidate rules of lookahead calibration against exact lookahead on a trained model: the noise-free shift each
rule's law keeps of exact lookahead's, the fits (CE(alpha), CE'(alpha), alpha*), and the cost per generated word.

    python bench/calibration_topk.py --ckpt runs/cpu/ptb/base/checkpoints/best.ckpt [--positions 1000]
        [--topk 16 64] [--tail-samples 16] [--min-context 100] [--out docs/bench/calibration_topk.md]
        [--calibration RUN/ptb/calibration/calibration.json] [--rules top-16 top-256 cover-0.95]
        [--multiples 1 3 10] [--approximation 30 10] [--timing] [--skip-fits]

1. The approximation table (--approximation G S, 0 0 to skip): at S positions of each of G plain
   generations (the calibration stage's first G prefixes, seed and horizon: from --calibration where given), every
   word's H_next exactly, and there E_{P_a}[H_next] - E_P[H_next] of exact lookahead against each of --rules' laws
   at a = k alpha* for each of --multiples (lmcal.stages.dose_response.approximation_table): what each rule keeps of
   the exact tilt, without generation noise. alpha*: the stage's (--calibration), else --alpha, else the first fit's.

2. The fits (skipped with --skip-fits): the first validation tokens of the checkpoint's corpus as --streams streams,
   each reading --min-context tokens before its positions count, and alpha* fitted on the same --positions positions
   in every mode: exact (V model steps per position) and each top-k law (k + m steps; the rest sharing one tilt from m
   draws, in the fit as in generation). For alpha in ALPHAS it prints CE(alpha) and CE'(alpha) of each top-k law beside
   exact mode's, and each difference in units of exact alpha*'s standard error (blocks of --cluster-size positions):
   dCE' / (CE''(alpha) se), how far the law's root of CE' lies from exact's, in standard errors; dCE / (CE''(a*) se^2 /
   2); d alpha* / se. Each top-k law is another law than exact lookahead's: these are the differences of the laws, not
   an estimator's error. With --seeds R each is fitted R times with other draws (the spread of alpha* over seeds is the
   draws' share of its uncertainty). Exact mode is timed on one position per stream first; if all positions would take
   more than --exact-budget seconds it is skipped (run it where it fits, e.g. on a GPU with --device cuda), and with
   --reference K M the differences are taken against top-K + M draws instead.

3. --timing: ms per generated word of the plain model and of each rule's law at alpha* (the calibration stage's
   generation: --timing-prefixes prefixes x 1 generation of --timing-horizon words, the best of --timing-repeats runs,
   each interleaved with a plain run: lmcal.stages.rows.timed_generation), against plain sampling and against the first
   rule, beside this machine's float32 matmul rate measured in the same run. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch
from bench_args import count, count_or_zero, positive, read_shaped  # bench/ is on sys.path when run as a script

from lmcal.core.calibration import calibrated, fit_lookahead_calibration, lookahead_statistics
from lmcal.core.lookahead_law import make_rule
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.models.step_lm import as_step_lm
from lmcal.reporting.docs import save_bench
from lmcal.stages.dose_response import (
    approximation_markdown,
    approximation_note,
    approximation_table,
    rule_from_text,
)
from lmcal.stages.rows import timed_generation
from lmcal.stages.targets import load_checkpoint_and_data
from lmcal.utils.boundary import boundary
from lmcal.utils.profiling import matmul_flops
from lmcal.utils.records import Maybe, Range

# what the bench reads of a calibration stage's calibration.json (each may be absent: the option's default)
CALIBRATION = {"alpha?": Maybe(float), "num_prefixes?": Range(1, integer=True), "prefix_len?": Range(1, integer=True),
               "horizon?": Range(1, integer=True), "seed?": Range(0, integer=True)}
ALPHAS = (-0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2)


def fit_timed(lm, tokens, topk, m, seed, args):
    t = time.perf_counter()
    fit = fit_lookahead_calibration(lm, tokens, make_rule(topk, tail_samples=m), min_context=args.min_context,
                                    seed=seed, cluster_size=args.cluster_size, progress=args.progress)
    return fit, time.perf_counter() - t


def main():
    with boundary():
        run()


def run():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--data-root")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--positions", type=count, default=1000, help="scored positions (a multiple of --streams)")
    ap.add_argument("--streams", type=count, default=10)
    ap.add_argument("--min-context", type=count_or_zero, default=100)
    ap.add_argument("--cluster-size", type=count, default=100, help="positions per block of the standard error")
    ap.add_argument("--topk", type=count, nargs="+", default=[16, 64])
    ap.add_argument("--tail-samples", type=count, nargs="+", default=[16])
    ap.add_argument("--seeds", type=count, default=1, help="fits of each top-k + tail setting, other draws each")
    ap.add_argument("--exact-budget", type=positive, default=900.0, help="seconds exact mode may take, projected")
    ap.add_argument("--skip-exact", action="store_true", help="time the approximate modes only")
    ap.add_argument("--reference", type=count, nargs=2, metavar=("K", "M"),
                    help="when exact mode is skipped, compare against top-K + M tail (M large) instead")
    ap.add_argument("--threads", type=count, help="torch threads (default: torch's); 1 on a machine shared with "
                    "other work, where idle threads spin")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--calibration", help="a calibration stage's calibration.json: its alpha*, prefixes, horizon, seed")
    ap.add_argument("--alpha", type=float, help="alpha* of the approximation table and the timing (without "
                    "--calibration; default: the first fit's)")
    ap.add_argument("--rules", nargs="+", default=["top-16", "top-256", "cover-0.95"])
    ap.add_argument("--multiples", type=positive, nargs="+", default=[1, 3, 10])
    ap.add_argument("--approximation", type=count_or_zero, nargs=2, default=[30, 10], metavar=("G", "S"),
                    help="generations and positions each of the approximation table (0 0: skipped)")
    ap.add_argument("--horizon", type=count, default=200, help="generated words (without --calibration)")
    ap.add_argument("--skip-fits", action="store_true", help="only the approximation table (and --timing)")
    ap.add_argument("--timing", action="store_true", help="ms per generated word of each rule (a quiet machine)")
    ap.add_argument("--timing-prefixes", type=count, default=20)
    ap.add_argument("--timing-horizon", type=count, default=30)
    ap.add_argument("--timing-repeats", type=count, default=3)
    ap.add_argument("--out", help="write the Markdown tables here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    rules = [rule_from_text(r) for r in args.rules]
    settings = read_shaped(args.calibration, CALIBRATION, "a calibration stage's calibration.json") \
        if args.calibration else {}  # before the checkpoint loads and the fits run
    net, _, dm = load_checkpoint_and_data(args.ckpt, args.data_root, args.device)
    lm = as_step_lm(net)
    per_stream = -(-args.positions // args.streams)
    t0 = max(1, args.min_context)
    valid = dm.tokens("valid")
    tokens = batchify(valid[: (t0 + per_stream) * args.streams], args.streams)  # [t0 + per_stream, streams]
    n = (tokens.size(0) - t0) * tokens.size(1)
    fitted = "" if args.skip_fits else (f": {n} validation positions ({args.streams} streams, each after "
                                        f"{args.min_context} tokens of context)")
    lines = [f"`{args.ckpt}`, V = {lm.vocab_size}{fitted}, {torch.get_num_threads()} threads on {args.device}, torch "
             f"{torch.__version__}.", ""]

    def emit(line=""):
        print(line, flush=True)
        lines.append(line)

    for line in lines:
        print(line)
    fits = {}
    if not args.skip_fits:
        fits = compare_fits(lm, tokens, n, t0, args, emit)
    alpha = settings.get("alpha", args.alpha)
    if alpha is None and fits:
        alpha = next(iter(fits.values()))[0].alpha
    valid_prefixes = random_prefixes(valid, settings.get("num_prefixes", 100), settings.get("prefix_len", 100),
                                     seed=settings.get("seed", 0))
    horizon, seed = settings.get("horizon", args.horizon), settings.get("seed", 0)
    g, steps = args.approximation
    approximated = bool(g and steps and alpha is not None)
    if approximated:
        ap = approximation_table(lm, valid_prefixes[:g], horizon, steps, rules, alpha, args.multiples, seed,
                                 progress=args.progress)
        emit("")
        whose = f", the calibration stage's: {args.calibration}" if args.calibration else ""
        emit(f"**What each rule's law keeps of exact lookahead** (alpha* = {alpha:.5f}{whose}; {ap['seconds']:.0f} s)")
        emit("")
        emit(approximation_markdown(ap).rstrip("\n"))
        emit("")
        emit(approximation_note(ap))
    if args.timing and alpha is not None:
        emit("")
        emit(timing_table(lm, valid_prefixes[:args.timing_prefixes], rules, alpha, seed, args))
    only_cost = args.skip_fits and not approximated  # a page of its own beside the comparison's
    title = ("Lookahead calibration: cost per generated word of each candidate rule" if only_cost
             else "Lookahead calibration: candidate rules against exact lookahead")
    save_bench(args.out, title, "\n".join(lines),
               command="python " + shlex.join(sys.argv))


def compare_fits(lm, tokens, n, t0, args, emit) -> dict:
    """Section 2 of the docstring: each top-k law's fit beside exact mode's (or the --reference law's)."""
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
            timing.append(f"| top-{k} + {m} tail | {k + m} | {dt:.1f} | {n / dt:.1f} | {a.mean():.5f} | "
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
        timing.append(f"| {ref} (reference) | {k + m} | {dt:.1f} | {n / dt:.2f} | {exact.alpha:.5f} | – | "
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
    return fits


def timing_table(lm, prefixes, rules, alpha, seed, args) -> str:
    """Section 3 of the docstring: ms per generated word of each rule's law at alpha*, against plain sampling (timed
    alternately with it, lmcal.stages.rows.timed_generation) and against the first rule."""
    peak = max(matmul_flops(1024) for _ in range(3))
    rows, plain, first = [], [], None
    for r in rules:
        model = calibrated(lm, alpha, r.topk, tail_samples=r.tail_samples, seed=seed, cover=r.cover,
                           cover_max=r.cover_max)
        ms, ratio = timed_generation(model, lm, prefixes, args.timing_horizon, 1, seed, 1024, args.timing_repeats)
        plain.append(ms / ratio)
        first = first or ms
        rows.append(f"| {r.label} at alpha* = {alpha:.4f} | {ms:.2f} | {ratio:.1f} | {ms / first:.2f} |")
        print(rows[-1], flush=True)
    return (f"**Cost per generated word** ({prefixes.size(0)} generations of {args.timing_horizon} words at once, the "
            f"best of {args.timing_repeats}, each law timed alternately with plain sampling; "
            f"{torch.get_num_threads()} threads; float32 matmul {peak / 1e9:.1f} GFLOP/s measured in this run)\n\n"
            f"| law | ms per generated word | × plain sampling | × {rules[0].label} |\n|---|---|---|---|\n"
            f"| plain sampling | {min(plain):.3f} | 1.0 | – |\n" + "\n".join(rows))

if __name__ == "__main__":
    main()
