"""The analysis stages, each declared once in `STAGES`: its plain function, the kinds of model it applies to, its
settings node under conf/analysis/, and the summary it adds to metrics.json. `train` (through one Lightning callback),
`evaluate` and `make reproduce` all run stages through `run_stages`.

The stage functions live in lmcal.analysis (the future_entropy stage in lmcal.analysis_future): each takes what it
analyses, an output folder and keyword settings, writes its files and returns its result as a dict. No Lightning, no
Hydra.

Adding a stage: one function, one `Stage` entry below (or `register` from a plugin), and one node in
conf/analysis/default.yaml.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lmcal import profiling
from lmcal.analysis import (
    calibration_stage,
    decoders_stage,
    entropy_rate_stage,
    memory_stage,
)
from lmcal.analysis_future import future_entropy_stage
from lmcal.errors import LmcalError
from lmcal.validate import renamed_note

# ---------------------------------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------------------------------

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


def _common(target: dict, logger) -> dict:
    return {"model_name": target["name"], "corpus": target["corpus"], "logger": logger}


def _used(earlier: dict, stage: str, use: str, path: str | None, otherwise: str) -> dict | None:
    """The result of stage `use` that `stage` reads: this run's, else the file analysis.<stage>.<use>_json names
    (None without either); `otherwise` says what the stage does without it."""
    r = earlier.get(use)
    if r is None and path:
        if not Path(path).is_file():
            raise LmcalError(f"analysis.{stage}.{use}_json={path} does not exist; run stages=[{use}] first, or drop "
                             f"the setting to {otherwise}.")
        r = json.loads(Path(path).read_text())
    return r


def _decoders_call(t, out, logger, earlier, calibration_json=None, **s):
    cal = _used(earlier, "decoders", "calibration", calibration_json, "fit the calibration row here")
    return decoders_stage(t["lm"], t["valid"], t["test"], out, calibration=cal, unit=t["unit"], **_common(t, logger),
                          **s)


def _future_call(t, out, logger, earlier, decoders_json=None, **s):
    dec = _used(earlier, "future_entropy", "decoders", decoders_json, "leave the decoders' rows out")
    if "train" not in t:
        raise LmcalError("The future_entropy stage trains its heads on rollouts from the training text, which this "
                         "model's target does not carry.")
    return future_entropy_stage(t["lm"], t["train"], t["valid"], t["test"], out, decoders=dec, unit=t["unit"],
                                **_common(t, logger), **s)


def _memory_call(t, out, logger, earlier, **s):
    # a tau-model is compared with its base; a full-context or Hugging Face model (limited=window) is its own base
    base = t["base"] if "base" in t else t.get("net", t["lm"])
    return memory_stage(base, t["net"] if t["kind"] == "tau" else None, t["valid"], t["test"], out,
                        base_ckpt=t.get("base_ckpt"), ckpt=t.get("ckpt"), exact_mi_nats=t.get("exact_mi"),
                        **_common(t, logger), **s)


def _memory_kinds(settings: dict) -> frozenset[str]:
    """limited=window runs the model itself on tau-token windows, so any model will do; trained needs a tau-model."""
    limited = settings.get("limited", "trained")
    if limited not in ("trained", "window"):
        raise LmcalError(f"analysis.memory.limited={limited!r}: choose trained (a tau-model checkpoint against its "
                         "base) or window (the model itself on tau-token windows).")
    return frozenset({"tau", "full", "hf"}) if limited == "window" else frozenset({"tau"})


def _pick(*keys):
    return lambda r: {k: r[k] for k in keys}


STAGES: dict[str, Stage] = {s.name: s for s in [
    Stage("entropy_rate", entropy_rate_stage,
          lambda t, out, logger, earlier, every_n_epochs=None, **s:  # every_n_epochs: train's, during training
          entropy_rate_stage(t["lm"], t["valid"], t["test_ce"], out, unit=t["unit"], **_common(t, logger), **s),
          frozenset({"full", "hf"}), _pick("entrate_ppl"), entry_settings=("every_n_epochs",), needs_test_ce=True),
    Stage("calibration", calibration_stage,
          lambda t, out, logger, earlier, **s: calibration_stage(t["lm"], t["valid"], t["test"], out, unit=t["unit"],
                                                                 **_common(t, logger), **s),
          frozenset({"full", "hf"}),
          _pick("alpha", "test_ppl_before", "test_ppl_after", "entrate_ppl_before", "entrate_ppl_after",
                "tail_ppl_before", "tail_ppl_after", "tail_diff_nats", "tail_diff_stderr_nats")),
    Stage("decoders", decoders_stage, _decoders_call, frozenset({"full", "hf"}),
          lambda r: {"decoders": {row["method"]: {k: row[k] for k in ("entrate_ppl", "test_ce_nats",
                                                                      "zero_prob_fraction", "tail_diff_nats",
                                                                      "tail_diff_stderr_nats")} for row in r["rows"]}},
          entry_settings=("calibration_json",), uses=("calibration",)),
    Stage("future_entropy", future_entropy_stage, _future_call, frozenset({"full", "hf"}),
          lambda r: {"future_entropy": [{k: row.get(k) for k in (
              "method", "params", "entrate_ppl", "tail_ppl", "test_ce_nats", "ms_per_token", "entropy_t1_nats",
              "tail_diff_nats", "tail_diff_stderr_nats", "test_ce_diff_nats", "test_ce_diff_stderr_nats",
              "zero_prob_fraction", "cost_ratio", "source")} for row in r["rows"]]},
          entry_settings=("decoders_json",), uses=("decoders",)),
    Stage("memory", memory_stage, _memory_call, frozenset({"tau"}),
          _pick("alpha", "mi_upper_bound_nats", "mi_stderr_nats", "mi_upper_bound_crossfit_nats", "delta_ce_nats"),
          kinds_with=_memory_kinds, kinds_note="or, with analysis.memory.limited=window analysis.memory.tau=TAU, on "
                                               "any model, fed tau-token windows"),
]}


def register(stage: Stage) -> Stage:
    """Adds a stage to the registry (a plugin module named in $LMCAL_PLUGINS does this when lmcal.stages loads, so
    that every process of a pipeline knows it)."""
    STAGES[stage.name] = stage
    return stage


def settings_keys(stage: Stage) -> list[str]:
    """The settings a stage takes: its function's keyword parameters (less what the target supplies) and the entry
    points' own."""
    params = inspect.signature(stage.fn).parameters.values()
    return [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.name not in CONTEXT] + list(stage.entry_settings)


