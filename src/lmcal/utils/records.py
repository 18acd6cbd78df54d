"""A record is read only when it is whole: the one check of every JSON file lmcal reads back (results.json, the stage
records under stages/, scale.json, metrics.json, memory.json and the other stage results, dose rows, bench
summaries, lock files).

`read(path, spec)` reads at most MAX_BYTES, parses, and refuses in one paragraph (LmcalError) naming the file and the
key: text that is not UTF-8 or not JSON, nesting deeper than MAX_DEPTH, NaN or ±Infinity (strict JSON has none:
lmcal writes null and a `K_nonfinite` reason beside), integers beyond 64 bits, and anything that does not fit `spec`.
A spec is
- a type: str, int (not a bool), float (any number: int or float, never a bool), dict, list, bool, or object (any);
- `Maybe(spec)`: null or spec;
- `Range(lo, hi, integer, above)`: a number (an int where `integer`) within [lo, hi] (None: unbounded; `above`:
  lo itself excluded);
- `Of(spec, min_len)`: a list of at least min_len items, each fitting spec;
- `Each(spec)`: an object whose every value fits spec (its keys are names: a stage's, a span's);
- a dict {key: spec}: an object with those keys (a key ending in "?" may be absent; other keys are free);
- a tuple of specs: any one of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcal.errors import LmcalError

MAX_BYTES = 64 * 2**20  # no record lmcal writes comes near this (a paper-size results.json is a few hundred kB)
MAX_DEPTH = 64  # nor nests this deep (results.json: about 6 levels)
INT_LIMIT = 2**63  # the integers a C long (and a float, exactly enough) holds
FIX = "Delete it, or rerun what wrote it; nothing was written or deleted."


@dataclass(frozen=True)
class Maybe:
    spec: Any


@dataclass(frozen=True)
class Range:
    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    above: bool = False  # lo itself excluded (a count of parameters, a perplexity: above 0)


@dataclass(frozen=True)
class Of:
    item: Any = object
    min_len: int = 0


@dataclass(frozen=True)
class Each:
    value: Any = object


POSITIVE = Range(lo=0.0, above=True)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def shown(v) -> str:
    """A value as a message names it: its JSON type and a short form."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, (int, float)):
        return f"the number {str(v)[:40]}"
    if isinstance(v, str):
        return f"a text ({v[:40]!r})"
    if isinstance(v, list):
        return f"a list of {len(v)}" if v else "an empty list"
    return "an object" if isinstance(v, dict) else type(v).__name__


def describe(spec) -> str:
    """What a spec asks for, in words."""
    if isinstance(spec, Maybe):
        return f"{describe(spec.spec)} or null"
    if isinstance(spec, tuple):
        return " or ".join(map(describe, spec))
    if isinstance(spec, Range):
        what = "an integer" if spec.integer else "a number"
        num = lambda x: str(int(x)) if float(x).is_integer() else f"{x:g}"  # noqa: E731
        bounds = ([] if spec.lo is None else [f"{'above' if spec.above else 'at least'} {num(spec.lo)}"]) + (
            [] if spec.hi is None else [f"at most {num(spec.hi)}"])
        return " ".join([what, " and ".join(bounds)]).strip()
    if isinstance(spec, Of):
        return "a list" + (f" of at least {spec.min_len}" if spec.min_len else "")
    if isinstance(spec, (dict, Each)):
        return "an object"
    return {str: "a text", int: "an integer", float: "a number", dict: "an object", list: "a list",
            bool: "a boolean", object: "anything"}.get(spec, getattr(spec, "__name__", str(spec)))


def _join(key: str, name) -> str:
    return f"{key}[{name}]" if isinstance(name, int) else f"{key}.{name}" if key else str(name)


def _where(key: str) -> str:
    if len(key) > 80:  # (a path deep into a nest)
        key = f"{key[:40]}...{key[-30:]}"
    return f"its {key}" if key else "it"


def _fits(value, spec) -> bool:
    if spec is object:
        return True
    if spec is float:
        return _is_number(value)
    if spec is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(spec, Range):
        if not (isinstance(value, int) if spec.integer else _is_number(value)) or isinstance(value, bool):
            return False
        low = spec.lo is None or value > spec.lo or (value == spec.lo and not spec.above)
        return low and (spec.hi is None or value <= spec.hi)
    return isinstance(value, spec)


