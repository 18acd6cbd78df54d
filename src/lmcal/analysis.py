"""The bodies of the analysis stages (registered in lmcal.stages): each takes what it analyses (a `StepLM` and token
tensors, or two networks for the memory bound), an output folder and keyword settings; writes its JSON, PNG and
Markdown there atomically; logs them to W&B when given a W&B logger; and returns its result as a dict. No Lightning,
no Hydra: the maths they call lives in entropy_rate, calibration, decoders and memory."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from lmcal import paper
from lmcal.calibration import calibrated, fit_lookahead_calibration, fit_temperature
from lmcal.data import batchify
from lmcal.decoders import decoder_params, heldout_cost, make_decoder
from lmcal.entropy_rate import (
    clustered_mean,
    generation_entropy_curve,
    paired_difference_curve,
    paired_tail_difference,
    random_prefixes,
    tail_steps,
)
from lmcal.errors import LmcalError
from lmcal.lm import as_step_lm
from lmcal.memory import context_rows, full_context_span, memory_summary
from lmcal.model import AWDLSTM, zip_rows
from lmcal.plots import entropy_curve_figure
from lmcal.profiling import add_flops, flops_per_token, span
from lmcal.report import decoders_table, table1_markdown
from lmcal.utils import exp_or_inf, format_params, write_json_atomic, write_text_atomic

log = logging.getLogger("lmcal")


def wandb_run(logger_cfg, config: dict | None = None):
    """The W&B run of an analysis entry point, from the logger node (conf/logger) that training gives Lightning's
    WandbLogger, opened with wandb itself so that these processes never import Lightning; False for any other logger
    (the stages' results are in their JSON files)."""
    node = dict(logger_cfg or {})
    if not str(node.pop("_target_", "")).endswith("WandbLogger"):
        return False
    import wandb

    offline, save_dir = node.pop("offline", False), node.pop("save_dir", None)
    node.pop("log_model", None)
    Path(save_dir or ".").mkdir(parents=True, exist_ok=True)
    return wandb.init(**node, dir=save_dir, mode="offline" if offline else "online", resume="allow", config=config)


def finish_run(run) -> None:
    """Close the W&B run whatever happened, so offline runs are complete and syncable."""
    if run:
        run.finish()


def wandb_log(logger, scalars: dict | None = None, images: dict | None = None, tables: dict | None = None) -> None:
    """Log to a W&B run, or the one behind a Lightning WandbLogger; a no-op for any other logger."""
    run = logger.experiment if type(logger).__name__ == "WandbLogger" else logger
    if type(run).__name__ != "Run":
        return
    import wandb

    payload = dict(scalars or {})
    payload.update({k: wandb.Image(str(v)) for k, v in (images or {}).items()})
    payload.update({k: wandb.Table(columns=cols, data=rows) for k, (cols, rows) in (tables or {}).items()})
    run.log(payload)


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
    result = {
        "model": model_name, "corpus": corpus,
        "test_ce_nats": test_ce_nats, "test_ppl": exp_or_inf(test_ce_nats),
        "entrate_nats": float(curve.mean[-1]), "entrate_ppl": exp_or_inf(curve.mean[-1]),
        "curve_nats": curve.mean.tolist(), "stderr_nats": curve.stderr.tolist(),
        "horizon": horizon, "num_prefixes": prefixes.size(0), "samples_per_prefix": samples_per_prefix,
        "num_generations": n_gen, "prefix_len": prefix_len, "seed": seed,
        "seconds": seconds, "generated_tokens_per_s": n_gen * horizon / seconds, "unit": unit,
    }
    png = entropy_curve_figure({f"{model_name} generations": (curve.mean, curve.stderr)}, out / f"{name}.png",
                               reference_nats={"test cross-entropy": test_ce_nats},
                               title=f"{model_name} on {corpus}: test ppl {result['test_ppl']:.1f}, "
                                     f"EntRate {result['entrate_ppl']:.1f} (t={horizon})")
    write_text_atomic(out / f"{name}.md", table1_markdown([result]) + f"\nPerplexities and entropies per {unit}.\n")
    write_json_atomic(out / f"{name}.json", result)
    rows = [[t + 1, float(m), float(se)] for t, (m, se) in enumerate(zip(curve.mean, curve.stderr, strict=True))]
    wandb_log(logger, scalars={f"{name}/entrate_ppl": result["entrate_ppl"], f"{name}/test_ppl": result["test_ppl"]},
              images={f"{name}/figure": png}, tables={f"{name}/curve": (["t", "entropy_nats", "stderr_nats"], rows)})
    log.info(f"{name}: test ppl {result['test_ppl']:.1f}, EntRate {result['entrate_ppl']:.1f} at t={horizon} "
             f"({n_gen} generations, {seconds:.0f} s); {out / (name + '.json')}")
    return result


def calibration_stage(lm, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, out_dir: str | Path, *,
                      fit_tokens: int = 20_000, fit_streams: int = 20, score_tokens: int | None = None,
                      score_streams: int = 10, topk: int | None = 64, tail_samples: int = 16, min_context: int = 100,
                      uniform_weight: float = 0.0, num_prefixes: int = 100, samples_per_prefix: int = 5,
                      prefix_len: int = 100, horizon: int = 700, seed: int = 0, max_batch: int = 1024,
                      model_name: str = "model", corpus: str = "ptb", logger=None, name: str = "calibration",
                      unit: str = "word") -> dict:
    """Lookahead calibration (Algorithm 2, Figure 3): fit alpha* on the first `fit_tokens` validation tokens
    (as `fit_streams` parallel streams, each reading `min_context` tokens before its positions count; top-k lookahead
    with `tail_samples` draws for the rest, seeded by `seed`), score test CE before and after on the first
    `score_tokens` test tokens (all when null), and the generation entropy curves of both models from the same
    prefixes and seeds, compared generation by generation over the last tenth of the horizon.

    "Before" is the eps-mixture (1 - w) P + w uniform, w = uniform_weight, for the cross-entropy and the curve alike
    (with w = 0, the model itself)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fit = fit_lookahead_calibration(lm, batchify(valid_tokens[:fit_tokens], fit_streams), topk=topk,
                                    epsilon=uniform_weight, tail_samples=tail_samples, min_context=min_context,
                                    seed=seed, progress=True)
    t_fit = time.perf_counter() - t0
    plain = calibrated(lm, 0.0, epsilon=uniform_weight)  # the eps-mixed base model, bit for bit lm itself at w = 0
    cal = calibrated(lm, fit.alpha, topk=topk, epsilon=uniform_weight, tail_samples=tail_samples, seed=seed)
    test = batchify(test_tokens[:score_tokens] if score_tokens else test_tokens, score_streams)
    cost_before = heldout_cost(plain, test)
    cost_after = heldout_cost(cal, test)
    ce_before, ce_after, n_scored = cost_before["test_ce_nats"], cost_after["test_ce_nats"], cost_after["test_tokens"]
    prefixes = random_prefixes(valid_tokens, num_prefixes, prefix_len, seed=seed)
    curves = {}
    for label, model in (("before", plain), ("after", cal)):  # the same prefixes and uniforms: paired generations
        curves[label] = generation_entropy_curve(model, prefixes, horizon, samples_per_prefix, seed=seed,
                                                 max_batch=max_batch, progress=True)
    tail_diff, tail_se = paired_tail_difference(curves["after"], curves["before"])
    diff_curve, diff_se = paired_difference_curve(curves["after"], curves["before"])
    result = {
        "model": model_name, "corpus": corpus, "alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr,
        "fit_ce_before_nats": fit.ce_before, "fit_ce_after_nats": fit.ce_after, "fit_tokens": fit.n_tokens,
        "fit_streams": fit_streams, "min_context": min_context, "cluster_size": fit.cluster_size,
        "test_ce_before_nats": ce_before, "test_ce_after_nats": ce_after,
        "test_ppl_before": exp_or_inf(ce_before), "test_ppl_after": exp_or_inf(ce_after), "test_tokens": n_scored,
        "test_ce_mixed_nats_before": cost_before["test_ce_mixed_nats"],
        "test_ce_mixed_nats_after": cost_after["test_ce_mixed_nats"], "mix_epsilon": cost_after["mix_epsilon"],
        "score_streams": score_streams,
        "curve_nats_before": curves["before"].mean.tolist(), "stderr_nats_before": curves["before"].stderr.tolist(),
        "curve_nats": curves["after"].mean.tolist(), "stderr_nats": curves["after"].stderr.tolist(),
        "entrate_ppl_before": exp_or_inf(curves["before"].mean[-1]),
        "entrate_ppl_after": exp_or_inf(curves["after"].mean[-1]),
        "tail_steps": tail_steps(horizon),
        "tail_ppl_before": exp_or_inf(curves["before"].tail_mean),
        "tail_ppl_after": exp_or_inf(curves["after"].tail_mean),
        "tail_diff_nats": tail_diff, "tail_diff_stderr_nats": tail_se,
        "diff_curve_nats": diff_curve.tolist(), "diff_stderr_nats": diff_se.tolist(),
        "tail_nats_per_generation_before": curves["before"].tail.tolist(),
        "tail_nats_per_generation": curves["after"].tail.tolist(),
        "topk": topk, "tail_samples": tail_samples if topk is not None else None, "epsilon": uniform_weight,
        "uniform_weight": uniform_weight, "horizon": horizon, "num_prefixes": prefixes.size(0),
        "samples_per_prefix": samples_per_prefix, "prefix_len": prefix_len, "seed": seed,
        "fit_seconds": t_fit, "seconds": time.perf_counter() - t0, "unit": unit,
    }
    png = entropy_curve_figure({f"{model_name}": (curves["before"].mean, curves["before"].stderr),
                                f"calibrated, alpha={fit.alpha:.3g}": (curves["after"].mean, curves["after"].stderr)},
                               out / f"{name}.png", reference_nats={"test cross-entropy": ce_before},
                               title=f"{model_name} on {corpus}: EntRate {result['entrate_ppl_before']:.1f} -> "
                                     f"{result['entrate_ppl_after']:.1f}, test ppl {result['test_ppl_before']:.1f} -> "
                                     f"{result['test_ppl_after']:.1f}",
                               difference={"label": "calibrated minus plain, paired", "mean": diff_curve,
                                           "stderr": diff_se, "tail": tail_diff, "tail_stderr": tail_se,
                                           "tail_steps": tail_steps(horizon)})
    write_json_atomic(out / f"{name}.json", result)
    wandb_log(logger, scalars={f"{name}/{k}": result[k] for k in ("alpha", "test_ppl_before", "test_ppl_after",
                                                                   "entrate_ppl_before", "entrate_ppl_after",
                                                                   "tail_ppl_before", "tail_ppl_after",
                                                                   "tail_diff_nats", "tail_diff_stderr_nats")},
              images={f"{name}/figure": png})
    log.info(f"{name}: alpha* {fit.alpha:.4f} +- {fit.alpha_stderr:.4f}; test ppl {result['test_ppl_before']:.2f} -> "
             f"{result['test_ppl_after']:.2f}; EntRate {result['entrate_ppl_before']:.1f} -> "
             f"{result['entrate_ppl_after']:.1f}; last tenth {result['tail_ppl_before']:.1f} -> "
             f"{result['tail_ppl_after']:.1f} (paired difference {tail_diff:+.4f} +- {tail_se:.4f} nats; "
             f"{result['seconds']:.0f} s)")
    return result


def generation_settings(prefixes: torch.Tensor, samples_per_prefix: int, prefix_len: int, horizon: int, seed: int,
                        test: torch.Tensor, score_streams: int) -> dict:
    """What makes two stages' generations and test scores the same (prefixes, seeds, test words), so that one may
    take the other's rows: the keys its result records them under."""
    return {"num_prefixes": prefixes.size(0), "samples_per_prefix": samples_per_prefix, "prefix_len": prefix_len,
            "horizon": horizon, "seed": seed, "test_tokens": (test.size(0) - 1) * test.size(1),
            "score_streams": score_streams}


def same_settings(result: dict | None, settings: dict) -> bool:
    """Whether an earlier stage's result was generated and scored as `settings` (generation_settings) say."""
    return bool(result) and all(result.get(k) == v for k, v in settings.items())


def curve_row(method: str, params: dict, curve, stderr, tail, plain_tail: np.ndarray, seconds: float,
              **columns) -> dict:
    """One method's row of a comparison table: its entropy curve (mean and stderr [T]), exp(entropy) at t = T and
    over the last tenth, and that tail's paired difference from the plain model's (tail, plain_tail [N, S]: the
    generations' last-tenth means, same prefixes and uniforms; prefixes as clusters); `columns`: its costs."""
    tail = np.asarray(tail, dtype=np.float64)  # [N, S]
    diff, diff_se = clustered_mean(tail - plain_tail)
    curve, stderr = [float(x) for x in curve], [float(x) for x in stderr]
    return {"method": method, "params": params, "entropy_t1_nats": curve[0], "entropy_last_nats": curve[-1],
            "entrate_ppl": exp_or_inf(curve[-1]), "tail_ppl": exp_or_inf(tail.mean()), "tail_diff_nats": float(diff),
            "tail_diff_stderr_nats": float(diff_se), **columns, "curve_nats": curve, "stderr_nats": stderr,
            "seconds": seconds}


def decoders_stage(lm, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, out_dir: str | Path, *,
                   methods: list[dict] | None = None, fitted: list[str] = ("temperature", "calibration"),
                   calibration: dict | None = None, fit_tokens: int = 20_000, fit_streams: int = 20,
                   score_tokens: int | None = None, score_streams: int = 10, topk: int | None = 64,
                   tail_samples: int = 16, min_context: int = 100, mix_epsilon: float = 1e-6,
                   num_prefixes: int = 100, samples_per_prefix: int = 5,
                   prefix_len: int = 100, horizon: int = 700, seed: int = 0, max_batch: int = 1024,
                   model_name: str = "model", corpus: str = "ptb", logger=None, name: str = "decoders",
                   unit: str = "word") -> dict:
    """Every decoding method on one entropy-rate figure and one table, from the same prefixes and seeds: the plain
    model, each of `methods` ({"name": ..., **params}, see lmcal.decoders), and the fitted ones: `temperature`
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
        cost = heldout_cost(model, test, mix_epsilon)
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
            rows.append(row("calibration", {"alpha": reuse["alpha"], "alpha_stderr": reuse["alpha_stderr"],
                                            "topk": reuse["topk"]}, reuse["curve_nats"], reuse["stderr_nats"],
                            reused_cost("after"), 0.0, reuse["tail_nats_per_generation"]))
        else:
            fit = fit_lookahead_calibration(lm, fit_text, topk=topk, tail_samples=tail_samples,
                                            min_context=min_context, seed=seed, progress=True)
            rows.append(measure("calibration", {"alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr, "topk": topk},
                                calibrated(lm, fit.alpha, topk=topk, tail_samples=tail_samples, seed=seed)))
    ref = rows[0]["test_ce_nats"]
    result = {"model": model_name, "corpus": corpus, "rows": rows, "reference_test_ce_nats": ref,
              "mix_epsilon": mix_epsilon, "fit_tokens": fit_text.numel() - fit_text.size(1),
              "calibration_reused": bool(reuse), **settings, "unit": unit, "seconds": time.perf_counter() - t0}
    label = lambda r: r["method"] + (f" ({format_params(r['params'], drop=('stderr',))})" if r["params"] else "")
    png = entropy_curve_figure({label(r): (np.asarray(r["curve_nats"]), np.asarray(r["stderr_nats"])) for r in rows},
                               out / f"{name}.png", reference_nats={"test cross-entropy (true text)": ref},
                               title=f"{model_name} on {corpus}: decoders and calibration", legend_outside=True,
                               tail_differences={label(r): (r["tail_diff_nats"], r["tail_diff_stderr_nats"])
                                                 for r in rows[1:]})
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
    log.info(f"{name}: {len(rows)} methods in {result['seconds']:.0f} s; {out / (name + '.json')}\n"
             f"{decoders_table(rows)}")
    return result


def _row_flops(lm, tau: int | None) -> float:
    """FLOPs of one row of context_rows: an AWD-LSTM, or a model read by whole windows, runs its body on every token
    of the window and its output layer once; another StepLM computes its whole step for every token fed."""
    head = getattr(lm, "head", None)
    if head is not None and (isinstance(getattr(lm, "net", None), AWDLSTM) or hasattr(lm, "window_log_probs")):
        dec = 2.0 * head[0].numel()
        return (flops_per_token(lm) - dec) * (tau or 1) + dec
    return flops_per_token(lm) * (tau or 1)


def _memory_rows(full, limited, tau: int, tokens: torch.Tensor, windows_per_batch: int, store_dtype: torch.dtype,
                 desc: str) -> list:
    """(log P^ [n, V], log P~_tau [n, V], targets [n]) chunks along `tokens`, kept on the CPU in store_dtype (the fit
    rereads them): P^ the model `full` with the whole past, P~ the model `limited` fed only the last tau tokens (each
    a StepLM or an AWDLSTM; see lmcal.memory.context_rows), with a progress bar."""
    from tqdm.auto import tqdm

    bar = tqdm(total=max(0, tokens.numel() - 1), desc=desc, unit="tok", leave=False)
    kept = []
    rows = zip_rows(context_rows(full, tokens, None, windows_per_batch),
                    context_rows(limited, tokens, tau, windows_per_batch))
    per_row = _row_flops(full, None) + _row_flops(limited, tau)
    while True:
        with span("forward"):  # both models' rows for one chunk
            f, q, y = next(rows, (None, None, None))
            if y is None:
                break
            add_flops(per_row * y.numel())
        kept.append((f.to("cpu", store_dtype), q.to("cpu", store_dtype), y.cpu()))
        bar.update(y.numel())
    bar.close()
    return kept


def memory_stage(full_net, limited_net, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, out_dir: str | Path,
                 *, limited: str = "trained", tau: int | None = None, score_tokens: int | None = None,
                 cluster_size: int = 2000, windows_per_batch: int = 512, store_dtype: str = "float32",
                 jackknife: str = "onestep", model_name: str = "model", corpus: str = "ptb",
                 base_ckpt: str | None = None, ckpt: str | None = None, exact_mi_nats: float | None = None,
                 logger=None, name: str = "memory") -> dict:
    """The memory bound for one tau (Section 5) on the first `score_tokens` test tokens (all when null), read as one
    stream: P^ (`full_net`) with its whole past, P~_tau with exactly the last tau tokens. limited="trained": P~ is
    the trained tau-model `limited_net`; "window": the base model itself fed tau-token windows (no tau-model needed;
    tau from the setting, else `limited_net`'s). Both nets may be AWDLSTMs or any StepLM.

    alpha* is fitted on the very rows the bound is reported on (so the bound is >= 0), with standard errors from a
    delete-one-block jackknife over blocks of `cluster_size` positions that refits alpha per block (`jackknife`:
    "onestep" or "exact"); also the bound cross-fitted over two halves of the blocks, ΔCE = CE(P~) - CE(P^), and the
    two-parameter calibration P^^beta P~^alpha. The rows are kept: 2 x N x V floats of `store_dtype`.
    `exact_mi_nats` (the source's true I_tau, on the Markov corpus) is stored beside. Writes `<name>.json`.
    valid_tokens is not read (kept so that every stage takes the same texts)."""
    if limited not in ("trained", "window"):
        raise LmcalError(f"analysis.memory.limited={limited!r}: choose trained (the tau-model checkpoint as the "
                         "limited model) or window (the base model itself on tau-token windows).")
    own_tau = getattr(limited_net, "memory_tau", None)
    if limited == "trained":
        if not own_tau:
            raise LmcalError("The memory stage needs a tau-limited model (one trained with model.memory_tau=TAU); "
                             "this checkpoint is an ordinary full-context model. To run the model itself on "
                             "tau-token windows instead, set analysis.memory.limited=window analysis.memory.tau=TAU.")
        if tau and int(tau) != own_tau:
            raise LmcalError(f"analysis.memory.tau={tau} but the tau-model was trained with memory_tau={own_tau}; "
                             "leave analysis.memory.tau unset with limited=trained (it is only for limited=window).")
        tau, lim = own_tau, limited_net
    else:
        tau, lim = tau or own_tau, full_net
        if not tau:
            raise LmcalError("analysis.memory.limited=window needs the window length: set analysis.memory.tau=TAU "
                             "(a positive integer).")
    tau = int(tau)
    if lim.vocab_size != full_net.vocab_size:
        raise LmcalError(f"The base model's vocabulary ({full_net.vocab_size} words) differs from the "
                         f"tau-model's ({lim.vocab_size}): they were trained on different corpora.")
    test = test_tokens[:score_tokens] if score_tokens else test_tokens
    full_net, lim = as_step_lm(full_net), as_step_lm(lim)
    if getattr(lim, "max_positions", None) and tau >= lim.max_positions:
        raise LmcalError(f"analysis.memory.tau={tau}: the model reads at most {lim.max_positions} tokens; a window "
                         f"must be shorter.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = _memory_rows(full_net, lim, tau, test, windows_per_batch, getattr(torch, store_dtype),
                        f"memory tau={tau} ({limited})")
    t_rows = time.perf_counter() - t0
    bound = memory_summary(rows, cluster_size=cluster_size, jackknife=jackknife)
    del rows
    ref = paper.MEMORY_PTB.get(tau) if corpus == "ptb" else None
    result = {
        "tau": tau, "limited": limited, "model": model_name, "corpus": corpus, **bound,
        "full_context": full_context_span(full_net, test.numel()),
        "exact_mi_nats": exact_mi_nats,
        "paper": dict(zip(("ce_limited_nats", "mi_upper_bound_nats", "alpha"), ref, strict=True)) if ref else None,
        "base_ckpt": base_ckpt, "ckpt": ckpt, "rows_seconds": t_rows, "seconds": time.perf_counter() - t0,
    }
    write_json_atomic(out / f"{name}.json", result)
    wandb_log(logger, scalars={f"{name}/{k}": result[k] for k in (
        "tau", "alpha", "ce_limited_nats", "mi_upper_bound_nats", "mi_upper_bound_crossfit_nats", "delta_ce_nats",
        "entropy_calibrated_nats")})
    two = result["two_parameter"]
    log.info(f"{name} tau={tau} ({limited}): alpha* {result['alpha']:.5f} +- {result['alpha_stderr']:.5f}; "
             f"CE(P||P~) {result['ce_limited_nats']:.4f}, ΔCE {result['delta_ce_nats']:.4f}; I_tau <= "
             f"{result['mi_upper_bound_nats']:.4f} +- {result['mi_stderr_nats']:.4f} nats (cross-fit "
             f"{result['mi_upper_bound_crossfit_nats']:.4f}; with the temperature, beta* {two['beta']:.4f}: "
             f"{two['mi_upper_bound_nats']:.4f} +- {two['mi_stderr_nats']:.4f}) ({result['seconds']:.0f} s)")
    return result
