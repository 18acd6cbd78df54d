"""Trained checkpoints, read without Lightning: the network (`load_net`), a tau-model's base (`load_base_net`), its
name, and the corpus it was trained on (`checkpoint_data`), so that the analysis entry points start in a couple of
seconds rather than after Lightning's import.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import re
from dataclasses import fields
from pathlib import Path

import torch

from lmcal.data.batching import CorpusData, DataConfig
from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.step_lm import LSTMStepLM
from lmcal.models.transformer import GPTLM

log = logging.getLogger("lmcal")


def model_name(model_cfg) -> str:
    """A network's name in tables and logs, from its config node (conf/model, or a checkpoint's plain mapping)."""
    if model_cfg.get("_target_", "").endswith("AWDLSTM"):
        tau = f", tau={model_cfg['memory_tau']}" if model_cfg.get("memory_tau") else ""
        return f"AWD-LSTM {model_cfg['emb_size']}/{model_cfg['hidden_size']}/{model_cfg['num_layers']}{tau}"
    if model_cfg.get("_target_", "").endswith("GPTLM"):
        return (f"Transformer {model_cfg.get('n_layer')}x{model_cfg.get('n_embd')}, "
                f"context {model_cfg.get('n_positions')}")
    return str(model_cfg.get("_target_"))


# what a checkpoint's data settings may hold: DataConfig's keys, less where the files are (root, download), which
# come from this run's settings, never from the machine that trained it
DATA_KEYS = frozenset(f.name for f in fields(DataConfig)) - {"root", "download"}


def default_data_root() -> str:
    """Where this run reads corpora when no data_root is given: $LMCAL_DATA_ROOT, else the project's data/ (the
    configs' data.root)."""
    from lmcal.utils.settings import PROJECT_ROOT

    return os.environ.get("LMCAL_DATA_ROOT") or str(PROJECT_ROOT / "data")


def checkpoint_data(ckpt: dict, data_root: str | None = None, path: str | Path = "the checkpoint") -> CorpusData:
    """The corpus a checkpoint was trained on, with the batch settings training used, read from this run's data root
    (`data_root`, else default_data_root()) and downloaded only where this project's config of that corpus says so:
    a checkpoint's own `root` and `download` (another machine's) are never used. Data settings with keys DataConfig
    does not take, or values that are not plain, are refused, naming them."""
    data_cfg = ckpt["hyper_parameters"].get("data_cfg")
    if data_cfg is None:  # python -m lmcal.train records it: the analysis reads the text the model was trained on
        raise LmcalError(f"{path} does not record the corpus it was trained on (hyper_parameters.data_cfg). Use a "
                         "checkpoint written by python -m lmcal.train.")
    data_cfg = {k: v for k, v in data_cfg.items() if k not in ("_target_", "root", "download")}
    unknown = sorted(k for k in data_cfg if k not in DATA_KEYS)
    bad = [f"{k}={v!r}" for k, v in data_cfg.items() if k in DATA_KEYS and not (
        _plain(v) or (k == "corpus_kwargs" and isinstance(v, dict) and all(map(_plain, v.values()))))]
    if unknown or bad or not isinstance(data_cfg.get("name", "ptb"), str):
        what = "; ".join([*([f"unknown keys {', '.join(unknown)}"] if unknown else []), *bad]) or "a name not text"
        raise LmcalError(f"{path} records data settings lmcal does not read: {what[:300]} (the data settings take "
                         f"{', '.join(sorted(DATA_KEYS))}). The file was edited or comes from another program; it was "
                         "not loaded. Use a checkpoint written by python -m lmcal.train.")
    name = data_cfg.get("name", "ptb")
    return CorpusData(DataConfig(**data_cfg, root=data_root or default_data_root(), download=_downloads(name)))


def _downloads(name: str) -> bool:
    """Whether this project's config of corpus `name` (conf/data/<name>.yaml) fetches missing files."""
    from lmcal.utils.settings import CONF_DIR

    conf = CONF_DIR / "data" / f"{name}.yaml"
    if not re.fullmatch(r"[a-z0-9_]+", name) or not conf.is_file():
        return False
    return re.search(r"^download:\s*true\b", conf.read_text(), re.M) is not None


