"""Algorithm 1's convergence study on an oracle whose answer is known exactly: SMC at each particle count, untwisted,
twisted by the exact time-to-go values and by a trained soft-value head, against the exact α* and the exact law.

    python bench/smc_convergence.py [--particles 1 2 4 8 16 32] [--prefixes 200] [--out docs/bench/smc_convergence.md]

The oracle: the delayed drifting chain of the tests (DelayedDriftOracle(make_markov_chain(vocab_size=8, order=1,
support=3, smoothing=0.05, seed=1), trigger_rate=0.02, delay=3, noise_vocab=32)): a trigger word starts a countdown,
and three words later the model emits uniform noise for good, a drift one-step lookahead cannot see. Algorithm 1's law
over L = 200 words (2 x the horizon T = 100), read over the first 100 as the sequence_calibration stage does. Each row:
α* fitted at that count and twist on 200 true continuations of 200 words (lmcal.core.sequence_fit), generations from
200 one-word prefixes at the exact α*, the surprisal of their words over the last tenth of the first 100 (the exact
law's beside it), mean ESS / K, and ms per generated word. The exact answers: lmcal.core.sequence_exact.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

import torch
from bench_args import count  # bench/ is on sys.path when run as a script

from lmcal.core.sequence_exact import (
    exact_alpha,
    exact_twist,
    finite_state_lm,
    generation,
    stationary_prefixes,
    true_text,
)
from lmcal.core.sequence_fit import RootSearch, fit_sequence_alpha
from lmcal.core.smc import smc_generate
from lmcal.core.soft_value import SoftValueTraining, TwistAtAlpha
from lmcal.data.markov import make_markov_chain, sample_markov
from lmcal.models.oracles import DelayedDriftOracle, MarkovOracle
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import machine_line

T, L = 100, 200


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--particles", type=count, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--prefixes", type=count, default=200)
    add_out_option(ap, "smc_convergence")
    args = ap.parse_args(argv)
    emit, lines = tee()
    chain = make_markov_chain(vocab_size=8, order=1, support=3, smoothing=0.05, seed=1)
    orc = DelayedDriftOracle(chain, trigger_rate=0.02, delay=3, noise_vocab=32)
    fs = finite_state_lm(orc)
    text = true_text(MarkovOracle.from_chain(chain), orc, *stationary_prefixes(chain))
    a = exact_alpha(fs, text, L)
    B = args.prefixes
    prefixes = torch.as_tensor(sample_markov(chain.probs, 8, 1, B, 3)).view(B, 1)
    start = torch.bincount(prefixes[:, 0], minlength=fs.num_states).double() / B
    last = slice(T - T // 10, T)
    exact = -generation(fs, a, L, start).base_logp[last].mean().item()
    plain = -generation(fs, 0.0, L, start).base_logp[last].mean().item()
    data = torch.as_tensor(sample_markov(chain.probs, 8, 1, B * (L + 1), 5)).view(B, L + 1)
    t0 = time.perf_counter()
    heads = SoftValueTraining(iterations=10, steps=20, backup_steps=10, hidden=64, rank=16)
    twist_at = TwistAtAlpha(orc, torch.as_tensor(sample_markov(chain.probs, 8, 1, 400, 4)).view(400, 1), L, a,
                            training=heads, retrain=replace(heads, iterations=3))
    head_s = time.perf_counter() - t0
    twists = {"untwisted": (None, None), "exact twist": (exact_twist(orc, a, L), lambda x: exact_twist(orc, x, L)),
              "soft-value head (finite horizon, trained at each α)": (twist_at(a), twist_at)}
    emit(f"Delayed drifting oracle, law over {L} words read over {T}; exact α* = {a:.4f}; exact last-tenth surprisal "
         f"{exact:.3f} nats (the plain model's {plain:.3f}); {B} prefixes and {B} fit continuations; the head trained "
         f"in {head_s:.0f} s; {machine_line('cpu')}\n")
    emit("| sampler | particles | α* fitted at this count | last-tenth surprisal (nats) | vs exact (se) | ESS / K | "
         "ms / word |")
    emit("|---|---|---|---|---|---|---|")
    for name, (tw, tw_at) in twists.items():
        for k in args.particles:
            fit = fit_sequence_alpha(orc, data[:, :1], data[:, 1:], particles=k, seed=0, search=RootSearch(xtol=1e-4),
                                     **({"twist_at": tw_at} if tw_at else {"twist": tw}))
            r = smc_generate(orc, prefixes, a, L, particles=k, seed=0, twist=tw_at(a) if tw_at else tw)
            s = -r.base_logp[:, last].mean(1)
            se = s.std().item() / math.sqrt(B)
            emit(f"| {name} | {k} | {fit.alpha:.4f} ± {fit.alpha_stderr:.4f} | {s.mean():.3f} ± {se:.3f} | "
                 f"{(s.mean().item() - exact) / se:+.1f} | {(r.ess / k).mean():.2f} | "
                 f"{1000 * r.seconds / r.tokens.numel():.3f} |")
    save_bench(args.out, "Algorithm 1's convergence on the delayed drifting oracle", "\n".join(lines))


if __name__ == "__main__":
    main()
