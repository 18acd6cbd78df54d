"""The future_entropy stage (registered in lmcal.stages): calibration against future-entropy heads
(lmcal.core.future_entropy) beside every other way of sampling, on the same prefixes, seeds and test words, with each
method's cost per generated word; its table and figure. Like lmcal.stages, no Lightning and no Hydra."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmcal.core.calibration import calibrated, fit_lookahead_calibration, fit_temperature, target_log_probs
from lmcal.core.decoders import make_decoder
from lmcal.core.entropy_rate import clustered_mean, generation_entropy_curve
from lmcal.core.expfit import NoFiniteMinimum, no_minimum_label, stream_block_sums
from lmcal.core.future_entropy import (
    FutureCalibratedLM,
    HeadTraining,
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
from lmcal.stages.configs import FutureEntropyConfig
from lmcal.stages.plots import entropy_curve_figure
from lmcal.stages.rows import curve_row, generation_settings, same_settings, timed_generation
from lmcal.stages.stage import Result, Stage, earlier_result
from lmcal.stages.wandb_run import log_curves, wandb_log
from lmcal.utils.numbers import exp_or_inf, format_ce, format_params

log = logging.getLogger("lmcal")

# the keys of a decoders row that join this stage's table, beside its timing here
DECODERS_KEYS = ("method", "params", "entropy_t1_nats", "entropy_last_nats", "entrate_ppl", "tail_ppl",
                 "tail_diff_nats", "tail_diff_stderr_nats", "test_ce_nats", "zero_prob_fraction", "test_ce_mixed_nats",
                 "curve_nats", "stderr_nats")


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


class FutureEntropyResult(Result):
    """One row per way of sampling: its entropy curve, held-out cost paired with the plain model's, and ms per word."""

    def table(self) -> str:
        r = self.record
        unfitted = r.get("no_minimum_rows") or []
        fit_table = heads_fit_table(r["rows"] + unfitted, r["unit"])
        fit_table = f"\nThe heads' held-out R² on their rollouts, by generated {r['unit']}:\n\n{fit_table}" \
            if fit_table else ""
        timed = r["timing_prefixes"] * r["samples_per_prefix"]
        return (future_entropy_table(r["rows"], r["reference_test_ce_nats"], unfitted)
                + f"\nEntropies and cross-entropies in nats per {r['unit']}; ms per generated {r['unit']} on {timed} "
                f"generations of {r['timing_horizon']}.\n"
                + fit_table)

    def figure(self, path: Path) -> Path:
        return future_entropy_figure(self.record, path)

    def log_wandb(self, logger, name: str, images: dict[str, Path]) -> None:
        rows = self.record["rows"]
        wandb_log(logger, scalars={f"{name}/{r['method']}{_suffix(r)}/{k}": r[k] for r in rows
                                   for k in ("tail_ppl", "test_ce_nats", "ms_per_token") if r[k] is not None},
                  images=images)
        curves = {f"{r['method']}{_suffix(r)}": r["curve_nats"] for r in rows if r.get("curve_nats")}
        if curves:
            log_curves(logger, f"{name}/curves", "t", range(1, len(next(iter(curves.values()))) + 1), curves)

    def line(self, name: str) -> str:
        r = self.record
        return (f"{name}: {len(r['rows'])} methods in {r['seconds']:.0f} s\n"
                f"{future_entropy_table(r['rows'], r['reference_test_ce_nats'], r.get('no_minimum_rows'))}")


@dataclass
class _Bench:
    """What every row is measured on: the model, the prefixes and test words, the settings, and the plain model's
    tail entropies [N, S] and test log-probs [n], set by the first row measured (every later row is paired with
    them)."""

    lm: object
    prefixes: torch.Tensor
    test: torch.Tensor
    s: FutureEntropyConfig
    plain_tail: np.ndarray | None = None
    plain_logq: torch.Tensor | None = None


