"""The decoders stage: the practitioners' decoding rules and the fitted temperature beside calibration, each with its
generation curve and held-out cost, on the same prefixes, seeds and test words.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from lmcal.core.calibration import calibrated, fit_lookahead_calibration, fit_temperature
from lmcal.core.decoders import decoder_params, heldout_cost, make_decoder
from lmcal.core.entropy_rate import generation_entropy_curve
from lmcal.core.lookahead_law import make_rule
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.errors import LmcalError
from lmcal.stages.configs import DecodersConfig
from lmcal.stages.plots import entropy_curve_figure
from lmcal.stages.rows import curve_row, generation_settings, method_label, same_settings
from lmcal.stages.stage import Result, Stage, earlier_result
from lmcal.stages.tables import decoders_table
from lmcal.stages.wandb_run import log_config, log_curves, wandb_log
from lmcal.utils.numbers import format_params

log = logging.getLogger("lmcal")

COSTS = ("test_ce_nats", "zero_prob_fraction", "test_ce_kept_nats", "test_ce_mixed_nats")  # a row's held-out cost
COLUMNS = ("method", "params", "entropy_t1_nats", "entropy_last_nats", "entrate_ppl", "tail_ppl", "tail_diff_nats",
           "tail_diff_stderr_nats", *COSTS)  # the W&B table's


def _label(r: dict) -> str:
    """A row's name in the figure and the W&B legend: its method and every parameter but the standard errors."""
    return r["method"] + (f" ({format_params(r['params'], drop=('stderr',))})" if r["params"] else "")


class DecodersResult(Result):
    """One row per decoding method: its entropy curve, its last tenth paired with the plain model's, its test cost."""

    def table(self) -> str:
        r = self.record
        return decoders_table(r["rows"]) + (f"\nEntropies and cross-entropies in nats per {r['unit']}; ε-mixed: "
                                            f"(1 - ε) q + ε uniform, ε = {r['mix_epsilon']:g}.\n")

    def figure(self, path: Path) -> Path:
        r, rows = self.record, self.record["rows"]
        return entropy_curve_figure({_label(x): (x["curve_nats"], x["stderr_nats"]) for x in rows}, path,
                                    reference_nats={"test cross-entropy (true text)": r["reference_test_ce_nats"]},
                                    title=f"{r['model']} on {r['corpus']}: decoders and calibration",
                                    legend_outside=True,
                                    tail_differences={method_label(x["method"], x["params"]): (
                                        x["tail_diff_nats"], x["tail_diff_stderr_nats"]) for x in rows[1:]})

    def log_wandb(self, logger, name: str, images: dict[str, Path]) -> None:
        rows = self.record["rows"]
        wandb_log(logger, scalars={f"{name}/{r['method']}/{k}": r[k] for r in rows for k in
                                   ("entrate_ppl", "zero_prob_fraction", "test_ce_mixed_nats") if r[k] is not None},
                  images=images,
                  tables={f"{name}/table": (list(COLUMNS), [[format_params(r[c]) if c == "params" else r[c]
                                                             for c in COLUMNS] for r in rows])})
        shown = [r for r in rows if r.get("curve_nats")]  # series keyed by method (the same in every run)
        log_curves(logger, f"{name}/curves", "t", range(1, len(rows[0]["curve_nats"]) + 1),
                   {method_label(r["method"], r["params"]): r["curve_nats"] for r in shown},
                   legend={method_label(r["method"], r["params"]): _label(r) for r in shown})
        log_config(logger, {f"{name}/{r['method']}/{k}": v for r in rows
                            if r["method"] in ("fitted_temperature", "calibration") for k, v in r["params"].items()})

    def line(self, name: str) -> str:
        r = self.record
        return f"{name}: {len(r['rows'])} methods in {r['seconds']:.0f} s\n{decoders_table(r['rows'])}"