def read_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """A checkpoint of `python -m lmcal.train`, read safely: `torch.load(weights_only=True)` unpickles tensors, plain
    containers and numbers only, so a crafted file cannot run code. An unreadable, truncated, foreign or unsafe file
    is one `LmcalError` naming the path and what to do."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise LmcalError(f"Checkpoint not found: {path}. Pass the best.ckpt or last.ckpt in a training run's "
                         "checkpoints/ folder.")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = re.search(r"unsupported GLOBAL (\S+)", str(e), re.IGNORECASE)
        if refused:
            raise LmcalError(f"{path} was not loaded: it asks to unpickle {refused.group(1)}, which a checkpoint of "
                             "lmcal never holds (only tensors, numbers and plain containers), and unpickling it could "
                             "run code. Use a checkpoint written by python -m lmcal.train, from a source you trust."
                             ) from None
        raise _unreadable(path, "not a pickle of tensors") from None
    except Exception as e:  # truncated zip, random bytes, empty file, I/O error
        raise _unreadable(path, type(e).__name__ + (f": {_first_sentence(e)}" if str(e).strip() else "")) from None
    hp = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    if not isinstance(hp, dict) or "net" not in hp or "vocab_size" not in hp or "state_dict" not in ckpt:
        raise LmcalError(f"{path} is a PyTorch file but not a checkpoint of python -m lmcal.train (it lacks the "
                         "network's settings or weights). Pass the best.ckpt or last.ckpt in a training run's "
                         "checkpoints/ folder; a Hugging Face model is analysed with model=hf model.name_or_path=.")
    v, wrong = hp["vocab_size"], []
    if not isinstance(hp["net"], dict):
        wrong.append(f"its network settings are a {type(hp['net']).__name__}, not a mapping")
    if not isinstance(v, int) or isinstance(v, bool) or v < 2:
        wrong.append(f"its vocab_size is {v!r}, not a count of words")
    if not isinstance(hp.get("data_cfg") or {}, dict):
        wrong.append(f"its data settings are a {type(hp['data_cfg']).__name__}, not a mapping")
    if not isinstance(ckpt["state_dict"], dict):
        wrong.append("its weights are not a mapping of names to tensors")
    if wrong:
        raise LmcalError(f"{path} is not a checkpoint lmcal can read: {'; '.join(wrong)}. The file was edited or "
                         "comes from another program; it was not loaded. Use a checkpoint written by python -m "
                         "lmcal.train.")
    return ckpt


def _first_sentence(e: Exception) -> str:
    return str(e).strip().splitlines()[0].split(". ")[0].rstrip(".")


def _unreadable(path: Path, why: str) -> LmcalError:
    return LmcalError(f"{path} is not a readable checkpoint ({why}): it is truncated, corrupt or not a PyTorch file. "
                      "If a run was killed while writing it, rerun the training to write it again; otherwise pass "
                      "the best.ckpt or last.ckpt in a training run's checkpoints/ folder.")


# The networks a checkpoint may name, under every module path lmcal has kept them at. A checkpoint's settings only
# choose one of these and give it plain values: nothing read from a checkpoint is imported or called by its name.
NETWORKS: dict[str, type] = {"lmcal.models.awd_lstm.AWDLSTM": AWDLSTM, "lmcal.model.AWDLSTM": AWDLSTM,
                             "lmcal.models.transformer.GPTLM": GPTLM, "lmcal.transformer.GPTLM": GPTLM}


def register_network(target: str, cls: type) -> None:
    """Lets checkpoints whose `_target_` is `target` be loaded as `cls` (a network of your own, registered by the
    plugin module that defines it; see LMCAL_PLUGINS)."""
    NETWORKS[target] = cls


def build_net(net_cfg: dict, vocab_size: int, source: str | Path = "the checkpoint"):
    """The network a checkpoint's settings name, built from NETWORKS with those settings as plain keyword values. A
    `_target_` outside NETWORKS, a nested node (a `_target_` inside a value), an interpolation (`${...}`) or a key
    the network does not take is refused with one LmcalError, before anything is built."""
    target = net_cfg.get("_target_") if isinstance(net_cfg, dict) else None
    if target not in NETWORKS:
        known = ", ".join(sorted({c.__name__ for c in NETWORKS.values()}))
        raise LmcalError(f"{source} names the network {target!r}, which is not one of lmcal's ({known}); a checkpoint "
                         "only chooses among them, so it was not loaded. Use a checkpoint written by python -m "
                         "lmcal.train, from a source you trust.")
    cls = NETWORKS[target]
    takes = set(inspect.signature(cls).parameters) - {"vocab_size"}
    kwargs = {k: v for k, v in net_cfg.items() if k not in ("_target_", "vocab_size")}
    bad = [f"{k}={v!r}" for k, v in kwargs.items() if k not in takes or not _plain(v)]
    if bad:
        raise LmcalError(f"{source} gives its network {cls.__name__} settings it does not take as plain values "
                         f"({'; '.join(bad)[:300]}): only numbers, booleans, plain strings and null are read from a "
                         "checkpoint, so it was not loaded. Use a checkpoint written by python -m lmcal.train.")
    from omegaconf import OmegaConf

    from lmcal.utils.validate import problems  # the ranges of the model's settings, as the command line's

    if out_of_range := problems(OmegaConf.create({"model": kwargs})):
        raise LmcalError(f"{source} gives its network settings out of range: {'; '.join(out_of_range)[:400]}. The "
                         "file was edited or is damaged; it was not loaded.")
    return cls(vocab_size=int(vocab_size), **kwargs)


def _plain(v) -> bool:
    """A value a network's settings may hold: a number, a boolean, null, or a string that is no interpolation."""
    return v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and "${" not in v)


