"""Algorithm 1's law, word by word, where it is exact: at the α* that makes P̂_α(w_1..L) ∝ P̂^(1+α)'s entropy rate over
all L words equal the cross-entropy, how far its entropy inside the law (over the last tenth of its first T = L / 2
words, where the sequence_calibration stage reads it) lies from that cross-entropy, and where its end lies.

    python bench/law_profile.py [--horizons 50 100 200] [--out docs/bench/law_profile.md]

The models: the chain of the tests (make_markov_chain(vocab_size=8, order=1, support=3, smoothing=0.05, seed=1)) as
true text, modelled by a flattened copy of itself (P^0.7, normalised: α* > 0) and by the delayed drifting oracle of
bench/smc_convergence.py (trigger_rate=0.02, delay=3, noise_vocab=32). Every number is exact
(lmcal.core.sequence_exact): the moment condition matches averages over the whole law, so a law whose end drifts
sits away from the cross-entropy inside, and a convergent sampler's last tenth measures that, not the goal.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

from bench_args import count  # bench/ is on sys.path when run as a script

from lmcal.core.sequence_exact import (
    exact_alpha,
    finite_state_lm,
    generation,
    sequence_ce,
    stationary_prefixes,
    true_text,
)
from lmcal.data.markov import make_markov_chain
from lmcal.models.oracles import DelayedDriftOracle, MarkovOracle
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import machine_line


def models() -> tuple:
    """The true chain, and the models of it by name."""
    chain = make_markov_chain(vocab_size=8, order=1, support=3, smoothing=0.05, seed=1)
    flat = chain.probs ** 0.7
    return chain, {"flattened chain (P^0.7)": MarkovOracle(flat / flat.sum(1, keepdims=True), 8, 1),
                   "delayed drifting oracle": DelayedDriftOracle(chain, trigger_rate=0.02, delay=3, noise_vocab=32)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--horizons", type=count, nargs="+", default=[50, 100, 200], help="T: the words read (L = 2 T)")
    add_out_option(ap, "law_profile")
    args = ap.parse_args(argv)
    emit, lines = tee()
    emit(machine_line("cpu") + "\n")
    chain, lms = models()
    truth = MarkovOracle.from_chain(chain)
    emit("Entropies in nats per word, of the exact law at its exact α* (CE(α*) = EntRate(α*) over all L words); "
         "inside: the last tenth of the first T words; end: the last tenth of all L.")
    emit("")
    emit("| model | T | L | α* | CE(α*) | EntRate over L | first T | inside | inside − CE | in perplexity | end |")
    emit("|" + "---|" * 11)
    gaps = []
    for name, lm in lms.items():
        fs = finite_state_lm(lm)
        text = true_text(truth, lm, *stationary_prefixes(chain))
        for t in args.horizons:
            L = 2 * t
            a = exact_alpha(fs, text, L)
            e = generation(fs, a, L, text.model_start).entropy  # [L]: the entropy word t is drawn with
            ce = sequence_ce(fs, text, a, L)
            inside, end = float(e[t - t // 10:t].mean()), float(e[L - t // 10:].mean())
            gaps.append((name, t, inside - ce))
            emit(f"| {name} | {t} | {L} | {a:.4f} | {ce:.4f} | {float(e.mean()):.4f} | {float(e[:t].mean()):.4f} | "
                 f"{inside:.4f} | {inside - ce:+.4f} | {100 * math.expm1(inside - ce):+.1f}% | {end:.4f} |")
    emit("")
    far = max(gaps, key=lambda g: abs(g[2]))
    emit(f"The law's entropy inside differs from the cross-entropy by up to {abs(far[2]):.4f} nats "
         f"({100 * abs(math.expm1(far[2])):.1f}% in perplexity: {far[0]}, T = {far[1]}), exactly, with no sampler "
         "involved.")
    save_bench(args.out, "Algorithm 1's law word by word, where it is exact", "\n".join(lines),
               command=shlex.join(["python", "bench/law_profile.py", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    main()
