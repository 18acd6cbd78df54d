"""One writer per run folder: `run_lock` holds `<folder>/.lmcal.lock` (PID, host, command) while a run writes there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from lmcal.errors import LmcalError

log = logging.getLogger("lmcal")


LOCK_NAME = ".lmcal.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


PACKAGE = Path(__file__).resolve().parents[1]  # src/lmcal, or the installed package
PROJECT = PACKAGE.parents[1] if (PACKAGE.parents[1] / "pyproject.toml").is_file() else None  # a source checkout
SOURCE_FOLDERS = ("src", "conf", "tests", "bench", "docs")


def check_output_folder(folder: str | Path) -> None:
    """Refuses, before anything is made there, an output folder that is the file system's root, the home folder, or
    the project's own (its root, its sources, configs, tests, benchmarks or docs, or the installed package)."""
    path = Path(folder).expanduser().resolve()
    why = ("the file system's root" if path == Path(path.anchor) else
           "your home folder" if path == Path.home().resolve() else
           "lmcal's own package" if path.is_relative_to(PACKAGE) else None)
    if why is None and PROJECT is not None:
        if path == PROJECT:
            why = "the project's own folder"
        elif any(path.is_relative_to(PROJECT / s) for s in SOURCE_FOLDERS):
            why = f"inside the project's {path.relative_to(PROJECT).parts[0]}/ folder"
    if why:
        raise LmcalError(f"Refusing to write a run into {path}: it is {why}, where its checkpoints, logs and lock "
                         "would mix with files that are not a run's. Give a folder of its own (out=outputs/NAME for "
                         "make reproduce, hydra.run.dir=... for train and evaluate).")


# a temporary file of lmcal.utils.io.temp_path: .NAME.<pid>.<8 hex>.tmp
_TEMP = re.compile(r"\..+\.(\d+)\.[0-9a-f]{8}\.tmp")


def sweep_temp_files(folder: str | Path) -> list[Path]:
    """Removes the temporary files under `folder` that processes no longer running (on this host) left half
    written; returns them. Call it holding the folder's lock, so that no writer of this run is among them."""
    swept = []
    for path in Path(folder).rglob(".*.tmp"):
        m = _TEMP.fullmatch(path.name)
        if m and path.is_file() and not _pid_alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            swept.append(path)
    if swept:
        log.warning(f"Removed {len(swept)} temporary file(s) that stopped processes left in {folder} "
                    f"(e.g. {swept[0].name}).")
    return swept


@contextmanager
def run_lock(folder: str | Path, what: str = "run"):
    """Holds `folder`/.lmcal.lock (this process's PID, host and command) while the block runs. A second run into the
    same folder stops with one paragraph naming the holder; a lock left by a process that no longer exists (on this
    host) is taken over with a note. The lock is removed when the block ends, however it ends."""
    folder = Path(folder)
    check_output_folder(folder)
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
