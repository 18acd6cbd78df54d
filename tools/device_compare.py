"""The smoke training, a resume after the NT-ASGD switch, and every analysis stage on two devices, side by side
(`make gpu-check`'s "CPU against CUDA"; `python tools/gpu_check.py --compare-devices cpu,cpu` runs it without CUDA).

    run_device(device, folder, analysis_ckpt)  # one device's runs, through the entry points in subprocesses
    compare(a_dir, b_dir) -> rows              # their results, quantity by quantity, each against its tolerance

What runs, on the order-2 Markov source (generated in memory: no corpus on disk is needed):
- training: `experiment=smoke` with `optim.nonmono=1`, stopped after 3 epochs (the NT-ASGD switch comes at epoch 2,
  so this is a run interrupted after its switch) and rerun in the same folder to 4 epochs, so it resumes from
  `last.ckpt` with the averages; the resumed run's last
  checkpoint (the averaged weights) is then scored on the test text on the same device;
- analysis: one small model of `experiment=markov`, trained once on the CPU (`train_analysis_model`: it learns the
  source, so alpha* is finite), through every stage (`STAGES`, `analysis=smoke`; memory on tau=2 windows) with
  `python -m lmcal.evaluate device=<device>`.

Tolerances (`TOLERANCE`), by what a quantity is made of; float32 on both devices with TF32 off (lmcal.utils.device):
- float32: cross-entropies of true text (teacher-forced): 1e-4 + 1e-4 |x| nats. Per-token log-probabilities of cuDNN's
  LSTM and the CPU's agree to about 1e-6 (tests/test_gpu.py asserts 1e-5); a mean over tokens does not amplify that.
- fit: parameters and bounds fitted on those rows (alpha*, beta*, the I_tau bound, CE after calibration):
  1e-3 + 1e-3 |x|. A 1-D fit moves by (change of objective) / curvature; 1e-3 leaves two orders of margin.
- sampled: everything measured on generations (entropy rates, tails, curves, decoders' and SMC's rows, heads trained
  on rollouts): 3 combined standard errors, 3 sqrt(se_a^2 + se_b^2) (at least 1e-4). The uniforms are counter-based
  (lmcal.core.sampling), the same on every device, so generations agree word for word unless a float32 difference
  moves a CDF boundary across a uniform; a generation that then diverges is an independent draw, i.e. sampling noise.
- training: the smoke model's CE after training, 0.05 nats. Different float32 rounding over ~4,000 SGD steps at lr 30
  moves the trajectory; the smoke model stays near log 16 = 2.77 nats on this source. On one device: exact.
- exact: the epoch of the NT-ASGD switch, and whether the rerun resumed after it.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # lmcal from src/ where it is not installed (a bare GPU machine)
    sys.path.insert(0, str(ROOT / "src"))
from lmcal.utils import records  # noqa: E402

STAGES = ["entropy_rate", "calibration", "decoders", "future_entropy", "sequence_calibration", "memory"]
SWITCH_EPOCHS, RESUMED_EPOCHS = 3, 4  # the first run stops after the NT-ASGD switch (epoch 2), the rerun resumes
TRAIN = ["experiment=smoke", "data=markov", "optim.nonmono=1", "logger=none", "trainer.enable_progress_bar=false",
         "analysis.stages=[]"]
ANALYSIS_MODEL = ["experiment=markov", "data.max_train_tokens=20000", "model.hidden_size=64", "trainer.max_epochs=3",
                  "trainer.accelerator=cpu", "logger=none", "trainer.enable_progress_bar=false", "analysis.stages=[]"]
EVALUATE = ["logger=none", "analysis=smoke", "analysis.memory.limited=window", "analysis.memory.tau=2"]
TOLERANCE = {"float32": lambda x, se: 1e-4 + 1e-4 * abs(x), "fit": lambda x, se: 1e-3 + 1e-3 * abs(x),
             "sampled": lambda x, se: max(1e-4, 3 * se), "training": lambda x, se: 0.05, "exact": lambda x, se: 0.0}


DEADLINE: list[float] = []  # time.monotonic() by which every run must have ended (compare_devices' timeout)


def _run(args: list[str], cwd: Path) -> None:
    print(f"[device_compare] {' '.join(args[1:])}", file=sys.stderr, flush=True)
    left = DEADLINE[0] - time.monotonic() if DEADLINE else None
    if left is not None and left <= 0:
        raise RuntimeError(f"out of time before {' '.join(args[1:])}")
    try:
        r = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(args)} ran out of time ({left:.0f} s left of the budget)") from None
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}")


def _accelerator(device: str) -> str:
    return "gpu" if device.startswith("cuda") else "cpu"


def train_analysis_model(folder: Path) -> Path:
    """The model every analysis stage reads, trained once on the CPU (both devices then analyse the same weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "lmcal.train", *ANALYSIS_MODEL, f"hydra.run.dir={folder}"], folder)
    return folder / "checkpoints" / "best.ckpt"


