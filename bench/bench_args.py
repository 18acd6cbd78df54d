"""What the benchmarks read, checked before any work: their command-line numbers as argparse reads them (a bad one is
argparse's error naming the option, exit 2: `--num-prefixes -3` is not "all but 3") and the JSON files they are
given (one line naming the file and the key, exit 2: lmcal.utils.records). Not a benchmark itself: the others import
it (bench/ is on sys.path when one runs as a script).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from lmcal.utils import records


def _number(text: str, integer: bool):
    try:
        v = int(text) if integer else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if integer else 'a number'}") from None
    if not integer and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def count(text: str) -> int:
    """An integer >= 1: a number of positions, prefixes, repetitions, tokens, particles..."""
    v = _number(text, True)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not a count: it must be an integer >= 1")
    return v


def count_or_zero(text: str) -> int:
    """An integer >= 0, where 0 means none (or: the default)."""
    v = _number(text, True)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be an integer >= 0")
    return v


def positive(text: str) -> float:
    """A finite number > 0: seconds, GB, a multiple."""
    v = _number(text, False)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{v:g} must be a number > 0")
    return v


def share(text: str) -> float:
    """A number in (0, 1]."""
    v = _number(text, False)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{v:g} must be a number in (0, 1]")
    return v


def read_shaped(path: str | Path, spec, what: str) -> dict:
    """The JSON object in `path` when it fits `spec` (lmcal.utils.records' specs); LmcalError otherwise, in one
    paragraph naming the file and the key (run the benchmark inside lmcal.utils.boundary.boundary: one line on
    stderr, exit 2)."""
    return records.read(path, spec, what, "Give the file that stage wrote (its run folder's), or rerun the stage.")


def check_shaped(value, spec, path: str | Path, what: str):
    """`value`, a part of the file `path`, when it fits `spec`; LmcalError naming the file and the key otherwise."""
    return records.check(value, spec, path, what, "Give the file that stage wrote (its run folder's), or rerun the "
                                                  "stage.")
