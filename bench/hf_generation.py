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
"""

from __future__ import annotations

import argparse
import time

import torch
from generation_speed import generated_per_s  # bench/ is on sys.path when run as a script
from train_throughput import matmul_flops

from lmcal.docs import add_out_option, save_bench, tee
from lmcal.lm import HFCausalLM


def hf_matmul_params(model) -> int:
    """Weights of every matrix multiply per token: Linear and GPT-2's Conv1D modules, the LM head included even when
    tied to the (lookup-only) token embedding. Attention over the cache adds 4 x layers x width x context per token,
    under 2% here, and is left out."""
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    ap.add_argument("--horizon", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=32)
    ap.add_argument("--reference", type=int, nargs="*", default=[64],
                    help="batch sizes also run with transformers' growing cache")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's choice); on a machine busy with other work, fewer threads "
                         "than cores avoid threads that wait on each other")
    add_out_option(ap, "hf_generation")
    args = ap.parse_args()
    emit, lines = tee()
    if args.threads:
        torch.set_num_threads(args.threads)  # before the matmul peak too: both are measured on the same threads
    from transformers import GPT2Config, GPT2LMHeadModel, __version__

    import lmcal.hf as L

    torch.manual_seed(0)
    t = time.perf_counter()
    model = GPT2LMHeadModel(GPT2Config())
    build_s = time.perf_counter() - t
    lm = HFCausalLM(model, device="cpu")
    n_params, n_mm = sum(p.numel() for p in model.parameters()), hf_matmul_params(model)
    peak = matmul_flops("cpu")
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
        new_cache = L._new_cache
        if cache.startswith("transformers"):
            L._new_cache = lambda limit=None: None  # the model makes its own DynamicCache
        try:
            tps = generated_per_s(lm, prefixes[:b], args.horizon, 1, max_batch=b)
        finally:
            L._new_cache = new_cache
        one = one or tps
        emit(f"| {cache} | {b} | {b * args.horizon:,} | {1000 / tps:.2f} | {tps:,.1f} | {2 * n_mm * tps / 1e9:.1f} | "
             f"{2 * n_mm * tps / peak:.1%} | {tps / one:.1f}x |")
    save_bench(args.out, "Hugging Face generation speed", "\n".join(lines))


if __name__ == "__main__":
    main()