def run_device(device: str, folder: Path, analysis_ckpt: Path) -> Path:
    """On `device` (cpu, cuda): the smoke training stopped after the switch and resumed, its last checkpoint scored, and
    every analysis stage on `analysis_ckpt`. Results under folder/{train,train_eval,evaluate}."""
    folder.mkdir(parents=True, exist_ok=True)
    train = folder / "train"
    for epochs in (SWITCH_EPOCHS, RESUMED_EPOCHS):  # the rerun in the same folder resumes from last.ckpt
        _run([sys.executable, "-m", "lmcal.train", *TRAIN, f"trainer.accelerator={_accelerator(device)}",
              f"trainer.max_epochs={epochs}", f"hydra.run.dir={train}"], folder)
    # the same training without the stop: the resumed run must repeat it (trainer.deterministic on CUDA)
    _run([sys.executable, "-m", "lmcal.train", *TRAIN, f"trainer.accelerator={_accelerator(device)}",
          f"trainer.max_epochs={RESUMED_EPOCHS}", f"hydra.run.dir={folder / 'train_straight'}"], folder)
    _run([sys.executable, "-m", "lmcal.evaluate", f"ckpt={train / 'checkpoints' / 'last.ckpt'}", f"device={device}",
          "logger=none", "analysis=smoke", "stages=[entropy_rate]", f"hydra.run.dir={folder / 'train_eval'}"], folder)
    _run([sys.executable, "-m", "lmcal.evaluate", f"ckpt={analysis_ckpt}", f"device={device}", *EVALUATE,
          f"stages=[{','.join(STAGES)}]", f"hydra.run.dir={folder / 'evaluate'}"], folder)
    return folder


def _get(obj, path: str):
    for key in path.split("."):
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    return obj


def _row(quantity: str, kind: str, a, b, se_a: float = 0.0, se_b: float = 0.0) -> dict:
    if kind == "exact" or not isinstance(a, (int, float)) or isinstance(a, bool):
        return {"quantity": quantity, "a": a, "b": b, "difference": "same" if a == b else "differs",
                "tolerance": "exact", "ok": a == b}
    diff, tol = abs(a - b), TOLERANCE[kind](a, math.hypot(se_a, se_b))
    return {"quantity": quantity, "a": a, "b": b, "difference": diff, "tolerance": tol, "ok": bool(diff <= tol)}


def _curve_row(quantity: str, a: dict, b: dict, curve: str, stderr: str) -> dict:
    """A curve over steps: its largest difference against 3 combined standard errors at the worst step."""
    ca, cb, sa, sb = a[curve], b[curve], a[stderr], b[stderr]
    if len(ca) != len(cb):
        return _row(f"{quantity}: steps", "exact", len(ca), len(cb))
    diff = max(abs(x - y) for x, y in zip(ca, cb, strict=True))
    tol = max(1e-4, max(3 * math.hypot(x, y) for x, y in zip(sa, sb, strict=True)))
    return {"quantity": f"{quantity} (mean of {len(ca)} steps; max step difference)", "a": sum(ca) / len(ca),
            "b": sum(cb) / len(cb), "difference": diff, "tolerance": tol, "ok": bool(diff <= tol)}


