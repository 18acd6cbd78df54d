"""A toy analysis stage, added the way a user adds one: a settings dataclass, a compute function and one registry
entry (its settings given on the command line as +analysis.toy={...}). Loaded in every process through
LMCAL_PLUGINS=tests.toy_stage."""

from dataclasses import dataclass

import torch

from lmcal.core.lookahead import entropy
from lmcal.stages import Result, Stage, register


@dataclass
class ToyConfig:
    positions: int = 10  # validation tokens read


@torch.no_grad()
def toy_compute(target: dict, settings: ToyConfig) -> Result:
    """The mean entropy of the model's next-word distributions along the first `positions` validation tokens."""
    lm, state, h = target["lm"], target["lm"].init_state(1), []
    for t in target["valid"][:settings.positions]:
        logp, state = lm.step(t.view(1), state)
        h.append(entropy(logp.double()).item())
    return Result({"model": target["name"], "corpus": target["corpus"], "positions": settings.positions,
                   "toy_mean_entropy": sum(h) / len(h)})


register(Stage("toy", ToyConfig, toy_compute, frozenset({"full", "hf"}),
               lambda r: {"toy_mean_entropy": r["toy_mean_entropy"]}))
