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
from lmcal.utils.records import Maybe, Range, parse, problem

log = logging.getLogger("lmcal")


LOCK_NAME = ".lmcal.lock"
HEARTBEAT_S = 30.0  # the holder touches its lock this often
# a lock from another host untouched this long is stale (several heartbeats, and room for clocks that differ a little)
STALE_S = float(os.environ.get("LMCAL_LOCK_STALE_S", 180))


PID_MAX = 2**31 - 1  # a process id is a pid_t: none is larger (nor 0 or below: os.kill reads those as groups)
LOCK_BYTES = 64 * 1024  # a lock's text is a line; more than this is no lmcal lock
# what a lock names: its holder (lmcal.utils.records's spec; other keys are free)
HOLDER = {"pid": Range(1, PID_MAX, integer=True), "host?": Maybe(str), "started?": Maybe(str),
          "command?": Maybe(str), "what?": Maybe(str), "slurm_job_id?": Maybe((str, int))}


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host; False for a number no process can have."""
    if not isinstance(pid, int) or not 0 < pid <= PID_MAX:
        return False
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
# the operating system's own folders: no run goes in them or anywhere inside them (macOS's /etc is /private/etc)
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
                "/sys", "/usr", "/private/etc", "/System", "/Library", "/Applications")
# folders that hold other things' folders: a run goes inside them, never in them
SHARED_FOLDERS = ("/home", "/Users", "/root", "/var", "/opt", "/srv", "/mnt", "/media", "/tmp", "/var/tmp",
                  "/private/tmp", "/private/var")


def _why_refused(path: Path) -> str | None:
    """Why `path` (resolved) is no run's folder, or None."""
    if path == Path(path.anchor):
        return "the file system's root"
    if path == Path.home().resolve():
        return "your home folder"
    if any(path.is_relative_to(t) for t in SYSTEM_TREES):
        return "a system folder"
    if path in {Path(p) for p in SHARED_FOLDERS}:
        return "a folder that holds other folders of the system or its users"
    if path.is_relative_to(PACKAGE):
        return "lmcal's own package"
    if PROJECT is not None:
        if path == PROJECT:
            return "the project's own folder"
        if any(path.is_relative_to(PROJECT / s) for s in SOURCE_FOLDERS):
            return f"inside the project's {path.relative_to(PROJECT).parts[0]}/ folder"
    for prefix in {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}:
        if prefix != Path(prefix.anchor) and (path == prefix or any(path.is_relative_to(prefix / d) for d in (
                "bin", "lib", "lib64", "include", "Lib", "Scripts"))):
            return "the Python environment lmcal runs in"
    return None


def check_output_folder(folder: str | Path) -> None:
    """Refuses, before anything is made there, an output folder that is the file system's root, a system folder or
    one inside it (/etc, /usr, /bin, /proc, /sys, ...), a folder that holds the system's or its users' folders
    (/home, /tmp, /var, ...: a run goes inside them), the home folder itself, the project's own (its root, its
    sources, configs, tests, benchmarks or docs), the installed package or the Python environment. The path is read
    as the run will use it: relative to the current folder, `~` expanded, symbolic links and `..` resolved."""
    path = Path(folder).expanduser().resolve()
    why = _why_refused(path)
    if why:
        raise LmcalError(f"Refusing to write a run into {path}: it is {why}, where its checkpoints, logs and lock "
                         "would mix with files that are not a run's. Nothing was written. Give a folder of its own "
                         "(out=outputs/NAME for make reproduce, hydra.run.dir=... for train and evaluate).")


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


WRITING_S = 2.0  # a lock whose body is not yet whole is being written, for at most this long


def holder_of(body: str) -> tuple[dict | None, str | None]:
    """(the holder a lock file's text names: {pid, host, started, command, ...}, None), or (None, why it names none):
    not JSON, or JSON that is no object with a process id of a process (`[1, 2]`, `null`, `{}`, a pid beyond any
    process's), read by lmcal.utils.records's one check."""
    holder, why = parse(body)
    why = why or problem(holder, HOLDER)
    return (None, why) if why else (holder, None)


def _holder(body: str) -> dict | None:
    return holder_of(body)[0]


def _shown(body: str) -> str:
    why = holder_of(body)[1]
    return "an empty file" if not body.strip() else f"it holds {body.strip()[:40]!r}: {why}"


def read_lock(lock: Path) -> tuple[str, float]:
    """(the text of a lock file, at most LOCK_BYTES of it, and its age in seconds); OSError where there is none."""
    with open(lock, "rb") as f:
        body = f.read(LOCK_BYTES + 1).decode("utf-8", errors="replace")
    return body, time.time() - lock.stat().st_mtime


