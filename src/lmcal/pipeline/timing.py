"""The plan check's wall-time model: each stage's time on one GPU, and the schedule of the stages on it.

Trainings of the AWD-LSTM are latency-bound: a step's time is a fixed part (the host's launches: Lightning, the
regularisers, the optimiser) plus one part per sequential time step of its window, measured on an H200 at batch 20
(tools/gpu_check.py's train part, the paper model 400/1150/3 through the real Lightning path):

    ms a step = STEP_FIXED_MS + STEP_PER_TIME_STEP_MS x sequential steps,

fitted to the three measured windows (70 steps: 19.06 ms; a tau-model's forward_chunked, which runs tau steps over
many streams at once, tau = 30: 14.63 ms, tau = 5: 11.21 ms; the fit gives 19.07, 14.24 and 11.21). A PTB epoch is its
windows (tokens / (batch x mean window), variable BPTT's mean 0.95 x bptt + 0.05 x bptt / 2) at that rate, plus its
validation at VALID_MS per window of 10 x 70. The public anchor: the original AWD-LSTM code took 65 s an epoch on a
GP100 at batch 20; the measured step gives 13 s on the H200. Other models (the transformer) and the analysis stages
have no measured rate: their FLOPs at an assumed BATCHED_TFLOPS, a stated assumption (the paper model's lookahead step
ran at about 51 TFLOP/s there, so it is a conservative one).

Stages run side by side where the plan's `jobs` and the stages' dependencies allow (the tau-models beside the base
model where they are not warm-started from it), and a sweep's jobs side by side under its launcher. One GPU runs the
kernels of one process at a time unless NVIDIA MPS is running, so the model assumes time-slicing only: a stage keeps
the GPU busy a fraction of its standalone time (BUSY: measured, 0.86 for the base model's step, 0.78-0.90 for the
tau-models'; 1.0 assumed for batched work), and stages running together progress at 1 / max(1, sum of their busy
fractions) of their own speed. With MPS their kernels may overlap further: not measured, not assumed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# measured by tools/gpu_check.py (NVIDIA H200, TF32 off, deterministic algorithms, batch 20)
MEASURED_ON = "an NVIDIA H200 (tools/gpu_check.py)"
STEP_FIXED_MS, STEP_PER_TIME_STEP_MS = 10.6, 0.121
VALID_MS = 5.87  # a validation window of 10 x 70
BUSY = {"recurrent training": 0.86, "tau training": 0.85, "batched": 1.0}
BATCHED_TFLOPS = 25.0  # assumed: FP32 with TF32 off, 37% of an H100's 67 TFLOP/s
ANCHOR = "the original AWD-LSTM code: 65 s a PTB epoch on a GP100 at batch 20"


@dataclass(frozen=True)
class Term:
    """One term of the time model: its value and where it comes from ("measured: ..." or "assumed: ...")."""

    value: float
    source: str


# the terms beside the steps and FLOPs: what every stage pays, measured where something measured it
TERMS = {
    "stage start-up (s)": Term(8.65, "measured: a stage process's imports, Hydra, checkpoint, corpus and test CE on 2 "
                                     "CPU cores (docs/bench/stage_startup.md)"),
    "CUDA context (s)": Term(3.0, "assumed: a process's first CUDA call"),
    "test scoring at batch 1 (ms a window of bptt)": Term(VALID_MS, "assumed: the measured validation window's "
                                                                    "time (latency-bound, so batch 1 as batch 10)"),
    "checkpoint writes (GB/s)": Term(0.5, "assumed: two files an epoch (last and best), weights and optimiser state"),
    "CPU-side fit (s a fitting stage)": Term(10.0, "assumed: alpha*'s and the bounds' fits and their standard errors"),
    "head training (s a head)": Term(5.0, "assumed: future_entropy's and sequence_calibration's small heads"),
    "report (s)": Term(5.0, "measured: the cpu reproduction's report, results.json, REPORT.md and the figures "
                            "(its console: 'report: done in 5 s', 2 CPU cores)"),
}
FITTING = ("calibration", "decoders", "future_entropy", "sequence_calibration", "memory")  # CPU-side fits


def term(name: str) -> float:
    return TERMS[name].value


def training_overheads(epochs: int, test_tokens: int, bptt: int, checkpoint_bytes: float) -> tuple[float, str]:
    """(seconds, arithmetic) a training run pays beyond its epochs: its start-up, the final test score at batch 1
    and the checkpoint writes."""
    start = term("stage start-up (s)") + term("CUDA context (s)")
    test = test_tokens / max(1, bptt) * term("test scoring at batch 1 (ms a window of bptt)") / 1000
    writes = 2 * epochs * checkpoint_bytes / (term("checkpoint writes (GB/s)") * 1e9)
    total = start + test + writes
    return total, (f"start-up {start:.0f} s + test at batch 1 {test:.0f} s + checkpoint writes {writes:.0f} s "
                   f"= {total:.0f} s")


def analysis_overheads(stage: str, heads: int) -> float:
    """Seconds an analysis stage pays beyond its model steps: start-up, its CPU-side fit, its heads' training."""
    return (term("stage start-up (s)") + term("CUDA context (s)") + term("CPU-side fit (s a fitting stage)")
            * (stage in FITTING) + term("head training (s a head)") * heads)


