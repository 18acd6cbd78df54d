"""The analysis stages, each declared once in `STAGES`: its compute function, its settings' dataclass (the schema of
analysis.<name>), the kinds of model it applies to, and the summary it adds to metrics.json. `train` (through one
Lightning callback), `evaluate` and `make reproduce` all run stages through `run_stages`.

Each stage is one module of lmcal.stages, named after it, holding `compute(target, settings) -> Result` and its
`STAGE` entry (no Lightning, no Hydra, no files: `publish` writes the result); its maths is the lmcal.core module of
the same name, its settings a dataclass of lmcal.stages.configs.

Adding a stage: a settings dataclass, a compute function returning a `Result`, one `Stage` entry (listed below, or
`register`ed from a plugin).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lmcal.errors import LmcalError
from lmcal.stages import calibration, decoders, entropy_rate, future_entropy, memory, sequence_calibration
from lmcal.stages.rows import method_label
from lmcal.stages.stage import KINDS, Stage, publish
from lmcal.utils import profiling
from lmcal.utils.oom import is_out_of_memory, oom_refusal
from lmcal.utils.rules import renamed_note

STAGES: dict[str, Stage] = {s.name: s for s in (entropy_rate.STAGE, calibration.STAGE, decoders.STAGE,
                                                 future_entropy.STAGE, sequence_calibration.STAGE, memory.STAGE)}


def register(stage: Stage) -> Stage:
    """Adds a stage to the registry (a plugin module named in $LMCAL_PLUGINS does this when lmcal.stages loads, so
    that every process of a pipeline knows it)."""
    STAGES[stage.name] = stage
    return stage


def settings_keys(stage: Stage) -> list[str]:
    """The settings a stage takes: the fields of its settings' dataclass."""
    return [f.name for f in dataclasses.fields(stage.config)]


def stage_kinds(name: str, settings: dict | None = None) -> frozenset[str]:
    """The kinds of model stage `name` applies to with its settings (analysis.<name>; None: its defaults)."""
    s = STAGES[name]
    if dataclasses.is_dataclass(settings):
        settings = dataclasses.asdict(settings)
    return s.kinds_with(settings or {}) if s.kinds_with else s.kinds


def check_stages(names: list[str], kind: str | None, settings: dict[str, dict] | None = None) -> None:
    """One rule for every entry point: unknown stages, and stages that do not apply to this kind of model (None: not
    known yet) with their settings ({name: analysis.<name>}; None: the defaults), are one paragraph naming the stages
    that do."""
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise LmcalError(f"Unknown analysis stage{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the stages "
                         f"are {', '.join(STAGES)}.")
    kinds = {n: stage_kinds(n, (settings or {}).get(n) if n in names else None) for n in STAGES}
    wrong = [n for n in names if kind is not None and kind not in kinds[n]]
    if wrong:
        fits = [n for n in STAGES if kind in kinds[n]]
        needs = "; ".join(f"{n} runs on a {' or a '.join(KINDS[k] for k in KINDS if k in kinds[n])}"
                          + (f", {STAGES[n].kinds_note}" if STAGES[n].kinds_note else "") for n in wrong)
        raise LmcalError(f"Stage{'s' if len(wrong) > 1 else ''} {', '.join(wrong)} do{'es' if len(wrong) == 1 else ''}"
                         f" not apply to a {KINDS[kind]} ({needs}); the stages that do: {', '.join(fits)}.")


def settings_of(name: str, settings):
    """`settings` (the node analysis.<name> as a dict, or already the stage's settings) as an instance of the stage's
    settings dataclass: an unknown key is one paragraph listing the valid ones, a value of the wrong type another."""
    cls = STAGES[name].config
    if isinstance(settings, cls):
        return settings
    valid = settings_keys(STAGES[name])
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise LmcalError(f"Unknown setting{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(f'analysis.{name}.{k}' for k in unknown)}; the {name} stage takes "
                         f"{', '.join(valid)}." + renamed_note(name, unknown))
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), settings))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        why = str(e).splitlines()[0]
        raise LmcalError(f"analysis.{name}.{key}: {why}. See the {name} stage's settings "
                         f"({cls.__module__}.{cls.__name__}).") from None


def check_settings(name: str, settings) -> dict:
    """`settings` checked as settings_of does, returned whole as a plain dict (every field, defaults filled in)."""
    return dataclasses.asdict(settings_of(name, settings))


def check_plan(names: list[str], kind: str | None, settings: dict) -> dict:
    """The checks every entry point makes before any work: the stages exist and apply to `kind`, and each one's
    settings (analysis.<name>) are its own. Returns {name: settings}."""
    check_stages(names, kind, settings)
    return {n: check_settings(n, settings.get(n) or {}) for n in names}


