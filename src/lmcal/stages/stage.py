"""One analysis stage as the registry holds it (`Stage`), and what the stages' adapters share.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lmcal.errors import LmcalError

KINDS = {"full": "full-context model", "tau": "tau-limited model (model.memory_tau)", "hf": "Hugging Face model"}


# Keyword arguments a stage function gets from the target and the entry point, never from its settings node.
CONTEXT = ("model_name", "corpus", "unit", "logger", "name", "calibration", "decoders", "base_ckpt", "ckpt",
           "exact_mi_nats", "bptt")


@dataclass(frozen=True)
class Stage:
    """One analysis stage. `call(target, out_dir, logger, earlier, **settings)` runs `fn` on a target (a dict: lm,
    valid, test, test_ce, name, corpus, unit, kind; net, base, bptt, exact_mi, ckpt, base_ckpt for the memory bound),
    `earlier` being the results of the stages run before it; `summary(result)` gives its metrics.json keys."""

    name: str
    fn: Callable[..., dict]
    call: Callable[..., dict]
    kinds: frozenset[str]
    summary: Callable[[dict], dict]
    entry_settings: tuple[str, ...] = ()  # read by the entry points or `call`, not passed to `fn`
    uses: tuple[str, ...] = ()  # stages whose result it reads: run before it, and given as analysis.<name>.<use>_json
    kinds_with: Callable[[dict], frozenset[str]] | None = None  # its kinds given its settings, where these matter
    kinds_note: str = ""  # says how its settings widen its kinds (in the error for a kind it does not apply to)
    needs_test_ce: bool = False  # reads target["test_ce"], the model's test CE that the entry point computes for it


def stage_context(target: dict, logger) -> dict:
    """The keyword arguments every stage function takes from its target and entry point."""
    return {"model_name": target["name"], "corpus": target["corpus"], "logger": logger}


def earlier_result(earlier: dict, stage: str, use: str, path: str | None, otherwise: str) -> dict | None:
    """The result of stage `use` that `stage` reads: this run's, else the file analysis.<stage>.<use>_json names
    (None without either); `otherwise` says what the stage does without it."""
    r = earlier.get(use)
    if r is None and path:
        if not Path(path).is_file():
            raise LmcalError(f"analysis.{stage}.{use}_json={path} does not exist; run stages=[{use}] first, or drop "
                             f"the setting to {otherwise}.")
        r = json.loads(Path(path).read_text())
    return r


def read_result(path: str | None, stage: str, key: str) -> dict | None:
    """A results file that analysis.<stage>.<key> names, read as data (JSON), or None without one; one clear error
    where it is missing or is not a JSON object."""
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise LmcalError(f"analysis.{stage}.{key}={path} does not exist: name the JSON a finished run of the stage "
                         "wrote, or drop the setting.")
    try:
        r = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LmcalError(f"analysis.{stage}.{key}={path} is not a JSON file ({e}): name the JSON a finished run of "
                         "the stage wrote.") from None
    if not isinstance(r, dict):
        raise LmcalError(f"analysis.{stage}.{key}={path} holds a JSON {type(r).__name__}, not a stage's result.")
    return r


def pick(*keys):
    """A stage's summary: these keys of its result."""
    return lambda r: {k: r[k] for k in keys}
