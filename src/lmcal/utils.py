"""Small shared helpers: atomic writes, strict JSON, the run-folder lock, and how numbers read in tables."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from lmcal.errors import LmcalError
from lmcal.profiling import timed

log = logging.getLogger("lmcal")


def temp_path(path: str | Path) -> Path:
    """A temporary name beside `path`, unique to this process and call: two writers never share one."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


@contextmanager
def atomic_path(path: str | Path):
    """Yields a temporary path to write; renamed onto `path` when the block ends, removed if it fails. Files are
    created by ordinary `open`, so they get the permissions of the user's umask, like any other file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@timed("io")
def write_text_atomic(path: str | Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def strict_json(obj):
    """`obj` with every non-finite float replaced by null, and the reason stated beside it: a key `K` whose value is
    (or holds) NaN or ±inf gains `K_nonfinite` ("inf", "-inf", "nan", or a count for lists). JSON that every parser
    reads (RFC 8259 has no NaN), with nothing hidden."""
    def fix(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None, ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf")
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                out[k], why = fix(x)
                if why is not None:
                    out[f"{k}_nonfinite"] = why
            return out, None
        if isinstance(v, (list, tuple)):
            fixed = [fix(x) for x in v]
            bad = [why for _, why in fixed if why is not None]
            return [x for x, _ in fixed], (f"{len(bad)} of {len(v)} values not finite ({', '.join(sorted(set(bad)))})"
                                           if bad else None)
        return v, None

    fixed, why = fix(obj)
    if why is not None:
        raise ValueError(f"a bare non-finite value has no key to explain it: {why}")
    return fixed


@timed("io")
def write_json_atomic(path: str | Path, obj) -> None:
    """Strict JSON (see `strict_json`), written atomically."""
    write_text_atomic(path, json.dumps(strict_json(obj), indent=2, allow_nan=False) + "\n")


def copy_atomic(src: str | Path, dst: str | Path) -> None:
    """Copy to a temporary file beside `dst`, then rename."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def exp_or_inf(x: float) -> float:
    """exp(x), or inf where it overflows: the perplexity of a cross-entropy beyond ~709 nats is inf, not a crash."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


# ---------------------------------------------------------------------------------------------------------------------
# One writer per run folder
# ---------------------------------------------------------------------------------------------------------------------

LOCK_NAME = ".lmcal.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextmanager
def run_lock(folder: str | Path, what: str = "run"):
    """Holds `folder`/.lmcal.lock (this process's PID, host and command) while the block runs. A second run into the
    same folder stops with one paragraph naming the holder; a lock left by a process that no longer exists (on this
    host) is taken over with a note. The lock is removed when the block ends, however it ends."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "command": " ".join(sys.argv), "what": what}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            pid, host = holder.get("pid"), holder.get("host")
            if holder and host == me["host"] and isinstance(pid, int) and not _pid_alive(pid):
                log.warning(f"{lock}: taking over a stale lock of process {pid} ({holder.get('command', '?')}), "
                            "which no longer runs.")
                lock.unlink(missing_ok=True)
                continue
            if not holder:  # being written this instant by another process, or empty: look again
                time.sleep(0.2)
                if lock.exists() and not lock.read_text().strip():
                    lock.unlink(missing_ok=True)
                continue
            raise LmcalError(
                f"{folder} is in use by another lmcal {holder.get('what', 'run')}: process {pid} on {host}, started "
                f"{holder.get('started', '?')} ({holder.get('command', '?')}). Two runs writing one folder would "
                "mix their logs, checkpoints and results. Wait for it to finish, or give this run another folder "
                f"(hydra.run.dir=..., or out=... for make reproduce). If no such process runs, delete {lock}."
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    else:
        raise LmcalError(f"Could not take the lock {lock}; another process keeps replacing it. Delete it and retry.")
    try:
        yield lock
    finally:
        try:
            if json.loads(lock.read_text()).get("pid") == me["pid"]:
                lock.unlink()
        except (OSError, ValueError):
            pass


# ---------------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------------


def format_params(params: dict, digits: int = 4, drop: tuple[str, ...] = (), empty: str = "–") -> str:
    """"k=v, ..." with floats to `digits` significant digits, leaving out keys that contain any of `drop`; `empty`
    if none is left."""
    return ", ".join(f"{k}={v:.{digits}g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
                     if not any(d in k for d in drop)) or empty


def format_ce(nats: float | None) -> str:
    """A cross-entropy for a table: None (a word of probability 0) reads as ∞."""
    return "∞" if nats is None else f"{nats:.4f}"
