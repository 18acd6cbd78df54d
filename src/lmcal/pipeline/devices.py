"""One GPU per running stage when `make reproduce ARGS='jobs=N'` runs on a machine with several: each stage process
gets CUDA_VISIBLE_DEVICES set to the GPU of its slot (slot i of the N running at once -> GPU i mod the count); and
its share of the CPU cores as threads."""

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


def device_env(slot: int, gpus: list[str], jobs: int = 1) -> dict[str, str]:
    """The environment a stage in `slot` adds to its process: its own GPU where there are several; and, where up to
    `jobs` stages run at once on fewer GPUs, how many may share one (LMCAL_GPU_SHARERS: each stage's memory budget,
    lmcal.core.lookahead.memory_budget, is then that share of half the free memory, not half of it each)."""
    env = {"CUDA_VISIBLE_DEVICES": gpus[slot % len(gpus)]} if len(gpus) > 1 else {}
    sharers = -(-jobs // max(1, len(gpus)))
    return {**env, GPU_SHARERS: str(sharers)} if gpus and sharers > 1 else env


GPU_SHARERS = "LMCAL_GPU_SHARERS"


def free_slot(running: dict) -> int:
    """The lowest slot no running stage holds (a stage keeps its slot, so its GPU, until it ends)."""
    taken = {r.get("slot") for r in running.values()}
    return next(i for i in range(len(running) + 1) if i not in taken)


def thread_env(jobs: int, env: dict | None = None, cores: int | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS for a stage process: its share of the cores, cores // jobs (at least 1), so that stages side by
    side do not each start a thread per core: torch's threads spin while they wait, so stages whose threads outnumber
    the cores run many times slower than each on its share. {} where the user set OMP_NUM_THREADS: theirs holds (set
    it to compare runs with other `jobs` bit for bit: reductions split by thread count may round differently)."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return {}
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // max(1, jobs)))}
