"""The lookahead's candidate steps (calibration's H_next of every candidate word), with each candidate's full LSTM
step (before) and with h W_hh^T computed once per row (LSTMStepLM.candidate_features, now), in one run, against the
machine's matmul rate.

    python bench/lookahead_step.py [--models cpu paper] [--repeats 3] [--out docs/bench/lookahead_step.md]

One call of the lookahead as the calibrated model makes it at each generated word: --rows rows (cpu: 500, the cpu
profile's generation batch; paper: 100), each with 32 candidates (top-16 + 16 tail draws), V = 10,000, random
weights of the AWD-LSTM's sizes (cpu: 200/400/3; paper: 400/1150/3). GFLOP/s counts the products each version runs
(the candidates' LSTM and output layer, and now also the rows' h W_hh^T once each); MFU is that against the float32
matmul rate measured in the same run. The entropies of the two versions agree to float rounding (printed).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from bench_args import count  # bench/ is on sys.path when run as a script

from lmcal.core.lookahead import candidate_entropies
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.step_lm import LSTMStepLM
from lmcal.reporting.docs import add_out_option, save_bench, tee
from lmcal.utils.profiling import best_of, matmul_flops

SIZES = {"cpu": (200, 400, 500), "paper": (400, 1150, 100)}  # emb, hidden, rows
V, K = 10_000, 32


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["cpu", "paper"], choices=sorted(SIZES))
    ap.add_argument("--repeats", type=count, default=3)
    add_out_option(ap, "lookahead_step")
    args = ap.parse_args(argv)
    emit, lines = tee()
    torch.set_grad_enabled(False)  # as in calibration's own calls
    torch.manual_seed(0)
    peak = max(matmul_flops(2048) for _ in range(3))  # the machine's best: a shared machine's rate varies by a third
    emit(f"{torch.get_num_threads()} threads, torch {torch.__version__}; float32 matmul {peak / 1e9:.1f} GFLOP/s "
         "(2048^3, best of 3)\n")
    emit("| model | rows x candidates | version | ms per call | candidates/s | GFLOP/s | MFU | speed-up |")
    emit("|---|---|---|---|---|---|---|---|")
    diffs = []
    for name in args.models:
        emb, hid, rows = SIZES[name]
        net = AWDLSTM(vocab_size=V, emb_size=emb, hidden_size=hid, num_layers=3)
        lm = LSTMStepLM(net)
        before = SimpleNamespace(head=lm.head, features=lm.features, select=lm.select)  # no candidate_features
        state = lm.init_state(rows)
        for _ in range(5):  # states away from zero
            _, state = lm.step(torch.randint(0, V, (rows,)), state)
        cand = torch.randint(0, V, (rows, K))
        sizes = [(r.lstm.input_size, r.lstm.hidden_size) for r in net.rnns]
        head = 2.0 * emb * V
        recurrent = sum(8.0 * h * h for _, h in sizes)  # a candidate's h W_hh^T products: now once per row
        flops = {"before": rows * K * (sum(8.0 * i * h for i, h in sizes) + recurrent + head),
                 "now": rows * K * (sum(8.0 * i * h for i, h in sizes) + head) + rows * recurrent}
        versions = {"before": before, "now": lm}
        h = {v: candidate_entropies(m, state, cand, 0.0, 512) for v, m in versions.items()}
        secs = {v: best_of(lambda m=m, s=state, c=cand: candidate_entropies(m, s, c, 0.0, 512), args.repeats)
                for v, m in versions.items()}
        for version in ("before", "now"):
            s, f = secs[version], flops[version]
            emit(f"| {name} ({emb}/{hid}/3) | {rows} x {K} | {version} | {1000 * s:.0f} | {rows * K / s:,.0f} | "
                 f"{f / s / 1e9:.1f} | {100 * f / s / peak:.0f}% | {secs['before'] / s:.2f}x |")
        diffs.append(f"{name}: {(h['now'] - h['before']).abs().max().item():.1e}")
    emit(f"\nLargest |H now - H before| (nats): {'; '.join(diffs)}.")
    emit(f"\nBest of {args.repeats}; before: every candidate's own nn.LSTM step from a copy of its row's state; now: "
         "each row's h W_hh^T once, the candidates' input products only. Both fuse the output layer with the "
         "entropy (lookahead.linear_entropy).")
    save_bench(args.out, "Lookahead candidate steps", "\n".join(lines),
               command="python bench/lookahead_step.py" + (f" --out {args.out}" if args.out else ""))


if __name__ == "__main__":
    main()
