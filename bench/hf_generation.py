"""Generation speed of a GPT-2-small-sized Hugging Face model through HFCausalLM, by batch size.

    python bench/hf_generation.py [--batches 1 16 32 64 128] [--horizon 64] [--prefix-len 32] [--threads N]
        [--out docs/bench/hf_generation.md]

A randomly initialised GPT2LMHeadModel(GPT2Config()) (12 layers, 768 wide, vocabulary 50257, 124M parameters; speed
does not depend on the weights) on the CPU, driven by lmcal's own generation_entropy_curve (entropy recorded,
inverse-CDF sampling): for each batch size, that many generations of --horizon tokens after --prefix-len tokens,
with lmcal's cache (ForkableLayer: keys and values written in place into a preallocated buffer) and, as the
reference, transformers' own growing cache (torch.cat of the whole past every step). Time includes feeding the
prefixes (not counted as generated tokens). FLOP/s = 2 x (parameters in matrix multiplies, the tied LM head
included, embedding lookups excluded) x generated tokens/s; MFU = that over the float32 matmul rate of a big
torch.mm measured in the same run.

Where a step's time goes (--profile-batch): one cached step of the whole batch under torch.profiler, its time by
operator, beside the matmul rate this machine reaches on that step's own shapes (M = batch rows against GPT-2's
weight matrices), which bounds what the step can reach.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_args import count, count_or_zero  # bench/ is on sys.path when run as a script
from generation_speed import generated_per_s  # bench/ is on sys.path when run as a script

from lmcal.models.hf import HFCausalLM
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import peak_flops


def hf_matmul_params(model) -> int:
    """Weights of every matrix multiply per token: Linear and GPT-2's Conv1D modules, the LM head included even when
    tied to the (lookup-only) token embedding. Attention over the cache adds 4 x layers x width x context per token,
    under 2% here, and is left out."""
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")


def shape_rate(batch: int, d: int, vocab: int, reps: int = 20) -> float:
    """FLOP/s of the matrix multiplies of one GPT-2 step at `batch` rows (per layer: qkv, out, fc, proj; then the
    LM head), timed as torch.addmm / torch.mm on those shapes; the layers' products repeat 12 times."""
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]
    mats = [(torch.randn(batch, k), torch.randn(k, n), torch.randn(n)) for k, n in shapes]
    head = torch.randn(d, vocab)
    x = torch.randn(batch, d)

    def step():
        for _ in range(12):
            for a, w, b in mats:
                torch.addmm(b, a, w)
        x @ head
    step()
    t = time.perf_counter()
    for _ in range(reps):
        step()
    flops = 2 * batch * (12 * sum(k * n for k, n in shapes) + d * vocab)
    return flops * reps / (time.perf_counter() - t)


def step_profile(lm, prefixes: torch.Tensor, emit) -> None:
    """One cached step of len(prefixes) generations, by operator (torch.profiler self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    b = prefixes.size(0)
    with torch.no_grad():
        logp, state = lm.prefill(prefixes, lm.init_state(b))
        tok = logp.argmax(-1)
        _, state = lm.step(tok, state)  # warm: the same shapes once outside the profile (a new state: stepping
        # one state twice would write its cache slot twice, which copies the cache, as it must)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            lm.step(tok, state)
        wall = time.perf_counter() - t0
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows)
    emit(f"One step at batch {b} after {prefixes.size(1)} tokens: {1000 * wall:.1f} ms under the profiler.")
    emit("")
    emit("| operator | calls | self CPU ms | share |")
    emit("|---|---|---|---|")
    for e in rows[:10]:
        emit(f"| `{e.key}` | {e.count} | {e.self_cpu_time_total / 1000:.2f} | {e.self_cpu_time_total / total:.0%} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=count, nargs="+", default=[1, 16, 32, 64, 128])
    ap.add_argument("--horizon", type=count, default=64)
    ap.add_argument("--prefix-len", type=count, default=32)
    ap.add_argument("--reference", type=count, nargs="*", default=[64],
                    help="batch sizes also run with transformers' growing cache")
    ap.add_argument("--threads", type=count, default=None,
                    help="torch threads (default: torch's choice); on a machine busy with other work, fewer threads "
                         "than cores avoid threads that wait on each other")
    ap.add_argument("--profile-batch", type=count_or_zero, default=64, help="profile one step at this batch (0: none)")
    add_out_option(ap, "hf_generation")
    args = ap.parse_args()
    emit, lines = tee()
    if args.threads:
        torch.set_num_threads(args.threads)  # before the matmul peak too: both are measured on the same threads
    from transformers import GPT2Config, GPT2LMHeadModel, __version__

    import lmcal.models.hf as L

    torch.manual_seed(0)
    t = time.perf_counter()
    model = GPT2LMHeadModel(GPT2Config())
    build_s = time.perf_counter() - t
    lm = HFCausalLM(model, device="cpu")
    n_params, n_mm = sum(p.numel() for p in model.parameters()), hf_matmul_params(model)
    peak = peak_flops("cpu")
    V = lm.vocab_size
    emit(f"{torch.get_num_threads()} threads, torch {torch.__version__}, transformers {__version__}; "
         f"float32 matmul {peak / 1e9:.1f} GFLOP/s (2048^3 torch.mm)")
    emit(f"GPT-2 small, random weights: {n_params / 1e6:.1f}M parameters, {n_mm / 1e6:.1f}M in matrix multiplies "
         f"(LM head included); built in {build_s:.0f} s. Prefix {args.prefix_len} tokens, horizon {args.horizon}.")
    emit("")
    emit("| cache | batch | generated tokens | s / 1,000 tokens | tokens/s | GFLOP/s | MFU | vs batch 1 |")
    emit("|---|---|---|---|---|---|---|---|")
    prefixes = torch.randint(0, V, (max(args.batches), args.prefix_len))
    generated_per_s(lm, prefixes[:1, :4], 2, 1, max_batch=1)  # warm-up: first-call allocations and lazy imports
    runs = [("lmcal (in place)", b) for b in args.batches] + [("transformers (torch.cat)", b) for b in args.reference]
    one = None
    for cache, b in runs:
        new_cache = L.new_cache
        if cache.startswith("transformers"):
            L.new_cache = lambda limit=None: None  # the model makes its own DynamicCache
        try:
            tps = generated_per_s(lm, prefixes[:b], args.horizon, 1, max_batch=b)
        finally:
            L.new_cache = new_cache
        one = one or tps
        emit(f"| {cache} | {b} | {b * args.horizon:,} | {1000 / tps:.2f} | {tps:,.1f} | {2 * n_mm * tps / 1e9:.1f} | "
             f"{2 * n_mm * tps / peak:.1%} | {tps / one:.1f}x |")
    if args.profile_batch:
        rate, rate128 = shape_rate(args.profile_batch, 768, V), shape_rate(128, 768, V)
        emit("")
        emit(f"Matrix multiplies on one step's own shapes ({args.profile_batch} rows; torch.addmm alone, no model): "
             f"{rate / 1e9:.1f} GFLOP/s, {rate / peak:.0%} of the 2048^3 rate; at 128 rows {rate128 / peak:.0%}.")
        emit("")
        step_profile(lm, torch.randint(0, V, (args.profile_batch, args.prefix_len + args.horizon // 2)), emit)
    save_bench(args.out, "Hugging Face generation speed", "\n".join(lines))


if __name__ == "__main__":
    main()
