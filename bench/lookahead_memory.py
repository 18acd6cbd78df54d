"""Peak memory and time of one lookahead step of a Hugging Face model at GPT-2-small's shape, in three versions: before
the memory budget, with forks sized by it, and with a row's candidates reading its past together.

    python bench/lookahead_memory.py [--layers 12] [--rows 4] [--prefix 128] [--out docs/bench/lookahead_memory.md]

A random small-init GPT2 (vocab 50,257, n_embd 768, 12 heads, --layers layers, context 1,024), --rows rows that have
read --prefix tokens, and top-64 + the true word + 16 tail draws = 81 candidates per row: what the calibrated model
steps at each generated word.
- before: chunks of 512 candidates, each a fork of its row's cache with room to grow (max(64, 2 (n + 1)) positions);
- forks: chunks sized so that the forks fit the budget (--budget-gb, the CPU's default 2 GB; chunk_sizes), each fork
  holding n + 1 positions (HFCausalLM.select_for_step);
- shared: a row's candidates as one sequence of queries at position n that reads the row's past once per layer under
  a 4D mask (HFCausalLM.candidate_step), chunks sized by the same budget over what a candidate then holds.
Each version runs in its own process. Peak memory: the most bytes the step's tensors held at once (torch.profiler's
allocations and frees, in order: what a CUDA allocator would have to provide), and the process's resident set sampled
every 2 ms, less the resident set just before the step (the CPU leaves untouched pages of a reserved buffer unbacked,
so the resident figure understates a buffer reserved and never written). Time: best of --repeats, outside the
profiler. The versions' entropies are compared with the first's (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch
from bench_args import count, positive  # bench/ is on sys.path when run as a script

from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import machine_line

K = 81  # top-64 + the true word + 16 tail draws
VERSIONS = ("before", "forks", "shared")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Before:
    """The model as the lookahead saw it before: no one-step forks, no row_bytes (so no budget)."""

    def __init__(self, lm):
        self.lm, self.head, self.vocab_size = lm, lm.head, lm.vocab_size

    def features(self, tokens, state):
        return self.lm.features(tokens, state)

    def select(self, state, index):
        return self.lm.select(state, index)


def one(version: str, layers: int, rows: int, prefix: int, repeats: int, budget_gb: float) -> dict:
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from lmcal.core.lookahead import candidate_entropies, set_memory_budget
    from lmcal.models.hf import HFCausalLM

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    cfg = transformers.GPT2Config(vocab_size=50_257, n_embd=768, n_head=12, n_layer=layers, n_positions=1024,
                                  initializer_range=0.02)
    lm = HFCausalLM(transformers.GPT2LMHeadModel(cfg))
    _, state = lm.prefill(torch.randint(0, 50_257, (rows, prefix)), lm.init_state(rows))
    cand = torch.randint(0, 50_257, (rows, K))
    set_memory_budget(budget_gb)
    model, chunk = (Before(lm), 512) if version == "before" else (lm, None)
    if version == "forks":
        lm.shares_past = lambda state: False
    base, peak, times, h = rss(), [0], [], None
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        h = candidate_entropies(model, state, cand, 0.0, chunk)  # [rows, K]
    held = top = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):  # allocations (+) and frees (-) in order
        held += e.self_cpu_memory_usage
        top = max(top, held)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = candidate_entropies(model, state, cand, 0.0, chunk)  # [rows, K]
        times.append(time.perf_counter() - t0)
    stop.set()
    t.join()
    from lmcal.core.lookahead import chunk_sizes

    used = min(512, rows * K) if version == "before" else chunk_sizes(lm, state, rows * K, 50_257, torch.device("cpu"),
                                                                    True, K)[0]
    n = prefix + 1
    held = {"before": lm.row_bytes(state) * max(64, 2 * n) / n, "forks": lm.row_bytes(state),
            "shared": lm.candidate_bytes(state, K)}[version]  # what one candidate holds of its row's state
    return {"peak_bytes": peak[0] - base, "allocated_bytes": top, "seconds": min(times), "chunk": used,
            "held_bytes": held, "h": h.flatten().tolist()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=count, default=12)
    ap.add_argument("--rows", type=count, default=4)
    ap.add_argument("--prefix", type=count, default=128)
    ap.add_argument("--repeats", type=count, default=2)
    ap.add_argument("--budget-gb", type=positive, default=2.0)
    ap.add_argument("--versions", default=",".join(VERSIONS),
                    help="which versions, comma-separated; the entropies are compared with the first's (before "
                         "needs memory for 512 growing forks: about 38 GB after 512 tokens)")
    ap.add_argument("--version", choices=VERSIONS, help=argparse.SUPPRESS)  # one version, in a child
    add_out_option(ap, "lookahead_memory")
    args = ap.parse_args(argv)
    if args.version:
        print(json.dumps(one(args.version, args.layers, args.rows, args.prefix, args.repeats, args.budget_gb)))
        return
    emit, lines = tee()
    emit(f"GPT-2-small shape (vocab 50,257, n_embd 768, 12 heads) with {args.layers} layers, random weights; "
         f"{args.rows} rows x {K} candidates after {args.prefix} tokens; CPU, {machine_line('cpu')}; budget "
         f"{args.budget_gb:g} GB\n")
    emit("| version | chunk (candidates) | state held per candidate | peak allocated | peak resident | s per step | "
         "candidates/s |")
    emit("|---|---|---|---|---|---|---|")
    res, versions = {}, args.versions.split(",")
    if not versions or any(v not in VERSIONS for v in versions):
        ap.error(f"--versions takes some of {','.join(VERSIONS)}, got {args.versions!r}")
    for version in versions:
        cmd = [sys.executable, __file__, "--version", version, "--layers", str(args.layers), "--rows", str(args.rows),
               "--prefix", str(args.prefix), "--repeats", str(args.repeats), "--budget-gb", str(args.budget_gb)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        r = res[version] = json.loads(out)
        emit(f"| {version} | {r['chunk']} | {r['held_bytes'] / 1e6:.2f} MB | {r['allocated_bytes'] / 1e9:.2f} GB | "
             f"{r['peak_bytes'] / 1e9:.2f} GB | "
             f"{r['seconds']:.2f} | {args.rows * K / r['seconds']:,.0f} |")
    emit("")
    for version in versions[1:]:
        diff = max(abs(a - b) for a, b in zip(res[versions[0]]["h"], res[version]["h"], strict=True))
        emit(f"Largest difference between the entropies of {version} and {versions[0]}: {diff:.2e} nats.")
    save_bench(args.out, f"Lookahead memory at GPT-2-small's shape, {args.prefix} tokens read", "\n".join(lines),
               command=" ".join(["python bench/lookahead_memory.py", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    main()
