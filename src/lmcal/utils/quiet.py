"""Third-party warnings and tips that say nothing to a user of lmcal, silenced once, here: every entry point calls
`quiet_third_party()` before it starts (each stage of a reproduction is its own process, whose log would otherwise
repeat them). lmcal's own messages and every other warning are untouched.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# (category, message regex) of warnings that are noise here
_WARNINGS = (
    (None, r".*`srun` command is available on your system but is not used.*"),  # Lightning, on a Slurm login node
    (None, r".*isinstance\(treespec, LeafSpec\)` is deprecated.*"),  # Lightning's own use of torch's pytree
    (None, r".*does not have many workers which may be a bottleneck.*"),  # our batches are tensors in memory
    (None, r".*The number of training batches .* is smaller than the logging interval.*"),
)


# Lightning's lines on a stop ("[rank: 0] Received SIGTERM: 15", "Detected KeyboardInterrupt, attempting graceful
# shutdown ..."): lmcal says how it stopped and how to go on (lmcal.utils.boundary.run_hydra)
_STOP_LINES = ("Received SIGTERM", "Bypassing SIGTERM", "Detected KeyboardInterrupt")


class _DropTips(logging.Filter):
    """Lightning's start-up lines (GPU/TPU available, the 💡 tips) and its lines on a stop: not lmcal's to show."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith(("GPU available", "TPU available", "HPU available")) or "Tip:" in msg
                    or any(s in msg for s in _STOP_LINES))


def quiet_third_party() -> None:
    if not sys.stderr.isatty():  # in a log file, Hugging Face's tqdm bars (saving a transformer's hf/) are litter
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when transformers is imported
        if "transformers" in sys.modules:
            sys.modules["transformers"].utils.logging.disable_progress_bar()
    for category, message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, **({"category": category} if category else {}))
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
                 "lightning_fabric.utilities.rank_zero", "pytorch_lightning.trainer.connectors.signal_connector",
                 "lightning.pytorch.trainer.connectors.signal_connector"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
