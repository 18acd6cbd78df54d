"""The memory stage: the upper bound on I_tau for one tau (Section 5), P~ a trained tau-model or the model itself on
tau-token windows.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from pathlib import Path

import torch

from lmcal import paper
from lmcal.core.context import context_rows, full_context_span, zip_rows
from lmcal.core.lookahead import memory_budget
from lmcal.core.memory_summary import memory_summary
from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.step_lm import as_step_lm
from lmcal.stages.configs import MemoryConfig
from lmcal.stages.plots import memory_bound_figure
from lmcal.stages.stage import Result, Stage, pick
from lmcal.stages.wandb_run import wandb_log
from lmcal.utils.budget import tau_too_long
from lmcal.utils.profiling import add_flops, flops_per_token, span

log = logging.getLogger("lmcal")

# the memory table's columns on W&B (one row per run here; the report's table gathers every tau)
MEMORY_COLUMNS = ["tau", "limited", "ce_limited_nats", "delta_ce_nats", "mi_upper_bound_nats", "mi_stderr_nats",
                  "mi_upper_bound_crossfit_nats", "alpha", "exact_mi_nats"]


def _row_flops(lm, tau: int | None) -> float:
    """FLOPs of one row of context_rows: an AWD-LSTM, or a model read by whole windows, runs its body on every token
    of the window and its output layer once; another StepLM computes its whole step for every token fed."""
    head = getattr(lm, "head", None)
    if head is not None and (isinstance(getattr(lm, "net", None), AWDLSTM) or hasattr(lm, "window_log_probs")):
        dec = 2.0 * head[0].numel()
        return (flops_per_token(lm) - dec) * (tau or 1) + dec
    return flops_per_token(lm) * (tau or 1)


# Streamed rows on the CPU hand the C heap's free pages back every TRIM_BYTES of rows. glibc serves chunk-sized blocks
# from its heap once one has been freed, and keeps the holes they leave: streaming 20,000 rows of 10,000 words (a small
# AWD-LSTM, 22 passes) peaked at 2.46 GB of RSS, more than keeping them (1.95 GB, 11 s); trimmed (every 4 chunks of
# 41 MB), 0.68 GB, in 36 s against 28 s untrimmed.
TRIM_BYTES = 128e6


def _trim_heap() -> None:
    """glibc's malloc_trim(0) where the C library has it (a no-op elsewhere)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _memory_rows(full, limited, tau: int, tokens: torch.Tensor, windows_per_batch: int, store_dtype: torch.dtype,
                 device: str | None, desc: str, trim: bool = False):
    """(log P^ [n, V], log P~_tau [n, V], targets [n]) chunks along `tokens` in store_dtype, moved to `device` (None:
    left where the models put them), lazily, with a progress bar: P^ the model `full` with the whole past, P~ the
    model `limited` fed only the last tau tokens (each a StepLM or an AWDLSTM; see lmcal.core.context.context_rows).
    trim: the C heap trimmed every TRIM_BYTES of rows (streamed rows on the CPU)."""
    from lmcal.utils.progress import progress_bar

    bar = progress_bar(total=max(0, tokens.numel() - 1), desc=desc, unit="tok", leave=False)
    rows = zip_rows(context_rows(full, tokens, None, windows_per_batch),
                    context_rows(limited, tokens, tau, windows_per_batch))
    per_row = _row_flops(full, None) + _row_flops(limited, tau)
    since = 0  # bytes of rows since the last trim
    try:
        while True:
            with span("forward"):  # both models' rows for one chunk
                f, q, y = next(rows, (None, None, None))
                if y is None:
                    break
                add_flops(per_row * y.numel())
            yield f.to(device=device, dtype=store_dtype), q.to(device=device, dtype=store_dtype), y.to(device=device)
            bar.update(y.numel())
            since += f.numel() * 2 * store_dtype.itemsize
            if trim and since >= TRIM_BYTES:
                _trim_heap()
                since = 0
    finally:  # also when a pass stops early (the fit's first check reads one chunk)
        bar.close()


ROWS = ("auto", "device", "cpu", "stream")


def rows_where(rows: str, device: torch.device, nbytes: float) -> str:
    """Where the fit's rows go (analysis.memory.rows): cpu, device (the model's) or stream (recomputed on every pass
    of the fit, one chunk held). auto: cpu for a model on the CPU (the rows are kept there, as always); on another
    device, kept there if their 2 x N x V x bytes fit its memory budget (analysis.memory_budget_gb, null: half its
    free memory, as the lookahead's), else streamed. device on the CPU is cpu."""
    if rows not in ROWS:
        raise LmcalError(f"analysis.memory.rows={rows!r}: choose auto (on the model's device when the rows fit the "
                         "memory budget, else streamed), device, cpu or stream (recomputed on every pass of the fit, "
                         "one chunk of windows_per_batch rows held).")
    if device.type == "cpu" and rows in ("auto", "device"):
        return "cpu"
    if rows == "auto":
        return "device" if nbytes <= memory_budget(device) else "stream"
    return rows


