"""One precision policy for every entry point: TF32 off by default (the `tf32` key of conf/train.yaml and
conf/evaluate.yaml), so cuDNN's LSTM and the decoder and lookahead matmuls all run in full float32 (the lookahead's two
paths then agree to float32 rounding, not TF32's 1e-3). Set explicitly once per process by `apply_precision_policy`
(PyTorch's own defaults differ between matmul and cuDNN), and recorded by `precision_policy` (metrics.json,
evaluation.json, results.json). On a machine without CUDA the flags are set all the same and change nothing.

Also here: the cuBLAS workspace that deterministic CUDA runs need (`deterministic_cublas`), the device an analysis runs
on (`resolve_device`), and the line saying which profile `PROFILE=auto` chose and why (`auto_profile`).
"""

from __future__ import annotations

import functools
import itertools
import os

import torch

TF32 = False  # the default policy: full float32 matmuls and convolutions/RNNs on CUDA
CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's reproducible workspace (8 buffers of 4 MiB): NVIDIA's cuBLAS docs


def apply_precision_policy(tf32: bool = TF32) -> dict:
    """Sets the TF32 flags of matmuls and cuDNN to `tf32` (the config's `tf32` key); returns precision_policy().
    Anything but a bool is refused (a string "false" would otherwise read as true)."""
    if not isinstance(tf32, bool):
        from lmcal.errors import LmcalError

        raise LmcalError(f"tf32={tf32!r}: choose tf32=false (full float32 matmuls and cuDNN, the default) or "
                         "tf32=true (TensorFloat-32 on Ampere and later GPUs: faster, about 1e-3 relative error).")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return precision_policy()


@functools.cache
def cpu_bf16_lstm() -> bool:
    """Whether this CPU runs an LSTM under bfloat16 autocast: oneDNN builds its bfloat16 LSTM only where the CPU has
    the instructions (AVX-512 and its BF16 extension); on an AVX2-only CPU it raises "could not create a primitive
    descriptor for the LSTM forward propagation primitive"."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.LSTM(2, 2)(torch.zeros(1, 1, 2))
        return True
    except RuntimeError:
        return False


def precision_policy() -> dict:
    """The flags in force, as recorded with the results."""
    return {"tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def deterministic_cublas(requested=True) -> str | None:
    """Gives cuBLAS the fixed workspace its deterministic mode needs (CUBLAS_WORKSPACE_CONFIG, unless already set)
    when deterministic algorithms are requested (`requested`: trainer.deterministic's true or warn); returns the value
    in force, or None when not requested. cuBLAS reads it when it starts, so this runs before any CUDA work: without
    it torch warns on every deterministic matmul, and a resumed run need not repeat an uninterrupted one. Harmless
    without CUDA."""
    if not requested or str(requested).lower() in ("false", "0", "none"):
        return None
    return os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def no_cuda_reason() -> str:
    """Why torch sees no CUDA device, in a few words: a CPU build, a hidden GPU, or a CUDA build without a GPU or a
    recent enough driver."""
    if not torch.version.cuda:
        return f"no CUDA device: torch {torch.__version__} is a CPU build"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return f"torch {torch.__version__} is a CUDA build, but CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU"
    return (f"torch {torch.__version__} is a CUDA build but sees no GPU: driver older than CUDA {torch.version.cuda}, "
            "or CUDA_VISIBLE_DEVICES empty?")


def auto_profile() -> tuple[str, str]:
    """(profile, line) for `make reproduce PROFILE=auto`: paper where torch sees a CUDA device, else cpu, and one
    line naming the GPU or saying why there is none, so that a CPU run on a GPU machine (a CPU wheel, an old driver)
    is seen at once rather than hours later."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        gpu = torch.cuda.get_device_name(0) + (f", {n} visible" if n > 1 else "")
        return "paper", f"profile=auto: paper (CUDA: {gpu})"
    return "cpu", f"profile=auto: cpu ({no_cuda_reason()})"


def cuda_missing() -> str:
    """Why torch sees no CUDA device here, and what would give it one: a CPU-only wheel, or no GPU or driver."""
    if not torch.version.cuda:
        return (f"torch {torch.__version__} is a CPU-only wheel; on a machine with an NVIDIA GPU install a CUDA wheel "
                "of torch")
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but no GPU or driver is visible: see "
            "nvidia-smi, and CUDA_VISIBLE_DEVICES where it is set")


def resolve_device(name: str | None) -> str:
    """The analysis entry point's one `device` key as a torch device string: null is cuda where CUDA is available,
    else cpu. A device this machine cannot run on is refused in one paragraph (LmcalError), before any model loads."""
    from lmcal.errors import LmcalError

    if name is None or str(name).strip() in ("", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(str(name))
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise LmcalError(f"device={name} is not a device lmcal runs on: use cpu, cuda, cuda:N (the N-th visible GPU), "
                         "mps, or null (cuda where available, else cpu).")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise LmcalError(f"device={name}, but this machine has no CUDA device torch can use ({cuda_missing()}). "
                             "Run with device=cpu (or device=null).")
        if dev.index is not None and dev.index >= count:
            raise LmcalError(f"device={name}, but only {count} CUDA device{'s are' if count > 1 else ' is'} visible "
                             f"(cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''}; CUDA_VISIBLE_DEVICES limits "
                             "them). Choose one of those.")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise LmcalError(f"device={name}, but this machine has no MPS (Apple GPU) device torch can use. Run with "
                         "device=cpu or device=null.")
    return str(dev)


HOST_COPY_STEPS = 32  # steps of per-step results held on the device between copies to the host


def host_blocks(steps, n: int = HOST_COPY_STEPS):
    """Lists of n consecutive items of `steps` (the last may be shorter): one copy to the host per list, not per step,
    so that the host waits on a GPU n times less often."""
    it = iter(steps)
    while block := list(itertools.islice(it, n)):
        yield block