def load_net(ckpt_path: str | Path, map_location="cpu"):
    """The network of a training checkpoint, with the weights that were validated
    (the averaged ones after an NT-ASGD switch), in eval mode. No Lightning needed."""
    ckpt = read_checkpoint(ckpt_path, map_location)
    hp = ckpt["hyper_parameters"]
    net = build_net(hp["net"], hp["vocab_size"], ckpt_path)
    weights = {k[len("net."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}
    try:
        net.load_state_dict(weights)
    except RuntimeError as e:
        raise LmcalError(f"{ckpt_path}: its weights do not fit the network its settings describe "
                         f"({str(e).splitlines()[0]}); the file is damaged or was edited.") from None
    nonfinite = [k for k, w in weights.items() if w.is_floating_point() and not torch.isfinite(w).all()]
    if nonfinite:
        raise LmcalError(f"{ckpt_path}: {len(nonfinite)} of its weight tensors hold NaN or infinite values "
                         f"({', '.join(nonfinite[:4])}{', ...' if len(nonfinite) > 4 else ''}): a training that "
                         "diverged, or a damaged file. It was not used; use another checkpoint (the run's best.ckpt "
                         "is kept from before a divergence).")
    return net.eval(), ckpt


def checkpoint_names(path: str | Path) -> tuple[str, str]:
    """(the network's name, as model_name gives it; its corpus's name) of a training checkpoint, read safely
    (read_checkpoint): what names its W&B artifact (lmcal.stages.wandb_run.checkpoint_artifact)."""
    hp = read_checkpoint(path)["hyper_parameters"]
    return model_name(hp["net"]), str((hp.get("data_cfg") or {}).get("name", ""))


def base_checkpoint(memory: dict | None, corpus: str | None) -> str | None:
    """Where the memory stage's full-context base model is: memory.base_ckpt, else memory.base_runs[<corpus>] (a
    run folder, meaning its checkpoints/best.ckpt, or a checkpoint), so that one tau sweep over datasets finds each
    dataset's base model: `'memory.base_runs={ptb: RUN, markov: RUN}'`. None: neither names one."""
    memory = dict(memory or {})
    if memory.get("base_ckpt"):
        return str(memory["base_ckpt"])
    path = (memory.get("base_runs") or {}).get(corpus) if corpus else None
    if not path:
        return None
    return str(Path(path) / "checkpoints" / "best.ckpt") if Path(path).is_dir() else str(path)


def load_base_net(path: str | Path | None, device, corpus: str | None = None, corpus_kwargs: dict | None = None,
                  vocab_size: int | None = None):
    """The full-context base model for the memory stage, with a clear error when it is missing or mismatched: its
    corpus, where given its generator's settings (`corpus_kwargs`: a Markov chain of another seed is another source)
    and its vocabulary must be this model's."""
    if not path:
        raise LmcalError("The memory stage needs the full-context base model: pass memory.base_ckpt=PATH (a "
                         "checkpoint of the same corpus trained with model.memory_tau=null), or, for a sweep over "
                         f"datasets, 'memory.base_runs={{{corpus or 'ptb'}: RUN_FOLDER, ...}}' (each dataset's base "
                         "run).")
    if not Path(path).is_file():
        raise LmcalError(f"memory.base_ckpt={path} does not exist; train the base model first "
                         "(python -m lmcal.train with model.memory_tau=null) and point at its checkpoints/best.ckpt.")
    net, ckpt = load_net(path, map_location="cpu")
    if net.memory_tau:
        raise LmcalError(f"memory.base_ckpt={path} is itself a tau={net.memory_tau} model; it must be full-context.")
    base_corpus = (ckpt["hyper_parameters"].get("data_cfg") or {}).get("name")
    if corpus and base_corpus and base_corpus != corpus:
        raise LmcalError(f"memory.base_ckpt={path} was trained on {base_corpus}, this model on {corpus}.")
    theirs = dict((ckpt["hyper_parameters"].get("data_cfg") or {}).get("corpus_kwargs") or {})
    if corpus_kwargs is not None and theirs != dict(corpus_kwargs):
        differ = sorted(k for k in set(theirs) | set(corpus_kwargs) if theirs.get(k) != corpus_kwargs.get(k))
        raise LmcalError(f"memory.base_ckpt={path} was trained on another {corpus or 'corpus'}: its "
                         + ", ".join(f"data.corpus_kwargs.{k}={theirs.get(k)!r} (this model: {corpus_kwargs.get(k)!r})"
                                     for k in differ)
                         + ". The bound compares two models of one source; train the base on this model's data "
                         "settings, or point at the base that was.")
    if vocab_size is not None and ckpt["hyper_parameters"]["vocab_size"] != vocab_size:
        raise LmcalError(f"memory.base_ckpt={path} has a vocabulary of {ckpt['hyper_parameters']['vocab_size']:,} "
                         f"words, this model {vocab_size:,}: not a model of the same corpus.")
    return net.to(device)


def lstm_from_checkpoint(path, device="cpu") -> LSTMStepLM:
    """The validated network of a training checkpoint (see lmcal.models.checkpoint.load_net) as a StepLM on `device`."""
    net, _ = load_net(path, map_location=device)
    return LSTMStepLM(net.to(device))