class MemoryResult(Result):
    """The bound on I_tau for one tau, its parts and their standard errors."""

    def figure(self, path: Path) -> Path:
        r = self.record
        return memory_bound_figure(r, path, title=f"{r['model']} on {r['corpus']}, tau = {r['tau']} ({r['limited']}): "
                                                  "the memory bound's parts")

    def log_wandb(self, logger, name: str, images: dict[str, Path]) -> None:
        r = self.record
        keys = ("tau", "alpha", "ce_limited_nats", "mi_upper_bound_nats", "mi_upper_bound_crossfit_nats",
                "delta_ce_nats", "entropy_calibrated_nats")  # null where the fit had no finite minimum: not logged
        wandb_log(logger, scalars={f"{name}/{k}": r[k] for k in keys if r.get(k) is not None},
                  tables={f"{name}/table": (MEMORY_COLUMNS, [[r.get(c) for c in MEMORY_COLUMNS]])}, images=images)

    def line(self, name: str) -> str:
        r = self.record
        passes = r["rows_passes"]
        ce = f"CE(P||P~) {r['ce_limited_nats']:.4f}, ΔCE {r['delta_ce_nats']:.4f}"
        if r.get("no_finite_minimum"):
            at = r["at_alpha_bound"]
            bound = (f"no finite minimum (CE still falls at |alpha| = {r['alpha_bound']:g}); {ce}; at the edge alpha = "
                     f"{at['alpha']:+g}, not a minimum, mean KL(P^_alpha||P~) {at['mi_upper_bound_nats']:.4f} nats "
                     f"bounds that tilted model's I_tau ({_temperature_text(r)})")
        else:
            bound = (f"alpha* {r['alpha']:.5f} +- {r['alpha_stderr']:.5f}; {ce}; I_tau <= "
                     f"{r['mi_upper_bound_nats']:.4f} +- {r['mi_stderr_nats']:.4f} nats (cross-fit "
                     f"{r['mi_upper_bound_crossfit_nats']:.4f}; {_temperature_text(r)})")
        return (f"{name} tau={r['tau']} ({r['limited']}): {bound} ({r['seconds']:.0f} s; rows {r['rows']}, "
                f"{passes} forward pass{'es' if passes > 1 else ''})")


def _temperature_text(r: dict) -> str:
    """The two-parameter variant in the stage's line: its bound, or that its fit had no finite minimum."""
    if r.get("two_parameter_no_minimum"):
        return f"with the temperature, no finite minimum (CE still falls at |theta| = " \
               f"{r['two_parameter_no_minimum']['alpha_bound']:g})"
    two = r["two_parameter"]
    return (f"with the temperature, beta* {two['beta']:.4f}: {two['mi_upper_bound_nats']:.4f} +- "
            f"{two['mi_stderr_nats']:.4f}")


def limited_model(full_net, limited_net, limited: str, tau: int | None):
    """(P~, tau): the trained tau-model `limited_net` (limited="trained"), or the base model itself read on
    tau-token windows ("window"; tau from the setting, else the tau-model's own)."""
    if limited not in ("trained", "window"):
        raise LmcalError(f"analysis.memory.limited={limited!r}: choose trained (the tau-model checkpoint as the "
                         "limited model) or window (the base model itself on tau-token windows).")
    own_tau = getattr(limited_net, "memory_tau", None)
    if limited == "trained":
        if not own_tau:
            raise LmcalError("The memory stage needs a tau-limited model (one trained with model.memory_tau=TAU); "
                             "this checkpoint is an ordinary full-context model. To run the model itself on "
                             "tau-token windows instead, set analysis.memory.limited=window analysis.memory.tau=TAU.")
        if tau and int(tau) != own_tau:
            raise LmcalError(f"analysis.memory.tau={tau} but the tau-model was trained with memory_tau={own_tau}; "
                             "leave analysis.memory.tau unset with limited=trained (it is only for limited=window).")
        return limited_net, int(own_tau)
    if not (tau or own_tau):
        raise LmcalError("analysis.memory.limited=window needs the window length: set analysis.memory.tau=TAU "
                         "(a positive integer).")
    return full_net, int(tau or own_tau)


def check_pair(full_net, lim, tau: int, test: torch.Tensor) -> None:
    """The two models read one vocabulary, and a tau-window fits the text and the model."""
    if lim.vocab_size != full_net.vocab_size:
        raise LmcalError(f"The base model's vocabulary ({full_net.vocab_size} words) differs from the "
                         f"tau-model's ({lim.vocab_size}): they were trained on different corpora.")
    if tau >= test.numel():
        raise LmcalError(tau_too_long("tau", tau, test.numel(), "test") + " Lower it, or score more tokens "
                         "(analysis.memory.score_tokens).")
    if getattr(lim, "max_positions", None) and tau >= lim.max_positions:
        raise LmcalError(f"analysis.memory.tau={tau}: the model reads at most {lim.max_positions} tokens; a window "
                         f"must be shorter.")


