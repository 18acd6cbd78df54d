"""`make gpu-check`: what proves the CUDA path, in a few minutes, as one Markdown report, on a GPU machine as it comes.

    python tools/gpu_check.py [--out outputs/gpu-check/REPORT.md] [--budget-min 18]
                              [--parts tests,mini,train,lookahead,compare] [--compare-devices cpu,cuda] [--dry-run]
    make gpu-check GPU_ARGS='--parts tests,mini --budget-min 9'   # the gpu tests and the paper profile's miniature
    make gpu-check PY=python3      # a machine's own Python and its CUDA torch: no venv, nothing from a registry

It runs with the Python that starts it (`PY=` in make) and its torch: it installs nothing from a registry. It prints
one line first (which torch, CUDA build and GPU it found, and which Python). lmcal itself is read from src/ (no
install needed). What that Python lacks of lmcal's pure-Python dependencies (Hydra, OmegaConf and its ANTLR runtime)
can travel as wheels fetched beforehand on a machine with a registry (`make gpu-wheels`: Python 3.12, into .whl/); the
check installs them from there alone (`pip install --no-index`) into outputs/gpu-check/site. Without CUDA it writes a
note saying so beside the report (REPORT.no-cuda.md: an earlier GPU run's REPORT.md is kept) and exits 1.

The parts, each a subprocess with its own timeout, within a total budget (--budget-min, default 18 minutes); the report
(REPORT.md, and results.json beside it) is rewritten after each part, so a part that fails or runs out of time leaves
the others' results and says what happened to it:
- tests: tests/test_gpu.py (the weight-dropped LSTM in training mode on cuDNN against the CPU with the same masks, a
  training step that never waits for the device between reads, a resume after the NT-ASGD switch, the lookahead's
  paths, a bf16 head, a Hugging Face model's shared past);
- mini: `make reproduce PROFILE=paper_mini` end to end (tools/paper_mini.py): every stage's measured seconds beside
  the plan check's estimate, the GPU's utilisation once a second, the FLOP rates measured (gpu_rates.json beside the
  report: copy it to docs/bench/ and the plan check uses it in place of its assumed rate);
- train: the paper-size AWD-LSTM (400/1150/3, V = 10,000, batch 20, BPTT 70) through the real Lightning path
  (bench/train_throughput.py's lightning_throughput): 200 steps reading the device every 20, then every step, then
  with deterministic algorithms; the tau-models' step (tau = 5, 30); a plain cuDNN nn.LSTM stack's bare loop; ms a
  step, and the epoch and `paper` profile times they extrapolate to;
- lookahead: one calibrated paper-size AWD-LSTM lookahead step (100 rows, 81 candidates), and one at GPT-2-small's shape
  (shared past against forks, float32 and bf16): ms, peak memory, largest entropy difference;
- compare: CPU against CUDA (tools/device_compare.py), with each device's resumed training against an uninterrupted one.
`--compare-devices cpu,cpu` runs that last part alone without CUDA (the tests use it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

try:
    import torch
except ImportError:  # a Python without torch at all: say so in one line, as for a CPU-only torch
    sys.exit(f"gpu-check: this Python ({sys.executable}, {sys.version.split()[0]}) has no torch; run it with a Python "
             "whose torch is a CUDA build (make gpu-check PY=...), or make install first.")

from paper_mini import MARK  # noqa: E402  (tools/, this script's folder; a part's report lines follow MARK)

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "mini", "train", "lookahead", "compare")
PART_MAX_S = {"tests": 240, "mini": 540, "train": 240, "lookahead": 150, "compare": 420}
NEEDS = ("hydra", "omegaconf", "pytorch_lightning", "scipy", "matplotlib", "pytest")  # what the parts import
# PTB's training split (tokens with the end-of-sentence marks) and validation windows of the paper profile
PTB_TRAIN_TOKENS, PTB_VALID_TOKENS = 929_589, 73_760
PAPER_EPOCHS, PAPER_TAUS, TAU_EPOCHS = 300, (5, 10, 15, 20, 25, 30), 120


def banner() -> str:
    """The one line that says what this machine gave the check."""
    py = f"Python {sys.version.split()[0]} ({sys.executable})"
    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda} but no GPU is visible" if torch.version.cuda \
            else "a CPU-only wheel"
        return f"gpu-check: torch {torch.__version__} ({build}); {py}"
    p = torch.cuda.get_device_properties(0)
    return (f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})"
            f", {p.name} ({p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible); {py}")


def no_cuda_report() -> str:
    build = torch.version.cuda or "none: a CPU-only wheel"
    return ("## GPU check\n\n**Not run: this check needs CUDA.** "
            f"torch {torch.__version__}, CUDA build {build}, torch.cuda.is_available() = {torch.cuda.is_available()}. "
            "Run `make gpu-check PY=python3` on a machine with an NVIDIA GPU whose Python has a CUDA build of torch "
            "(or `make install TORCH=\"torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126\"`, then "
            "`make gpu-check`).\n")


def write_note(out: Path, kind: str, text: str) -> Path:
    """A check that did not run says so beside the report (REPORT.<kind>.md), never over it: an earlier GPU run's
    REPORT.md and results.json stay as they were."""
    note = out.with_name(f"{out.stem}.{kind}{out.suffix or '.md'}")
    note.parent.mkdir(parents=True, exist_ok=True)
    tmp = note.with_name(f".{note.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(note)
    return note


def with_dependencies(site: Path) -> list[str]:
    """The parts' imports that this Python lacks, after installing what .whl/ holds of them (local wheels only, no
    registry) into `site`, which then goes on sys.path and the children's PYTHONPATH; lmcal itself is read from src/."""
    site, paths = site.resolve(), [str(ROOT / "src")]  # absolute: the parts' own children run in other folders
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if missing and wheels:
        print(f"gpu-check: {', '.join(missing)} missing; installing the {len(wheels)} wheels of .whl/ into {site} "
              "(--no-index: no registry)", flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--upgrade", "--target", str(site), *map(str, wheels)], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"gpu-check: pip could not install .whl/: {r.stderr.strip()[-1500:]}", file=sys.stderr)
        paths.insert(0, str(site))
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()
    return [m for m in NEEDS if importlib.util.find_spec(m) is None]


def run_part(cmd: list[str], timeout: float) -> dict:
    """A part as a subprocess: {rc, seconds, stdout, stderr, timed_out}; never raises."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, timeout))
        out = {"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "timed_out": False}
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        out = {"rc": None, "stdout": text(e.stdout), "stderr": text(e.stderr), "timed_out": True}
    out["seconds"] = time.perf_counter() - t0
    return out


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(it printed nothing)"


def status(r: dict, what: str) -> str:
    if r["timed_out"]:
        return f"**timed out** after {r['seconds']:.0f} s ({what})"
    return f"exit {r['rc']} in {r['seconds']:.0f} s" + ("" if r["rc"] == 0 else f": {last_line(r['stderr'])[:300]}")


# -- the parts that run in a child of this script (--part NAME): each prints Markdown, then one JSON line ------------


def part_train(device: str = "cuda", dry: bool = False, out: list | None = None) -> dict:
    """Paper-size training steps through the Lightning path, and what they extrapolate to (dry: the small model and
    a few steps, to try the script itself on a CPU). Its lines for the report go to `out`."""
    out = [] if out is None else out
    sys.path.insert(0, str(ROOT / "bench"))
    from train_throughput import PlainLSTM, build, lightning_throughput, throughput

    from lmcal.utils.device import apply_precision_policy

    # what every training run gets from conf/trainer (deterministic: warn), set before cuBLAS starts, as there
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    apply_precision_policy()
    net = build("awd_lstm_small" if dry else "awd_lstm", 10_000)
    batch, bptt = 20, 70
    n = 4 if dry else 100
    main = "Lightning, reads every 20 (the preset: deterministic)"
    rows = {
        main: lightning_throughput(net, 2 * n, batch, bptt, device, 20, deterministic=True,
                                   val_batches=max(1, n // 5)),
        "Lightning, reads every 20, not deterministic": lightning_throughput(net, n, batch, bptt, device, 20),
        "Lightning, reads every step (deterministic)": lightning_throughput(net, n, batch, bptt, device, 1,
                                                                            deterministic=True),
    }
    for tau in (5, 30):
        window = max(tau, round(bptt / tau) * tau)
        rows[f"Lightning, tau = {tau} (window {window})"] = lightning_throughput(net, n, batch, window, device, 20,
                                                                               deterministic=True, memory_tau=tau)
    plain = throughput(PlainLSTM(net), n, batch, bptt, device)
    rows["plain cuDNN nn.LSTM, bare loop"] = {"tokens_per_s": plain, "ms_per_step": 1000 * batch * bptt / plain}
    torch.use_deterministic_algorithms(True, warn_only=True)
    for tau in (None, 5, 30):  # the device's own busy time a step (kernels), against the step's wall time above
        window = bptt if tau is None else max(tau, round(bptt / tau) * tau)
        key = main if tau is None else f"Lightning, tau = {tau} (window {window})"
        rows[key]["gpu_busy_ms_per_step"] = busy_ms(net, batch, window, device, tau, 5 if dry else 20)
    base = rows[main]
    val_s = PTB_VALID_TOKENS / (10 * bptt) * base["val_ms_per_batch"] / 1000
    epoch_s = PTB_TRAIN_TOKENS / base["tokens_per_s"] + val_s
    tau_epochs = {tau: PTB_TRAIN_TOKENS / rows[f"Lightning, tau = {tau} (window {max(tau, round(bptt / tau) * tau)})"]
                  ["tokens_per_s"] for tau in (5, 30)}
    tau_epoch = lambda tau: tau_epochs[5] + (tau_epochs[30] - tau_epochs[5]) * (tau - 5) / 25  # noqa: E731
    tau_total = sum(TAU_EPOCHS * (tau_epoch(t) + val_s) for t in PAPER_TAUS)
    out.append("| step | ms a step | tokens/s | GPU busy ms a step (kernels) |\n|---|---|---|---|")
    for k, r in rows.items():
        busy = r.get("gpu_busy_ms_per_step")
        out.append(f"| {k} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{'-' if busy is None else f'{busy:.2f}'} |")
    train_s = PTB_TRAIN_TOKENS / base["tokens_per_s"]
    out.append(f"\nValidation: {base['val_ms_per_batch']:.2f} ms a window of 10 x {bptt}. An epoch of PTB at batch "
          f"{batch} "
          f"(929,589 tokens, then 73,760 validation tokens): **{epoch_s:.0f} s** ({train_s:.0f} "
          f"s training, {val_s:.0f} s validation); the public anchor, the original AWD-LSTM code on a GP100 at batch "
          f"20, took 65 s. The `paper` profile's trainings at these rates: the base model, {PAPER_EPOCHS} epochs, "
          f"**{PAPER_EPOCHS * epoch_s / 3600:.2f} h**; the six tau-models, {TAU_EPOCHS} epochs each, "
          f"**{tau_total / 3600:.2f} h** one after another (tau between 5 and 30 interpolated); side by side they "
          "overlap only where the GPU runs their kernels concurrently (MPS).")
    return {"rows": rows, "epoch_s": epoch_s, "val_s": val_s, "base_h": PAPER_EPOCHS * epoch_s / 3600,
            "tau_models_h_serial": tau_total / 3600, "tau_epoch_s": tau_epochs}


def busy_ms(net, batch: int, window: int, device: str, tau: int | None, steps: int) -> float | None:
    """Milliseconds a training step keeps the GPU busy: the summed time of its kernels (torch.profiler, CUDA activity)
    over `steps` steps of the bare loop (forward, AR/TAR, backward, clipping, SGD), per step. Beside a step's wall time
    it says how far the step is bound by the host (launches, Python) rather than the device, which is what decides
    how trainings side by side on one GPU overlap when it time-slices between them. None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from lmcal.models.awd_lstm import ar_tar, forward_chunked, repackage

    net.to(device).train()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    x = torch.randint(0, 10_000, (window, batch), device=device)
    hidden = net.init_hidden(batch)

    def step():
        nonlocal hidden
        if tau:
            out, raw = forward_chunked(net, x, tau)
        else:
            out, raw, hidden = net(x, repackage(hidden))
        loss = F.cross_entropy(net.logits(out).flatten(0, 1), x.flatten()) + ar_tar(out, raw, 2.0, 1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.25)
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in prof.key_averages())
    return us / 1000 / steps


