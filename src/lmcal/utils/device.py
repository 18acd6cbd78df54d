"""One precision policy for every entry point: TF32 off, so cuDNN's LSTM and the decoder and lookahead matmuls all run
in full float32 (the lookahead's two paths then agree to float32 rounding, not TF32's 1e-3). Set explicitly once per
process by `apply_precision_policy` (PyTorch's own defaults differ between matmul and cuDNN), and recorded in
results.json by `precision_policy`. On a machine without CUDA the flags are set all the same and change nothing.
"""

from __future__ import annotations

import itertools

import torch

TF32 = False  # the policy: full float32 matmuls and convolutions/RNNs on CUDA


def apply_precision_policy() -> dict:
    """Sets the TF32 flags of matmuls and cuDNN to the policy; returns precision_policy()."""
    torch.backends.cuda.matmul.allow_tf32 = TF32
    torch.backends.cudnn.allow_tf32 = TF32
    torch.set_float32_matmul_precision("high" if TF32 else "highest")
    return precision_policy()


def precision_policy() -> dict:
    """The flags in force, as recorded in results.json."""
    return {"tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


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