def _specs(methods: list[dict], fitted: list[str]) -> list[tuple[str, dict]]:
    """(name, checked parameters) of each decoding method, every one checked before any work starts."""
    specs = []
    for m in methods:
        m = dict(m)
        if "name" not in m:
            raise LmcalError(f"A decoder needs a name, got {m}; e.g. {{name: top_p, p: 0.9}}.")
        method = m.pop("name")
        specs.append((method, decoder_params(method, **m)))
    unknown = set(fitted) - {"temperature", "calibration"}
    if unknown:
        raise LmcalError(f"Unknown fitted method(s) {sorted(unknown)}: choose from temperature, calibration.")
    return specs


def _reusable(calibration: dict | None, settings: dict) -> dict | None:
    """The calibration stage's result where its rows are this stage's own (same prefixes, seeds and test words, and
    the plain model as its "before"), else None."""
    reuse = calibration if same_settings(calibration, settings) else None
    if reuse and reuse["uniform_weight"]:  # its "before" is the eps-mixture, not the plain model here
        reuse = None
    if calibration and not reuse:
        log.info("decoders: the calibration result has other generation or scoring settings; refitting here")
    return reuse


def _row(method: str, params: dict, curve, stderr, cost: dict, seconds: float, tail, plain_tail) -> dict:
    """One method's row, its tail paired with `plain_tail` (None: the row is the plain model's own)."""
    plain = np.asarray(tail, dtype=np.float64) if plain_tail is None else plain_tail
    r = curve_row(method, params, curve, stderr, tail, plain, seconds, **{k: cost[k] for k in COSTS})
    log.info(f"decoders: {method} ({format_params(params)}): EntRate {r['entrate_ppl']:.1f}, test CE "
             f"{'inf' if r['test_ce_nats'] is None else format(r['test_ce_nats'], '.4f')}, zero-prob "
             f"{r['zero_prob_fraction']:.4f}")
    return r


def _measure(method: str, params: dict, model, prefixes: torch.Tensor, test: torch.Tensor, s: DecodersConfig,
             plain_tail) -> dict:
    """A method's row from its own generations and its held-out cost on the test words."""
    t = time.perf_counter()
    curve = generation_entropy_curve(model, prefixes, s.horizon, s.samples_per_prefix, seed=s.seed,
                                     max_batch=s.max_batch, progress=True)
    cost = heldout_cost(model, test, s.mix_epsilon, progress=True)
    return _row(method, params, curve.mean.tolist(), curve.stderr.tolist(), cost, time.perf_counter() - t,
                curve.tail, plain_tail)


def _reused_cost(reuse: dict, when: str) -> dict:
    """The calibration stage's test cost of the model `before` or `after` (both give every word a positive
    probability)."""
    ce = reuse[f"test_ce_{when}_nats"]
    return {"test_ce_nats": ce, "zero_prob_fraction": 0.0, "test_ce_kept_nats": ce,
            "test_ce_mixed_nats": reuse[f"test_ce_mixed_nats_{when}"]}


