"""Every key of a run's settings checked against the schema that reads it, before any work: a key that nothing reads
(a typo, `+optim.lrr=3`) is refused in one paragraph naming it and the nearest known keys, instead of a TypeError
after the data has loaded, or a setting silently ignored.

The schemas: the entry point's own config file (its top-level keys and config groups), the optimiser's OptimConfig,
the data's DataConfig, the network's constructor (AWDLSTM, GPTLM), Lightning's Trainer, and each analysis stage's
settings (lmcal.stages.registry)."""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import inspect
from dataclasses import fields
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.stages.registry import STAGES, settings_keys
from lmcal.training.optim import OptimConfig
from lmcal.utils.settings import CONF_DIR


@functools.cache  # (the plan check asks once per stage and tau-model)
def top_keys(entry: str) -> frozenset[str]:
    """The top-level keys of `entry`'s config (conf/train.yaml or conf/evaluate.yaml): its own keys, its config
    groups and hydra."""
    conf = OmegaConf.load(CONF_DIR / f"{entry.rsplit('.', 1)[-1]}.yaml")
    groups = {next(iter(d)) for d in conf.get("defaults", []) if isinstance(d, DictConfig)}
    return frozenset((set(conf) - {"defaults"}) | groups | {"hydra"})


def analysis_keys() -> set[str]:
    """The keys of `analysis`: each registered stage's settings, and the keys conf/analysis/default.yaml gives them
    all."""
    conf = OmegaConf.load(CONF_DIR / "analysis" / "default.yaml")
    return set(STAGES) | (set(conf) - {"defaults"} - set(STAGES))


def network_keys(target: str) -> set[str] | None:
    """The settings the network `target` (model._target_) takes: its constructor's parameters; None for a model this
    check does not know (a Hugging Face one, read by its own loader)."""
    from lmcal.models.awd_lstm import AWDLSTM
    from lmcal.models.transformer import GPTLM

    cls = {"AWDLSTM": AWDLSTM, "GPTLM": GPTLM}.get(str(target).rsplit(".", 1)[-1])
    if cls is None:
        return None
    return {p for p in inspect.signature(cls.__init__).parameters if p != "self"} | {"_target_"}


def trainer_keys() -> set[str]:
    """The parameters of Lightning's Trainer, read from its source file rather than by importing Lightning (seconds
    that a refused setting should not wait for); by its signature where the source is not where Lightning keeps it."""
    spec = importlib.util.find_spec("pytorch_lightning")
    path = Path(spec.origin).parent / "trainer" / "trainer.py" if spec and spec.origin else None
    if path is not None and path.is_file():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name == "Trainer":
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        a = item.args
                        return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} - {"self"}
    import pytorch_lightning as pl

    return set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}


@functools.cache
def fixed_sections() -> dict[str, frozenset[str]]:
    """The known keys of the sections whose schema never changes: optim, data, trainer."""
    from lmcal.data.batching import DataConfig

    return {"optim": frozenset(f.name for f in fields(OptimConfig)),
            "data": frozenset({f.name for f in fields(DataConfig)} | {"_target_"}),
            "trainer": frozenset(trainer_keys() | {"_target_"})}


def section_keys(cfg: DictConfig) -> dict[str, set[str] | frozenset[str] | None]:
    """{section: its known keys} for the sections of `cfg` that have a schema (None: not checked here)."""
    model = cfg.get("model")
    return {
        **fixed_sections(),
        "model": network_keys(model.get("_target_")) if isinstance(model, DictConfig) else None,
        "memory": {"base_ckpt", "base_runs"},
        **{f"analysis.{n}": set(settings_keys(stage)) for n, stage in STAGES.items()},
    }


def unknown_keys(cfg: DictConfig, entry: str) -> list[tuple[str, list[str]]]:
    """[(the full key nothing reads, the nearest known keys)] of `cfg` for entry point `entry`."""
    out = []

    def compare(prefix: str, given, known: set[str]) -> None:
        for k in given:
            if k not in known:
                near = difflib.get_close_matches(str(k), sorted(known), n=3, cutoff=0.6)
                out.append((f"{prefix}{k}", [f"{prefix}{n}" for n in near]))

    compare("", cfg, top_keys(entry))
    if isinstance(cfg.get("analysis"), DictConfig):
        compare("analysis.", cfg.analysis, analysis_keys())
    for section, known in section_keys(cfg).items():
        node = OmegaConf.select(cfg, section)
        if known is not None and isinstance(node, DictConfig):
            compare(f"{section}.", node, known)
    return out


def check_known_keys(cfg: DictConfig, entry: str = "lmcal.train") -> None:
    """Refuses, in one paragraph, settings that no part of `entry` reads (unknown_keys), naming each and the nearest
    known keys."""
    bad = unknown_keys(cfg, entry)
    if not bad:
        return
    named = "; ".join(f"{k}" + (f" (did you mean {' or '.join(near)}?)" if near else "") for k, near in bad)
    raise LmcalError(f"Unknown setting{'s' if len(bad) > 1 else ''}: {named}. No part of python -m {entry} reads "
                     f"{'them' if len(bad) > 1 else 'it'}, so it would be ignored or fail after the data had loaded; "
                     "nothing was run or written. Fix the name (python -m "
                     f"{entry} --cfg job lists every setting; the analysis stages' settings and defaults are their "
                     "dataclasses in lmcal.stages.configs), or remove it.")
