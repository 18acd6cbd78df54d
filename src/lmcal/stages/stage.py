"""One analysis stage as the registry holds it (`Stage`), what its work returns (`Result`), and how a result is
written and logged (`publish`): every stage has the shape compute(target, settings) -> Result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcal.errors import LmcalError
from lmcal.stages.wandb_run import wandb_group, wandb_log
from lmcal.utils import records
from lmcal.utils.io import write_json_atomic, write_text_atomic

log = logging.getLogger("lmcal")

KINDS = {"full": "full-context model", "tau": "tau-limited model (model.memory_tau)", "hf": "Hugging Face model"}


@dataclass(frozen=True)
class Stage:
    """One analysis stage. `compute(target, settings)` does its work and returns its `Result`; `target` is what it
    analyses (a dict: lm, valid, test, train, test_ce, name, corpus, unit, kind; net, base, exact_mi, ckpt, base_ckpt
    for the memory bound; `earlier`, the records of the stages run before it), `settings` an instance of `config`,
    the dataclass that is the schema of analysis.<name> and the one source of its defaults. `summary(record)` gives
    its metrics.json keys."""

    name: str
    config: type
    compute: Callable[[dict, Any], Result]
    kinds: frozenset[str]
    summary: Callable[[dict], dict]
    uses: tuple[str, ...] = ()  # stages whose result it reads: run before it, and given as analysis.<name>.<use>_json
    kinds_with: Callable[[dict], frozenset[str]] | None = None  # its kinds given its settings, where these matter
    kinds_note: str = ""  # says how its settings widen its kinds (in the error for a kind it does not apply to)
    needs_test_ce: bool = False  # reads target["test_ce"], the model's test CE that the entry point computes for it


@dataclass
class Result:
    """What a stage's compute returns: its record (`<name>.json`, the keys every reader of it knows) and how it is
    shown. A stage subclasses it to draw its own table and figure from the record."""

    record: dict

    def to_json(self) -> dict:
        return self.record

    def table(self) -> str | None:
        """`<name>.md` (None: none)."""
        return None

    def figure(self, path: Path) -> Path | None:
        """Draws `<name>.png` at `path` and returns it (None: no figure)."""
        return None

    def extras(self, out: Path, name: str) -> dict[str, Path]:
        """Further files beside the record; returns the figures among them, {W&B key under name/: path}."""
        return {}

    def log_wandb(self, logger, name: str, images: dict[str, Path]) -> None:
        """Logs the result to the run behind `logger` (a no-op without one), with the figures drawn."""
        wandb_log(logger, images=images)

    def line(self, name: str) -> str:
        """The log line that says what it found."""
        return f"{name}: done"


def publish(result: Result, out_dir: str | Path, name: str, logger=None) -> dict:
    """Writes a stage's result into out_dir (`<name>.md`, `.png`, its extras, then `<name>.json`, whose presence
    marks the stage done, with the W&B group of a W&B run), logs it to W&B and says what it found; returns its
    record."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = {}
    png = result.figure(out / f"{name}.png")
    if png is not None:
        images[f"{name}/figure"] = png
    images.update({f"{name}/{k}": p for k, p in result.extras(out, name).items()})
    table = result.table()
    if table is not None:
        write_text_atomic(out / f"{name}.md", table)
    record = result.to_json()
    if (group := wandb_group(logger)) is not None:  # the run's W&B group: a report over these records joins it
        record["wandb_group"] = group
    write_json_atomic(out / f"{name}.json", record)
    result.log_wandb(logger, name, images)
    first, *more = result.line(name).split("\n", 1)  # the record's path on the first line, any table below it
    log.info("\n".join([f"{first}; {out / (name + '.json')}", *more]))
    return record


def target(lm, *, valid=None, test=None, train=None, test_ce: float | None = None, name: str = "model",
           corpus: str = "text", unit: str = "word", kind: str = "full", **more) -> dict:
    """The target a stage's compute takes, for a model of one's own: a StepLM and its token streams ([N] tensors)."""
    return {"lm": lm, "valid": valid, "test": test, "train": train, "test_ce": test_ce, "name": name,
            "corpus": corpus, "unit": unit, "kind": kind, "earlier": {}, **more}


def earlier_result(target: dict, stage: str, use: str, path: str | None) -> dict | None:
    """The result of stage `use` that `stage` reads: this run's (target["earlier"]), else the file
    analysis.<stage>.<use>_json names (None without either)."""
    r = target.get("earlier", {}).get(use)
    return r if r is not None else read_result(path, stage, f"{use}_json")


def read_result(path: str | None, stage: str, key: str) -> dict | None:
    """A results file that analysis.<stage>.<key> names, read as data (JSON), or None without one; one clear error
    where it is missing or is not a JSON object."""
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise LmcalError(f"analysis.{stage}.{key}={path} does not exist: name the JSON a finished run of the stage "
                         "wrote, or drop the setting.")
    r, why = records.load(p, dict)
    if why:
        raise LmcalError(f"analysis.{stage}.{key}={path} is not a stage's result: {why}. Name the JSON a finished run "
                         "of the stage wrote.")
    return r


def pick(*keys):
    """A stage's summary: these keys of its result."""
    return lambda r: {k: r[k] for k in keys}