def _method_rows(stage: str, a: dict, b: dict) -> list[dict]:
    """The rows of a method table (decoders, future_entropy, sequence_calibration) that the stage made itself (rows it
    took from another stage are compared there), matched by position; fitted parameters get rows of their own."""
    rows = []
    for ra, rb in zip(a["rows"], b["rows"], strict=False):
        if ra.get("source", stage) != stage:
            continue
        if ra["method"] != rb["method"]:
            rows.append(_row(f"{stage}: method", "exact", ra["method"], rb["method"]))
            continue
        params = ra.get("params", {})
        fitted = {k for k in params if f"{k}_stderr" in params} | {"alpha", "beta"}
        name = ra["method"] + "".join(f" {k}={v}" for k, v in params.items() if k not in fitted and "stderr" not in k)
        kind = "fit" if stage == "decoders" else "sampled"  # heads and SMC learn from generations; decoders from text
        rows.append(_row(f"{stage} {name}: tail entropy (nats)", "sampled", ra["tail_nats"], rb["tail_nats"],
                         ra["tail_stderr_nats"], rb["tail_stderr_nats"]))
        rows.append(_row(f"{stage} {name}: test CE (nats)", kind, ra["test_ce_nats"], rb["test_ce_nats"],
                         ra.get("test_ce_diff_stderr_nats", 0.0), rb.get("test_ce_diff_stderr_nats", 0.0)))
        for k in sorted(k for k in fitted if f"{k}_stderr" in params and ra["method"] != "calibration"):
            rows.append(_row(f"{stage} {name}: fitted {k}", kind, params[k], rb["params"][k],
                             params[f"{k}_stderr"], rb["params"][f"{k}_stderr"]))
    if len(a["rows"]) != len(b["rows"]):
        rows.append(_row(f"{stage}: rows", "exact", len(a["rows"]), len(b["rows"])))
    return rows


def resume_rows(folder: Path, device: str) -> list[dict]:
    """On one device: the training stopped after the switch and resumed, against the same training uninterrupted. The
    weights of both last checkpoints, and the validation and test CE: exact (0 difference) where the device repeats
    its own arithmetic (the CPU; CUDA under trainer.deterministic)."""
    import torch

    def weights(run: Path) -> dict:
        return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]

    resumed, straight = folder / "train", folder / "train_straight"
    wa, wb = weights(resumed), weights(straight)
    diff = max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa) if set(wa) == set(wb) else math.inf
    rows = [{"quantity": f"{device}: resumed training's last weights against the uninterrupted run's (largest)",
             "a": "resumed", "b": "uninterrupted", "difference": diff, "tolerance": 0.0, "ok": diff == 0.0}]
    ma, mb = (_read(r / "metrics.json", METRICS) for r in (resumed, straight))
    for key in ("val_ce_nats", "test_ce_nats"):
        rows.append({"quantity": f"{device}: resumed training's {key} against the uninterrupted run's",
                     "a": ma[key], "b": mb[key], "difference": abs(ma[key] - mb[key]), "tolerance": 0.0,
                     "ok": ma[key] == mb[key]})
    return rows


# what the comparisons read of a training's metrics.json
METRICS = {"val_ce_nats": float, "test_ce_nats": float, "resumed_from": records.Maybe(str),
           "asgd_epoch": records.Maybe(int),
           "epochs": int}


def _read(path: Path, spec) -> dict:
    """A record one of the compared runs wrote, read only when whole (lmcal.utils.records): one paragraph naming the
    file and the key otherwise."""
    return records.read(path, spec, "a result of this comparison's runs", "Run that device's runs again "
                        "(tools/device_compare.py); nothing was compared.")


