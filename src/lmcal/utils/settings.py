"""The resolved settings of a command: what a pipeline stage records when it runs, so that a rerun notices when
they changed, and what is validated before any stage starts.

    composed(entry, overrides)  the config `python -m <entry> <overrides>` would run with (Hydra's compose API)
    settings_of(cfg)            its result-bearing settings, flattened to {dotted key: value}
    differences(old, new)       'key: old -> new' lines
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

from lmcal.errors import LmcalError

PROJECT_ROOT = Path(__file__).resolve().parents[3]
CONF_DIR = PROJECT_ROOT / "conf"
OmegaConf.register_new_resolver("lmcal_root", lambda: str(PROJECT_ROOT), replace=True)  # conf/*: paths.root_dir


def epochs_for(budget, tokens) -> int:
    """`${lmcal_epochs:BUDGET,${data.max_train_tokens}}`: the epochs over `tokens` of training text that make about
    BUDGET training tokens, at least 1 (experiment=scale_powerlaw: every amount of data trained for one budget)."""
    if tokens in (None, "null") or int(tokens) < 1:
        raise ValueError(f"lmcal_epochs needs the training tokens of the data (data.max_train_tokens), got {tokens}")
    return max(1, round(int(budget) / int(tokens)))


OmegaConf.register_new_resolver("lmcal_epochs", epochs_for, replace=True)

# Keys that do not change any result: where things are read from and written to, and how progress is shown
# (the same list Hydra's override_dirname leaves out, in conf/train.yaml, plus the run's own bookkeeping).
NOT_SETTINGS = ("paths", "logger", "task_name", "data.root", "data.download", "data_root", "ckpt_path",
                "trainer.enable_progress_bar", "force_size")


def composed(entry: str, overrides: list[str]) -> DictConfig:
    """The config of `python -m lmcal.train|lmcal.evaluate <overrides>` (Hydra's own hydra.* keys dropped)."""
    name = {"lmcal.train": "train", "lmcal.evaluate": "evaluate"}[entry]
    overrides = [o for o in overrides if not o.startswith("hydra.")]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=name, overrides=overrides)
    except Exception as e:  # a misspelt preset or key: Hydra's own one-line reason
        raise LmcalError(f"python -m {entry} {' '.join(overrides)} does not compose: "
                         f"{str(e).strip().splitlines()[0]}") from None
    with open_dict(cfg):
        cfg.paths.output_dir = None  # ${hydra:runtime.output_dir} resolves only inside a Hydra run
    return cfg


def settings_of(cfg: DictConfig) -> dict:
    """{dotted key: resolved value} of every setting that can change a result. Analysis settings count only for
    the stages that run (analysis.<stage> for each of `stages`, or analysis.stages of a training)."""
    c = OmegaConf.to_container(cfg, resolve=True)
    running = set(c.get("stages") or (c.get("analysis") or {}).get("stages") or [])
    if "analysis" in c:
        c["analysis"] = {k: v for k, v in c["analysis"].items() if k == "stages" or k in running}
    flat = {}

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if key in NOT_SETTINGS:
                continue
            if isinstance(v, dict) and v:
                walk(v, key + ".")
            else:
                flat[key] = v

    walk(c, "")
    return flat


def differences(old: dict, new: dict) -> list[str]:
    """'key: old -> new' for each key whose value differs (a key missing on one side reads 'absent')."""
    def show(d, k):
        return json.dumps(d[k]) if k in d else "absent"

    return [f"{k}: {show(old, k)} -> {show(new, k)}" for k in sorted(set(old) | set(new))
            if old.get(k, ABSENT.get(k, ...)) != new.get(k, ABSENT.get(k, ...))]


# keys added after runs were recorded, and the value a record without them ran with: not a difference
ABSENT = {"tf32": False}