def _timing(b: _Bench, model) -> dict:
    """ms per generated word of `model` and its ratio to the plain model's, on the timing protocol."""
    s = b.s
    ms = timed_generation(model, b.lm, b.prefixes[:s.timing_prefixes], s.timing_horizon, s.samples_per_prefix, s.seed,
                          s.max_batch, s.timing_repeats)
    return dict(zip(("ms_per_token", "cost_ratio"), ms, strict=True))


def _measure(b: _Bench, method: str, params: dict, model, extra: dict | None = None) -> dict:
    """A method's row: its generations, its test words' log-probs paired with the plain model's, and its timing."""
    s, t = b.s, time.perf_counter()
    curve = generation_entropy_curve(model, b.prefixes, s.horizon, s.samples_per_prefix, seed=s.seed,
                                     max_batch=s.max_batch, progress=True)
    logq = target_log_probs(model, b.test, progress=True)  # [n]
    if b.plain_tail is None:
        b.plain_tail, b.plain_logq = curve.tail, logq
    ce_diff, ce_diff_se = _paired_ce(logq, b.plain_logq, s.score_streams, s.cluster_size)
    zero = torch.isneginf(logq)
    cost = {"test_ce_nats": None if zero.any() else -logq.mean().item(), "test_ce_diff_nats": ce_diff,
            "test_ce_diff_stderr_nats": ce_diff_se, "zero_prob_fraction": zero.double().mean().item(),
            "test_ce_mixed_nats": -mix_uniform(logq, s.mix_epsilon, b.lm.vocab_size).mean().item(), **_timing(b, model),
            "generation_ms_per_token": 1000.0 * curve.generation_seconds / (curve.num_generations * s.horizon)}
    r = {**curve_row(method, params, curve.mean, curve.stderr, curve.tail, b.plain_tail, 0.0, **cost),
         "source": "future_entropy", "seconds": time.perf_counter() - t, **(extra or {})}
    log.info(f"future_entropy: {method} ({format_params(params)}): last tenth {r['tail_ppl']:.1f}, test CE "
             f"{'inf' if r['test_ce_nats'] is None else format(r['test_ce_nats'], '.4f')} "
             f"({ce_diff:+.4f} +- {ce_diff_se:.4f} vs the model), {r['ms_per_token']:.3f} ms/word")
    return r


