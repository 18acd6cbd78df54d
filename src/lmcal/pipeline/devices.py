"""One GPU per running stage when `make reproduce ARGS='jobs=N'` runs on a machine with several: each stage process
gets CUDA_VISIBLE_DEVICES set to the GPU of its slot (slot i of the N running at once -> GPU i mod the count)."""

from __future__ import annotations

import os


def cuda_count() -> int:
    import torch  # only when several stages run at once

    return torch.cuda.device_count()


def visible_gpus(env: dict | None = None, count: int | None = None) -> list[str]:
    """The GPUs the pipeline may hand out: CUDA_VISIBLE_DEVICES's list where it is set (a Slurm allocation, a user's
    choice), else 0 .. count-1 (`count`: torch's device count when not given)."""
    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    return [str(i) for i in range(cuda_count() if count is None else count)]


def device_env(slot: int, gpus: list[str]) -> dict[str, str]:
    """The environment a stage in `slot` adds to its process: its own GPU where there are several; nothing with one
    GPU or none (the stage sees what the pipeline sees)."""
    return {"CUDA_VISIBLE_DEVICES": gpus[slot % len(gpus)]} if len(gpus) > 1 else {}


def free_slot(running: dict) -> int:
    """The lowest slot no running stage holds (a stage keeps its slot, so its GPU, until it ends)."""
    taken = {r.get("slot") for r in running.values()}
    return next(i for i in range(len(running) + 1) if i not in taken)
