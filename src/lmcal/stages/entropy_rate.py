"""The entropy_rate stage: the entropy of the t-th generated word from true-text prefixes (Table 1's row, Figure 2).
"""

from __future__ import annotations

import time
from pathlib import Path

from lmcal.core.entropy_rate import clustered_mean, generation_entropy_curve
from lmcal.core.sampling import random_prefixes
from lmcal.stages.configs import EntropyRateConfig
from lmcal.stages.plots import entropy_curve_figure
from lmcal.stages.stage import Result, Stage, pick
from lmcal.stages.tables import table1_markdown
from lmcal.stages.wandb_run import log_curves, wandb_log
from lmcal.utils.numbers import exp_or_inf


class EntropyRateResult(Result):
    """The entropy curve of free generations and the model's test cross-entropy beside it."""

    def table(self) -> str:
        return table1_markdown([self.record]) + f"\nPerplexities and entropies per {self.record['unit']}.\n"

    def figure(self, path: Path) -> Path:
        r = self.record
        return entropy_curve_figure({f"{r['model']} generations": (r["curve_nats"], r["stderr_nats"])}, path,
                                    reference_nats={f"test cross-entropy (every test {r['unit']})": r["test_ce_nats"]},
                                    title=f"{r['model']} on {r['corpus']}: test ppl {r['test_ppl']:.1f}, "
                                          f"EntRate {r['entrate_ppl']:.1f} (t={r['horizon']})")

    def log_wandb(self, logger, name: str, images: dict[str, Path]) -> None:
        r = self.record
        wandb_log(logger, scalars={f"{name}/entrate_ppl": r["entrate_ppl"], f"{name}/test_ppl": r["test_ppl"]},
                  images=images)  # the curve once, as series (below)
        log_curves(logger, f"{name}/curves", "t", range(1, r["horizon"] + 1),
                   {"model": r["curve_nats"], "model_stderr": r["stderr_nats"]})  # (the plain model: "model")

    def line(self, name: str) -> str:
        r = self.record
        return (f"{name}: test ppl {r['test_ppl']:.1f}, EntRate {r['entrate_ppl']:.1f} at t={r['horizon']} "
                f"({r['num_generations']} generations, {r['seconds']:.0f} s)")


def compute(target: dict, settings: EntropyRateConfig) -> EntropyRateResult:
    """Entropy of the t-th generated word (Table 1 row, Figure 2) from random validation prefixes; target["unit"]
    says what a token is ("word"; "model token" for a Hugging Face model's own tokens)."""
    s = settings
    prefixes = random_prefixes(target["valid"], s.num_prefixes, s.prefix_len, seed=s.seed)  # [N, prefix_len]
    t0 = time.perf_counter()
    curve = generation_entropy_curve(target["lm"], prefixes, s.horizon, s.samples_per_prefix, seed=s.seed,
                                     max_batch=s.max_batch, progress=True)
    seconds = time.perf_counter() - t0
    n_gen = prefixes.size(0) * s.samples_per_prefix
    tail, tail_se = clustered_mean(curve.tail)  # the last tenth's mean entropy, its se clustered by prefix
    test_ce = target["test_ce"]
    return EntropyRateResult({
        "model": target["name"], "corpus": target["corpus"],
        "test_ce_nats": test_ce, "test_ppl": exp_or_inf(test_ce),
        "entrate_nats": float(curve.mean[-1]), "entrate_ppl": exp_or_inf(curve.mean[-1]),
        "curve_nats": curve.mean.tolist(), "stderr_nats": curve.stderr.tolist(),
        "tail_nats": float(tail), "tail_stderr_nats": float(tail_se),
        "tail_nats_per_generation": curve.tail.tolist(),  # [N, S]: the scale record's bootstrap resamples prefixes
        "horizon": s.horizon, "num_prefixes": prefixes.size(0), "samples_per_prefix": s.samples_per_prefix,
        "num_generations": n_gen, "prefix_len": s.prefix_len, "seed": s.seed,
        "seconds": seconds, "generated_tokens_per_s": n_gen * s.horizon / seconds, "unit": target["unit"],
    })


STAGE = Stage("entropy_rate", EntropyRateConfig, compute, frozenset({"full", "hf"}), pick("entrate_ppl"),
              needs_test_ce=True)
