"""The one boundary between lmcal and its user: every entry point (python -m lmcal.train, evaluate, reproduce, report,
docs) runs inside `boundary()`, which turns the errors a user can act on into one paragraph on stderr,

    lmcal: error: <what is wrong, the path, key or value, and what to do>

and exit status 2. Those errors are LmcalError, the operating system's (OSError: a missing, unreadable or read-only
path, a full disk), text that is not UTF-8, running out of memory, and settings whose interpolation fails. Anything
else is a bug in lmcal and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from lmcal.errors import LmcalError

_OS_ADVICE = {
    errno.ENOENT: "Check the path (and that the folders above it exist).",
    errno.EACCES: "Check its permissions (and its folder's), or choose a path you can read and write.",
    errno.EPERM: "Check its permissions (and its folder's), or choose a path you can read and write.",
    errno.EROFS: "The file system is read-only: choose an output folder on a writable one.",
    errno.ENOSPC: "The disk is full: free some space (or choose an output folder on another disk) and rerun; "
                  "finished work is kept.",
    errno.EDQUOT: "Your disk quota is used up: free some space and rerun; finished work is kept.",
    errno.ENOTDIR: "A part of the path is a file where a folder is needed: choose another path or move the file.",
    errno.EISDIR: "It is a folder where a file is needed: give the file's path.",
    errno.ELOOP: "It is a symbolic link that leads back to itself: fix or remove the link.",
    errno.EEXIST: "Something of that name is already there: move it away or choose another path.",
    errno.ENAMETOOLONG: "Choose a shorter path.",
}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _os_error(e: OSError) -> str:
    path = e.filename if e.filename is not None else "a file"
    what = e.strerror or _first_line(e)
    also = f" (and {e.filename2})" if getattr(e, "filename2", None) else ""
    advice = _OS_ADVICE.get(e.errno, "Check the path and rerun.")
    return f"{path}{also}: {what}. {advice}"


def _omegaconf_error(e: Exception) -> str | None:
    try:
        from omegaconf.errors import OmegaConfBaseException
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return None
    if not isinstance(e, OmegaConfBaseException):
        return None
    key = getattr(e, "full_key", None)
    where = f"the setting {key}" if key else "a setting"
    why = " ".join((getattr(e, "msg", None) or _first_line(e)).split())
    return (f"{where} could not be resolved: {why}. Fix its value on the command line or in the config: an "
            "interpolation ${oc.env:NAME} needs that environment variable set (or a default, ${oc.env:NAME,value}), "
            "and only the resolvers lmcal and OmegaConf define can be used.")


def _memory_error(e: BaseException) -> str | None:
    oom = type(e).__name__ == "OutOfMemoryError" or isinstance(e, MemoryError)
    if not oom and not (isinstance(e, RuntimeError) and "allocat" in str(e).lower()):
        return None
    detail = " ".join(_first_line(e).split())[:200]
    return (f"Out of memory ({type(e).__name__}: {detail}). The settings ask for more memory than this machine has: "
            "lower the sizes (model.hidden_size, prefix_len, samples_per_prefix, batch sizes) or run on a machine "
            "with more memory.")


def _hydra_error(e: Exception) -> str | None:
    """Hydra's own errors (an override it cannot parse, a config group or option that does not exist): its message."""
    try:
        from hydra.errors import CompactHydraException, InstantiationException
    except ImportError:  # pragma: no cover - hydra is a dependency
        return None
    if not isinstance(e, CompactHydraException) or isinstance(e, InstantiationException):
        return None
    why = " ".join(str(e).split())
    cause = e.__cause__ and " ".join(_first_line(e.__cause__).split())  # e.g. the schema's word on a value's type
    if cause and cause not in why:
        why = f"{why.rstrip('.')}: {cause}"
    return (f"{why.rstrip('.')}. Check the command line's overrides (key=value, +key=value to add a key, "
            "group=option to choose a config; --help lists the groups and their options).")


