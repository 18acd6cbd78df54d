"""`make gpu-check`: what proves the CUDA path, in a few minutes, as one Markdown report.

    python bench/gpu_check.py [--out outputs/gpu-check/REPORT.md]

Needs CUDA. Without it the report says so (which torch is installed, whether it is a CUDA build) and the script exits
1: nothing here can stand in for a GPU. With CUDA it records
- the CUDA build and the device;
- the tests marked `gpu` (pytest -m gpu: the weight-dropped LSTM's outputs and gradients on CUDA against the CPU, a
  resume after the NT-ASGD switch with the module on CUDA, the lookahead's two paths under the TF32 policy);
- paper-size training tokens/s, ours against a plain cuDNN nn.LSTM stack in one run (bench/train_throughput.py);
- one calibrated paper-size lookahead step (100 rows, top-64 + the true word + 16 draws, V = 10,000): time, with
  synchronisation, and peak memory (torch.cuda.max_memory_allocated).
Not yet in it: the smoke training, resume and every analysis stage on CUDA and on CPU side by side (issue 32).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def no_cuda_report() -> str:
    build = torch.version.cuda or "none: a CPU-only wheel"
    return ("## GPU check\n\n**Not run: this check needs CUDA.** "
            f"torch {torch.__version__}, CUDA build {build}, torch.cuda.is_available() = {torch.cuda.is_available()}. "
            "Run `make gpu-check` on a machine with an NVIDIA GPU and a CUDA wheel of torch (e.g. make install "
            "TORCH=\"torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126\").\n")


def calibrated_step() -> list[str]:
    from lmcal.core.lookahead import candidate_entropies
    from lmcal.models.awd_lstm import AWDLSTM
    from lmcal.models.step_lm import LSTMStepLM

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    lm = LSTMStepLM(AWDLSTM(vocab_size=10_000, emb_size=400, hidden_size=1150, num_layers=3).cuda().eval())
    rows, k = 100, 64 + 1 + 16
    state = lm.init_state(rows)
    for _ in range(5):
        _, state = lm.step(torch.randint(0, 10_000, (rows,), device="cuda"), state)
    cand = torch.randint(0, 10_000, (rows, k), device="cuda")
    candidate_entropies(lm, state, cand, 0.0)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        candidate_entropies(lm, state, cand, 0.0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    return ["| rows x candidates | ms per step (best of 5) | peak allocated |", "|---|---|---|",
            f"| {rows} x {k} | {1000 * min(times):.2f} | {peak / 1e6:.1f} MB |"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/gpu-check/REPORT.md")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        out.write_text(no_cuda_report())
        print(no_cuda_report(), file=sys.stderr)
        return 1
    from lmcal.utils.device import apply_precision_policy

    policy = apply_precision_policy()
    lines = ["## GPU check", "", f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
             f"{torch.cuda.get_device_name(0)}; precision policy {policy}", ""]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests"], cwd=ROOT,
                           capture_output=True, text=True)
    lines += ["### Tests marked gpu", "", f"exit {tests.returncode}: `{tests.stdout.strip().splitlines()[-1]}`", ""]
    bench = subprocess.run([sys.executable, "bench/train_throughput.py", "--models", "paper", "--reps", "3",
                            "--device", "cuda"], cwd=ROOT, capture_output=True, text=True)
    lines += ["### Paper-size training, ours against cuDNN's nn.LSTM", "",
              bench.stdout.strip() if bench.returncode == 0 else f"failed: {bench.stderr.strip()[-2000:]}", ""]
    lines += ["### One calibrated paper-size lookahead step", "", *calibrated_step(), ""]
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if tests.returncode == 0 and bench.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
