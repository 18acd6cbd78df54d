"""`make gpu-check`: what proves the CUDA path, in a few minutes, as one Markdown report.

    python bench/gpu_check.py [--out outputs/gpu-check/REPORT.md] [--compare-devices cpu,cuda]

Needs CUDA. Without it the report says so (which torch is installed, whether it is a CUDA build) and the script exits
1: nothing here can stand in for a GPU. With CUDA it records
- the CUDA build and the device;
- the tests marked `gpu` (pytest -m gpu: the weight-dropped LSTM's outputs and gradients on CUDA against the CPU, a
  resume after the NT-ASGD switch with the module on CUDA, the lookahead's two paths under the TF32 policy, a Hugging
  Face model's candidates sharing their rows' past on CUDA against the CPU's forks);
- paper-size training tokens/s, ours against a plain cuDNN nn.LSTM stack in one run (bench/train_throughput.py);
- one calibrated paper-size lookahead step (100 rows, top-64 + the true word + 16 draws, V = 10,000): time, with
  synchronisation, and peak memory (torch.cuda.max_memory_allocated);
- "CPU against CUDA" (bench/device_compare.py): a smoke training stopped after the NT-ASGD switch and resumed through
  `python -m lmcal.train`, and every analysis stage through `python -m lmcal.evaluate`, on the CPU and on CUDA, with
  the table of quantities (alpha*, entropy curves, CE, the memory bound...) and each one's stated tolerance. Its runs
  go to outputs/gpu-check/devices/ (next to the report).
`--compare-devices cpu,cpu` runs that last section alone on two CPU runs (no CUDA needed: the tests use it; on one
device every quantity agrees exactly).
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


def devices_section(devices: list[str], work: Path) -> tuple[list[str], bool]:
    """The "CPU against CUDA" section: both devices' runs side by side; True when every row is within tolerance."""
    from device_compare import compare_devices, markdown  # bench/: this script's own folder is on sys.path

    t0 = time.perf_counter()
    try:
        rows = compare_devices(*devices, work)
    except RuntimeError as e:  # a run that failed: its command and the end of its stderr
        return ["### CPU against CUDA", "", f"failed: {e}", ""], False
    names = devices if devices[0] != devices[1] else [devices[0], f"{devices[1]} (2nd run)"]
    bad = [r["quantity"] for r in rows if not r["ok"]]
    lines = ["### CPU against CUDA", "",
             f"{' and '.join(devices)}: a smoke training stopped after the NT-ASGD switch and resumed, and every "
             f"analysis stage on one checkpoint (tolerances: bench/device_compare.py). {len(rows) - len(bad)} of "
             f"{len(rows)} quantities agree; {time.perf_counter() - t0:.0f} s; runs in {work}.", "",
             *markdown(rows, *names), ""]
    return lines, not bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/gpu-check/REPORT.md")
    ap.add_argument("--compare-devices", default=None, metavar="A,B",
                    help="the two devices of the side-by-side section (default cpu,cuda); without CUDA, "
                         "cpu,cpu runs that section alone")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / "devices"
    if args.compare_devices and not torch.cuda.is_available():
        devices = args.compare_devices.split(",")
        if len(devices) != 2 or any(d.startswith("cuda") for d in devices):
            print(f"--compare-devices takes two devices, A,B, and without CUDA only cpu: got {args.compare_devices!r}",
                  file=sys.stderr)
            return 2
        lines, ok = devices_section(devices, work)
        lines = ["## GPU check", "", "CUDA missing: only the side-by-side section ran (--compare-devices).", "",
                 *lines]
        out.write_text("\n".join(lines))
        print("\n".join(lines))
        return 0 if ok else 1
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
    section, agree = devices_section((args.compare_devices or "cpu,cuda").split(","), work)
    lines += section
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if tests.returncode == 0 and bench.returncode == 0 and agree else 1


if __name__ == "__main__":
    sys.exit(main())