def problem(value, spec, key: str = "") -> str | None:
    """Why `value` (at `key`, "" for the whole record) does not fit `spec`, naming the key; None when it fits."""
    if isinstance(spec, Maybe):
        return None if value is None else problem(value, spec.spec, key)
    if isinstance(spec, tuple):
        whys = [problem(value, s, key) for s in spec]
        return None if None in whys else f"{_where(key)} is {shown(value)}, not {describe(spec)}"
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{_where(key)} is {shown(value)}, not an object"
        for k, s in spec.items():
            name = k.removesuffix("?")
            if name not in value:
                if k.endswith("?"):
                    continue
                return f"it lacks the key {_join(key, name)}"
            if why := problem(value[name], s, _join(key, name)):
                return why
        return None
    if isinstance(spec, Each):
        if not isinstance(value, dict):
            return f"{_where(key)} is {shown(value)}, not an object"
        return next((why for k, x in value.items() if (why := problem(x, spec.value, _join(key, k)))), None)
    if isinstance(spec, Of):
        if not isinstance(value, list):
            return f"{_where(key)} is {shown(value)}, not a list"
        if len(value) < spec.min_len:
            return f"{_where(key)} is {shown(value)}, where at least {spec.min_len} item(s) are needed"
        for i, x in enumerate(value):
            if why := problem(x, spec.item, _join(key, i)):
                return why
        return None
    return None if _fits(value, spec) else f"{_where(key)} is {shown(value)}, not {describe(spec)}"


def unsound(value) -> str | None:
    """Why a parsed JSON value is no record whatever its schema, naming the key: nesting deeper than MAX_DEPTH, a
    number that is not finite (NaN, ±Infinity, or a float literal that overflows, 1e400), an integer beyond 64 bits.
    Iterative: any depth is looked at without recursion."""
    stack = [(value, "", 0)]
    while stack:
        v, key, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                return f"{_where(key)} nests deeper than {MAX_DEPTH} levels"
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack += [(x, _join(key, k), depth + 1) for k, x in items]
        elif isinstance(v, float) and not math.isfinite(v):
            return f"{_where(key)} is {v} (strict JSON has no NaN or Infinity: lmcal writes null there)"
        elif isinstance(v, int) and not isinstance(v, bool) and not -INT_LIMIT <= v < INT_LIMIT:
            return f"{_where(key)} is an integer of {len(str(abs(v)))} digits, beyond 64 bits"
    return None


def parse(text: str):
    """(value, None) of JSON text that is sound (`unsound`), or (None, why not)."""
    try:
        value = json.loads(text)
    except RecursionError:
        return None, f"it nests too deeply to parse (lmcal's records nest at most {MAX_DEPTH} levels)"
    except ValueError as e:  # (JSONDecodeError; and an integer literal of over 4300 digits)
        return None, f"it does not parse ({' '.join(str(e).split())[:120]})"
    why = unsound(value)
    return (None, why) if why else (value, None)


def load(path: str | Path, spec=dict, max_bytes: int | None = None):
    """(value, None) of the record in `path` when it is whole (at most max_bytes, default MAX_BYTES, of UTF-8 JSON,
    sound, fitting `spec`), else (None, why not). An OSError (no such file, a folder) is the caller's: it is
    raised."""
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        return None, f"it is over {max_bytes / 2**20:g} MiB, more than any record lmcal writes"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"it is not UTF-8 text (bytes {data[e.start:e.start + 8]!r})"
    value, why = parse(text)
    if why is None:
        why = problem(value, spec)
    return (None, why) if why else (value, None)


def read(path: str | Path, spec=dict, what: str = "a record lmcal wrote", fix: str = FIX):
    """The record in `path`, whole (see `load`); LmcalError otherwise: one paragraph, "<path> is not <what>: <why,
    naming the key>. <fix>"."""
    value, why = load(path, spec)
    if why:
        raise LmcalError(f"{path} is not {what}: {why}. {fix}")
    return value


def check(value, spec, path: str | Path, what: str = "a record lmcal wrote", fix: str = FIX):
    """`value` (read from `path`) when it is sound and fits `spec`; LmcalError as `read` words it otherwise."""
    why = unsound(value) or problem(value, spec)
    if why:
        raise LmcalError(f"{path} is not {what}: {why}. {fix}")
    return value