def run_stage(name: str, target: dict, settings, out_dir: str | Path, logger=None, earlier: dict | None = None,
              as_name: str | None = None) -> dict:
    """Stage `name` on `target` with `settings` (its dataclass, or a dict of analysis.<name>): its result written
    into out_dir (as `as_name`, the stage's name by default) and logged; returns its record."""
    st, cfg = STAGES[name], settings_of(name, settings)
    try:
        result = st.compute({**target, "earlier": earlier or target.get("earlier") or {}}, cfg)
    except Exception as e:
        if is_out_of_memory(e):  # (one paragraph naming the setting that lowers it, not torch's traceback)
            raise oom_refusal(e, f"Stage '{name}'", f"analysis.{name}", dataclasses.asdict(cfg)) from e
        raise
    return publish(result, out_dir, as_name or name, logger)


def run_stages(names: list[str], target: dict, settings: dict, out_dir: str | Path, logger=None) -> dict:
    """Runs `names` on `target` in the registry's order, with `settings[name]` (all checked before any runs);
    returns {name: record}."""
    checked = check_plan(names, target["kind"], settings)
    results: dict[str, dict] = {}
    if "lm" in target:  # every step of the model timed as "forward" (lmcal.utils.profiling)
        target = {**target, "lm": profiling.profiled(target["lm"])}
    for n in [n for n in STAGES if n in names]:  # registry order: decoders reuse this run's calibration
        profiling.reset()
        t0 = time.perf_counter()
        with profiling.span(n):
            results[n] = run_stage(n, target, checked[n], out_dir, logger, results)
        if isinstance(results[n], dict):  # where its time went: evaluation.json, and REPORT.md's profile table
            results[n]["profile"] = {"seconds": time.perf_counter() - t0, "spans": profiling.snapshot()}
    return results


def summary(results: dict[str, dict]) -> dict:
    """The metrics.json keys of the stages that ran."""
    return {k: v for n, r in results.items() if r for k, v in STAGES[n].summary(r).items()}


# numbers of a stage's result shown beside its summary in the table evaluate ends with (with their standard errors)
HEADLINE = {"entropy_rate": ("test_ppl", "tail_nats", "tail_stderr_nats"), "calibration": ("alpha_stderr",),
            "memory": ("delta_ce_stderr_nats", "ce_full_nats", "ce_full_stderr_nats", "ce_limited_nats")}
ROW_METRICS = ("tail_ppl", "tail_diff_nats", "test_ce_nats", "test_ce_diff_nats")  # of each method (entrate_ppl
# where it has no tail_ppl)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _stderr(d: dict, key: str) -> float | None:
    """The standard error of d[key], by the results' naming: key_stderr, *_stderr_nats, mi_stderr_nats."""
    for k in (f"{key}_stderr", key.replace("_nats", "_stderr_nats"), "mi_stderr_nats" if "mi_upper" in key else ""):
        if k and k != key and _number(d.get(k)):
            return float(d[k])
    return None


def result_rows(results: dict[str, dict]) -> list[tuple[str, str, float, float | None]]:
    """(stage, metric, value, standard error or None) of every stage's summary (and HEADLINE numbers), one row per
    number; a stage's methods (decoders, future_entropy, sequence_calibration) give ROW_METRICS each."""
    out = []
    for n, r in results.items():
        if n not in STAGES or not isinstance(r, dict):
            continue
        s = {**{k: r[k] for k in HEADLINE.get(n, ()) if k in r}, **STAGES[n].summary(r)}
        out += [(n, k, float(v), _stderr(s, k)) for k, v in s.items() if _number(v) and "stderr" not in k]
        methods = [(str(m), row) for v in s.values() if isinstance(v, dict) for m, row in v.items()]
        methods += [(method_label(row.get("method", "?"), row.get("params")), row) for v in s.values()
                    if isinstance(v, list) for row in v if isinstance(row, dict) and row.get("source", n) == n]
        out += [(n, f"{label}: {k}", float(row[k]), _stderr(row, k)) for label, row in methods if isinstance(row, dict)
                for k in (ROW_METRICS if "tail_ppl" in row else ("entrate_ppl", *ROW_METRICS))
                if _number(row.get(k))]
    return out


def load_plugins() -> None:
    """Imports the modules named in $LMCAL_PLUGINS (comma-separated), each of which registers its stages: every process
    of a pipeline then knows them. lmcal.stages calls this once, when it is first imported."""
    for name in filter(None, os.environ.get("LMCAL_PLUGINS", "").split(",")):
        try:
            importlib.import_module(name.strip())
        except Exception as e:  # missing, raising, or not Python (SyntaxError): the plugin's fault, told as such
            where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
            detail = " ".join(str(e).split())[:200]
            raise LmcalError(f"LMCAL_PLUGINS names {name.strip()!r}, which does not import ({type(e).__name__}"
                             f"{where}: {detail}); it should be a module on the Python path that calls "
                             "lmcal.stages.register(...). Fix the module, or unset LMCAL_PLUGINS "
                             "(or remove that name from it).") from None
