"""Stopping a pipeline's stages: each runs in its own process group (`stage_process_options`) that `end_groups` ends
whole, the stage's own children too. (SIGTERM and SIGHUP stop the pipeline itself as Ctrl-C does:
lmcal.utils.boundary.stop_on_signals.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys


def _libc_prctl():
    with contextlib.suppress(Exception):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


_PRCTL = _libc_prctl() if sys.platform == "linux" else None  # looked up here: the child must not load libraries


def _die_with_parent() -> None:
    """In a stage's process before it starts (Linux): if the pipeline dies without cleaning up (SIGKILL), the kernel
    ends the stage too, as when both shared one process group."""
    _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stage_process_options() -> dict:
    """Popen keywords for a stage: its own session (a process group that `end_groups` ends whole, and that a
    terminal's Ctrl-C does not reach: the pipeline stops it), dying with the pipeline on Linux."""
    return {"start_new_session": True, **({"preexec_fn": _die_with_parent} if _PRCTL is not None else {})}


def end_groups(procs: list[subprocess.Popen], grace: float = 20.0) -> None:
    """SIGTERM to each running stage's process group, then SIGKILL to what is left after `grace` seconds; returns
    once every stage process has exited."""
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