def _calibration_row(lm, fit_text: torch.Tensor, reuse: dict | None, prefixes: torch.Tensor, test: torch.Tensor,
                     s: DecodersConfig, plain_tail) -> dict:
    """Lookahead calibration's row: the calibration stage's where it is this stage's own, else fitted here."""
    if reuse:
        rule = {k: reuse[k] for k in ("topk", "cover", "cover_max") if reuse[k] is not None or k == "topk"}
        return _row("calibration", {"alpha": reuse["alpha"], "alpha_stderr": reuse["alpha_stderr"], **rule},
                    reuse["curve_nats"], reuse["stderr_nats"], _reused_cost(reuse, "after"), 0.0,
                    reuse["tail_nats_per_generation"], plain_tail)
    fit = fit_lookahead_calibration(lm, fit_text, make_rule(s.topk, s.cover, s.cover_max, s.tail_samples),
                                    min_context=s.min_context, seed=s.seed, progress=True)
    rule = {"topk": s.topk, **{k: v for k, v in (("cover", s.cover), ("cover_max", s.cover_max)) if v is not None}}
    model = calibrated(lm, fit.alpha, topk=s.topk, tail_samples=s.tail_samples, seed=s.seed, cover=s.cover,
                       cover_max=s.cover_max)
    return _measure("calibration", {"alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr, **rule}, model, prefixes,
                    test, s, plain_tail)


def compute(target: dict, settings: DecodersConfig) -> DecodersResult:
    """Every decoding method on one entropy-rate figure and one table, from the same prefixes and seeds: the plain
    model, each of `methods` ({"name": ..., **params}, see lmcal.core.decoders), and the fitted ones: `temperature`
    (P^(1/T), T* by validation CE) and `calibration` (lookahead, Algorithm 2; taken from the calibration stage's
    result when its settings match, else fitted here). Held-out cost on the first `score_tokens` test tokens read as
    `score_streams` streams. Each row's generations are paired with the plain model's (same prefixes and uniforms):
    tail_diff_nats is the mean difference of their entropy over the last tenth of the horizon, with its standard
    error clustered by prefix."""
    s, lm = settings, target["lm"]
    calibration = earlier_result(target, "decoders", "calibration", s.calibration_json)
    t0 = time.perf_counter()
    specs = _specs(s.methods, s.fitted)
    prefixes = random_prefixes(target["valid"], s.num_prefixes, s.prefix_len, seed=s.seed)
    test = batchify(target["test"][:s.score_tokens] if s.score_tokens else target["test"], s.score_streams)
    gen = generation_settings(prefixes, s.samples_per_prefix, s.prefix_len, s.horizon, s.seed, test, s.score_streams)
    reuse = _reusable(calibration, gen)
    if reuse:  # the plain model's curve and cost from the calibration stage: same prefixes, seeds and test text
        rows = [_row("model", {}, reuse["curve_nats_before"], reuse["stderr_nats_before"],
                     _reused_cost(reuse, "before"), 0.0, reuse["tail_nats_per_generation_before"], None)]
    else:
        rows = [_measure("model", {}, lm, prefixes, test, s, None)]
    plain = np.asarray(rows[0]["tail_nats_per_generation"], dtype=np.float64)  # [N, S]: what every row is paired with
    for method, params in specs:
        rows.append(_measure(method, params, make_decoder(method, lm, **params), prefixes, test, s, plain))
    fit_text = batchify(target["valid"][:s.fit_tokens], s.fit_streams)
    if "temperature" in s.fitted:
        tf = fit_temperature(lm, fit_text, progress=True)
        rows.append(_measure("fitted_temperature", {"temperature": tf.temperature,
                                                    "temperature_stderr": tf.temperature_stderr},
                             make_decoder("temperature", lm, temperature=tf.temperature), prefixes, test, s, plain))
        # the fit lowers the cross-entropy of the text it was fitted on; on test text it may not
        rows[-1].update(fit_ce_before_nats=tf.ce_before, fit_ce_after_nats=tf.ce_after)
    if "calibration" in s.fitted:
        rows.append(_calibration_row(lm, fit_text, reuse, prefixes, test, s, plain))
    return DecodersResult({
        "model": target["name"], "corpus": target["corpus"], "rows": rows,
        "reference_test_ce_nats": rows[0]["test_ce_nats"], "mix_epsilon": s.mix_epsilon,
        "fit_tokens": fit_text.numel() - fit_text.size(1), "calibration_reused": bool(reuse), **gen,
        "unit": target["unit"], "seconds": time.perf_counter() - t0})


STAGE = Stage("decoders", DecodersConfig, compute, frozenset({"full", "hf"}),
              lambda r: {"decoders": {row["method"]: {k: row[k] for k in ("entrate_ppl", "test_ce_nats",
                                                                          "zero_prob_fraction", "tail_diff_nats",
                                                                          "tail_diff_stderr_nats")}
                                      for row in r["rows"]}},
              uses=("calibration",))
