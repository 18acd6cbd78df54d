"""The analysis hot loops against this machine's float32 matmul rate, each beside the straightforward version it
replaced, in one run.

    python bench/hot_loops.py [--generations 500] [--horizon 50] [--positions 2] [--rows 2000]
        [--out docs/bench/hot_loops.md]

Loops (random weights: speed does not depend on them; V = 10,000 words):
- generation: `generation_entropy_curve` (entropy recorded, inverse-CDF sampling) at --generations generations of
  --horizon words after 20-word prefixes, both LSTM sizes. Reference: the straightforward loop (float64 copy of the
  log-probs, clamped entropy, a float64 cumsum over the vocabulary).
- exact lookahead: `lookahead_entropies` (every word's next entropy, V LSTM steps per position), small model.
  Reference: a step per candidate (log_softmax) then the clamped entropy, 8,192 candidates per forward.
- tau-context scoring: `limited_context_log_probs` (the memory stage's rows: every window from a zero state) at
  tau = 5 and 30, and the full-context rows (batch 1), small model.

MFU = the model FLOPs done (2 x matrix-multiply parameters per token stepped; the prefix feeding left out of
generation's count, not of its time) per second over the matmul rate (n x n float32 products, same threads).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_args import count  # bench/ is on sys.path when run as a script
from train_throughput import build  # bench/ is on sys.path when run as a script

from lmcal.core import calibration
from lmcal.core.entropy_rate import generation_entropy_curve
from lmcal.core.sampling import uniforms
from lmcal.models.awd_lstm import full_context_log_probs, limited_context_log_probs, matmul_params
from lmcal.models.step_lm import LSTMStepLM
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import peak_flops


def _old_entropy(logp):
    return -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)


@torch.no_grad()
def reference_generation(lm, prefixes, horizon, samples, seed=0):
    """The generation loop as it was: float64 log-probs, a clamped entropy, a full float64 cumsum to sample."""
    n = prefixes.size(0)
    state = lm.init_state(n)
    for i in range(prefixes.size(1)):
        logp, state = lm.step(prefixes[:, i], state)
    rows = torch.arange(n).repeat_interleave(samples)
    logp, state = logp[rows], lm.select(state, rows)
    gen_ids = torch.arange(n * samples)
    for t in range(horizon):
        lp = logp.double()
        p = lp.exp()
        _old_entropy(lp)
        if t == horizon - 1:
            break
        cdf = p.cumsum(-1)
        u = uniforms(seed, gen_ids, t) * cdf[:, -1]
        tokens = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp_(max=cdf.size(1) - 1)
        logp, state = lm.step(tokens, state)


@torch.no_grad()
def reference_lookahead(lm, state, logp, chunk=8192):
    B, V = logp.shape
    rows = torch.arange(B).repeat_interleave(V)
    toks = torch.arange(V).repeat(B)
    out = [_old_entropy(lm.step(toks[i:i + chunk], lm.select(state, rows[i:i + chunk]))[0])
           for i in range(0, B * V, chunk)]
    return torch.cat(out).view(B, V)


def timed(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generations", type=count, default=500, help="100 prefixes x generations/100 samples")
    ap.add_argument("--horizon", type=count, default=50)
    ap.add_argument("--positions", type=count, default=2, help="exact lookahead: positions (V candidates each)")
    ap.add_argument("--rows", type=count, default=2000, help="tau-context scoring: positions of the test stream")
    ap.add_argument("--vocab", type=count, default=10_000)
    add_out_option(ap, "hot_loops")
    args = ap.parse_args()
    emit, lines = tee()
    torch.manual_seed(0)
    peak = peak_flops("cpu")
    emit(f"{torch.get_num_threads()} threads, torch {torch.__version__}; float32 matmul {peak / 1e9:.1f} GFLOP/s "
         "(2048^3, best of 3)")
    emit("")
    emit("| loop | model | implementation | work | per second | GFLOP/s | MFU | speed-up |")
    emit("|---|---|---|---|---|---|---|---|")

    def row(loop, name, impl, work, unit, seconds, flops, ref_seconds):
        emit(f"| {loop} | {name} | {impl} | {work:,} {unit} | {work / seconds:,.1f} | {flops / seconds / 1e9:.1f} | "
             f"{flops / seconds / peak:.0%} | {ref_seconds / seconds:.2f}x |")

    samples = max(1, args.generations // 100)
    for name in ("awd_lstm_small", "awd_lstm"):
        net = build(name, args.vocab).eval()
        lm, fpt = LSTMStepLM(net), 2.0 * matmul_params(net)
        prefixes = torch.randint(0, args.vocab, (100, 20))
        reference_generation(lm, prefixes[:10], 3, samples)  # warm-up
        generation_entropy_curve(lm, prefixes[:10], 3, samples)
        ref = timed(reference_generation, lm, prefixes, args.horizon, samples)
        ours = timed(generation_entropy_curve, lm, prefixes, args.horizon, samples, max_batch=100 * samples)
        n = 100 * samples * args.horizon
        row("generation", name, "reference", n, "words", ref, fpt * n, ref)
        row("generation", name, "ours", n, "words", ours, fpt * n, ref)

    net = build("awd_lstm_small", args.vocab).eval()
    lm, fpt = LSTMStepLM(net), 2.0 * matmul_params(net)
    B = args.positions
    state = lm.init_state(B)
    logp, state = lm.step(torch.randint(0, args.vocab, (B,)), state)
    ref = timed(lambda: reference_lookahead(lm, state, logp))
    ours = timed(lambda: calibration.lookahead_entropies(lm, state, logp))
    n = B * args.vocab
    row("exact lookahead", "awd_lstm_small", "reference", n, "candidates", ref, fpt * n, ref)
    row("exact lookahead", "awd_lstm_small", "ours", n, "candidates", ours, fpt * n, ref)

    tokens = torch.randint(0, args.vocab, (args.rows + 1,))
    lstm = 2.0 * (matmul_params(net) - net.decoder.weight.numel())
    dec = 2.0 * net.decoder.weight.numel()
    drain = lambda rows: sum(y.numel() for _, y in rows)
    for tau in (5, 30):
        drain(limited_context_log_probs(net, tokens[:100], tau))
        s = timed(lambda: drain(limited_context_log_probs(net, tokens, tau)))  # noqa: B023
        row("tau-context rows", "awd_lstm_small", f"tau = {tau}", args.rows, "rows", s, (lstm * tau + dec) * args.rows,
            s)
    s = timed(lambda: drain(full_context_log_probs(net, tokens, 512)))
    row("full-context rows", "awd_lstm_small", "batch 1", args.rows, "rows", s, (lstm + dec) * args.rows, s)
    emit("")
    emit("Speed-up: against the reference row of the same loop and model.")
    save_bench(args.out, "Analysis hot loops", "\n".join(lines))


if __name__ == "__main__":
    main()