def part_lookahead(device: str = "cuda", dry: bool = False, out: list | None = None) -> dict:
    """One calibrated paper-size AWD-LSTM lookahead step, and one at GPT-2-small's shape (dry: small models, to try
    the script itself on a CPU). Its lines for the report go to `out`."""
    report = [] if out is None else out
    import transformers

    from lmcal.core.lookahead import candidate_entropies
    from lmcal.models.awd_lstm import AWDLSTM
    from lmcal.models.hf import HFCausalLM
    from lmcal.models.step_lm import LSTMStepLM
    from lmcal.utils.device import apply_precision_policy

    apply_precision_policy()
    torch.set_grad_enabled(False)

    cuda = device.startswith("cuda")

    def timed(fn, reps=5):
        fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        times = []
        for _ in range(reps if not dry else 1):
            t0 = time.perf_counter()
            out = fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return out, 1000 * min(times), (torch.cuda.max_memory_allocated() - before) if cuda else 0

    torch.manual_seed(0)
    rows_n, k = (4 if dry else 100), 64 + 1 + 16
    sizes = dict(emb_size=40, hidden_size=64) if dry else dict(emb_size=400, hidden_size=1150)
    lm = LSTMStepLM(AWDLSTM(vocab_size=10_000, num_layers=3, **sizes).to(device).eval())
    state = lm.init_state(rows_n)
    for _ in range(5):
        _, state = lm.step(torch.randint(0, 10_000, (rows_n,), device=device), state)
    cand = torch.randint(0, 10_000, (rows_n, k), device=device)
    _, ms, peak = timed(lambda: candidate_entropies(lm, state, cand, 0.0))
    out = {"awd_lstm": {"rows": rows_n, "candidates": k, "ms": ms, "peak_bytes": peak}}
    report.append("| model | rows x candidates | version | ms a step | peak allocated | "
                  "largest abs(dH) vs float32 forks |")
    report.append("|---|---|---|---|---|---|")
    report.append(f"| AWD-LSTM 400/1150/3, V = 10,000 | {rows_n} x {k} | fused (h W_hh^T once a row) | {ms:.2f} | "
          f"{peak / 1e6:.1f} MB | - |")
    cfg = transformers.GPT2Config(vocab_size=50_257, n_embd=768 if not dry else 64, n_head=12 if not dry else 4,
                                  n_layer=12 if not dry else 2, n_positions=1024, initializer_range=0.02)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).eval()
    rows_n, prefix = (16, 128) if not dry else (2, 16)
    x = torch.randint(0, 50_257, (rows_n, prefix))
    cand = torch.randint(0, 50_257, (rows_n, k), device=device)
    ref, out["gpt2"] = None, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = transformers.GPT2LMHeadModel(cfg).eval()
        model.load_state_dict(base.state_dict())
        hf = HFCausalLM(model.to(dtype), device=device)
        _, st = hf.prefill(x, hf.init_state(rows_n))
        for version in ("forks", "shared"):
            if version == "forks":
                hf.shares_past = lambda state: False
            else:
                del hf.shares_past  # the class's own rule again
            h, ms, peak = timed(lambda: candidate_entropies(hf, st, cand, 0.0))  # noqa: B023
            h = h.float().cpu()
            ref = h if ref is None else ref
            diff = (h - ref).abs().max().item()
            name = f"{version}, {str(dtype).split('.')[-1]}"
            out["gpt2"][name] = {"ms": ms, "peak_bytes": peak, "max_abs_dh": diff}
            report.append(f"| GPT-2-small shape, V = 50,257, after {prefix} tokens | {rows_n} x {k} | {name} | "
                          f"{ms:.2f} | "
                  f"{peak / 1e6:.1f} MB | {diff:.2e} |")
        hf = model = None  # the float32 model's memory back before the bf16 one
        if cuda:
            torch.cuda.empty_cache()
    return out