def _fit_heads(lm, train_tokens: torch.Tensor, fit_text: torch.Tensor, heads_spec: list, s: FutureEntropyConfig):
    """The heads: rollouts on the training text, one regression per horizon, all from the same rollouts, each head's
    tilt (and, with `temperature`, its two-parameter family) fitted on the validation rows. Returns the rollouts'
    examples, their steps and stride, the fit's token count, (method, params, head, fit, stats) per fit and the
    rows of fits without a finite minimum (calibrate_head)."""
    t_roll = time.perf_counter()
    steps = int(s.rollout_steps or s.horizon)  # the heads learn from the whole run they are used on
    stride = max(1, math.ceil(steps / s.examples_per_rollout))
    ex = rollout_examples(lm, train_tokens, heads_spec, contexts=max(1, s.rollouts // 2), prefix_len=s.rollout_prefix,
                          steps=steps, stride=stride, seed=s.seed, max_batch=s.max_batch, progress=True)
    log.info(f"future_entropy: {ex.targets.size(0):,} examples from {s.rollouts} rollouts ({ex.model_steps:,} model "
             f"steps, {time.perf_counter() - t_roll:.0f} s)")
    logp, feats, y = fit_rows(lm, fit_text, s.min_context, progress=True)
    words = word_vectors(lm)
    words = None if words is None else words.cpu()  # the heads train and fit on the CPU rows
    training = HeadTraining(hidden=s.hidden, rank=s.rank, epochs=s.epochs, batch_size=s.batch_size, lr=s.lr,
                            weight_decay=s.weight_decay, seed=s.seed)
    heads, unfitted = [], []
    for j in range(len(heads_spec)):
        t = time.perf_counter()
        head, stats = train_head(ex, j, lm.vocab_size, words, training)
        stats["train_seconds"] = time.perf_counter() - t
        fitted, without = calibrate_head(logp, head_rows(head, feats), y, head, stats, s)
        heads += fitted
        unfitted += without
    return ex, steps, stride, int(y.numel()), heads, unfitted


def calibrate_head(logp: torch.Tensor, g: torch.Tensor, y: torch.Tensor, head, stats: dict,
                   s: FutureEntropyConfig) -> tuple[list, list[dict]]:
    """A head's tilt P ∝ P exp(a g) fitted on the fit rows log P [n, V], g [n, V], next words y [n] (and, with
    s.temperature, P^b exp(a g), started from the tilt): (method, params, head, fit, stats) per fit with a finite
    minimum, and a no_minimum_row per fit without one (a result: recorded, nothing measured)."""
    k, d = stats["horizon_k"], stats["discount"]
    fitted, unfitted, fit = [], [], None
    for two in ([False, True] if s.temperature else [False]):
        method = "future_entropy_temperature" if two else "future_entropy"
        what = f"future_entropy: head K={k} discount={d}{' with temperature' if two else ''}"
        try:
            fit = fit_future_calibration(logp, g, y, temperature=two, streams=s.fit_streams,
                                         cluster_size=s.cluster_size, start=fit)
        except NoFiniteMinimum as e:
            log.warning(f"{what}: {no_minimum_label(e.record())}; recorded as such, not generated from")
            unfitted.append(no_minimum_row(method, k, d, e, stats, int(y.numel())))
            continue
        params = {"horizon_k": k, "discount": d, "alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr}
        if two:
            params.update(beta=fit.beta, beta_stderr=fit.beta_stderr)
        log.info(f"{what} (held-out R² {stats['r2']:.3f}, rmse {stats['rmse_nats']:.3f} nats): alpha* "
                 f"{fit.alpha:.4f} +- {fit.alpha_stderr:.4f}" + (f", beta* {fit.beta:.4f}" if two else "")
                 + f"; fit CE {fit.ce_before:.4f} -> {fit.ce_after:.4f}")
        fitted.append((method, params, head, fit, stats))
    return fitted, unfitted


def no_minimum_row(method: str, k: int, d: float, e: NoFiniteMinimum, stats: dict, fit_tokens: int) -> dict:
    """The record of a head's fit whose CE has no minimum inside |theta| < e.bound: no calibrated model exists, so
    nothing is generated or scored from it (no measured keys, no verdict); kept are NoFiniteMinimum.record's keys
    (the edge's parameters, theta = [alpha] or [beta - 1, alpha], and CE on the fit rows there, which the family's
    infimum is below), the head's regression statistics and the reason."""
    return {"method": method, "params": {"horizon_k": k, "discount": d}, **e.record(), "fit_tokens": fit_tokens,
            "head": stats, "source": "future_entropy", "no_finite_minimum_reason": str(e)}


def _decoders_rows(b: _Bench, decoders: dict) -> list[dict]:
    """The decoders stage's rows (same prefixes, seeds and test words), each timed here."""
    s, lm, rows = b.s, b.lm, []
    for r in decoders["rows"][1:]:
        p = r["params"]
        if r["method"] == "calibration":
            model = calibrated(lm, p["alpha"], topk=p.get("topk"), tail_samples=s.tail_samples, seed=s.seed,
                               cover=p.get("cover"), cover_max=p.get("cover_max"))
        elif r["method"] == "fitted_temperature":
            model = make_decoder("temperature", lm, temperature=p["temperature"])
        else:
            model = make_decoder(r["method"], lm, **p)
        rows.append({**{k: r.get(k) for k in DECODERS_KEYS}, **_timing(b, model), "source": "decoders"})
    return rows


def _exact(s: FutureEntropyConfig, vocab_size: int) -> bool:
    """Whether exact one-step lookahead runs too: `exact_lookahead`, auto meaning vocabularies up to exact_max_vocab
    (it costs V model steps a position)."""
    if s.exact_lookahead not in ("auto", True, False):
        raise LmcalError(f"analysis.future_entropy.exact_lookahead={s.exact_lookahead!r}: choose auto, true or false.")
    return vocab_size <= s.exact_max_vocab if s.exact_lookahead == "auto" else bool(s.exact_lookahead)


def _check_fit_text(s: FutureEntropyConfig, fit_text: torch.Tensor) -> None:
    """One paragraph where the fit streams are too short for anything to be fitted."""
    if fit_text.size(0) <= max(1, s.min_context):
        raise LmcalError(f"analysis.future_entropy: each of the {s.fit_streams} fit streams is {fit_text.size(0)} "
                         f"tokens long and reads min_context={s.min_context} before its positions count, so nothing "
                         "is fitted. Raise fit_tokens, or lower fit_streams or min_context.")


def compute(target: dict, settings: FutureEntropyConfig) -> FutureEntropyResult:
    """Calibration against future-entropy heads (lmcal.core.future_entropy) beside every other method, from the same
    prefixes and seeds: one head per (horizon_k, discount) trained on `rollouts` rollouts from the training text (each
    runs `rollout_steps` words past its prefix, the generation horizon when null, and gives `examples_per_rollout`
    examples spread evenly over them, so the heads learn the late words too, where the drift is),
    P ∝ P exp(a g) (and, with `temperature`, P^b exp(a g)) fitted on the first `fit_tokens` validation tokens; the
    plain model; exact one-step lookahead where affordable (`exact_lookahead`: auto = vocabularies up to
    exact_max_vocab); and the decoders stage's rows (its result, with the same generation and scoring settings:
    fitted temperature, top-k + tail lookahead, the truncating decoders), else the fitted temperature here.

    Each row: entropy at t = 1, over the last tenth (tail_ppl) and at the horizon; held-out CE on the first
    `score_tokens` test tokens (paired with the plain model's, blocks of cluster_size positions as units); the
    zero-probability fraction; and ms_per_token, the wall time of one generated word in a run of
    timing_prefixes x samples_per_prefix generations of timing_horizon words (the same protocol for every method,
    best of timing_repeats), with cost_ratio, its ratio to the plain model's timed in between."""
    s, lm = settings, target["lm"]
    decoders = earlier_result(target, "future_entropy", "decoders", s.decoders_json)
    if target.get("train") is None:
        raise LmcalError("The future_entropy stage trains its heads on rollouts from the training text, which this "
                         "model's target does not carry.")
    t0 = time.perf_counter()
    heads_spec = heads_of(s.horizon_k, s.discount)
    do_exact = _exact(s, lm.vocab_size)
    prefixes = random_prefixes(target["valid"], s.num_prefixes, s.prefix_len, seed=s.seed)
    test = batchify(target["test"][:s.score_tokens] if s.score_tokens else target["test"], s.score_streams)
    fit_text = batchify(target["valid"][:s.fit_tokens], s.fit_streams)
    _check_fit_text(s, fit_text)
    gen = generation_settings(prefixes, s.samples_per_prefix, s.prefix_len, s.horizon, s.seed, test, s.score_streams)
    reuse = decoders if same_settings(decoders, gen) else None
    if decoders and not reuse:
        log.info("future_entropy: the decoders result has other generation or scoring settings; its rows are left out")
    b = _Bench(lm, prefixes, test, s)
    rows = [_measure(b, "model", {}, lm)]
    ex, steps, stride, fit_tokens, heads, unfitted = _fit_heads(lm, target["train"], fit_text, heads_spec, s)
    head_lms = [FutureCalibratedLM(lm, head.to(getattr(lm, "device", None) or "cpu"), fit.alpha, fit.beta)
                for _, _, head, fit, _ in heads]  # each head's calibrated model, beside its row
    for (method, params, _, fit, stats), model in zip(heads, head_lms, strict=True):
        rows.append(_measure(b, method, params, model, {"head": stats, "fit_ce_before_nats": fit.ce_before,
                                                        "fit_ce_after_nats": fit.ce_after, "fit_tokens": fit.n_tokens}))
    best_head = _best_head(rows[1:1 + len(heads)], head_lms, rows[0]["test_ce_nats"], b)
    if do_exact:
        fit = fit_lookahead_calibration(lm, fit_text, min_context=s.min_context, seed=s.seed, progress=True)
        rows.append(_measure(b, "lookahead_exact", {"alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr},
                             calibrated(lm, fit.alpha), {"fit_ce_before_nats": fit.ce_before,
                                                         "fit_ce_after_nats": fit.ce_after}))
    if reuse:
        rows += _decoders_rows(b, reuse)
    else:
        tf = fit_temperature(lm, fit_text, progress=True)
        rows.append(_measure(b, "fitted_temperature", {"temperature": tf.temperature,
                                                       "temperature_stderr": tf.temperature_stderr},
                             make_decoder("temperature", lm, temperature=tf.temperature)))
    ref_ce = rows[0]["test_ce_nats"]
    return FutureEntropyResult({
        "model": target["name"], "corpus": target["corpus"], "rows": rows, "reference_test_ce_nats": ref_ce,
        "reference_test_ppl": exp_or_inf(ref_ce), "heads": [list(h) for h in heads_spec], "rollouts": s.rollouts,
        "rollout_examples": int(ex.targets.size(0)), "rollout_model_steps": ex.model_steps, "rollout_steps": steps,
        "examples_per_rollout": len(range(0, steps, stride)), "rollout_seconds": ex.seconds, "fit_tokens": fit_tokens,
        "fit_streams": s.fit_streams, "min_context": s.min_context, "cluster_size": s.cluster_size,
        "unit": target["unit"], "decoders_reused": bool(reuse), "exact_lookahead": do_exact, "best_head": best_head,
        "timing_prefixes": s.timing_prefixes, "timing_horizon": s.timing_horizon, "timing_repeats": s.timing_repeats,
        "mix_epsilon": s.mix_epsilon, "no_minimum_rows": unfitted, **gen, "seconds": time.perf_counter() - t0})


def _best_head(rows: list[dict], models: list, test_nats: float | None, b: _Bench) -> dict | None:
    """The head row whose last tenth comes closest to the test perplexity without a higher test CE than the model's,
    chosen on the generations of the settings' seed (the rows') and measured again on those of seed + 1, so that the
    level reported is not the one it was picked for; as the sequence_calibration stage's goal row."""
    fair = [(r, m) for r, m in zip(rows, models, strict=True) if (r.get("test_ce_diff_nats") or 0) <= 0]
    if not fair or test_nats is None:
        return None
    s, seed = b.s, b.s.seed
    chosen, model = min(fair, key=lambda rm: abs(rm[0]["tail_nats"] - test_nats))
    curve = generation_entropy_curve(model, b.prefixes, s.horizon, s.samples_per_prefix, seed=seed + 1,
                                     max_batch=s.max_batch, progress=True)
    level, se = clustered_mean(curve.tail)  # [N, S] -> the level and its se, by prefix
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


def future_entropy_table(rows: list[dict], ref_ce: float | None, unfitted: list[dict] | None = None) -> str:
    """The future_entropy stage's Markdown table: one line per method, every entropy and cross-entropy in nats; ×
    model is the row's ms / word over the plain model row's, the column beside it (the ratio timed alternately with
    the plain model is cost_ratio in the JSON). `unfitted`: heads whose fit had no finite minimum (no_minimum_row),
    each a line that says so in place of its numbers."""
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
    lines += [f"| {r['method']} | {format_params(r['params'])} | {no_minimum_label(r, table=True)} |" + " – |" * 8
              for r in unfitted or []]
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


STAGE = Stage("future_entropy", FutureEntropyConfig, compute, frozenset({"full", "hf"}),
              lambda r: {"future_entropy": [{k: row.get(k) for k in (
                  "method", "params", "entrate_ppl", "tail_ppl", "test_ce_nats", "ms_per_token", "entropy_t1_nats",
                  "tail_diff_nats", "tail_diff_stderr_nats", "test_ce_diff_nats", "test_ce_diff_stderr_nats",
                  "zero_prob_fraction", "cost_ratio", "source")} for row in r["rows"]]},
              uses=("decoders",))
