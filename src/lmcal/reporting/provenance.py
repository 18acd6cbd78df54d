"""What made an output: the command, the date, the machine, the code's commit and the packages' versions."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def machine() -> str:
    """The machine in words: CPU model and cores, accelerator, torch version."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {gpu}, torch {torch.__version__}"


def provenance(command: str | None = None) -> dict:
    """What made an output: the command, the date, the machine and the code's git commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        changed = subprocess.run(["git", "status", "--porcelain", "--", "src", "conf", "bench"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        if commit and changed:  # the code that ran is not that commit's: say so
            commit += " with uncommitted changes"
    except (OSError, subprocess.SubprocessError):
        commit = None
    if command is None:  # this process's own command line, the script relative to the project
        script = Path(sys.argv[0]).resolve()
        command = "python " + shlex.join([str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else
                                          sys.argv[0], *sys.argv[1:]])
    return {"command": command,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(), "commit": commit}


def versions() -> dict:
    """The versions of Python and of the packages the numbers depend on (those installed)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("lmcal", "torch", "numpy", "scipy", "pytorch-lightning", "transformers", "hydra-core", "omegaconf",
                "wandb"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def provenance_line(p: dict) -> str:
    return (f"*Command:* `{p['command']}` · *date:* {p['date']} · *machine:* {p['machine']}"
            + (f" · *commit:* {p['commit']}" if p.get("commit") else ""))


TF32_KEYS = ("tf32_matmul", "tf32_cudnn", "float32_matmul_precision")  # lmcal.utils.device.precision_policy's


def stage_precision(out: Path) -> dict:
    """The arithmetic the stages under `out` ran with, as each recorded it (a training's metrics.json "precision",
    an analysis's evaluation.json provenance): {"by_folder": {folder: its record}} and, where every stage had the
    same TF32 flags, those flags (the report's own process runs no stage: its flags say nothing)."""
    from lmcal.utils.io import read_record

    found = {}
    for name in ("metrics.json", "evaluation.json"):
        for p in sorted(Path(out).rglob(name)):
            r = read_record(p, warn=False) or {}
            v = r.get("precision") if name == "metrics.json" else (r.get("provenance") or {}).get("precision")
            if isinstance(v, dict):
                found[p.parent.relative_to(out).as_posix()] = v
    flags = {tuple(v.get(k) for k in TF32_KEYS) for v in found.values()}
    return {**(dict(zip(TF32_KEYS, flags.pop(), strict=True)) if len(flags) == 1 else {}), "by_folder": found}
