"""The entropy_rate stage: the entropy of the t-th generated word from true-text prefixes (Table 1's row, Figure 2).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from lmcal.core.entropy_rate import (
    clustered_mean,
    generation_entropy_curve,
)
from lmcal.core.sampling import random_prefixes
from lmcal.stages.plots import entropy_curve_figure
from lmcal.stages.stage import Stage, pick, stage_context
from lmcal.stages.tables import table1_markdown
from lmcal.stages.wandb_run import log_curves, wandb_log
from lmcal.utils.io import write_json_atomic, write_text_atomic
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")


def entropy_rate_stage(lm, valid_tokens: torch.Tensor, test_ce_nats: float, out_dir: str | Path, *,
                       num_prefixes: int = 100, samples_per_prefix: int = 5, prefix_len: int = 100,
                       horizon: int = 700, seed: int = 0, max_batch: int = 1024, model_name: str = "model",
                       corpus: str = "ptb", logger=None, name: str = "entropy_rate", unit: str = "word") -> dict:
    """Entropy of the t-th generated word (Table 1 row, Figure 2): `name`.json, .png and .md in out_dir.
    unit: what a token is ("word"; "model token" for a Hugging Face model's own tokens), stated in the outputs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefixes = random_prefixes(valid_tokens, num_prefixes, prefix_len, seed=seed)
    t0 = time.perf_counter()
    curve = generation_entropy_curve(lm, prefixes, horizon, samples_per_prefix, seed=seed, max_batch=max_batch,
                                     progress=True)
    seconds = time.perf_counter() - t0
    n_gen = prefixes.size(0) * samples_per_prefix
    tail, tail_se = clustered_mean(curve.tail)  # the last tenth's mean entropy, its se clustered by prefix
    result = {
        "model": model_name, "corpus": corpus,
        "test_ce_nats": test_ce_nats, "test_ppl": exp_or_inf(test_ce_nats),
        "entrate_nats": float(curve.mean[-1]), "entrate_ppl": exp_or_inf(curve.mean[-1]),
        "curve_nats": curve.mean.tolist(), "stderr_nats": curve.stderr.tolist(),
        "tail_nats": float(tail), "tail_stderr_nats": float(tail_se),
        "tail_nats_per_generation": curve.tail.tolist(),  # [N, S]: the scale record's bootstrap resamples prefixes
        "horizon": horizon, "num_prefixes": prefixes.size(0), "samples_per_prefix": samples_per_prefix,
        "num_generations": n_gen, "prefix_len": prefix_len, "seed": seed,
        "seconds": seconds, "generated_tokens_per_s": n_gen * horizon / seconds, "unit": unit,
    }
    png = entropy_curve_figure({f"{model_name} generations": (curve.mean, curve.stderr)}, out / f"{name}.png",
                               reference_nats={f"test cross-entropy (every test {unit})": test_ce_nats},
                               title=f"{model_name} on {corpus}: test ppl {result['test_ppl']:.1f}, "
                                     f"EntRate {result['entrate_ppl']:.1f} (t={horizon})")
    write_text_atomic(out / f"{name}.md", table1_markdown([result]) + f"\nPerplexities and entropies per {unit}.\n")
    write_json_atomic(out / f"{name}.json", result)
    wandb_log(logger, scalars={f"{name}/entrate_ppl": result["entrate_ppl"], f"{name}/test_ppl": result["test_ppl"]},
              images={f"{name}/figure": png})  # the curve once, as series (below)
    log_curves(logger, f"{name}/curves", "t", range(1, horizon + 1),
               {"entropy_nats": curve.mean.tolist(), "stderr_nats": curve.stderr.tolist()})
    log.info(f"{name}: test ppl {result['test_ppl']:.1f}, EntRate {result['entrate_ppl']:.1f} at t={horizon} "
             f"({n_gen} generations, {seconds:.0f} s); {out / (name + '.json')}")
    return result


STAGE = Stage("entropy_rate", entropy_rate_stage,
              lambda t, out, logger, earlier, every_n_epochs=None, **s:  # every_n_epochs: train's, during training
              entropy_rate_stage(t["lm"], t["valid"], t["test_ce"], out, unit=t["unit"], **stage_context(t, logger),
                                 **s),
              frozenset({"full", "hf"}), pick("entrate_ppl"), entry_settings=("every_n_epochs",), needs_test_ce=True)
