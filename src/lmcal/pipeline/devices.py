"""One GPU per running stage when `make reproduce ARGS='jobs=N'` runs on a machine with several: each stage process
gets CUDA_VISIBLE_DEVICES set to the GPU of its slot (slot i of the N running at once -> GPU i mod the count); and
its share of the CPU cores as threads.

A stage that is a sweep of local processes (`python -m lmcal.train -m hydra/launcher=local_parallel
hydra.launcher.n_jobs=6 model.memory_tau=5,10,...`, the tau-models) gets the list of GPUs its jobs may use
(LMCAL_GPUS, its slot's GPU first) and how many processes share the host's cores (LMCAL_HOST_JOBS); each job then
takes its own GPU, job k the k-th of the list (round-robin where there are fewer), and cores // LMCAL_HOST_JOBS
threads, in `apply_job_devices`, which the training entry point calls as a job starts, before CUDA initialises."""

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


def device_env(slot: int, gpus: list[str], jobs: int = 1, sweep: int = 1) -> dict[str, str]:
    """The environment a stage in `slot` adds to its process: its own GPU where there are several; and, where up to
    `jobs` stages run at once on fewer GPUs, how many may share one (LMCAL_GPU_SHARERS: each stage's memory budget,
    lmcal.core.lookahead.memory_budget, is then that share of half the free memory, not half of it each). A stage
    whose `sweep` jobs run at once as its own processes (sweep_jobs) gets every GPU, its slot's first (LMCAL_GPUS,
    one a job: apply_job_devices), and counts its jobs among the sharers."""
    n = len(gpus)
    if sweep > 1 and n > 1:
        mine = ",".join(gpus[slot % n:] + gpus[:slot % n])
        env = {"CUDA_VISIBLE_DEVICES": mine, GPUS: mine}
    else:
        env = {"CUDA_VISIBLE_DEVICES": gpus[slot % n]} if n > 1 else {}
    sharers = -(-(jobs - 1 + max(1, sweep)) // max(1, n))
    return {**env, GPU_SHARERS: str(sharers)} if gpus and sharers > 1 else env


GPU_SHARERS = "LMCAL_GPU_SHARERS"
GPUS = "LMCAL_GPUS"  # the GPUs a sweep's local jobs take in turn (apply_job_devices)
HOST_JOBS = "LMCAL_HOST_JOBS"  # the processes the host's cores are shared among (a sweep job's threads)
SIDE_BY_SIDE = "hydra/launcher=local_parallel"  # a sweep's jobs as parallel local processes (joblib)


def free_slot(running: dict) -> int:
    """The lowest slot no running stage holds (a stage keeps its slot, so its GPU, until it ends)."""
    taken = {r.get("slot") for r in running.values()}
    return next(i for i in range(len(running) + 1) if i not in taken)


def cores_here() -> int:
    """The cores this process may run on (its affinity, e.g. a Slurm allocation's), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_env(jobs: int, env: dict | None = None, cores: int | None = None, sweep: int = 1) -> dict[str, str]:
    """OMP_NUM_THREADS for a stage process: its share of the cores, cores // jobs (at least 1), so that stages side by
    side do not each start a thread per core: torch's threads spin while they wait, so stages whose threads outnumber
    the cores run many times slower than each on its share. A stage of `sweep` jobs at once (sweep_jobs) also gets
    LMCAL_HOST_JOBS = jobs x sweep: each of its jobs takes cores // that (apply_job_devices), not the stage's share
    each (joblib leaves a set OMP_NUM_THREADS as it is). {} where the user set OMP_NUM_THREADS: theirs holds (set
    it to compare runs with other `jobs` bit for bit: reductions split by thread count may round differently)."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return {}
    cores = cores_here() if cores is None else cores
    out = {"OMP_NUM_THREADS": str(max(1, cores // max(1, jobs)))}
    return {**out, HOST_JOBS: str(max(1, jobs) * sweep)} if sweep > 1 else out


def sweep_points(overrides: list[str]) -> int:
    """The jobs a Hydra sweep's overrides make, as Hydra's parser reads them: the product of their sweeps' lengths
    (model.memory_tau=5,10 and data=ptb,markov: 4; range(1,5): 4); a sweep it cannot count alone (a glob of a config
    group's options) counts 1."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    n = 1
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            try:
                n *= max(1, len(list(o.sweep_iterator())))
            except Exception:  # noqa: BLE001 - a glob needs the config's options; the job count is then a floor
                pass
    return n


def sweep_jobs(cmd: list[str]) -> int:
    """How many jobs of stage command `cmd` run at once as its own local processes: a `-m` sweep under
    hydra/launcher=local_parallel runs hydra.launcher.n_jobs of them (the preset's default where not given), at most
    its points; 1 for any other command (the basic launcher runs a sweep's jobs one after another; Slurm's, each on
    its own allocation)."""
    if "-m" not in cmd[2:]:
        return 1
    return max(1, min(launcher_jobs(cmd), sweep_points(cmd[cmd.index("-m", 2) + 1:])))


def launcher_jobs(cmd: list[str]) -> int:
    """The jobs a command's launcher runs at once: hydra.launcher.n_jobs (its preset's default where not given) under
    hydra/launcher=local_parallel, else 1."""
    if SIDE_BY_SIDE not in cmd:
        return 1
    given = [o.split("=", 1)[1] for o in cmd if o.startswith("hydra.launcher.n_jobs=")]
    if given:
        return int(given[-1])
    from omegaconf import OmegaConf

    from lmcal.utils.settings import CONF_DIR

    return int(OmegaConf.load(CONF_DIR / "hydra" / "launcher" / "local_parallel.yaml").n_jobs)


def job_gpu(job_num: int, gpus: list[str]) -> str:
    """The GPU of a sweep's job `job_num` (Hydra's job number, from 0): the job_num-th of `gpus`, round-robin where
    there are fewer; '' with none."""
    return gpus[job_num % len(gpus)] if gpus else ""


def job_threads(host_jobs: int, cores: int | None = None) -> int:
    """Threads of one of `host_jobs` processes sharing this host's `cores` (this process's, when not given): its
    share, at least 1."""
    return max(1, (cores_here() if cores is None else cores) // max(1, host_jobs))


def _cuda_started() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def apply_job_devices(job_num: int, env: dict | None = None) -> dict[str, str]:
    """Gives this process (a sweep's job `job_num`) its GPU and threads from what the pipeline set (device_env,
    thread_env): CUDA_VISIBLE_DEVICES = job_gpu(job_num, LMCAL_GPUS), and cores // LMCAL_HOST_JOBS threads
    (OMP_NUM_THREADS and torch.set_num_threads). Call it as the job starts, before CUDA initialises; in a process
    where CUDA has (a joblib worker reused for a later job) the GPU stays the one of its first job, which keeps the
    jobs spread. Returns what it set; {} without those variables (a run of its own, a user's settings)."""
    env = os.environ if env is None else env
    gpus = [g.strip() for g in env.get(GPUS, "").split(",") if g.strip()]
    done = {}
    if gpus and not _cuda_started():
        done["CUDA_VISIBLE_DEVICES"] = job_gpu(job_num, gpus)
    if env.get(HOST_JOBS, "").isdigit():
        done["OMP_NUM_THREADS"] = str(job_threads(int(env[HOST_JOBS])))
    env.update(done)
    if "OMP_NUM_THREADS" in done:
        import torch

        torch.set_num_threads(int(done["OMP_NUM_THREADS"]))
    return done
