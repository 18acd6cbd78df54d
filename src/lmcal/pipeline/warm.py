"""A warm worker for a pipeline's stages: one process that imports what every stage imports (torch, Lightning, Hydra,
W&B, the stages) once, then forks a child per stage, which runs the stage's `python -m lmcal.<entry> ...` as a fresh
process would, with the stage's environment, log and exit status. A stage then skips its imports, which are most of a
short stage's start-up (bench/stage_startup.py measures both ways).

Forking is safe only from a process that has run no torch operation (a fork after one deadlocks the child's OpenMP
pool) and has not touched CUDA: the worker only imports, and the pipeline uses it only on Linux where it hands out no
GPU. Each child starts its own session (the pipeline's `end_groups` ends it whole, as a stage started by Popen) and dies
with the worker, which dies with the pipeline.

The protocol, one JSON line each way: the pipeline sends {"id", "argv", "env", "log"}; the worker answers
{"id", "pid"} once the child is forked and {"id", "rc"} once it has exited (rc as Popen's returncode: -N for signal
N).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from lmcal.pipeline.signals import stage_process_options

ENTRIES = ("lmcal.train", "lmcal.evaluate")  # the stage commands the worker takes
# what it imports: the entry points, and the training run they import only once its settings have passed (Lightning)
PRELOAD = (*ENTRIES, "lmcal.training.run")


def takes(cmd: list[str]) -> bool:
    """Whether the warm worker can run `cmd`: this Python's `-m lmcal.train` or `-m lmcal.evaluate`."""
    return len(cmd) > 2 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] in ENTRIES


class WarmProc:
    """A stage forked by the worker, with what the scheduler and `end_groups` use of a Popen: pid, poll, wait,
    returncode."""

    def __init__(self, worker: Worker, key: int, pid: int):
        self.worker, self.key, self.pid, self.returncode = worker, key, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.worker.exit_status(self.key)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"warm stage {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


class Worker:
    """The pipeline's handle on the worker process: `launch` a stage, `close` when done."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.replies, self.next, self.ended = proc, {}, 0, False
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="lmcal-warm-worker", daemon=True).start()

    @classmethod
    def start(cls, env: dict) -> Worker:
        """The worker process, with the stages' environment `env` (its threads: OMP_NUM_THREADS is read at import)."""
        proc = subprocess.Popen([sys.executable, "-m", "lmcal.pipeline.warm"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, text=True, bufsize=1, **stage_process_options())
        return cls(proc)

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                self.replies.setdefault(msg["id"], {}).update(msg)
        self.ended = True  # every reply the worker wrote has been read

    def _reply(self, key: int, field: str):
        with self.lock:
            return self.replies.get(key, {}).get(field)

    def exit_status(self, key: int) -> int | None:
        rc = self._reply(key, "rc")
        if rc is None and self.ended and self._reply(key, "rc") is None:
            return -9  # the worker died before its child ended (the child died with it)
        return rc

    def launch(self, cmd: list[str], env: dict, log: Path) -> WarmProc:
        """Forks `cmd` (takes(cmd)) in the worker with environment `env`, its output appended to `log`."""
        with self.lock:
            key, self.next = self.next, self.next + 1
        self.proc.stdin.write(json.dumps({"id": key, "argv": cmd[2:], "env": env, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        while (pid := self._reply(key, "pid")) is None:
            if self.ended:
                raise RuntimeError(f"the warm worker ended (exit status {self.proc.returncode}) before it forked "
                                   "a stage")
            time.sleep(0.02)
        return WarmProc(self, key, pid)

    def close(self, grace: float = 30.0) -> None:
        """Ends the worker once its children have ended (the scheduler has waited for or stopped them)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=grace)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def _exit_hooks() -> None:
    """What a normal interpreter exit runs before it ends, in its order: threading's exit hooks and the join of the
    non-daemon threads (threading._shutdown), then the atexit hooks (W&B's, logging's, multiprocessing's). Without
    the first, loky's hook, which stops its workers, never runs, and multiprocessing's atexit hook then joins those
    workers until their idle timeout (300 s): a stage with a local_parallel (joblib) sweep stayed minutes after its
    jobs had ended."""
    import threading

    try:
        threading._shutdown()
    finally:
        atexit._run_exitfuncs()


def _child(argv: list[str], env: dict, log: str) -> None:
    """In the forked child: becomes the stage's process (`python -m argv...`) and never returns."""
    code = 1
    try:
        os.setsid()
        from lmcal.pipeline.signals import die_with_parent

        die_with_parent()
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        import torch

        if env.get("OMP_NUM_THREADS", "").isdigit():  # libgomp read the worker's value at import
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        import runpy

        sys.modules.pop(argv[0], None)  # run as __main__, as `python -m` does, not as the imported module
        sys.argv = ["-m", *argv[1:]]
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    try:
        _exit_hooks()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep the child alive
                pass
        os._exit(code)


def serve() -> None:
    """The worker: imports the entry points, then forks a child per request read from stdin, until stdin closes
    and its children have exited."""
    for name in PRELOAD:
        importlib.import_module(name)
    out, children, buf, open_ = sys.stdout, {}, b"", True
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    while open_ or children:
        if open_ and sel.select(timeout=0.2):
            chunk = os.read(0, 65536)
            open_, buf = bool(chunk), buf + chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                out.flush()
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    _child(req["argv"], req["env"], req["log"])
                children[pid] = req["id"]
                out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
                out.flush()
        elif not open_:
            time.sleep(0.2)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            key = children.pop(pid, None)
            if key is not None:
                out.write(json.dumps({"id": key, "rc": os.waitstatus_to_exitcode(status)}) + "\n")
                out.flush()


if __name__ == "__main__":
    serve()
