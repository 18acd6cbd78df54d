"""Files written whole or not at all: atomic writes (a temporary name, then a rename), strict JSON (no NaN), and
reading JSON back.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

from lmcal.errors import LmcalError
from lmcal.utils.profiling import timed
from lmcal.utils.safe_paths import check_not_link


def file_name(value, source: str | Path, key: str) -> str:
    """`value`, a name read from a file (`source`, its `key`), made safe to become part of a file name: every run of
    characters other than letters, digits, _ + - becomes one _ (so no separator, no dot, no ..), at most 64 of them.
    "valid (gpt2 tokens)" -> "valid_gpt2_tokens", "../../../tmp/x" -> "tmp_x"; a name left empty is an error."""
    name = re.sub(r"[^A-Za-z0-9_+-]+", "_", str(value)).strip("_")[:64]
    if not name:
        raise LmcalError(f"{source}: its {key} {str(value)[:80]!r} has no letter or digit to name a file by. Fix that "
                         "value or delete the file.")
    return name


def inside(folder: str | Path, path: str | Path) -> Path:
    """`path`, after checking that it resolves (links followed) inside `folder`: no write lands outside its output
    folder, whatever a name in it held."""
    folder, path = Path(folder), Path(path)
    if not path.resolve().is_relative_to(folder.resolve()):
        raise LmcalError(f"Refusing to write {path}: it resolves to {path.resolve()}, outside the output folder "
                         f"{folder.resolve()}. Remove the link or the name that leads there.")
    return path


def temp_path(path: str | Path) -> Path:
    """A temporary name beside `path`, unique to this process and call: two writers never share one."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


@contextmanager
def atomic_path(path: str | Path):
    """Yields a temporary path to write; renamed onto `path` when the block ends, removed if it fails. A `path` that
    is a symbolic link is refused (lmcal.utils.safe_paths.check_not_link), before and again at the rename; the
    temporary file is created here, new (O_EXCL, not through a link), with the permissions of the user's umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_not_link(path)
    tmp = temp_path(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666))
    try:
        yield tmp
        check_not_link(path)  # (a link made while the file was written)
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


def read_json(path: str | Path):
    """The JSON value in a file."""
    return json.loads(Path(path).read_text())


def read_record(path: str | Path, warn: bool = True) -> dict | None:
    """The JSON object in `path`; None when there is none, or when the file does not hold one (truncated, edited, not
    an object), with a warning naming it: a record or result that does not parse means "not done", and its stage
    runs again."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # (JSONDecodeError, UnicodeDecodeError; nested too deeply)
        why = " ".join(str(e).split())[:120]
    else:
        if isinstance(value, dict):
            return value
        why = f"a JSON {type(value).__name__}, not an object"
    if warn:
        print(f"warning: {path} does not parse ({why}); taking its stage as not done, so it runs again.",
              file=sys.stderr, flush=True)
    return None


def copy_atomic(src: str | Path, dst: str | Path) -> None:
    """Copy to a temporary file beside `dst`, then rename."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
