"""One writer per run folder: `run_lock` holds `<folder>/.lmcal.lock` (PID, host, Slurm job, command) while a run
writes there, and refreshes the file's modification time every HEARTBEAT_S seconds: on a filesystem shared by several
hosts, a lock whose holder died on another node (a killed or requeued Slurm job) is known by its silence.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from lmcal.errors import LmcalError

log = logging.getLogger("lmcal")


LOCK_NAME = ".lmcal.lock"
HEARTBEAT_S = 30.0  # the holder touches its lock this often
# a lock from another host untouched this long is stale (several heartbeats, and room for clocks that differ a little)
STALE_S = float(os.environ.get("LMCAL_LOCK_STALE_S", 180))


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


def _slurm_job_gone(job: str) -> bool:
    """True only where Slurm says the job no longer runs (squeue does not list it, or no longer knows it); False
    without squeue, or when squeue cannot answer (another cluster, the controller down)."""
    if not shutil.which("squeue"):
        return False
    try:
        r = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    if r.returncode == 0:
        return r.stdout.strip() not in ("RUNNING", "COMPLETING", "SUSPENDED", "STOPPED")
    return "invalid job id" in r.stderr.lower()


def stale(holder: dict, age: float, me: dict) -> str | None:
    """Why the lock `holder` (untouched for `age` seconds) is left by a run that no longer runs, or None if its holder
    may still run. On this host: its process is gone. Anywhere: it was an earlier run of this very Slurm job (a
    requeued job starts again under its own id, and Slurm runs one copy of a job at a time), Slurm says its job has
    ended, or it was not refreshed for STALE_S seconds."""
    pid, host, job = holder.get("pid"), holder.get("host"), holder.get("slurm_job_id")
    if host == me["host"]:
        if isinstance(pid, int) and not _pid_alive(pid):
            return f"process {pid}, which no longer runs"
        return None
    if job and job == me.get("slurm_job_id"):
        return f"an earlier run of this Slurm job ({job}, on {host}), requeued since"
    if job and _slurm_job_gone(job):
        return f"Slurm job {job} on {host}, which no longer runs"
    if age > STALE_S:
        return f"process {pid} on {host}, silent for {age:.0f} s (a live holder refreshes it every {HEARTBEAT_S:.0f} s)"
    return None


def _heartbeat(lock: Path, pid: int, done: threading.Event) -> None:
    while not done.wait(HEARTBEAT_S):
        try:
            if json.loads(lock.read_text()).get("pid") == pid:
                os.utime(lock)
        except (OSError, ValueError):
            pass


@contextmanager
def run_lock(folder: str | Path, what: str = "run"):
    """Holds `folder`/.lmcal.lock (this process's PID, host and command) while the block runs. A second run into the
    same folder stops with one paragraph naming the holder; a lock whose holder no longer runs (`stale`: on this host
    or, on a shared filesystem, another) is taken over with a note. The lock is removed when the block ends, however
    it ends."""
    folder = Path(folder)
    check_output_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "command": " ".join(sys.argv), "what": what, "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            pid, host = holder.get("pid"), holder.get("host")
            try:
                age = time.time() - lock.stat().st_mtime
            except OSError:
                continue
            why = stale(holder, age, me) if holder else None
            if why:
                log.warning(f"{lock}: taking over a stale lock of {why} ({holder.get('command', '?')}).")
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
                f"(hydra.run.dir=..., or out=... for make reproduce). If no such process runs, delete {lock} (a lock "
                f"from another host is taken over by itself once it has not been refreshed for {STALE_S:.0f} s)."
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    else:
        raise LmcalError(f"Could not take the lock {lock}; another process keeps replacing it. Delete it and retry.")
    done = threading.Event()
    threading.Thread(target=_heartbeat, args=(lock, me["pid"], done), daemon=True).start()
    try:
        yield lock
    finally:
        done.set()
        try:
            if json.loads(lock.read_text()).get("pid") == me["pid"]:
                lock.unlink()
        except (OSError, ValueError):
            pass
