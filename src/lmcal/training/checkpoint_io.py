"""Checkpoints of `python -m lmcal.train`: written atomically (a run killed while saving keeps its last whole one),
read back safely, resumed only with the settings they were trained with, or used to warm-start another network."""

from __future__ import annotations

import logging
from pathlib import Path

from pytorch_lightning.plugins.io import TorchCheckpointIO

from lmcal.errors import LmcalError
from lmcal.models.checkpoint import load_net, read_checkpoint
from lmcal.training.module import LMModule
from lmcal.utils.io import atomic_path

log = logging.getLogger("lmcal")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written to a temporary file (named for this process) and renamed: a run killed while saving
    leaves the previous checkpoint whole, so the rerun can resume from it. Read back safely (`read_checkpoint`)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with atomic_path(path) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return read_checkpoint(path, map_location if map_location is not None else "cpu")


def check_resume(path: str, model_cfg: dict, vocab_size: int) -> None:
    """Resuming continues the checkpoint's own network: a run folder resumed with other model settings (a size, tau)
    stops here with the differences, not with a size-mismatch traceback from deep inside Lightning."""
    hp = read_checkpoint(path)["hyper_parameters"]
    if not isinstance(hp.get("optim"), dict):  # the optimiser's settings, which training reads, are grouped there
        raise LmcalError(f"Cannot resume from {path}: it was written by an earlier lmcal, whose checkpoints keep the "
                         "optimiser settings ungrouped rather than as hyper_parameters.optim, and training continues "
                         "only checkpoints of this layout. Its network is still read for analysis (python -m "
                         "lmcal.evaluate ckpt=...); to train, start a new run in another folder (hydra.run.dir=...) "
                         "or set ckpt_path= to a checkpoint written by this version. Nothing was changed.")
    was, now = {**hp["net"], "vocab_size": hp["vocab_size"]}, {**model_cfg, "vocab_size": vocab_size}
    diff = [f"model.{k} is {was.get(k)} there, {now.get(k)} now" for k in sorted(set(was) | set(now))
            if was.get(k) != now.get(k)]
    if diff:
        raise LmcalError(f"Cannot resume from {path}: it was trained with other model settings ({'; '.join(diff)})"
                         ". Rerun with the settings it was trained with to continue it, or start a new run in "
                         "another folder (hydra.run.dir=...), or set ckpt_path= to another checkpoint. Nothing "
                         "was changed.")


def init_from(module: LMModule, path: str) -> None:
    """Start from the network weights of another checkpoint (not its optimiser or schedule): warm-starts
    tau-models from the base model in the CPU profile."""
    if not Path(path).is_file():
        raise LmcalError(f"init_ckpt={path} does not exist.")
    net, _ = load_net(path)
    try:
        module.net.load_state_dict(net.state_dict())
    except RuntimeError as e:
        raise LmcalError(f"init_ckpt={path} does not fit this model (different sizes or vocabulary): "
                         f"{str(e).splitlines()[0]}") from None
    log.info(f"Initialised the network from {path}")
