"""A toy analysis stage, added the way a user adds one: one function and one registry entry (and its settings node,
given on the command line as +analysis.toy={...}). Loaded in every process through LMCAL_PLUGINS=tests.toy_stage."""

from pathlib import Path

import torch

from lmcal.core.lookahead import entropy
from lmcal.stages import Stage, register
from lmcal.utils.io import write_json_atomic


@torch.no_grad()
def toy_stage(lm, valid_tokens: torch.Tensor, out_dir, *, positions: int = 10, model_name: str = "model",
              corpus: str = "ptb", logger=None) -> dict:
    """The mean entropy of the model's next-word distributions along the first `positions` validation tokens."""
    state, h = lm.init_state(1), []
    for t in valid_tokens[:positions]:
        logp, state = lm.step(t.view(1), state)
        h.append(entropy(logp.double()).item())
    result = {"model": model_name, "corpus": corpus, "positions": positions, "toy_mean_entropy": sum(h) / len(h)}
    write_json_atomic(Path(out_dir) / "toy.json", result)
    return result


register(Stage("toy", toy_stage,
               lambda t, out, logger, earlier, **s: toy_stage(t["lm"], t["valid"], out, model_name=t["name"],
                                                              corpus=t["corpus"], logger=logger, **s),
               frozenset({"full", "hf"}), lambda r: {"toy_mean_entropy": r["toy_mean_entropy"]}))