def _stream_pass(full, lim, tau: int, test: torch.Tensor, s: MemoryConfig, desc: str, trim: bool, passes: list[int]):
    """The fit's rows recomputed for one more pass (rows=stream); passes[0] counts them."""
    passes[0] += 1
    return _memory_rows(full, lim, tau, test, s.windows_per_batch, getattr(torch, s.store_dtype), None,
                        f"{desc}, pass {passes[0]}", trim=trim)


def fit_bound(full, lim, tau: int, test: torch.Tensor, s: MemoryConfig) -> dict:
    """The bound fitted on the rows of both models along `test`, kept where s.rows says (rows_where) or streamed;
    with where they were, the bytes held at once, the passes of both models over the text and their seconds."""
    t0 = time.perf_counter()
    dtype, desc = getattr(torch, s.store_dtype), f"memory tau={tau} ({s.limited})"
    row_bytes = 2 * full.vocab_size * dtype.itemsize  # one row of log P^ and log P~
    device = torch.device(getattr(full, "device", "cpu"))
    where = rows_where(s.rows, device, row_bytes * max(0, test.numel() - 1))
    passes = [1]
    if where == "stream":  # every pass of the fit recomputes the rows
        passes[0] = 0
        kept = functools.partial(_stream_pass, full, lim, tau, test, s, desc, device.type == "cpu", passes)
        held = row_bytes * min(s.windows_per_batch, max(0, test.numel() - 1))
    else:
        kept = list(_memory_rows(full, lim, tau, test, s.windows_per_batch, dtype,
                                 "cpu" if where == "cpu" else None, desc))
        held = row_bytes * sum(c[2].numel() for c in kept)
    t_rows = time.perf_counter() - t0
    bound = memory_summary(kept, cluster_size=s.cluster_size, jackknife=s.jackknife)
    return {"bound": bound, "rows": where, "rows_bytes": held, "rows_passes": passes[0], "rows_seconds": t_rows}


def compute(target: dict, settings: MemoryConfig) -> MemoryResult:
    """The memory bound for one tau (Section 5) on the first `score_tokens` test tokens (all when null), read as one
    stream: P^ (target["base"], else the model itself) with its whole past, P~_tau with exactly the last tau tokens
    (limited_model). alpha* is fitted on the very rows the bound is reported on (so the bound is >= 0), with
    standard errors from a delete-one-block jackknife over blocks of `cluster_size` positions that refits alpha per
    block (`jackknife`: onestep or exact); also the bound cross-fitted over two halves of the blocks, ΔCE =
    CE(P~) - CE(P^), and the two-parameter calibration P^^beta P~^alpha. target["exact_mi"] (the source's true I_tau,
    on the Markov corpus) is stored beside."""
    s, t = settings, target
    full_net = t["base"] if "base" in t else t.get("net", t["lm"])  # a full or HF model (window) is its own base
    lim, tau = limited_model(full_net, t["net"] if t["kind"] == "tau" else None, s.limited, s.tau)
    test = t["test"][:s.score_tokens] if s.score_tokens else t["test"]
    check_pair(full_net, lim, tau, test)
    full_net, lim = as_step_lm(full_net), as_step_lm(lim)
    t0 = time.perf_counter()
    fit = fit_bound(full_net, lim, tau, test, s)
    ref = paper.MEMORY_PTB.get(tau) if t["corpus"] == "ptb" else None
    return MemoryResult({
        "tau": tau, "limited": s.limited, "model": t["name"], "corpus": t["corpus"], **fit.pop("bound"),
        "full_context": full_context_span(full_net, test.numel()),
        "exact_mi_nats": t.get("exact_mi"),
        "paper": dict(zip(("ce_limited_nats", "mi_upper_bound_nats", "alpha"), ref, strict=True)) if ref else None,
        # where the fit's rows were (analysis.memory.rows resolved), the bytes held at once (streamed: one chunk) and
        # the passes of both models' forward over the text
        "rows": fit["rows"], "rows_bytes": fit["rows_bytes"], "rows_passes": fit["rows_passes"],
        "base_ckpt": t.get("base_ckpt"), "ckpt": t.get("ckpt"), "rows_seconds": fit["rows_seconds"],
        "seconds": time.perf_counter() - t0,
    })


def _kinds(settings: dict) -> frozenset[str]:
    """limited=window runs the model itself on tau-token windows, so any model will do; trained needs a tau-model."""
    limited = settings.get("limited", "trained")
    if limited not in ("trained", "window"):
        raise LmcalError(f"analysis.memory.limited={limited!r}: choose trained (a tau-model checkpoint against its "
                         "base) or window (the model itself on tau-token windows).")
    return frozenset({"tau", "full", "hf"}) if limited == "window" else frozenset({"tau"})




STAGE = Stage("memory", MemoryConfig, compute, frozenset({"tau"}),
              pick("alpha", "mi_upper_bound_nats", "mi_stderr_nats", "mi_upper_bound_crossfit_nats", "delta_ce_nats"),
              kinds_with=_kinds, kinds_note="or, with analysis.memory.limited=window analysis.memory.tau=TAU, on any "
                                            "model, fed tau-token windows")