def compare(a_dir: Path, b_dir: Path) -> list[dict]:
    """Every compared quantity of two run_device folders: {quantity, a, b, difference, tolerance, ok}. Only the
    quantities named here are read, so wall times, profiles and paths never enter."""
    def load(d: Path, name: str) -> dict:
        return _read(Path(d) / name, METRICS if name.endswith("metrics.json") else dict)

    rows = []
    ta, tb = load(a_dir, "train/metrics.json"), load(b_dir, "train/metrics.json")
    for t in (ta, tb):
        t["resumed_after_switch"] = bool(t["resumed_from"] and str(t["resumed_from"]).endswith("last.ckpt")
                                         and t["asgd_epoch"] is not None and t["asgd_epoch"] < SWITCH_EPOCHS
                                         and t["epochs"] == RESUMED_EPOCHS)
    rows.append(_row("training: resumed after the NT-ASGD switch", "exact", ta["resumed_after_switch"],
                     tb["resumed_after_switch"]))
    rows.append(_row("training: epoch of the NT-ASGD switch", "exact", ta["asgd_epoch"], tb["asgd_epoch"]))
    for key in ("val_ce_nats", "test_ce_nats"):
        rows.append(_row(f"training: best checkpoint's {key}", "training", ta[key], tb[key]))
    ea, eb = load(a_dir, "train_eval/entropy_rate.json"), load(b_dir, "train_eval/entropy_rate.json")
    rows.append(_row("training: resumed last checkpoint's test CE (averaged weights)", "training",
                     ea["test_ce_nats"], eb["test_ce_nats"]))

    a, b = load(a_dir, "evaluate/entropy_rate.json"), load(b_dir, "evaluate/entropy_rate.json")
    rows.append(_row("entropy_rate: test CE (nats)", "float32", a["test_ce_nats"], b["test_ce_nats"]))
    rows.append(_row("entropy_rate: tail entropy (nats)", "sampled", a["tail_nats"], b["tail_nats"],
                     a["tail_stderr_nats"], b["tail_stderr_nats"]))
    rows.append(_curve_row("entropy_rate: entropy curve (nats)", a, b, "curve_nats", "stderr_nats"))

    a, b = load(a_dir, "evaluate/calibration.json"), load(b_dir, "evaluate/calibration.json")
    rows.append(_row("calibration: alpha*", "fit", a["alpha"], b["alpha"]))
    rows.append(_row("calibration: test CE before (nats)", "float32", a["test_ce_before_nats"],
                     b["test_ce_before_nats"]))
    rows.append(_row("calibration: test CE after (nats)", "fit", a["test_ce_after_nats"], b["test_ce_after_nats"]))
    rows.append(_row("calibration: tail entropy after (nats)", "sampled", a["tail_nats"], b["tail_nats"],
                     a["tail_stderr_nats"], b["tail_stderr_nats"]))
    rows.append(_curve_row("calibration: entropy curve after (nats)", a, b, "curve_nats", "stderr_nats"))

    for stage in ("decoders", "future_entropy", "sequence_calibration"):
        rows += _method_rows(stage, load(a_dir, f"evaluate/{stage}.json"), load(b_dir, f"evaluate/{stage}.json"))
    a, b = load(a_dir, "evaluate/sequence_calibration.json"), load(b_dir, "evaluate/sequence_calibration.json")
    rows.append(_row("sequence_calibration: alpha* (SMC)", "sampled", a["alpha"], b["alpha"], a["alpha_stderr"],
                     b["alpha_stderr"]))

    a, b = load(a_dir, "evaluate/memory.json"), load(b_dir, "evaluate/memory.json")
    for key, kind in (("ce_full_nats", "float32"), ("ce_limited_nats", "float32"), ("alpha", "fit"),
                      ("mi_upper_bound_nats", "fit"), ("two_parameter.beta", "fit")):
        rows.append(_row(f"memory tau=2: {key}", kind, _get(a, key), _get(b, key)))
    return rows


def _fmt(x) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def markdown(rows: list[dict], a_name: str, b_name: str) -> list[str]:
    """The table of gpu_check's report: quantity, the two devices, difference, tolerance, ok."""
    lines = [f"| quantity | {a_name} | {b_name} | difference | tolerance | ok |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['quantity']} | {_fmt(r['a'])} | {_fmt(r['b'])} | {_fmt(r['difference'])} | "
              f"{_fmt(r['tolerance'])} | {'yes' if r['ok'] else '**no**'} |" for r in rows]
    return lines


def compare_devices(a: str, b: str, work: Path, timeout: float | None = None) -> list[dict]:
    """Both devices' runs in work/ (the analysis model trained once, on the CPU), then their comparison, and each
    device's resumed training against its uninterrupted one. The three folders it writes are emptied first: a training
    folder left from an earlier check would be resumed, not rerun. timeout: seconds for all of it (RuntimeError past
    it, naming the run it stopped)."""
    DEADLINE[:] = [time.monotonic() + timeout] if timeout else []
    work = Path(work).resolve()  # the runs' subprocesses each run in their own folder
    for name in ("analysis_model", "a", "b"):
        shutil.rmtree(work / name, ignore_errors=True)
    ckpt = train_analysis_model(work / "analysis_model")
    run_device(a, work / "a", ckpt)
    run_device(b, work / "b", ckpt)
    return (compare(work / "a", work / "b") + resume_rows(work / "a", a)
            + resume_rows(work / "b", b if b != a else f"{b} (2nd run)"))
