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
from lmcal.core.entropy_rate import (
    generation_entropy_curve,
)
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.errors import LmcalError
from lmcal.stages.plots import entropy_curve_figure
from lmcal.stages.rows import curve_row, generation_settings, method_label, same_settings
from lmcal.stages.stage import Stage, earlier_result, stage_context
from lmcal.stages.tables import decoders_table
from lmcal.stages.wandb_run import log_config, log_curves, wandb_log
from lmcal.utils.io import write_json_atomic, write_text_atomic
from lmcal.utils.numbers import format_params

log = logging.getLogger("lmcal")


def decoders_stage(lm, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, out_dir: str | Path, *,
                   methods: list[dict] | None = None, fitted: list[str] = ("temperature", "calibration"),
                   calibration: dict | None = None, fit_tokens: int = 20_000, fit_streams: int = 20,
                   score_tokens: int | None = None, score_streams: int = 10, topk: int | None = 64,
                   tail_samples: int = 16, cover: float | None = None, cover_max: int | None = None,
                   min_context: int = 100, mix_epsilon: float = 1e-6,
                   num_prefixes: int = 100, samples_per_prefix: int = 5,
                   prefix_len: int = 100, horizon: int = 700, seed: int = 0, max_batch: int = 1024,
                   model_name: str = "model", corpus: str = "ptb", logger=None, name: str = "decoders",
                   unit: str = "word") -> dict:
    """Every decoding method on one entropy-rate figure and one table, from the same prefixes and seeds: the plain
    model, each of `methods` ({"name": ..., **params}, see lmcal.core.decoders), and the fitted ones: `temperature`
    (P^(1/T), T* by validation CE) and `calibration` (lookahead, Algorithm 2; taken from the calibration stage's
    result `calibration` when its settings match, else fitted here). Held-out cost on the first `score_tokens` test
    tokens read as `score_streams` streams. Each row's generations are paired with the plain model's (same prefixes
    and uniforms): tail_diff_nats is the mean difference of their entropy over the last tenth of the horizon, with
    its standard error clustered by prefix. Writes `<name>.json`, `.md` and `.png`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    methods = [dict(m) for m in (methods or [])]
    specs = []
    for m in methods:
        if "name" not in m:
            raise LmcalError(f"A decoder needs a name, got {m}; e.g. {{name: top_p, p: 0.9}}.")
        method = m.pop("name")
        specs.append((method, decoder_params(method, **m)))  # checked before any work starts
    unknown = set(fitted) - {"temperature", "calibration"}
    if unknown:
        raise LmcalError(f"Unknown fitted method(s) {sorted(unknown)}: choose from temperature, calibration.")
    prefixes = random_prefixes(valid_tokens, num_prefixes, prefix_len, seed=seed)
    test = batchify(test_tokens[:score_tokens] if score_tokens else test_tokens, score_streams)
    settings = generation_settings(prefixes, samples_per_prefix, prefix_len, horizon, seed, test, score_streams)
    reuse = calibration if same_settings(calibration, settings) else None
    if reuse and ("tail_nats_per_generation_before" not in reuse  # from before paired tails: its pairs are unknown
                  or reuse.get("uniform_weight")):  # its "before" is the eps-mixture, not the plain model here
        reuse = None
    if calibration and not reuse:
        log.info(f"{name}: the calibration result has other generation or scoring settings; refitting here")

    plain_tail = []  # the plain model's per-generation tail entropies [N, S], what every row is paired with

    def measure(method: str, params: dict, model) -> dict:
        t = time.perf_counter()
        curve = generation_entropy_curve(model, prefixes, horizon, samples_per_prefix, seed=seed,
                                         max_batch=max_batch, progress=True)
        cost = heldout_cost(model, test, mix_epsilon, progress=True)
        return row(method, params, curve.mean.tolist(), curve.stderr.tolist(), cost, time.perf_counter() - t,
                   curve.tail)

    def row(method, params, curve, stderr, cost, seconds, tail) -> dict:
        if not plain_tail:
            plain_tail.append(np.asarray(tail, dtype=np.float64))
        r = curve_row(method, params, curve, stderr, tail, plain_tail[0], seconds,
                      **{k: cost[k] for k in ("test_ce_nats", "zero_prob_fraction", "test_ce_kept_nats",
                                              "test_ce_mixed_nats")})
        log.info(f"{name}: {method} ({format_params(params)}): EntRate {r['entrate_ppl']:.1f}, test CE "
                 f"{'inf' if r['test_ce_nats'] is None else format(r['test_ce_nats'], '.4f')}, zero-prob "
                 f"{r['zero_prob_fraction']:.4f}")
        return r

    def reused_cost(when: str) -> dict:  # the calibration stage's test cost of the model `before` or `after`
        ce = reuse[f"test_ce_{when}_nats"]  # both give every word a positive probability
        return {"test_ce_nats": ce, "zero_prob_fraction": 0.0, "test_ce_kept_nats": ce,
                "test_ce_mixed_nats": reuse.get(f"test_ce_mixed_nats_{when}")}

    rows = []
    if reuse:  # the plain model's curve and cost from the calibration stage: same prefixes, seeds and test text
        rows.append(row("model", {}, reuse["curve_nats_before"], reuse["stderr_nats_before"], reused_cost("before"),
                        0.0, reuse["tail_nats_per_generation_before"]))
    else:
        rows.append(measure("model", {}, lm))
    for method, params in specs:
        rows.append(measure(method, params, make_decoder(method, lm, **params)))
    fit_text = batchify(valid_tokens[:fit_tokens], fit_streams)
    if "temperature" in fitted:
        tf = fit_temperature(lm, fit_text, progress=True)
        rows.append(measure("fitted_temperature", {"temperature": tf.temperature,
                                                   "temperature_stderr": tf.temperature_stderr},
                            make_decoder("temperature", lm, temperature=tf.temperature)))
        # the fit lowers the cross-entropy of the text it was fitted on; on test text it may not
        rows[-1].update(fit_ce_before_nats=tf.ce_before, fit_ce_after_nats=tf.ce_after)
    if "calibration" in fitted:
        if reuse:
            rule = {k: reuse[k] for k in ("topk", "cover", "cover_max") if reuse.get(k) is not None or k == "topk"}
            rows.append(row("calibration", {"alpha": reuse["alpha"], "alpha_stderr": reuse["alpha_stderr"],
                                            **rule}, reuse["curve_nats"], reuse["stderr_nats"],
                            reused_cost("after"), 0.0, reuse["tail_nats_per_generation"]))
        else:
            fit = fit_lookahead_calibration(lm, fit_text, topk=topk, tail_samples=tail_samples,
                                            min_context=min_context, seed=seed, progress=True, cover=cover,
                                            cover_max=cover_max)
            rule = {"topk": topk, **{k: v for k, v in (("cover", cover), ("cover_max", cover_max)) if v is not None}}
            rows.append(measure("calibration", {"alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr, **rule},
                                calibrated(lm, fit.alpha, topk=topk, tail_samples=tail_samples, seed=seed,
                                           cover=cover, cover_max=cover_max)))
    ref = rows[0]["test_ce_nats"]
    result = {"model": model_name, "corpus": corpus, "rows": rows, "reference_test_ce_nats": ref,
              "mix_epsilon": mix_epsilon, "fit_tokens": fit_text.numel() - fit_text.size(1),
              "calibration_reused": bool(reuse), **settings, "unit": unit, "seconds": time.perf_counter() - t0}
    label = lambda r: r["method"] + (f" ({format_params(r['params'], drop=('stderr',))})" if r["params"] else "")
    png = entropy_curve_figure({label(r): (np.asarray(r["curve_nats"]), np.asarray(r["stderr_nats"])) for r in rows},
                               out / f"{name}.png", reference_nats={"test cross-entropy (true text)": ref},
                               title=f"{model_name} on {corpus}: decoders and calibration", legend_outside=True,
                               tail_differences={method_label(r["method"], r["params"]): (
                                   r["tail_diff_nats"], r["tail_diff_stderr_nats"]) for r in rows[1:]})
    write_text_atomic(out / f"{name}.md", decoders_table(rows) + f"\nEntropies and cross-entropies in nats per {unit}; "
                      f"ε-mixed: (1 - ε) q + ε uniform, ε = {mix_epsilon:g}.\n")
    write_json_atomic(out / f"{name}.json", result)
    cols = ["method", "params", "entropy_t1_nats", "entropy_last_nats", "entrate_ppl", "tail_ppl", "tail_diff_nats",
            "tail_diff_stderr_nats", "test_ce_nats", "zero_prob_fraction", "test_ce_kept_nats", "test_ce_mixed_nats"]
    wandb_log(logger, scalars={f"{name}/{r['method']}/{k}": r[k] for r in rows for k in
                               ("entrate_ppl", "zero_prob_fraction", "test_ce_mixed_nats") if r[k] is not None},
              images={f"{name}/figure": png},
              tables={f"{name}/table": (cols, [[format_params(r[c]) if c == "params" else r[c] for c in cols]
                                               for r in rows])})
    shown = [r for r in rows if r.get("curve_nats")]  # series keyed by method (the same in every run), fits to config
    log_curves(logger, f"{name}/curves", "t", range(1, len(rows[0]["curve_nats"]) + 1),
               {method_label(r["method"], r["params"]): r["curve_nats"] for r in shown},
               legend={method_label(r["method"], r["params"]): label(r) for r in shown})
    log_config(logger, {f"{name}/{r['method']}/{k}": v for r in rows if r["method"] in ("fitted_temperature",
                                                                                        "calibration")
                        for k, v in r["params"].items()})
    log.info(f"{name}: {len(rows)} methods in {result['seconds']:.0f} s; {out / (name + '.json')}\n"
             f"{decoders_table(rows)}")
    return result


def _call(t, out, logger, earlier, calibration_json=None, **s):
    cal = earlier_result(earlier, "decoders", "calibration", calibration_json, "fit the calibration row here")
    return decoders_stage(t["lm"], t["valid"], t["test"], out, calibration=cal, unit=t["unit"],
                          **stage_context(t, logger), **s)


STAGE = Stage("decoders", decoders_stage, _call, frozenset({"full", "hf"}),
              lambda r: {"decoders": {row["method"]: {k: row[k] for k in ("entrate_ppl", "test_ce_nats",
                                                                          "zero_prob_fraction", "tail_diff_nats",
                                                                          "tail_diff_stderr_nats")}
                                      for row in r["rows"]}},
              entry_settings=("calibration_json",), uses=("calibration",))
