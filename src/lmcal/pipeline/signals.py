"""Stopping a pipeline's stages: each runs in its own process group (`stage_process_options`) that `end_groups` ends
whole, the stage's own children too, and dies with the pipeline. (SIGTERM and SIGHUP stop the pipeline itself as
Ctrl-C does: lmcal.utils.boundary.stop_on_signals.) A pipeline started by `make` ends itself when make is gone
(`watch_parent`): killing make does not leave it running as an orphan that holds its lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def _libc_prctl():
    with contextlib.suppress(Exception):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


_PRCTL = _libc_prctl() if sys.platform == "linux" else None  # looked up here: the child must not load libraries


def _die_with_parent() -> None:
    """In a stage's process before it starts (Linux): if the pipeline dies without cleaning up (SIGKILL), the kernel
    ends the stage too, as when both shared one process group."""
    _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def die_with_parent() -> None:
    """This process dies when its parent does (Linux; elsewhere nothing): a stage forked by the warm worker
    (lmcal.pipeline.warm), as a stage started with `stage_process_options`."""
    if _PRCTL is not None:
        _die_with_parent()


def stage_process_options() -> dict:
    """Popen keywords for a stage: its own session (a process group that `end_groups` ends whole, and that a
    terminal's Ctrl-C does not reach: the pipeline stops it), dying with the pipeline on Linux."""
    return {"start_new_session": True, **({"preexec_fn": _die_with_parent} if _PRCTL is not None else {})}


ORPHAN_GRACE_S = 3.0  # a stage's grace once the pipeline's parent is gone: nobody waits for a tidy stop
ORPHAN_EXIT_S = 10.0  # and the pipeline's own, after which it ends itself (its stages die with it: PDEATHSIG)
ORPHANED = threading.Event()  # set by watch_parent once the process that started the pipeline has ended
_GROUPS: set[int] = set()  # the stage process groups end_groups is ending (the last resort SIGKILLs them)


def end_groups(procs: list[subprocess.Popen], grace: float = 20.0) -> None:
    """SIGTERM to each running stage's process group, then SIGKILL to what is left after `grace` seconds
    (ORPHAN_GRACE_S at most once the pipeline's parent has gone: watch_parent); returns once every stage process has
    exited."""
    if ORPHANED.is_set():
        grace = min(grace, ORPHAN_GRACE_S)
    _GROUPS.update(p.pid for p in procs)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group, stragglers included
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie, dead but not yet waited for by its parent, has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def last_resort() -> None:
    """A pipeline that has not ended ORPHAN_EXIT_S after its parent went (its main thread stuck in a call that a
    signal does not interrupt): SIGKILL to the stage groups it knows, then it ends at once, exit 143 as for SIGTERM
    (a lock it leaves names a dead process: the next run takes it over)."""
    print(f"lmcal: the pipeline did not stop within {ORPHAN_EXIT_S:g} s: ending it and its stages now.",
          file=sys.stderr, flush=True)
    for group in _GROUPS | set(child_pids()):  # (a stage leads its own group: stage_process_options)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    os._exit(128 + signal.SIGTERM)


def child_pids(pid: int | None = None) -> list[int]:
    """The processes whose parent is `pid` (default: this one), from /proc (Linux; elsewhere none)."""
    pid, found = os.getpid() if pid is None else pid, []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def watch_parent(pid: int, every: float = 1.0, exit_after: float = ORPHAN_EXIT_S) -> threading.Thread:
    """Watches process `pid` (the `make` that started this pipeline: $LMCAL_WATCH_PID, which the Makefile sets) from a
    daemon thread; once it has ended, or this process's own parent has, this process stops itself with SIGTERM, as on
    Ctrl-C: its stages ended (each within ORPHAN_GRACE_S, then killed), its temporary files and lock removed, one line
    on how to resume. If it has not ended `exit_after` seconds later, it ends at once (last_resort)."""
    parent = os.getppid()

    def watch():
        while not (gone(pid) or os.getppid() != parent):
            time.sleep(every)
        ORPHANED.set()  # the stages get ORPHAN_GRACE_S, not their usual grace
        print(f"lmcal: the process that started this pipeline (make, process {pid}) has ended: stopping the "
              "pipeline and its stages.", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(exit_after)  # (a daemon thread: a pipeline that has stopped by then has ended it)
        last_resort()

    t = threading.Thread(target=watch, name="lmcal-watch-parent", daemon=True)
    t.start()
    return t
