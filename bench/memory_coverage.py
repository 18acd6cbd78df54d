"""Coverage of the memory bound's standard errors on the Markov source, where I_tau is known exactly.

    python bench/memory_coverage.py [--runs 100] [--tokens 20000 40000] [--block 2000] [--taus 1 2 3]
        [--out docs/bench/memory_coverage.md]

Each run draws an independent stationary test stream from the chain of the default Markov corpus (conf/data/
markov.yaml: order 2, 16 words), reads it with the exact oracle (P^: the whole past, which for an order-k chain is
its k-token windows; P~_tau: the same oracle fed only tau-token windows, lmcal.core.context.context_rows) and computes
the
memory stage's numbers (lmcal.core.memory.memory_summary: alpha fitted on the rows the bound is reported on, standard
errors from the delete-one-block jackknife with alpha refitted per block). P^ is the truth, so the bound's target is
the exact I_tau = H(W_t | last tau) - H(W_t | last k) (0 for tau >= k). Per tau it prints the mean bound over runs,
its spread (SD), the mean reported standard error, and the fraction of runs whose +-1 SE and +-2 SE intervals
contain the exact I_tau: for the one-parameter bound, the two-parameter one (beta too), and the cross-fitted bound
(with the one-parameter SE).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time

import numpy as np
import torch
from bench_args import count, count_or_zero  # bench/ is on sys.path when run as a script

from lmcal.core.context import context_rows
from lmcal.core.memory import memory_summary
from lmcal.data.markov import make_markov_chain, markov_conditional_entropy, markov_stationary, sample_markov
from lmcal.models.oracles import MarkovOracle
from lmcal.reporting.docs import save_bench
from lmcal.utils.profiling import machine_line

# the default Markov corpus (conf/data/markov.yaml corpus_kwargs)
CHAIN = {"vocab_size": 16, "order": 2, "support": 3, "smoothing": 0.01, "seed": 0}


def t_coverage(dof: int, z: float) -> float:
    """P(|T| <= z) for Student's t with `dof` degrees of freedom: the nominal coverage of +-z jackknife SEs."""
    from scipy.stats import t

    return float(2 * t.cdf(z, dof) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=count, default=100, help="independent test streams")
    ap.add_argument("--tokens", type=count, nargs="+", default=[20_000],
                    help="tokens per stream (20000: the Markov corpus's test split); several: one table row each")
    ap.add_argument("--block", type=count, default=2000, help="positions per jackknife block (analysis.memory)")
    ap.add_argument("--taus", type=count, nargs="+", default=[1, 2, 3])
    ap.add_argument("--seed", type=count_or_zero, default=1000, help="stream r of length n uses seed [seed, n, r]")
    ap.add_argument("--out", help="write the Markdown table here")
    args = ap.parse_args()

    chain = make_markov_chain(**CHAIN)
    v, k = CHAIN["vocab_size"], CHAIN["order"]
    pi = markov_stationary(chain.probs, v, k)
    h = markov_conditional_entropy(chain.probs, v, k, k, pi)
    exact = {tau: markov_conditional_entropy(chain.probs, v, k, tau, pi) - h for tau in args.taus}
    oracle = MarkovOracle.from_chain(chain)
    keys = ("one", "two", "cross")
    labels = {"one": "P̂·P̃^α", "two": "P̂^β·P̃^α", "cross": "P̂·P̃^α cross-fitted"}
    lines = [machine_line("cpu"), "",
             f"{args.runs} independent stationary streams of the order-{k} Markov source ({v} words, seed "
             f"{CHAIN['seed']}) per length; the exact oracle as P̂, the same oracle on τ-token windows as P̃; "
             f"standard errors from the delete-one-block jackknife over blocks of {args.block:,} positions with the "
             "fit redone per block (one Newton step); the cross-fitted bound is judged with the one-parameter SE. "
             "A jackknife t-interval over B blocks would cover "
             + "; ".join(f"{b} blocks: {t_coverage(b - 1, 1):.3f} (±1 SE), {t_coverage(b - 1, 2):.3f} (±2 SE)"
                         for b in sorted({-(-(n - 1) // args.block) for n in args.tokens}))
             + "; a normal interval 0.683 and 0.954.", "",
             "| tokens (blocks) | τ | estimator | exact I_τ (nats) | mean estimate | bias / SD | SD over runs | "
             "mean SE | SD / mean SE | ±1 SE covers | ±2 SE covers |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    t0 = time.perf_counter()
    for n in args.tokens:
        est = {tau: {key: [] for key in keys} for tau in args.taus}  # (value, se) per run
        for r in range(args.runs):
            w = torch.from_numpy(sample_markov(chain.probs, v, k, n, np.random.default_rng([args.seed, n, r]), pi))
            # the whole past: for an order-k chain its last k tokens (the same rows as tau=None, batched)
            full = torch.cat([lp for lp, _ in context_rows(oracle, w, k, batch_size=4096)])  # [N-1, V]
            for tau in args.taus:
                q = torch.cat([lp for lp, _ in context_rows(oracle, w, tau, batch_size=4096)])
                m = memory_summary([(full, q, w[1:])], cluster_size=args.block)
                two = m["two_parameter"]
                est[tau]["one"].append((m["mi_upper_bound_nats"], m["mi_stderr_nats"]))
                est[tau]["two"].append((two["mi_upper_bound_nats"], two["mi_stderr_nats"]))
                est[tau]["cross"].append((m["mi_upper_bound_crossfit_nats"], m["mi_stderr_nats"]))
            if (r + 1) % 20 == 0:
                print(f"{n} tokens: {r + 1}/{args.runs} runs, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for tau in args.taus:
            for key in keys:
                x, se = (np.array(c) for c in zip(*est[tau][key], strict=True))
                err, sd = np.abs(x - exact[tau]), x.std(ddof=1)
                lines.append(f"| {n:,} ({-(-(n - 1) // args.block)}) | {tau} | {labels[key]} | {exact[tau]:.5f} | "
                             f"{x.mean():.5f} | {(x.mean() - exact[tau]) / sd if sd > 0 else math.nan:+.2f} | "
                             f"{sd:.5f} | {se.mean():.5f} | {sd / se.mean():.2f} | {(err <= se).mean():.2f} | "
                             f"{(err <= 2 * se).mean():.2f} |")
    lines += ["", f"Measured in {time.perf_counter() - t0:.0f} s."]
    print("\n".join(lines))
    save_bench(args.out, "Memory bound: coverage of its standard errors on the Markov source", "\n".join(lines),
               command="python " + shlex.join(sys.argv))


if __name__ == "__main__":
    main()
