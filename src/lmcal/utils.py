"""Small shared helpers: atomic writes, and how parameters and cross-entropies read in tables."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def copy_atomic(src: str | Path, dst: str | Path) -> None:
    """Copy to a temporary file beside `dst`, then rename."""
    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def format_params(params: dict, digits: int = 4, drop: tuple[str, ...] = (), empty: str = "–") -> str:
    """"k=v, ..." with floats to `digits` significant digits, leaving out keys that contain any of `drop`; `empty`
    if none is left."""
    return ", ".join(f"{k}={v:.{digits}g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
                     if not any(d in k for d in drop)) or empty


def format_ce(nats: float | None) -> str:
    """A cross-entropy for a table: None (a word of probability 0) reads as ∞."""
    return "∞" if nats is None else f"{nats:.4f}"