def taken_name(lock: Path) -> bool:
    """Whether a lock's name is taken by something other than a plain file: lmcal never writes that there."""
    return lock.is_symlink() or (lock.exists() and not lock.is_file())


def not_a_file(lock: Path) -> LmcalError:
    """The paragraph for a lock's name taken by something that is not a file (a folder, a link, a device)."""
    what = ("a symbolic link" if lock.is_symlink() else "a folder" if lock.is_dir()
            else "something that is not a file")
    return LmcalError(f"{lock} is {what} where lmcal's lock file goes (a run keeps its process id there while it "
                      f"writes {lock.parent}), so no run can take that folder. Nothing was written. Remove it (it is "
                      f"no lmcal lock: lmcal writes a file there), or give the run another folder.")


def live_holder(folder: str | Path, above: bool = True) -> tuple[Path, dict] | None:
    """(lock, holder) of a live lmcal run, other than this process, that holds `folder` or (`above`) a folder above
    it (a reproduction holds its whole output folder), else None. A lock that holds no lmcal lock, or whose holder
    no longer runs, holds nothing."""
    me = {"host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    path = Path(folder).expanduser().resolve()
    for d in (path, *path.parents) if above else (path,):
        lock = d / LOCK_NAME
        if d == path and taken_name(lock):
            raise not_a_file(lock)
        try:
            body, age = read_lock(lock)
        except OSError:
            continue
        holder = _holder(body)
        if holder is not None and holder.get("pid") != os.getpid() and not stale(holder, age, me):
            return lock, holder
    return None


def _heartbeat(lock: Path, pid: int, done: threading.Event) -> None:
    while not done.wait(HEARTBEAT_S):
        try:
            if (_holder(read_lock(lock)[0]) or {}).get("pid") == pid:
                os.utime(lock)
        except OSError:
            pass


@contextmanager
def run_lock(folder: str | Path, what: str = "run",
             advice: str = "hydra.run.dir=..., or out=... for make reproduce"):
    """Holds `folder`/.lmcal.lock (this process's PID, host and command) while the block runs. A second run into the
    same folder stops with one paragraph naming the holder; a lock whose holder no longer runs (`stale`: on this host
    or, on a shared filesystem, another) is taken over with a note. The lock is removed when the block ends, however
    it ends. A lock file that holds no lmcal lock (not a JSON object naming a process: damaged, or written by
    something else) is taken over with a warning once it is older than a write takes. `advice`: how this command is
    given another folder."""
    folder = Path(folder)
    check_output_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "command": " ".join(sys.argv), "what": what, "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    for _ in range(50):  # (a lock being written, or replaced, is looked at again)
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            if taken_name(lock):
                raise not_a_file(lock) from None
            try:
                body, age = read_lock(lock)
            except OSError:
                continue
            holder = _holder(body)
            if holder is None:  # not an lmcal lock, or one being written this instant
                if age < WRITING_S:
                    time.sleep(0.2)
                    continue
                log.warning(f"{lock} holds no lmcal lock ({_shown(body)}, untouched for {age:.0f} s); taking it "
                            "over.")
                lock.unlink(missing_ok=True)
                continue
            why = stale(holder, age, me)
            if why:
                log.warning(f"{lock}: taking over a stale lock of {why} ({holder.get('command', '?')}).")
                lock.unlink(missing_ok=True)
                continue
            raise LmcalError(
                f"{folder} is in use by another lmcal {holder.get('what', 'run')}: process {holder.get('pid')} on "
                f"{holder.get('host')}, started {holder.get('started', '?')} ({holder.get('command', '?')}). Two "
                "runs writing one folder would mix their logs, checkpoints and results. Wait for it to finish, or "
                f"give this run another folder ({advice}). If no such process runs, delete {lock} (a lock from "
                f"another host is taken over by itself once it has not been refreshed for {STALE_S:.0f} s)."
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    else:
        raise LmcalError(f"Could not take the lock {lock}: it was replaced 50 times while this run looked at it, so "
                         "another process keeps rewriting it. Stop that process (or delete the file) and rerun.")
    done = threading.Event()
    threading.Thread(target=_heartbeat, args=(lock, me["pid"], done), daemon=True).start()
    try:
        yield lock
    finally:
        done.set()
        try:
            if (_holder(read_lock(lock)[0]) or {}).get("pid") == me["pid"]:
                lock.unlink()
        except OSError:
            pass