# -- the parent -------------------------------------------------------------------------------------------------------


class Report:
    """REPORT.md and results.json, rewritten after every part."""

    def __init__(self, out: Path, head: list[str]):
        self.out, self.lines, self.results = out, list(head), {}

    def add(self, name: str, lines: list[str], result: dict | None = None) -> None:
        self.lines += lines
        if result is not None:
            self.results[name] = result
        self.write()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".md.tmp")
        tmp.write_text("\n".join(self.lines) + "\n")
        tmp.replace(self.out)
        (self.out.parent / "results.json").write_text(json.dumps(self.results, indent=1, default=str))


def child_part(name: str, timeout: float, dry: bool = False) -> tuple[list[str], dict | None, bool]:
    r = run_part([sys.executable, __file__, "--part", name, *(["--dry-run"] if dry else [])], timeout)
    lines = r["stdout"].strip().splitlines()
    if MARK in lines:  # what the part printed for the report (Lightning's progress bars come before it)
        lines = lines[lines.index(MARK) + 1:]
    result = None
    if r["rc"] == 0 and lines and lines[-1].startswith("{"):
        result = json.loads(lines.pop())
    body = lines if r["rc"] == 0 else [*lines, "", "```", r["stderr"].strip()[-3000:], "```"]
    return [f"_{status(r, f'the part had {timeout:.0f} s')}_", "", *body, ""], result, r["rc"] == 0


