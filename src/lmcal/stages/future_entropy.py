"""The future_entropy stage (registered in lmcal.stages): calibration against future-entropy heads
(lmcal.core.future_entropy) beside every other way of sampling, on the same prefixes, seeds and test words, with each
method's cost per generated word; its table and figure. Like lmcal.stages, no Lightning and no Hydra."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from lmcal.core.calibration import calibrated, fit_lookahead_calibration, fit_temperature, target_log_probs
from lmcal.core.decoders import make_decoder
from lmcal.core.entropy_rate import clustered_mean, generation_entropy_curve
from lmcal.core.expfit import stream_block_sums
from lmcal.core.future_entropy import (
    FutureCalibratedLM,
    check_horizons,
    fit_future_calibration,
    fit_rows,
    head_rows,
    rollout_examples,
    train_head,
    word_vectors,
)
from lmcal.core.lookahead import mix_uniform
from lmcal.core.lookahead_law import make_rule
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.errors import LmcalError
from lmcal.stages.plots import entropy_curve_figure
from lmcal.stages.rows import curve_row, generation_settings, same_settings, timed_generation
from lmcal.stages.stage import Stage, earlier_result, stage_context
from lmcal.stages.wandb_run import log_curves, wandb_log
from lmcal.utils.io import write_json_atomic, write_text_atomic
from lmcal.utils.numbers import exp_or_inf, format_ce, format_params

log = logging.getLogger("lmcal")


def heads_of(horizon_k, discount) -> list[tuple[int, float]]:
    """The (K, discount) pairs of the settings: every K with every discount, K = 1 once (it has no discount)."""
    ks = list(horizon_k) if isinstance(horizon_k, (list, tuple)) else [horizon_k]
    ds = list(discount) if isinstance(discount, (list, tuple)) else [discount]
    one = [k for k in ks if k == 1 and not isinstance(k, bool)]
    pairs = [(1, 1.0)] if one else []
    pairs += [(k, d) for k in ks if not (k == 1 and not isinstance(k, bool)) for d in ds]  # checked by check_horizons
    return check_horizons(pairs)


def _paired_ce(logq: torch.Tensor, logq_ref: torch.Tensor, streams: int, cluster_size: int) -> tuple[float, float]:
    """Mean of -log q + log q_ref over the test words (t-major, `streams` streams) and its standard error with blocks
    of cluster_size positions of a stream as units."""
    d = (logq_ref - logq).double()
    if not torch.isfinite(d).all():
        return math.inf, math.nan
    c = d - d.mean()
    return d.mean().item(), math.sqrt(stream_block_sums(c, streams, cluster_size).pow(2).sum().item()) / d.numel()


def future_entropy_stage(lm, train_tokens: torch.Tensor, valid_tokens: torch.Tensor, test_tokens: torch.Tensor,
                         out_dir: str | Path, *, horizon_k=(1, 5, 20, 100), discount=(1.0, 0.95), rollouts: int = 800,
                         rollout_prefix: int = 50, rollout_steps: int | None = None,
                         examples_per_rollout: int = 50, hidden: int = 256, rank: int = 64,
                         epochs: int = 8, batch_size: int = 512, lr: float = 3e-3, weight_decay: float = 1e-4,
                         temperature: bool = True, exact_lookahead: str | bool = "auto", exact_max_vocab: int = 2000,
                         fit_tokens: int = 20_000, fit_streams: int = 20, min_context: int = 100,
                         cluster_size: int = 100, score_tokens: int | None = None, score_streams: int = 10,
                         topk: int | None = 64, tail_samples: int = 16, cover: float | None = None,
                         cover_max: int | None = None, mix_epsilon: float = 1e-6,
                         timing_prefixes: int = 20, timing_horizon: int = 30, timing_repeats: int = 3,
                         decoders: dict | None = None,
                         num_prefixes: int = 100, samples_per_prefix: int = 5, prefix_len: int = 100,
                         horizon: int = 700, seed: int = 0, max_batch: int = 1024, model_name: str = "model",
                         corpus: str = "ptb", logger=None, name: str = "future_entropy", unit: str = "word") -> dict:
    """Calibration against future-entropy heads (lmcal.core.future_entropy) beside every other method, from the same
    prefixes and seeds: one head per (horizon_k, discount) trained on `rollouts` rollouts from the training text (each
    runs `rollout_steps` words past its prefix, the generation horizon when null, and gives `examples_per_rollout`
    examples spread evenly over them, so the heads learn the late words too, where the drift is),
    P ∝ P exp(a g) (and, with `temperature`, P^b exp(a g)) fitted on the first `fit_tokens` validation tokens; the
    plain model; exact one-step lookahead where affordable (`exact_lookahead`: auto = vocabularies up to
    exact_max_vocab); and the decoders stage's rows (`decoders`: its result, with the same generation and scoring
    settings: fitted temperature, top-k + tail lookahead, the truncating decoders), else the fitted temperature here.

    Each row: entropy at t = 1, over the last tenth (tail_ppl) and at the horizon; held-out CE on the first
    `score_tokens` test tokens (paired with the plain model's, blocks of cluster_size positions as units); the
    zero-probability fraction; and ms_per_token, the wall time of one generated word in a run of
    timing_prefixes x samples_per_prefix generations of timing_horizon words (the same protocol for every method,
    best of timing_repeats), with cost_ratio, its ratio to the plain model's timed in between.
    Writes `<name>.json`, `.md` and `.png`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    heads_spec = heads_of(horizon_k, discount)
    if exact_lookahead not in ("auto", True, False):
        raise LmcalError(f"analysis.{name}.exact_lookahead={exact_lookahead!r}: choose auto, true or false.")
    do_exact = lm.vocab_size <= exact_max_vocab if exact_lookahead == "auto" else bool(exact_lookahead)
    prefixes = random_prefixes(valid_tokens, num_prefixes, prefix_len, seed=seed)
    test = batchify(test_tokens[:score_tokens] if score_tokens else test_tokens, score_streams)
    fit_text = batchify(valid_tokens[:fit_tokens], fit_streams)
    if fit_text.size(0) <= max(1, min_context):
        raise LmcalError(f"analysis.{name}: each of the {fit_streams} fit streams is {fit_text.size(0)} tokens long "
                         f"and reads min_context={min_context} before its positions count, so nothing is fitted. "
                         "Raise fit_tokens, or lower fit_streams or min_context.")
    settings = generation_settings(prefixes, samples_per_prefix, prefix_len, horizon, seed, test, score_streams)
    reuse = decoders if same_settings(decoders, settings) else None
    if decoders and not reuse:
        log.info(f"{name}: the decoders result has other generation or scoring settings; its rows are left out")

    def timing(model) -> tuple[float, float]:  # (ms per generated word, its ratio to the plain model's)
        return timed_generation(model, lm, prefixes[:timing_prefixes], timing_horizon, samples_per_prefix, seed,
                                max_batch, timing_repeats)

    plain_tail, plain_logq = [], []

    def measure(method: str, params: dict, model, extra: dict | None = None) -> dict:
        t = time.perf_counter()
        curve = generation_entropy_curve(model, prefixes, horizon, samples_per_prefix, seed=seed,
                                         max_batch=max_batch, progress=True)
        logq = target_log_probs(model, test, progress=True)  # [n]
        if not plain_tail:
            plain_tail.append(curve.tail)
            plain_logq.append(logq)
        ce_diff, ce_diff_se = _paired_ce(logq, plain_logq[0], score_streams, cluster_size)
        zero = torch.isneginf(logq)
        cost = {"test_ce_nats": None if zero.any() else -logq.mean().item(), "test_ce_diff_nats": ce_diff,
                "test_ce_diff_stderr_nats": ce_diff_se, "zero_prob_fraction": zero.double().mean().item(),
                "test_ce_mixed_nats": -mix_uniform(logq, mix_epsilon, lm.vocab_size).mean().item(),
                **dict(zip(("ms_per_token", "cost_ratio"), timing(model), strict=True)),
                "generation_ms_per_token": 1000.0 * curve.generation_seconds / (curve.num_generations * horizon)}
        r = {**curve_row(method, params, curve.mean, curve.stderr, curve.tail, plain_tail[0], 0.0, **cost),
             "source": name, "seconds": time.perf_counter() - t, **(extra or {})}
        log.info(f"{name}: {method} ({format_params(params)}): last tenth {r['tail_ppl']:.1f}, test CE "
                 f"{'inf' if r['test_ce_nats'] is None else format(r['test_ce_nats'], '.4f')} "
                 f"({ce_diff:+.4f} +- {ce_diff_se:.4f} vs the model), {r['ms_per_token']:.3f} ms/word")
        return r

    rows = [measure("model", {}, lm)]
    # the heads: rollouts on the training text, one regression per horizon, all from the same rollouts
    t_roll = time.perf_counter()
    steps = int(rollout_steps or horizon)  # the heads learn from the whole run they are used on
    stride = max(1, math.ceil(steps / examples_per_rollout))
    ex = rollout_examples(lm, train_tokens, heads_spec, contexts=max(1, rollouts // 2), prefix_len=rollout_prefix,
                          steps=steps, stride=stride, seed=seed, max_batch=max_batch, progress=True)
    log.info(f"{name}: {ex.targets.size(0):,} examples from {rollouts} rollouts ({ex.model_steps:,} model steps, "
             f"{time.perf_counter() - t_roll:.0f} s)")
    logp, feats, y = fit_rows(lm, fit_text, min_context, progress=True)
    words = word_vectors(lm)
    words = None if words is None else words.cpu()  # the heads train and fit on the CPU rows
    heads = []
    for j, (k, d) in enumerate(heads_spec):
        t = time.perf_counter()
        head, stats = train_head(ex, j, lm.vocab_size, words, hidden=hidden, rank=rank, epochs=epochs,
                                 batch_size=batch_size, lr=lr, weight_decay=weight_decay, seed=seed)
        stats["train_seconds"] = time.perf_counter() - t
        g = head_rows(head, feats)  # [n, V]
        fit = None
        for two in ([False, True] if temperature else [False]):
            fit = fit_future_calibration(logp, g, y, temperature=two, streams=fit_streams, cluster_size=cluster_size,
                                         start=fit)
            params = {"horizon_k": k, "discount": d, "alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr}
            if two:
                params.update(beta=fit.beta, beta_stderr=fit.beta_stderr)
            log.info(f"{name}: head K={k} discount={d} (held-out R² {stats['r2']:.3f}, rmse {stats['rmse_nats']:.3f} "
                     f"nats){' with temperature' if two else ''}: alpha* {fit.alpha:.4f} +- {fit.alpha_stderr:.4f}"
                     + (f", beta* {fit.beta:.4f}" if two else "") + f"; fit CE {fit.ce_before:.4f} -> "
                     f"{fit.ce_after:.4f}")
            heads.append(("future_entropy_temperature" if two else "future_entropy", params, head, fit, stats))
        del g
    del logp, feats
    head_lms = []  # each head's calibrated model, beside its row
    for method, params, head, fit, stats in heads:
        head_lms.append(FutureCalibratedLM(lm, head.to(getattr(lm, "device", None) or "cpu"), fit.alpha, fit.beta))
        rows.append(measure(method, params, head_lms[-1],
                            {"head": stats, "fit_ce_before_nats": fit.ce_before, "fit_ce_after_nats": fit.ce_after,
                             "fit_tokens": fit.n_tokens}))
    best_head = _best_head(rows[1:1 + len(heads)], head_lms, rows[0]["test_ce_nats"],
                           lambda m, s: generation_entropy_curve(m, prefixes, horizon, samples_per_prefix, seed=s,
                                                                 max_batch=max_batch, progress=True), seed)
    if do_exact:
        fit = fit_lookahead_calibration(lm, fit_text, topk=None, min_context=min_context, seed=seed, progress=True)
        rows.append(measure("lookahead_exact", {"alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr},
                            calibrated(lm, fit.alpha), {"fit_ce_before_nats": fit.ce_before,
                                                        "fit_ce_after_nats": fit.ce_after}))
    if reuse:  # the decoders stage's rows, on the same prefixes, seeds and test words; timed here
        for r in reuse["rows"][1:]:
            p = r["params"]
            if r["method"] == "calibration":
                model = calibrated(lm, p["alpha"], topk=p.get("topk"), tail_samples=tail_samples, seed=seed,
                                   cover=p.get("cover"), cover_max=p.get("cover_max"))
            elif r["method"] == "fitted_temperature":
                model = make_decoder("temperature", lm, temperature=p["temperature"])
            else:
                model = make_decoder(r["method"], lm, **p)
            rows.append({**{k: r.get(k) for k in ("method", "params", "entropy_t1_nats", "entropy_last_nats",
                                                  "entrate_ppl", "tail_ppl", "tail_diff_nats", "tail_diff_stderr_nats",
                                                  "test_ce_nats", "zero_prob_fraction", "test_ce_mixed_nats",
                                                  "curve_nats", "stderr_nats")},
                         **dict(zip(("ms_per_token", "cost_ratio"), timing(model), strict=True)), "source": "decoders"})
    else:
        tf = fit_temperature(lm, fit_text, progress=True)
        rows.append(measure("fitted_temperature", {"temperature": tf.temperature,
                                                   "temperature_stderr": tf.temperature_stderr},
                            make_decoder("temperature", lm, temperature=tf.temperature)))
    ref_ce = rows[0]["test_ce_nats"]
    result = {"model": model_name, "corpus": corpus, "rows": rows, "reference_test_ce_nats": ref_ce,
              "reference_test_ppl": exp_or_inf(ref_ce), "heads": [list(h) for h in heads_spec],
              "rollouts": rollouts, "rollout_examples": int(ex.targets.size(0)), "rollout_model_steps": ex.model_steps,
              "rollout_steps": steps, "examples_per_rollout": len(range(0, steps, stride)),
              "rollout_seconds": ex.seconds, "fit_tokens": int(y.numel()), "fit_streams": fit_streams,
              "min_context": min_context, "cluster_size": cluster_size, "decoders_reused": bool(reuse),
              "exact_lookahead": do_exact, "timing_prefixes": timing_prefixes, "timing_horizon": timing_horizon,
              "timing_repeats": timing_repeats,
              "mix_epsilon": mix_epsilon, "best_head": best_head, **settings, "unit": unit,
              "seconds": time.perf_counter() - t0}
    png = future_entropy_figure(result, out / f"{name}.png")
    fit_table = heads_fit_table(rows, unit)
    fit_table = f"\nThe heads' held-out R² on their rollouts, by generated {unit}:\n\n{fit_table}" if fit_table else ""
    write_text_atomic(out / f"{name}.md", future_entropy_table(rows, ref_ce) + f"\nEntropies and cross-entropies in "
                      f"nats per {unit}; ms per generated {unit} on {timing_prefixes * samples_per_prefix} "
                      f"generations of {timing_horizon}.\n" + fit_table)
    write_json_atomic(out / f"{name}.json", result)
    wandb_log(logger, scalars={f"{name}/{r['method']}{_suffix(r)}/{k}": r[k] for r in rows
                               for k in ("tail_ppl", "test_ce_nats", "ms_per_token") if r[k] is not None},
              images={f"{name}/figure": png})
    curves = {f"{r['method']}{_suffix(r)}": r["curve_nats"] for r in rows if r.get("curve_nats")}
    if curves:
        log_curves(logger, f"{name}/curves", "t", range(1, len(next(iter(curves.values()))) + 1), curves)
    log.info(f"{name}: {len(rows)} methods in {result['seconds']:.0f} s; {out / (name + '.json')}\n"
             f"{future_entropy_table(rows, ref_ce)}")
    return result


def _best_head(rows: list[dict], models: list, test_nats: float | None, curve_of, seed: int) -> dict | None:
    """The head row whose last tenth comes closest to the test perplexity without a higher test CE than the model's,
    chosen on the generations of `seed` (the rows') and measured again on those of seed + 1 (curve_of(model, seed)),
    so that the level reported is not the one it was picked for; as the sequence_calibration stage's goal row."""
    fair = [(r, m) for r, m in zip(rows, models, strict=True) if (r.get("test_ce_diff_nats") or 0) <= 0]
    if not fair or test_nats is None:
        return None
    chosen, model = min(fair, key=lambda rm: abs(rm[0]["tail_nats"] - test_nats))
    level, se = clustered_mean(curve_of(model, seed + 1).tail)  # [N, S] -> the level and its se, by prefix
    log.info(f"future_entropy: closest head on seed {seed}: {chosen['method']}{_suffix(chosen)}; on seed "
             f"{seed + 1} its last tenth is {exp_or_inf(float(level)):.1f} against the test perplexity "
             f"{exp_or_inf(test_nats):.1f}")
    return {"method": chosen["method"], "params": chosen["params"], "chosen_on_seed": seed,
            "reported_on_seed": seed + 1, "tail_nats": float(level), "tail_stderr_nats": float(se),
            "tail_ppl": exp_or_inf(float(level)), "tail_ppl_chosen_seed": chosen["tail_ppl"],
            "candidates": [f"{r['method']}{_suffix(r)}" for r, _ in fair]}


def _short_label(r: dict) -> str:
    """A row's name in the figure: the heads by K, γ (and β), the others by method and their main parameter."""
    p = r["params"]
    if "horizon_k" in p:
        return f"head K={p['horizon_k']}, γ={p['discount']:g}" + (", with β" if "beta" in p else "")
    return {"model": "model", "lookahead_exact": "exact one-step lookahead",
            "calibration": f"{make_rule(p.get('topk'), p.get('cover'), p.get('cover_max')).label} lookahead",
            "fitted_temperature": "fitted temperature"}.get(
        r["method"], r["method"])


def future_entropy_figure(result: dict, path: str | Path) -> Path:
    """The future_entropy stage's figure from its result: the plain model, each head's calibrated model, exact and
    top-k lookahead and the fitted temperature (the truncating decoders are on the decoders' figure), with the paired
    differences over the last tenth."""
    rows = result["rows"]
    shown = [r for r in rows if r.get("source") != "decoders" or r["method"] in ("calibration", "fitted_temperature")]
    return entropy_curve_figure(
        {_short_label(r): (np.asarray(r["curve_nats"]), np.asarray(r["stderr_nats"])) for r in shown}, path,
        reference_nats={"test cross-entropy (true text)": result["reference_test_ce_nats"]},
        title=f"{result['model']} on {result['corpus']}: calibration against future entropy", legend_outside=True,
        tail_differences={_short_label(r): (r["tail_diff_nats"], r["tail_diff_stderr_nats"]) for r in shown[1:]})


def _suffix(r: dict) -> str:
    p = r["params"]
    return f"_K{p['horizon_k']}_d{p['discount']:g}" if "horizon_k" in p else ""


def future_entropy_table(rows: list[dict], ref_ce: float | None) -> str:
    """The future_entropy stage's Markdown table: one line per method, every entropy and cross-entropy in nats; ×
    model is the row's ms / word over the plain model row's, the column beside it (the ratio timed alternately with
    the plain model is cost_ratio in the JSON)."""
    lines = ["| method | params | H(t=1) (nats) | H, last tenth (nats) | Δ last tenth vs model (nats) | H(t=T) (nats) "
             "| test CE (nats) | Δ test CE vs model (nats) | zero-prob | ms / word | × model |", "|" + "---|" * 11]
    plain_ms = next((r["ms_per_token"] for r in rows if r["method"] == "model"), rows[0]["ms_per_token"])
    for r in rows:
        ce_d = ("–" if r.get("test_ce_diff_nats") is None else
                f"{r['test_ce_diff_nats']:+.4f} ± {r['test_ce_diff_stderr_nats']:.4f}")
        tail_d = "–" if r is rows[0] else f"{r['tail_diff_nats']:+.3f} ± {r['tail_diff_stderr_nats']:.3f}"
        ratio = f"{r['ms_per_token'] / plain_ms:.2f}" if plain_ms else "–"
        lines.append(f"| {r['method']} | {format_params(r['params'], drop=('stderr',))} | {r['entropy_t1_nats']:.3f} "
                     f"| {math.log(r['tail_ppl']):.3f} | {tail_d} | {math.log(r['entrate_ppl']):.3f} "
                     f"| {format_ce(r['test_ce_nats'])} | {ce_d} | {r['zero_prob_fraction']:.4f} "
                     f"| {r['ms_per_token']:.3f} | {ratio} |")
    if ref_ce is not None:
        lines.append(f"\nThe model's test perplexity: {exp_or_inf(ref_ce):.1f}.")
    return "\n".join(lines) + "\n"


def heads_fit_table(rows: list[dict], unit: str = "word") -> str:
    """Each head's held-out R² on its rollouts, overall and by stage of the free run (the generated word's index):
    one line per head (its plain row; the temperature row shares the head). Empty when no row has r2_by_step."""
    heads = [r for r in rows if r["method"] == "future_entropy" and (r.get("head") or {}).get("r2_by_step")]
    if not heads:
        return ""
    bins = [tuple(b["steps"]) for b in heads[0]["head"]["r2_by_step"]]
    lines = ["| head | R², all | " + " | ".join(f"R², {unit}s {a}–{b}" for a, b in bins) + " |",
             "|" + "---|" * (len(bins) + 2)]
    for r in heads:
        h = r["head"]
        by = {tuple(b["steps"]): b["r2"] for b in h["r2_by_step"]}
        cells = ["–" if by.get(b) is None else f"{by[b]:.3f}" for b in bins]
        lines.append(f"| K={h['horizon_k']}, γ={h['discount']:g} | "
                     f"{'–' if h.get('r2') is None else format(h['r2'], '.3f')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _call(t, out, logger, earlier, decoders_json=None, **s):
    dec = earlier_result(earlier, "future_entropy", "decoders", decoders_json, "leave the decoders' rows out")
    if "train" not in t:
        raise LmcalError("The future_entropy stage trains its heads on rollouts from the training text, which this "
                         "model's target does not carry.")
    return future_entropy_stage(t["lm"], t["train"], t["valid"], t["test"], out, decoders=dec, unit=t["unit"],
                                **stage_context(t, logger), **s)


STAGE = Stage("future_entropy", future_entropy_stage, _call, frozenset({"full", "hf"}),
              lambda r: {"future_entropy": [{k: row.get(k) for k in (
                  "method", "params", "entrate_ppl", "tail_ppl", "test_ce_nats", "ms_per_token", "entropy_t1_nats",
                  "tail_diff_nats", "tail_diff_stderr_nats", "test_ce_diff_nats", "test_ce_diff_stderr_nats",
                  "zero_prob_fraction", "cost_ratio", "source")} for row in r["rows"]]},
              entry_settings=("decoders_json",), uses=("decoders",))