def measured_rates(path) -> dict[str, float]:
    """{stage kind: TFLOP/s} measured by `make gpu-check`'s paper_mini part (its gpu_rates.json: each analysis
    stage's FLOPs over its measured seconds less its overheads); {} without the file or with one not whole."""
    import math

    from lmcal.utils.io import read_record

    rates = (read_record(path, warn=False) or {}).get("tflops")
    if not isinstance(rates, dict):
        return {}
    return {str(k): float(v) for k, v in rates.items() if isinstance(v, (int, float)) and math.isfinite(v) and v > 0}


def step_ms(sequential_steps: float) -> float:
    """ms of one AWD-LSTM training step whose window runs `sequential_steps` time steps one after another."""
    return STEP_FIXED_MS + STEP_PER_TIME_STEP_MS * sequential_steps


def lstm_epoch_seconds(train_tokens: int, valid_tokens: int, batch: int, bptt: int, tau: int | None,
                       eval_batch: int = 10) -> tuple[float, str]:
    """(seconds, arithmetic) of one AWD-LSTM epoch: its training windows at the measured step, and its validation."""
    window = bptt * (0.95 + 0.05 / 2)  # variable BPTT: bptt with p = 0.95, else bptt / 2, on average
    if tau:  # windows rounded to multiples of tau; each runs tau sequential steps over window / tau streams
        window = max(tau, round(window / tau) * tau)
    steps = train_tokens / (batch * window)
    seq = tau or window
    valid = valid_tokens / (eval_batch * bptt)
    seconds = steps * step_ms(seq) / 1000 + valid * VALID_MS / 1000
    return seconds, (f"{steps:,.0f} windows x ({STEP_FIXED_MS:g} + {STEP_PER_TIME_STEP_MS:g} x {seq:.0f} sequential "
                     f"steps) ms + {valid:,.0f} validation windows x {VALID_MS:g} ms = {seconds:.1f} s an epoch")


@dataclass
class Job:
    name: str
    seconds: float  # alone on the GPU
    busy: float  # the share of that time the GPU is busy with it
    deps: tuple[str, ...] = ()
    flops: float = 0.0  # an analysis stage's model FLOPs (0: a training or the report) ...
    idle: float = 0.0  # ... and its seconds with the GPU idle (start-up, fits, writes) ...
    kind: str = ""  # ... and its kind (calibration, memory, ...), which make gpu-check's rates are keyed by
    what: str = ""  # what the stage is, in the plan's table ("awd_lstm, 24.2M parameters"; "memory on the awd_lstm")


def side_by_side_group(seconds: list[float], busy: list[float], at_once: int) -> tuple[float, float]:
    """(wall seconds, busy fraction) of a sweep's runs, `at_once` at a time under time-slicing (one runs after another
    when at_once = 1)."""
    wall = schedule([Job(str(i), s, b) for i, (s, b) in enumerate(zip(seconds, busy, strict=True))], at_once)[0]
    return wall, min(1.0, sum(s * b for s, b in zip(seconds, busy, strict=True)) / wall) if wall else 1.0


def schedule(jobs: list[Job], slots: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """Event-driven list scheduling of `jobs` in their order on `slots` slots of one time-sliced GPU: a job starts when
    its deps have ended and a slot is free; the running jobs progress at 1 / max(1, sum of their busy fractions).
    Returns (total wall seconds, {name: (start, end)})."""
    left = {j.name: j.seconds for j in jobs}
    pending, running, done, spans, t = list(jobs), [], set(), {}, 0.0
    while pending or running:
        for j in list(pending):  # start what can start, in order
            if len(running) < slots and all(d in done for d in j.deps if d in left):
                pending.remove(j)
                running.append(j)
                spans[j.name] = (t, t)
        if not running:
            raise ValueError(f"stages wait on stages that never run: {[j.name for j in pending]}")
        rate = 1.0 / max(1.0, sum(j.busy for j in running))
        first = heapq.nsmallest(1, running, key=lambda j: left[j.name])[0]
        dt = left[first.name] / rate
        t += dt
        for j in list(running):
            left[j.name] -= dt * rate
            if left[j.name] <= 1e-9:
                running.remove(j)
                done.add(j.name)
                spans[j.name] = (spans[j.name][0], t)
    return t, spans


def idle_job(name: str, gpu_seconds: float, busy: float, idle_seconds: float, deps: tuple[str, ...],
             flops: float = 0.0, kind: str = "", what: str = "") -> Job:
    """A stage's job: `gpu_seconds` keeping the GPU `busy` that share, and `idle_seconds` of start-up, fits and
    writes that leave it to the stages beside it (the job's busy share is over both)."""
    total = gpu_seconds + idle_seconds
    return Job(name, total, busy * gpu_seconds / total if total else 0.0, deps, flops, idle_seconds, kind, what)


def hours(seconds: float) -> str:
    """'5.3 h', or '7.5 min' under an hour."""
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"
