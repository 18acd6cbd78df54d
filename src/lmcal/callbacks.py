"""Analysis stages as plain functions, and the thin Lightning callbacks that run them after training.

A stage takes a `StepLM` and tensors, writes its JSON/PNG/Markdown atomically into a folder, logs
them to Weights & Biases when a W&B logger is given, and returns its results as a dict.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch

from lmcal.calibration import calibrated, fit_lookahead_calibration, fit_temperature
from lmcal.data import batchify
from lmcal.decoders import decoder_params, heldout_cost, make_decoder
from lmcal.entropy_rate import generation_entropy_curve, random_prefixes
from lmcal.errors import LmcalError
from lmcal.lm import LSTMStepLM
from lmcal.memory import memory_upper_bound
from lmcal.model import (
    evaluate_ce,
    full_context_log_probs,
    limited_context_ce,
    limited_context_log_probs,
    zip_rows,
)
from lmcal.module import load_net
from lmcal.plots import entropy_curve_figure
from lmcal.utils import exp_or_inf, format_ce, format_params, write_json_atomic, write_text_atomic

log = logging.getLogger("lmcal")


def wandb_log(logger, scalars: dict | None = None, images: dict | None = None, tables: dict | None = None) -> None:
    """Log to the W&B run behind a Lightning WandbLogger; a no-op for any other logger."""
    if not logger or type(logger).__name__ != "WandbLogger":
        return
    import wandb

    payload = dict(scalars or {})
    payload.update({k: wandb.Image(str(v)) for k, v in (images or {}).items()})
    payload.update({k: wandb.Table(columns=cols, data=rows) for k, (cols, rows) in (tables or {}).items()})
    logger.experiment.log(payload)


def table1_markdown(rows: list[dict]) -> str:
    """The paper's Table 1 layout: model, corpus, test ppl, EntRate (= exp of the last step's entropy)."""
    lines = ["| model | corpus | test ppl | EntRate |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['corpus']} | {r['test_ppl']:.1f} | {r['entrate_ppl']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def entropy_rate_stage(lm, valid_tokens: torch.Tensor, test_ce_nats: float, out_dir: str | Path, *,
                       num_prefixes: int = 100, samples_per_prefix: int = 5, prefix_len: int = 100,
                       horizon: int = 700, seed: int = 0, max_batch: int = 1024, model_name: str = "model",
                       corpus: str = "ptb", logger=None, name: str = "entropy_rate", unit: str = "word",
                       **_ignored) -> dict:
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
                      score_streams: int = 10, topk: int | None = 64, epsilon: float = 0.0,
                      num_prefixes: int = 100, samples_per_prefix: int = 5, prefix_len: int = 100, horizon: int = 700,
                      seed: int = 0, max_batch: int = 1024, model_name: str = "model", corpus: str = "ptb",
                      logger=None, name: str = "calibration", unit: str = "word", **_ignored) -> dict:
    """Lookahead calibration (Algorithm 2, Figure 3): fit alpha* on the first `fit_tokens` validation tokens
    (as `fit_streams` parallel streams), score test CE before and after on the first `score_tokens` test tokens
    (all when null), and the generation entropy curves of both models from the same prefixes and seeds."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fit = fit_lookahead_calibration(lm, batchify(valid_tokens[:fit_tokens], fit_streams), topk=topk,
                                    epsilon=epsilon, progress=True)
    t_fit = time.perf_counter() - t0
    cal = calibrated(lm, fit.alpha, topk=topk, epsilon=epsilon)
    test = batchify(test_tokens[:score_tokens] if score_tokens else test_tokens, score_streams)
    cost_before = heldout_cost(calibrated(lm, 0.0, epsilon=epsilon), test)
    cost_after = heldout_cost(cal, test)
    ce_before, ce_after, n_scored = cost_before["test_ce_nats"], cost_after["test_ce_nats"], cost_after["test_tokens"]
    prefixes = random_prefixes(valid_tokens, num_prefixes, prefix_len, seed=seed)
    curves = {}
    for label, model in (("before", lm), ("after", cal)):
        curves[label] = generation_entropy_curve(model, prefixes, horizon, samples_per_prefix, seed=seed,
                                                 max_batch=max_batch, progress=True)
    result = {
        "model": model_name, "corpus": corpus, "alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr,
        "fit_ce_before_nats": fit.ce_before, "fit_ce_after_nats": fit.ce_after, "fit_tokens": fit.n_tokens,
        "test_ce_before_nats": ce_before, "test_ce_after_nats": ce_after,
        "test_ppl_before": exp_or_inf(ce_before), "test_ppl_after": exp_or_inf(ce_after), "test_tokens": n_scored,
        "test_ce_mixed_nats_before": cost_before["test_ce_mixed_nats"],
        "test_ce_mixed_nats_after": cost_after["test_ce_mixed_nats"], "mix_epsilon": cost_after["mix_epsilon"],
        "score_streams": score_streams,
        "curve_nats_before": curves["before"].mean.tolist(), "stderr_nats_before": curves["before"].stderr.tolist(),
        "curve_nats": curves["after"].mean.tolist(), "stderr_nats": curves["after"].stderr.tolist(),
        "entrate_ppl_before": exp_or_inf(curves["before"].mean[-1]),
        "entrate_ppl_after": exp_or_inf(curves["after"].mean[-1]),
        "topk": topk, "epsilon": epsilon, "horizon": horizon, "num_prefixes": prefixes.size(0),
        "samples_per_prefix": samples_per_prefix, "prefix_len": prefix_len, "seed": seed,
        "fit_seconds": t_fit, "seconds": time.perf_counter() - t0, "unit": unit,
    }
    png = entropy_curve_figure({f"{model_name}": (curves["before"].mean, curves["before"].stderr),
                                f"calibrated, alpha={fit.alpha:.3g}": (curves["after"].mean, curves["after"].stderr)},
                               out / f"{name}.png", reference_nats={"test cross-entropy": ce_before},
                               title=f"{model_name} on {corpus}: EntRate {result['entrate_ppl_before']:.1f} -> "
                                     f"{result['entrate_ppl_after']:.1f}, test ppl {result['test_ppl_before']:.1f} -> "
                                     f"{result['test_ppl_after']:.1f}")
    write_json_atomic(out / f"{name}.json", result)
    wandb_log(logger, scalars={f"{name}/{k}": result[k] for k in ("alpha", "test_ppl_before", "test_ppl_after",
                                                                   "entrate_ppl_before", "entrate_ppl_after")},
              images={f"{name}/figure": png})
    log.info(f"{name}: alpha* {fit.alpha:.4f} +- {fit.alpha_stderr:.4f}; test ppl {result['test_ppl_before']:.2f} -> "
             f"{result['test_ppl_after']:.2f}; EntRate {result['entrate_ppl_before']:.1f} -> "
             f"{result['entrate_ppl_after']:.1f} ({result['seconds']:.0f} s)")
    return result


