"""The memory bound of any StepLM in one call: P~ the model itself fed only the last tau tokens.

    bound = memory_bound(lm, tokens, tau=5)    # a MemoryBound: bound.mi_upper_bound ± bound.mi_stderr nats

The memory stage's `limited=window` variant (lmcal.stages.memory) without its files: the rows come from
lmcal.core.context, the fit and its standard errors from lmcal.core.memory.
"""

from __future__ import annotations

import torch

from lmcal.core.context import context_rows, zip_rows
from lmcal.core.memory import MemoryBound, memory_upper_bound


@torch.no_grad()
def memory_bound(lm, tokens: torch.Tensor, tau: int, *, cluster_size: int | None = None, batch_size: int = 512,
                 temperature: bool = False, jackknife: str = "onestep") -> MemoryBound:
    """The calibration upper bound on I_tau of `lm` along the 1-D text tokens [N] (nats per token).

    P^ is lm reading the text with its whole past, P~ the same lm fed only the last tau tokens from lm.init_state
    (no tau-model to train); alpha* is fitted on the N - 1 predicted positions and the bound reported on them, as the
    memory stage does. Standard errors treat blocks of `cluster_size` consecutive positions as independent (None:
    a tenth of the positions, at most the stage's 2,000, so that a short text still has ten blocks).
    temperature=True fits P^^beta P~^alpha instead, so that a mere sharpening of P^ does not count as memory. The
    rows are kept in memory: 2 x N x V floats.
    """
    tokens = tokens.reshape(-1).long()
    if not 1 <= int(tau) < tokens.numel():
        raise ValueError(f"tau must be between 1 and the text's length - 1 ({tokens.numel() - 1}), got {tau}")
    n = tokens.numel() - 1
    if cluster_size is None:
        cluster_size = min(2000, -(-n // 10))
    rows = list(zip_rows(context_rows(lm, tokens, None, batch_size), context_rows(lm, tokens, int(tau), batch_size)))
    return memory_upper_bound(rows, cluster_size=cluster_size, temperature=temperature, jackknife=jackknife)
