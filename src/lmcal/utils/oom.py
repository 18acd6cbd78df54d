"""An out-of-memory error named by the setting that lowers what ran out: the preflight sized the stage and found it
fitting, so when the device runs out all the same, the paragraph says which of that stage's settings holds the
memory that grew (the generations advanced together, the windows fed side by side, the training batch) and a value
that holds half of it, with the device's words on what it tried to allocate.

    is_out_of_memory(e)                       a CUDA, MPS or host out-of-memory error, anywhere in e's chain
    oom_refusal(e, subject, prefix, values)   the LmcalError naming prefix.<key>=<half> for the first key of values
"""

from __future__ import annotations

from lmcal.errors import LmcalError

# the settings whose value scales the memory a stage holds at once, in the order they are proposed
MEMORY_KEYS = ("max_batch", "windows_per_batch", "batch_size")


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` (or an error it was raised from) is a device or host running out of memory: torch's
    OutOfMemoryError, MemoryError, or a RuntimeError saying an allocation failed (MPS, older CUDA builds)."""
    return any(type(x).__name__ == "OutOfMemoryError" or isinstance(x, MemoryError)
               or (isinstance(x, RuntimeError) and "out of memory" in str(x).lower()) for x in _chain(e))


def oom_refusal(e: BaseException, subject: str, prefix: str, values: dict) -> LmcalError:
    """One paragraph for `subject` (e.g. "Stage 'calibration'") that ran out of memory in `e`: the first of
    MEMORY_KEYS in `values` ({key: its value now}) proposed as prefix.key at half its value, and the memory stage's
    rows kept on the CPU where they were on the device."""
    detail = " ".join(str(next(x for x in _chain(e) if is_out_of_memory(x))).split())[:240]
    fits = [f"{prefix}.{k}={max(1, int(values[k]) // 2)}" for k in MEMORY_KEYS
            if isinstance(values.get(k), int) and values[k] > 1][:1]
    if values.get("rows") in ("device", "auto"):
        fits.append(f"{prefix}.rows=stream")
    how = (f"{'Settings that hold' if len(fits) > 1 else 'A setting that holds'} about half of it: {' '.join(fits)}"
           if fits else "None of its settings sizes that memory: run it on a device with more memory")
    return LmcalError(f"{subject} ran out of memory ({detail}). Its sizes were checked before it started and fitted "
                      "the device's memory as lmcal estimates it, so the device held less than that or the stage held "
                      f"more. {how}; or give the device to this stage alone (jobs=1, hydra.launcher.n_jobs=1). Work "
                      "finished before it is kept: rerun the same command with the setting to resume.")