def stage_kinds(name: str, settings: dict | None = None) -> frozenset[str]:
    """The kinds of model stage `name` applies to with its settings (analysis.<name>; None: its defaults)."""
    s = STAGES[name]
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


def check_settings(name: str, settings: dict) -> dict:
    """`settings` (the node analysis.<name>) checked against the stage's parameters: an unknown key is one paragraph
    listing the valid ones."""
    valid = settings_keys(STAGES[name])
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise LmcalError(f"Unknown setting{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(f'analysis.{name}.{k}' for k in unknown)}; the {name} stage takes "
                         f"{', '.join(valid)}." + renamed_note(name, unknown))
    return dict(settings)


def check_plan(names: list[str], kind: str | None, settings: dict[str, dict]) -> dict[str, dict]:
    """The checks every entry point makes before any work: the stages exist and apply to `kind`, and each one's
    settings (analysis.<name>) are its own. Returns {name: settings}."""
    check_stages(names, kind, settings)
    return {n: check_settings(n, settings.get(n) or {}) for n in names}


def run_stages(names: list[str], target: dict, settings: dict[str, dict], out_dir: str | Path, logger=None) -> dict:
    """Runs `names` on `target` in the registry's order, with `settings[name]` (all checked before any runs);
    returns {name: result}."""
    checked = check_plan(names, target["kind"], settings)
    results: dict[str, dict] = {}
    if "lm" in target:  # every step of the model timed as "forward" (lmcal.profiling)
        target = {**target, "lm": profiling.profiled(target["lm"])}
    for n in [n for n in STAGES if n in names]:  # registry order: decoders reuse this run's calibration
        profiling.reset()
        t0 = time.perf_counter()
        with profiling.span(n):
            results[n] = STAGES[n].call(target, Path(out_dir), logger, results, **checked[n])
        if isinstance(results[n], dict):  # where its time went: evaluation.json, and REPORT.md's profile table
            results[n]["profile"] = {"seconds": time.perf_counter() - t0, "spans": profiling.snapshot()}
    return results


def summary(results: dict[str, dict]) -> dict:
    """The metrics.json keys of the stages that ran."""
    return {k: v for n, r in results.items() if r for k, v in STAGES[n].summary(r).items()}


for _plugin in filter(None, os.environ.get("LMCAL_PLUGINS", "").split(",")):
    try:
        importlib.import_module(_plugin.strip())
    except ImportError as e:
        raise LmcalError(f"LMCAL_PLUGINS names {_plugin!r}, which does not import ({e}); it should be a module on "
                         "the Python path that calls lmcal.stages.register(...).") from None