def explain(e: BaseException) -> str | None:
    """The one paragraph for an error the user can act on, or None for a bug (which keeps its traceback). Looks
    through the exceptions that `e` was raised from (`raise ... from`), so a library's wrapper (Hydra's instantiate)
    hides nothing."""
    first, seen = e, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, LmcalError):
            return str(e)
        if msg := _hydra_error(e):  # (before OSError: Hydra's MissingConfigException is one)
            return msg
        if isinstance(e, UnicodeDecodeError):
            return (f"A file is not UTF-8 text (it holds the bytes {e.object[e.start:e.start + 8]!r}: {e.reason}). "
                    "Convert it to UTF-8 (iconv -f latin1 -t utf-8) or give another file.")
        if isinstance(e, OSError):
            return _os_error(e)
        msg = _omegaconf_error(e) or _memory_error(e)
        if msg:
            return msg
        e = e.__cause__  # (not __context__: a bug raised while handling an OSError is still a bug)
    if type(first).__name__ == "InstantiationException":  # a config node that does not fit the class it names
        return " ".join(str(first).split()) + " Check that config node's keys and values."
    return None


def fail(message: str) -> NoReturn:
    """Prints the one paragraph (its first line is the message, never a blank one) and exits with status 2."""
    print(f"lmcal: error: {message.strip()}", file=sys.stderr, flush=True)
    sys.exit(2)


@contextmanager
def boundary():
    """Runs the block; an error the user can act on (see `explain`) ends the process with one paragraph and exit 2."""
    try:
        yield
    except Exception as e:  # KeyboardInterrupt and SystemExit pass through
        message = explain(e)
        if message is None:
            raise
        fail(message)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the process is, so that it unwinds as on Ctrl-C (locks and temporary files
    removed on the way out)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    for s in (signal.SIGTERM, signal.SIGHUP):  # one stop: a second signal must not interrupt the cleaning up
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


@contextmanager
def stop_on_signals():
    """While the block runs, SIGTERM and SIGHUP raise `Stopped` (a KeyboardInterrupt) in the main thread."""
    before = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def run_hydra(main, go_on: str = "rerun the same command to resume from the last checkpoint") -> None:
    """Runs a @hydra.main entry point inside the boundary. HYDRA_FULL_ERROR=1 lets Hydra's own errors (an override it
    cannot parse, a run folder it cannot make) reach the boundary rather than Hydra's printout and exit status 1.
    SIGTERM and SIGHUP stop it as Ctrl-C does, so that its lock and temporary files are removed (a pipeline ends its
    stages this way); one line says how to go on (`go_on`). Its settings are checked before Hydra writes anything
    (lmcal.utils.precheck); a run refused later (exit 2) removes the run folder Hydra made for it where nothing else
    was written there."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        with boundary(), stop_on_signals():
            main()
    except SystemExit as e:
        if e.code == 2:  # refused: the run folder Hydra made for it, if it holds nothing else, goes too
            remove_untouched()
        raise
    except KeyboardInterrupt as e:
        name = f"Stopped by {e}" if isinstance(e, Stopped) else "Interrupted"
        print(f"{name}: {go_on}.", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum if isinstance(e, Stopped) else 130)


# (run folder, the first of its parents it made) of this process's Hydra run, where the folder did not exist:
# lmcal.utils.precheck
MADE: list[tuple[Path, Path]] = []


def remove_untouched() -> None:
    """After a run that stopped with one paragraph (exit 2): its run folder, if this run made it and it holds only
    what Hydra wrote there (.hydra/ and the job's log), is removed, and the parents made for it that are left empty,
    so that a refused run leaves nothing behind."""
    for folder, top in MADE:
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        hydra_files = {"config.yaml", "hydra.yaml", "overrides.yaml"}
        ours = [e for e in entries if not e.is_symlink() and (  # (a link, and what it leads to, are not ours)
            (e.name == ".hydra" and e.is_dir() and all(f.name in hydra_files and not f.is_symlink()
                                                       for f in e.iterdir()))
            or (e.suffix == ".log" and e.is_file()))]
        if len(ours) != len(entries) or len([e for e in ours if e.suffix == ".log"]) > 1:
            continue
        for e in ours:
            if e.is_dir():
                for f in e.iterdir():
                    f.unlink()
                e.rmdir()
            else:
                e.unlink()
        folder.rmdir()
        while folder != top and folder.parent.is_dir() and not any(folder.parent.iterdir()):
            folder = folder.parent
            folder.rmdir()
    MADE.clear()


def fail_at_import(e: LmcalError) -> None:
    """For an error while lmcal itself is imported (a plugin of $LMCAL_PLUGINS that fails): when this process is one
    of lmcal's entry points (python -m lmcal.<name>), the one paragraph and exit 2; in a library user's process
    nothing, so that the caller raises the error as usual."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and str(spec.name).startswith("lmcal."):
        fail(str(e))