def decoders_table(rows: list[dict]) -> str:
    """Markdown: one row per method, entropies of the t = 1 and last generated words, EntRate and held-out costs."""
    lines = ["| method | parameters | entropy t=1 (nats) | entropy t=horizon (nats) | EntRate | test CE (nats) | "
             "zero-prob. fraction | CE on kept words | CE, ε-mixed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {format_params(r['params'])} | {r['entropy_t1_nats']:.3f} | "
                     f"{r['entropy_last_nats']:.3f} | {r['entrate_ppl']:.1f} | {format_ce(r['test_ce_nats'])} | "
                     f"{r['zero_prob_fraction']:.4f} | {format_ce(r['test_ce_kept_nats'])} | "
                     f"{format_ce(r['test_ce_mixed_nats'])} |")
    return "\n".join(lines) + "\n"


def decoders_stage(lm, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, out_dir: str | Path, *,
                   methods: list[dict] | None = None, fitted: list[str] = ("temperature", "calibration"),
                   calibration: dict | None = None, fit_tokens: int = 20_000, fit_streams: int = 20,
                   score_tokens: int | None = None, score_streams: int = 10, topk: int | None = 64,
                   mix_epsilon: float = 1e-6, num_prefixes: int = 100, samples_per_prefix: int = 5,
                   prefix_len: int = 100, horizon: int = 700, seed: int = 0, max_batch: int = 1024,
                   model_name: str = "model", corpus: str = "ptb", logger=None, name: str = "decoders",
                   unit: str = "word", **_ignored) -> dict:
    """Every decoding method on one entropy-rate figure and one table, from the same prefixes and seeds: the plain
    model, each of `methods` ({"name": ..., **params}, see lmcal.decoders), and the fitted ones: `temperature`
    (P^(1/T), T* by validation CE) and `calibration` (lookahead, Algorithm 2; taken from the calibration stage's
    result `calibration` when its settings match, else fitted here). Held-out cost on the first `score_tokens` test
    tokens read as `score_streams` streams. Writes `<name>.json`, `.md` and `.png`."""
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
    settings = {"num_prefixes": prefixes.size(0), "samples_per_prefix": samples_per_prefix, "prefix_len": prefix_len,
                "horizon": horizon, "seed": seed, "test_tokens": (test.size(0) - 1) * test.size(1),
                "score_streams": score_streams}
    reuse = calibration if calibration and all(calibration.get(k) == v for k, v in settings.items()) else None
    if calibration and not reuse:
        log.info(f"{name}: the calibration result has other generation or scoring settings; refitting here")

    def measure(method: str, params: dict, model) -> dict:
        t = time.perf_counter()
        curve = generation_entropy_curve(model, prefixes, horizon, samples_per_prefix, seed=seed,
                                         max_batch=max_batch, progress=True)
        cost = heldout_cost(model, test, mix_epsilon)
        return row(method, params, curve.mean.tolist(), curve.stderr.tolist(), cost, time.perf_counter() - t)

    def row(method, params, curve, stderr, cost, seconds) -> dict:
        r = {"method": method, "params": params, "entropy_t1_nats": curve[0], "entropy_last_nats": curve[-1],
             "entrate_ppl": exp_or_inf(curve[-1]), **{k: cost[k] for k in ("test_ce_nats", "zero_prob_fraction",
                                                                          "test_ce_kept_nats", "test_ce_mixed_nats")},
             "curve_nats": curve, "stderr_nats": stderr, "seconds": seconds}
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
                        0.0))
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
                            reused_cost("after"), 0.0))
        else:
            fit = fit_lookahead_calibration(lm, fit_text, topk=topk, progress=True)
            rows.append(measure("calibration", {"alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr, "topk": topk},
                                calibrated(lm, fit.alpha, topk=topk)))
    ref = rows[0]["test_ce_nats"]
    result = {"model": model_name, "corpus": corpus, "rows": rows, "reference_test_ce_nats": ref,
              "mix_epsilon": mix_epsilon, "fit_tokens": fit_text.numel() - fit_text.size(1),
              "calibration_reused": bool(reuse), **settings, "unit": unit, "seconds": time.perf_counter() - t0}
    label = lambda r: r["method"] + (f" ({format_params(r['params'], drop=('stderr',))})" if r["params"] else "")
    png = entropy_curve_figure({label(r): (np.asarray(r["curve_nats"]), np.asarray(r["stderr_nats"])) for r in rows},
                               out / f"{name}.png", reference_nats={"test cross-entropy (true text)": ref},
                               title=f"{model_name} on {corpus}: decoders and calibration", legend_outside=True)
    write_text_atomic(out / f"{name}.md", decoders_table(rows) + f"\nEntropies and cross-entropies in nats per {unit}; "
                      f"ε-mixed: (1 - ε) q + ε uniform, ε = {mix_epsilon:g}.\n")
    write_json_atomic(out / f"{name}.json", result)
    cols = ["method", "params", "entropy_t1_nats", "entropy_last_nats", "entrate_ppl", "test_ce_nats",
            "zero_prob_fraction", "test_ce_kept_nats", "test_ce_mixed_nats"]
    wandb_log(logger, scalars={f"{name}/{r['method']}/{k}": r[k] for r in rows for k in
                               ("entrate_ppl", "zero_prob_fraction", "test_ce_mixed_nats") if r[k] is not None},
              images={f"{name}/figure": png},
              tables={f"{name}/table": (cols, [[format_params(r[c]) if c == "params" else r[c] for c in cols]
                                               for r in rows])})
    log.info(f"{name}: {len(rows)} methods in {result['seconds']:.0f} s; {out / (name + '.json')}\n"
             f"{decoders_table(rows)}")
    return result


PAPER_MEMORY_PTB = {  # the paper's Section 5 table for its PTB AWD-LSTM (nats): tau -> (CE(P||P~), I_tau bound, alpha*)
    5: (4.8144, 0.6180, 0.003515), 10: (4.5258, 0.4226, -0.01041), 15: (4.4166, 0.2678, -0.00447),
    20: (4.3347, 0.2485, -0.02268), 25: (4.2777, 0.2274, -0.01814), 30: (4.2408, 0.2143, -0.02323),
}


def _memory_rows(full_net, limited_net, tau: int, tokens: torch.Tensor, windows_per_batch: int, bptt: int,
                 desc: str):
    """(log P^ [n, V], log P~_tau [n, V], targets [n]) chunks along `tokens`, with a progress bar."""
    from tqdm.auto import tqdm

    bar = tqdm(total=max(0, tokens.numel() - 1), desc=desc, unit="tok", leave=False)
    for f, q, y in zip_rows(full_context_log_probs(full_net, tokens, bptt),
                            limited_context_log_probs(limited_net, tokens, tau, windows_per_batch)):
        bar.update(y.numel())
        yield f, q, y
    bar.close()


def memory_stage(full_net, limited_net, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, out_dir: str | Path,
                 *, tau: int | None = None, fit_tokens: int | None = None, score_tokens: int | None = None,
                 cluster_size: int = 100, windows_per_batch: int = 512, bptt: int = 70,
                 store_dtype: str = "float32", model_name: str = "model", corpus: str = "ptb",
                 base_ckpt: str | None = None, ckpt: str | None = None, exact_mi_nats: float | None = None,
                 logger=None, name: str = "memory", **_ignored) -> dict:
    """The memory bound for one tau (Section 5): fit alpha* of P^ * P~_tau^alpha on the first `fit_tokens`
    validation tokens (all when null), then evaluate CE(P||P~_tau), H(P^_alpha*) and the I_tau bound on the first
    `score_tokens` test tokens (all when null), each split read as one stream: P^ with its full past, P~_tau with
    exactly the last tau tokens. `exact_mi_nats` (the source's true I_tau, on the Markov corpus) is stored beside.
    Writes `<name>.json`."""
    tau = tau or getattr(limited_net, "memory_tau", None)
    if not tau:
        raise LmcalError("The memory stage needs a tau-limited model (one trained with model.memory_tau=TAU); "
                         "this checkpoint is an ordinary full-context model.")
    if full_net.decoder.weight.size(0) != limited_net.decoder.weight.size(0):
        raise LmcalError(f"The base model's vocabulary ({full_net.decoder.weight.size(0)} words) differs from the "
                         f"tau-model's ({limited_net.decoder.weight.size(0)}): they were trained on different corpora.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    valid = valid_tokens[:fit_tokens] if fit_tokens else valid_tokens
    test = test_tokens[:score_tokens] if score_tokens else test_tokens
    fit = memory_upper_bound(_memory_rows(full_net, limited_net, tau, valid, windows_per_batch, bptt, "memory fit"),
                             cluster_size=cluster_size, store_dtype=getattr(torch, store_dtype))
    t_fit = time.perf_counter() - t0
    ev = memory_upper_bound(_memory_rows(full_net, limited_net, tau, test, windows_per_batch, bptt, "memory test"),
                            alpha=fit.alpha, cluster_size=cluster_size)
    paper = PAPER_MEMORY_PTB.get(tau) if corpus == "ptb" else None
    result = {
        "tau": tau, "model": model_name, "corpus": corpus, "alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr,
        "ce_limited_nats": ev.ce_limited, "mi_upper_bound_nats": ev.mi_upper_bound, "mi_stderr_nats": ev.mi_stderr,
        "entropy_calibrated_nats": ev.entropy_calibrated, "ce_full_nats": ev.ce_full,
        "ce_calibrated_nats": ev.ce_calibrated, "ce_full_stderr_nats": ev.ce_full_stderr, "test_tokens": ev.n_tokens,
        "exact_mi_nats": exact_mi_nats,
        "valid": {"ce_limited_nats": fit.ce_limited, "mi_upper_bound_nats": fit.mi_upper_bound,
                  "entropy_calibrated_nats": fit.entropy_calibrated, "ce_full_nats": fit.ce_full,
                  "ce_calibrated_nats": fit.ce_calibrated, "tokens": fit.n_tokens},
        "paper": dict(zip(("ce_limited_nats", "mi_upper_bound_nats", "alpha"), paper, strict=True)) if paper else None,
        "cluster_size": cluster_size, "base_ckpt": base_ckpt, "ckpt": ckpt,
        "fit_seconds": t_fit, "seconds": time.perf_counter() - t0,
    }
    write_json_atomic(out / f"{name}.json", result)
    wandb_log(logger, scalars={f"{name}/{k}": result[k] for k in ("tau", "alpha", "ce_limited_nats",
                                                                   "mi_upper_bound_nats", "entropy_calibrated_nats")})
    log.info(f"{name} tau={tau}: alpha* {fit.alpha:.5f} +- {fit.alpha_stderr:.5f}; CE(P||P~) {ev.ce_limited:.4f}, "
             f"H(cal) {ev.entropy_calibrated:.4f}, I_tau <= {ev.mi_upper_bound:.4f} +- {ev.mi_stderr:.4f} nats "
             f"({result['seconds']:.0f} s)")
    return result


def markov_exact_mi(info: dict, tau: int) -> float:
    """The Markov source's own I_tau = H(W_t | last tau tokens) - H(W_t | last k tokens), in nats (0 for tau >= k)."""
    from lmcal.data import markov_chain_from_info, markov_conditional_entropy, markov_stationary

    chain = markov_chain_from_info(info)
    v, k = info["vocab_size"], info["order"]
    pi = markov_stationary(chain.probs, v, k)
    return markov_conditional_entropy(chain.probs, v, k, tau, pi) - markov_conditional_entropy(chain.probs, v, k, k, pi)


@torch.no_grad()
def markov_oracle_memory(info: dict, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, taus: list[int],
                         cluster_size: int = 100) -> dict:
    """The estimators run on the Markov source's exact oracles, where every answer is known: P^ = the true order-k
    conditional, P~_tau = the exact order-tau conditional of the stationary chain. Returns the entropy-rate estimate
    (the oracle's test CE ± se) and, per tau, the I_tau bound (alpha* fitted on validation, evaluated on test) beside
    the exact I_tau. Positions t >= max(taus, k), so every context is complete."""
    from lmcal.data import markov_chain_from_info, markov_conditional, markov_stationary

    chain = markov_chain_from_info(info)
    v, k = info["vocab_size"], info["order"]
    pi = markov_stationary(chain.probs, v, k)
    start = max(*taus, k)

    def rows(tokens: torch.Tensor, m: int) -> torch.Tensor:  # log P(. | last m tokens) at t = start..N-1: [n, V]
        table = torch.from_numpy(markov_conditional(chain.probs, v, k, m, pi)).log()  # [v**m, v]
        t = torch.arange(start, tokens.numel())
        ctx = sum(tokens[t - m + j] * v ** (m - 1 - j) for j in range(m))  # [n]
        return table[ctx]

    out = {}
    for name, tokens in (("valid", valid_tokens), ("test", test_tokens)):
        tokens = tokens.long()
        out[name] = ({m: rows(tokens, m) for m in {*taus, k}}, tokens[start:])
    (fv, yv), (ft, yt) = out["valid"], out["test"]
    full = memory_upper_bound(ft[k], ft[k], yt, alpha=0.0, cluster_size=cluster_size)  # just its CE and se
    result = {"estimated_entropy_rate_nats": full.ce_full, "estimated_entropy_rate_stderr_nats": full.ce_full_stderr,
              "test_tokens": int(yt.numel()), "memory": []}
    for tau in taus:
        fit = memory_upper_bound(fv[k], fv[tau], yv, cluster_size=cluster_size)
        ev = memory_upper_bound(ft[k], ft[tau], yt, alpha=fit.alpha, cluster_size=cluster_size)
        result["memory"].append({"tau": tau, "mi_upper_bound_nats": ev.mi_upper_bound, "mi_stderr_nats": ev.mi_stderr,
                                 "alpha": fit.alpha, "exact_mi_nats": markov_exact_mi(info, tau)})
    return result


def load_base_net(path: str | Path | None, device, corpus: str | None = None):
    """The full-context base model for the memory stage, with a clear error when it is missing or mismatched."""
    if not path:
        raise LmcalError("The memory stage needs the full-context base model: pass memory.base_ckpt=PATH (a "
                         "checkpoint of the same corpus trained with model.memory_tau=null).")
    if not Path(path).is_file():
        raise LmcalError(f"memory.base_ckpt={path} does not exist; train the base model first "
                         "(python -m lmcal.train with model.memory_tau=null) and point at its checkpoints/best.ckpt.")
    net, ckpt = load_net(path, map_location="cpu")
    if net.memory_tau:
        raise LmcalError(f"memory.base_ckpt={path} is itself a tau={net.memory_tau} model; it must be full-context.")
    base_corpus = (ckpt["hyper_parameters"].get("data_cfg") or {}).get("name")
    if corpus and base_corpus and base_corpus != corpus:
        raise LmcalError(f"memory.base_ckpt={path} was trained on {base_corpus}, this model on {corpus}.")
    return net.to(device)


def best_model_scores(trainer: pl.Trainer, datamodule) -> dict:
    """The best checkpoint (the last if none is better), loaded, with its validation and test
    cross-entropy: full-context scores for an ordinary model, exact tau-context ones for a
    limited-memory model. Cached on the trainer: the metrics and every stage share it."""
    ckpt = trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path
    if not ckpt or not Path(ckpt).is_file():
        raise LmcalError(f"Training ended without a checkpoint in {trainer.checkpoint_callback.dirpath}; "
                         "did it run a whole epoch?")
    cache = trainer.__dict__.setdefault("_lmcal_scores", {})
    if ckpt not in cache:
        net, raw = load_net(ckpt)
        net.to(trainer.lightning_module.device)
        tau = net.memory_tau
        if tau:
            val_ce, _ = limited_context_ce(net, datamodule.tokens("valid"), tau)
            test_ce, n_test = limited_context_ce(net, datamodule.tokens("test"), tau)
        else:
            val_ce, _ = evaluate_ce(net, datamodule.tokens("valid"), datamodule.eval_batch_size, datamodule.bptt)
            test_ce, n_test = evaluate_ce(net, datamodule.tokens("test"), datamodule.test_batch_size, datamodule.bptt)
        cache[ckpt] = {"net": net, "ckpt": raw, "path": ckpt, "val_ce": val_ce, "test_ce": test_ce,
                       "test_tokens": n_test}
    return cache[ckpt]


class MetricsCallback(pl.Callback):
    """Scores the best checkpoint when training ends and writes metrics.json at once, before any
    analysis stage runs, so a failing stage never costs the training results."""

    def __init__(self, out_dir: str | Path, extra: dict | None = None):
        self.out_dir, self.extra = Path(out_dir), dict(extra or {})
        self.t_start = time.perf_counter()
        self.metrics: dict | None = None

    def on_fit_end(self, trainer, module):
        s = best_model_scores(trainer, trainer.datamodule)
        net, tau = s["net"], s["net"].memory_tau
        limited = ({"ce_limited_nats": {"valid": s["val_ce"], "test": s["test_ce"]},
                    "val_ce_limited_nats": s["val_ce"], "test_ce_limited_nats": s["test_ce"]} if tau else {})
        self.metrics = {
            **self.extra,
            "memory_tau": tau,
            **limited,
            "true_entropy_rate_nats": trainer.datamodule.prepare().info.get("entropy_rate_nats"),
            "markov_order": trainer.datamodule.prepare().info.get("order"),
            "val_ce_nats": s["val_ce"], "val_ppl": exp_or_inf(s["val_ce"]),
            "test_ce_nats": s["test_ce"], "test_ppl": exp_or_inf(s["test_ce"]), "test_tokens": s["test_tokens"],
            "params": sum(p.numel() for p in net.parameters()),
            "epochs": trainer.current_epoch,
            "best_epoch": s["ckpt"].get("epoch"),
            "asgd_epoch": module.asgd_epoch,
            "tokens_per_s": module.train_tokens / module.train_seconds if module.train_seconds else None,
            "train_tokens": module.train_tokens,
            "train_seconds": module.train_seconds,
            "wall_seconds": time.perf_counter() - self.t_start,
            "best_ckpt": str(Path(s["path"]).resolve()),
            "device": str(module.device),
        }
        write_json_atomic(self.out_dir / "metrics.json", self.metrics)
        if trainer.logger:
            trainer.logger.log_metrics({f"final/{k}": v for k, v in self.metrics.items()
                                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        log.info(f"val ppl {self.metrics['val_ppl']:.2f}, test ppl {self.metrics['test_ppl']:.2f}; "
                 f"{self.out_dir / 'metrics.json'}")


class EntropyRateCallback(pl.Callback):
    """Runs `entropy_rate_stage` on the best checkpoint when training ends, and on the current
    (averaged, if NT-ASGD switched) weights every `every_n_epochs` epochs if set."""

    def __init__(self, out_dir: str | Path, every_n_epochs: int | None = None, at_fit_end: bool = True,
                 **settings):
        self.out_dir, self.every_n_epochs, self.at_fit_end = Path(out_dir), every_n_epochs, at_fit_end
        self.settings = settings
        self.result: dict | None = None

    def on_train_epoch_end(self, trainer, module):  # after the epoch's validation, so val_loss is fresh
        n = self.every_n_epochs
        if not n or trainer.sanity_checking or (trainer.current_epoch + 1) % n:
            return
        val_ce = float(trainer.callback_metrics["val_loss"])
        was_training = module.net.training
        with module.averaged_weights():
            entropy_rate_stage(LSTMStepLM(module.net), trainer.datamodule.tokens("valid"), val_ce,
                               self.out_dir / "entropy_rate_epochs", logger=trainer.logger,
                               name=f"entropy_rate_epoch{trainer.current_epoch}", **self.settings)
        module.net.train(was_training)

    def on_fit_end(self, trainer, module):
        if not self.at_fit_end:
            return
        s = best_model_scores(trainer, trainer.datamodule)
        self.result = entropy_rate_stage(LSTMStepLM(s["net"]), trainer.datamodule.tokens("valid"), s["test_ce"],
                                         self.out_dir, logger=trainer.logger, **self.settings)


class CalibrationCallback(pl.Callback):
    """Runs `calibration_stage` on the best checkpoint when training ends."""

    def __init__(self, out_dir: str | Path, **settings):
        self.out_dir, self.settings = Path(out_dir), settings
        self.result: dict | None = None

    def on_fit_end(self, trainer, module):
        s = best_model_scores(trainer, trainer.datamodule)
        dm = trainer.datamodule
        self.result = calibration_stage(LSTMStepLM(s["net"]), dm.tokens("valid"), dm.tokens("test"), self.out_dir,
                                        logger=trainer.logger, **self.settings)


class DecodersCallback(pl.Callback):
    """Runs `decoders_stage` on the best checkpoint when training ends, taking the calibration row from a
    CalibrationCallback that ran before it (same settings), if given."""

    def __init__(self, out_dir: str | Path, calibration: CalibrationCallback | None = None, **settings):
        self.out_dir, self.calibration, self.settings = Path(out_dir), calibration, settings
        self.result: dict | None = None

    def on_fit_end(self, trainer, module):
        s = best_model_scores(trainer, trainer.datamodule)
        dm = trainer.datamodule
        cal = self.calibration.result if self.calibration is not None else None
        self.result = decoders_stage(LSTMStepLM(s["net"]), dm.tokens("valid"), dm.tokens("test"), self.out_dir,
                                     logger=trainer.logger, calibration=cal, **self.settings)


class MemoryCallback(pl.Callback):
    """Runs `memory_stage` for a tau run when training ends: the trained tau-model against the base model at
    `base_ckpt`."""

    def __init__(self, out_dir: str | Path, base_ckpt: str | None, **settings):
        self.out_dir, self.base_ckpt, self.settings = Path(out_dir), base_ckpt, settings
        self.result: dict | None = None

    def on_fit_end(self, trainer, module):
        s = best_model_scores(trainer, trainer.datamodule)
        dm = trainer.datamodule
        base = load_base_net(self.base_ckpt, module.device, dm.name)
        info = dm.prepare().info or {}
        exact = markov_exact_mi(info, s["net"].memory_tau) if dm.name == "markov" else None
        self.result = memory_stage(base, s["net"], dm.tokens("valid"), dm.tokens("test"), self.out_dir,
                                   logger=trainer.logger, base_ckpt=str(self.base_ckpt), ckpt=s["path"],
                                   bptt=dm.bptt, exact_mi_nats=exact, **self.settings)