def devices_section(devices: list[str], work: Path, timeout: float | None = None) -> tuple[list[str], bool, dict]:
    """The "CPU against CUDA" section: both devices' runs side by side, and each one's resumed training against an
    uninterrupted one; True when every row is within tolerance."""
    sys.path.insert(0, str(ROOT / "tools"))
    from device_compare import compare_devices, markdown

    t0 = time.perf_counter()
    try:
        rows = compare_devices(*devices, work, timeout=timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:  # a run that failed or ran out of time: what it said
        return ["### CPU against CUDA", "", f"failed: {e}", ""], False, {"error": str(e)[-2000:]}
    names = devices if devices[0] != devices[1] else [devices[0], f"{devices[1]} (2nd run)"]
    bad = [r["quantity"] for r in rows if not r["ok"]]
    lines = ["### CPU against CUDA", "",
             f"{' and '.join(devices)}: a smoke training stopped after the NT-ASGD switch and resumed, beside an "
             "uninterrupted one on the same device, and every analysis stage on one checkpoint (tolerances: "
             f"tools/device_compare.py). {len(rows) - len(bad)} of {len(rows)} quantities agree; "
             f"{time.perf_counter() - t0:.0f} s; runs in {work}.", "",
             *markdown(rows, *names), ""]
    return lines, not bad, {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/gpu-check/REPORT.md")
    ap.add_argument("--budget-min", type=float, default=18.0, help="the whole check's time budget in minutes")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"which parts, comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--compare-devices", default=None, metavar="A,B",
                    help="the two devices of the side-by-side part (default cpu,cuda); without CUDA, cpu,cpu runs "
                         "that part alone")
    ap.add_argument("--dry-run", action="store_true",
                    help="without CUDA: the train and lookahead parts on the CPU at small sizes (tries this script)")
    ap.add_argument("--part", choices=("train", "lookahead"), help=argparse.SUPPRESS)  # one part, in a child
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if args.part:
        sys.path.insert(0, str(ROOT / "src"))
        run = {"train": part_train, "lookahead": part_lookahead}[args.part]
        with contextlib.redirect_stdout(io.StringIO()) as noise:  # progress bars: kept out of the report
            result = run(device, args.dry_run, report := [])
        print(noise.getvalue(), MARK, *report, sep="\n")
        print(json.dumps(result, default=str))
        return 0
    deadline = time.perf_counter() + 60 * args.budget_min
    out = Path(args.out)
    line = banner()
    print(line, flush=True)
    if not torch.cuda.is_available() and not (args.compare_devices or args.dry_run):
        note = write_note(out, "no-cuda", no_cuda_report())
        print(f"{no_cuda_report()}(written to {note}; {out}, an earlier GPU run's report, is left as it was)",
              file=sys.stderr)
        return 1
    missing = with_dependencies(out.parent / "site")
    if missing:
        text = (f"## GPU check\n\n{line}\n\n**Not run: this Python lacks {', '.join(missing)}.** Fetch their wheels "
                "on a machine with a package registry (`make gpu-wheels`: Python 3.12, into .whl/), bring .whl/ with "
                "the checkout, and rerun; the check installs them from there alone.\n")
        note = write_note(out, "no-dependencies", text)
        print(f"{text}(written to {note})", file=sys.stderr)
        return 2
    if args.compare_devices and not torch.cuda.is_available():
        devices = args.compare_devices.split(",")
        if len(devices) != 2 or any(d.startswith("cuda") for d in devices):
            print(f"--compare-devices takes two devices, A,B, and without CUDA only cpu: got {args.compare_devices!r}",
                  file=sys.stderr)
            return 2
        lines, ok, _ = devices_section(devices, (out.parent / "devices").resolve())
        Report(out, ["## GPU check", "", line, "", "CUDA missing: only the side-by-side section ran "
                     "(--compare-devices).", "", *lines]).write()
        print("\n".join(lines))
        return 0 if ok else 1
    parts = [p for p in args.parts.split(",") if p]
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts takes some of {','.join(PARTS)}, got {args.parts!r}")
    from lmcal.utils.device import apply_precision_policy

    policy = apply_precision_policy()
    report = Report(out, ["## GPU check", "", line, "", f"Precision policy: {policy}. Budget {args.budget_min:g} min; "
                          f"parts: {', '.join(parts)}.", ""])
    ok = True
    for name in parts:
        left = deadline - time.perf_counter()
        timeout = min(PART_MAX_S[name], left - 5)
        title = {"tests": "### Tests (tests/test_gpu.py)", "train": "### Paper-size training steps, Lightning path",
                 "lookahead": "### One lookahead step", "compare": "### CPU against CUDA"}[name]
        if timeout < 30:
            report.add(name, [title, "", f"**Not run: {left:.0f} s of the budget left.**", ""])
            ok = False
            continue
        print(f"gpu-check: {name} (up to {timeout:.0f} s)", flush=True)
        if name == "tests":
            r = run_part([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                          "tests/test_gpu.py"], timeout)
            tail = r["stdout"].strip().splitlines()[-25:] if r["rc"] else []
            report.add(name, [title, "", f"_{status(r, f'the part had {timeout:.0f} s')}_: "
                              f"`{last_line(r['stdout'])}`", "", *(["```", *tail, "```", ""] if tail else [])],
                       {"rc": r["rc"], "summary": last_line(r["stdout"]), "seconds": r["seconds"]})
            ok &= r["rc"] == 0
        elif name == "mini":
            mini = [sys.executable, str(ROOT / "tools" / "paper_mini.py"), "--out", str(out.parent / "paper_mini"),
                    "--timeout", f"{max(30.0, timeout - 30):.0f}", *(["--tiny"] if args.dry_run else [])]
            r = run_part(mini, timeout)
            lines = r["stdout"].strip().splitlines()
            lines = lines[lines.index(MARK) + 1:] if MARK in lines else lines
            result = json.loads(lines.pop()) if lines and lines[-1].startswith("{") else None
            report.add(name, ["### The paper profile's miniature (make reproduce PROFILE=paper_mini)", "",
                              f"_{status(r, f'the part had {timeout:.0f} s')}_", "", *lines, ""], result)
            ok &= r["rc"] == 0
        elif name == "compare":
            lines, agree, result = devices_section((args.compare_devices or "cpu,cuda").split(","),
                                                   (out.parent / "devices").resolve(), timeout)
            report.add(name, lines, result)
            ok &= agree
        else:
            lines, result, good = child_part(name, timeout, args.dry_run)
            report.add(name, [title, "", *lines], result)
            ok &= good
    print("\n".join(report.lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
