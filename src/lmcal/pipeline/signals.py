"""Stopping a pipeline: SIGTERM and SIGHUP stop `make reproduce` as Ctrl-C does (`stop_on_signals`), and each stage
runs in its own process group (`stage_process_options`) that `end_groups` ends whole, the stage's own children too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, raised where the pipeline is, so that it unwinds as on Ctrl-C: the stages are ended, the
    temporary files and the lock removed."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    for s in SIGNALS:  # one stop: a second signal must not interrupt the cleaning up
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals():
    """While the block runs, SIGTERM and SIGHUP raise `Stopped` (a KeyboardInterrupt) in the main thread."""
    before = {s: signal.signal(s, _raise_stopped) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


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
