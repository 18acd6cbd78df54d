"""The sequence_calibration stage: the paper's Algorithm 1, P̂_α(w_1..L) ∝ P̂(w_1..L)^(1+α), by sequential Monte Carlo
at each particle count, twisted (a soft-value head as the twist) and untwisted, and amortised by the soft-value heads,
beside the plain model, the best future-entropy row and the fitted temperature, on the same prefixes and seeds
(lmcal.core.smc, lmcal.core.sequence_fit, lmcal.core.soft_value; the SMC rows: lmcal.stages.smc_study).

Which law each row estimates. The SMC rows: Algorithm 1's law over L = law_horizon words (2 x the horizon by default),
fitted, generated and scored over L words and read over its first `horizon` words, far from its end; each row at its
own particle count and twist, end to end, and called Algorithm 1 only where it agrees with twice (or half) its
particles (smc_study.mark_convergence). The soft-value heads: that law's infinite-horizon limit, per word,
P ∝ P̂^(1+α) e^Q, with α fitted on the sampler's own exact per-word validation cross-entropy (the head retrained at the
refitted α, `sv_refits` times). The per-word rows' "last tenth" is the mean entropy of their next-word distributions
over the last tenth of the horizon; the SMC rows', the entropy per word of the sequence law there, H(A | h), by two
nested SMC runs from each returned path (core.smc.smc_tail_entropy), at the row's own count and twist. The SMC rows'
curves show the model's surprisal -log P̂(w_t | past) of the words they generate.

Test CE: the per-word samplers score the test stream, paired word by word with the model. An SMC row's law is one over
whole continuations: its CE is -(1+α) log P̂(x | prefix) / L + log Ẑ / L on true test continuations of L words after
the same kind of prefix, at its own particle count, paired with the model on the same words, with log Ẑ's downward
bias estimated from two independent runs.

The goal row is chosen on the generations of one seed (the one every row here uses), among the rows that are
Algorithm 1 (converged) or per-word samplers with a test CE not above the model's, and measured again on fresh
prefixes and the next seed; the twisted row with the fewest particles is measured there too.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from lmcal.core.calibration import fit_temperature, target_log_probs
from lmcal.core.decoders import make_decoder
from lmcal.core.entropy_rate import clustered_mean, generation_entropy_curve, tail_steps
from lmcal.core.sampling import random_prefixes, spread_windows
from lmcal.core.soft_value import soft_value_lm, soft_value_twist
from lmcal.data.batching import batchify
from lmcal.errors import LmcalError
from lmcal.stages.plots import entropy_curve_figure
from lmcal.stages.rows import generation_settings, same_settings, timed_generation
from lmcal.stages.sequence_report import row_label, sequence_table
from lmcal.stages.smc_generations import StudySetup, drawn_seeds, extend_row
from lmcal.stages.smc_study import (
    SAME_STUDY,
    converged_summary,
    label,
    mark_convergence,
    remeasure,
    same_value,
    study_differences,
    study_row,
    study_row_of,
)
from lmcal.stages.stage import Stage, earlier_result, read_result, stage_context
from lmcal.stages.sv_heads import train_heads
from lmcal.stages.wandb_run import log_config, log_curves, wandb_log
from lmcal.utils.io import write_json_atomic, write_text_atomic
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")


def _row(method: str, params: dict, curve: np.ndarray, stderr: np.ndarray, tail: np.ndarray, plain_tail: np.ndarray,
         **columns) -> dict:
    """A row: its curve [T], the last tenth's level (exp of the mean, with the standard error of the mean in nats,
    prefixes as clusters) and its paired difference from the model's (tail, plain_tail [N, S])."""
    level, level_se = clustered_mean(tail)
    diff, diff_se = clustered_mean(tail - plain_tail)
    return {"method": method, "params": params, "tail_ppl": exp_or_inf(float(level)),
            "tail_nats": float(level), "tail_ppl_stderr": exp_or_inf(float(level)) * float(level_se),
            "tail_stderr_nats": float(level_se), "tail_diff_nats": float(diff), "tail_diff_stderr_nats": float(diff_se),
            **columns, "curve_nats": [float(x) for x in curve], "stderr_nats": [float(x) for x in stderr]}


def sequence_calibration_stage(lm, train_tokens: torch.Tensor, valid_tokens: torch.Tensor, test_tokens: torch.Tensor,
                               out_dir: str | Path, *, particles=(4, 8, 16), twist: bool = True,
                               untwisted: bool = True, sv_alpha: float | None = None,
                               law_horizon: int | None = None, smc_prefixes: int | None = None, fit_prefixes: int = 40,
                               goal_prefixes: int | None = None, converge_tol: float | None = 0.1,
                               smc_seeds: list[int] | None = None, extend: dict | None = None,
                               bracket=(-0.5, 1.0), xtol: float = 2e-3, tail_particles: int | None = None,
                               soft_value: bool = True, sv_rollouts: int = 200, sv_prefix: int = 50,
                               sv_steps: int = 20, sv_iterations: int = 10, sv_backup_steps: int = 10,
                               sv_explore: float = 0.5, sv_refits: int = 1, hidden: int = 128, rank: int = 64,
                               epochs: int = 4, batch_size: int = 512, lr: float = 3e-3, fit_tokens: int = 20_000,
                               fit_streams: int = 20, score_tokens: int | None = None, score_streams: int = 10,
                               timing_prefixes: int = 20, timing_horizon: int = 30, timing_repeats: int = 3,
                               decoders: dict | None = None, future_entropy: dict | None = None,
                               num_prefixes: int = 100, samples_per_prefix: int = 5, prefix_len: int = 100,
                               horizon: int = 700, seed: int = 0, max_batch: int = 1024, model_name: str = "model",
                               corpus: str = "ptb", logger=None, name: str = "sequence_calibration",
                               unit: str = "word") -> dict:
    """Algorithm 1 (module docstring): the plain model; SMC at each count of `particles` untwisted, each with α* fitted
    at that count on `fit_prefixes` validation continuations of law_horizon (null: 2 x horizon) words (evenly spaced
    over the validation text, disjoint where it holds that many: lmcal.core.sampling.spread_windows; the test CE's
    test continuations alike), from the first `smc_prefixes` prefixes (all when null), the goal rows measured again
    on `goal_prefixes` fresh ones (null: as many as the row's own); the soft-value heads trained at the largest
    count's α* (or `sv_alpha`) by `sv_iterations` rounds of relative value iteration on `sv_rollouts` rollouts of
    `sv_steps` words from the training text, their α refitted on the first `fit_tokens` validation tokens and the
    head retrained `sv_refits` times; SMC twisted by that head at each count (`twist`; untwisted=False: the twisted
    rows only, the heads first trained at `sv_alpha`, so that a study spends its time on the twisted law); the rows
    of the earlier stages (`future_entropy`: its best head; `decoders`: the fitted temperature, else fitted here)
    when their generation and scoring settings are these. The SMC rows generate S a prefix at each of `smc_seeds`
    (null: `seed`), joined along S. `extend`: an earlier result of this stage whose study rows get more generations,
    at their own α* (not fitted again), at `smc_seeds` (none of its own), their fit, test CE, cost and goal rows kept
    (smc_study.extend_row; its settings must be this run's). Writes `<name>.json`, `.md` and `.png`."""
    out = Path(out_dir)
    t0 = time.perf_counter()
    ks = sorted({int(k) for k in (particles if isinstance(particles, (list, tuple)) else [particles])})
    if not ks or ks[0] < 1:
        raise LmcalError(f"analysis.{name}.particles={particles!r}: give one or more positive particle counts.")
    L = int(law_horizon or 2 * horizon)
    if L < horizon:
        raise LmcalError(f"analysis.{name}.law_horizon={law_horizon} is shorter than the horizon ({horizon}): the law "
                         "is read over its first `horizon` words, so it must run at least that long (null: 2 x "
                         "horizon).")
    if twist and not soft_value:
        raise LmcalError(f"analysis.{name}.twist=true twists SMC with the soft-value heads: it needs "
                         f"analysis.{name}.soft_value=true (or set twist=false).")
    if not untwisted and not (twist and soft_value):
        raise LmcalError(f"analysis.{name}.untwisted=false leaves the twisted SMC rows only, and they need "
                         f"analysis.{name}.twist=true and soft_value=true: set those, or untwisted=true.")
    if not untwisted and sv_alpha is None:
        raise LmcalError(f"analysis.{name}.untwisted=false: the soft-value heads are first trained at the untwisted "
                         f"rows' alpha*, which this run does not fit; give analysis.{name}.sv_alpha (for example the "
                         "alpha* an earlier run of this stage fitted, its JSON's rows' params.alpha).")
    seeds = [int(x) for x in (smc_seeds if isinstance(smc_seeds, (list, tuple)) else [seed] if smc_seeds is None
                              else [smc_seeds])]
    if len(set(seeds)) != len(seeds) or not seeds:
        raise LmcalError(f"analysis.{name}.smc_seeds={smc_seeds!r}: give one or more different seeds (null: the "
                         f"stage's seed, {seed}).")
    before = _extendable(extend, name, seeds, smc_seeds, ks, untwisted, twist and soft_value) if extend else []
    prefixes = random_prefixes(valid_tokens, num_prefixes, prefix_len, seed=seed)  # [N, P]: as every other stage
    n_smc = min(prefixes.size(0), smc_prefixes or prefixes.size(0))
    test = batchify(test_tokens[:score_tokens] if score_tokens else test_tokens, score_streams)
    settings = generation_settings(prefixes, samples_per_prefix, prefix_len, horizon, seed, test, score_streams)
    last = tail_steps(horizon)
    mine = {"model": model_name, "corpus": corpus, **settings, "smc_prefixes": n_smc, "law_horizon": L,
            "fit_prefixes": fit_prefixes, "tail_steps": last, "tail_particles": tail_particles,
            "converge_tol": converge_tol, "goal_prefixes": goal_prefixes, "sv_alpha": sv_alpha}

    def same_study(keys) -> None:  # an extended run's settings must be its earlier run's
        if extend and (differ := study_differences(mine, extend, keys)):
            raise LmcalError(f"analysis.{name}.extend_json: the earlier run is not this study, so its rows cannot get "
                             f"more generations here: {', '.join(differ)} (run with the earlier run's settings and "
                             "other smc_seeds).")

    same_study([k for k in mine if k in SAME_STUDY or k in ("goal_prefixes", "sv_alpha")])
    out.mkdir(parents=True, exist_ok=True)  # after the checks: a refused run leaves nothing behind

    overlapping: dict[str, bool] = {}  # split -> whether its windows' continuations overlap

    def windows(tokens: torch.Tensor, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        p, c, disjoint = spread_windows(tokens, fit_prefixes, prefix_len, L)  # [B, P], [B, L]
        overlapping[split] = not disjoint
        if not disjoint:
            log.warning(f"{name}: {fit_prefixes} {split} continuations of {L} words overlap (the {split} text holds "
                        f"{(tokens.numel() - prefix_len) // L} disjoint ones): their standard errors, which take each "
                        "as an independent unit, are too small")
        return p, c

    def timing(model) -> tuple[float, float]:  # (ms per generated word, its ratio to the plain model's)
        return timed_generation(model, lm, prefixes[:timing_prefixes], timing_horizon, samples_per_prefix, seed,
                                max_batch, timing_repeats)

    plain_logq = target_log_probs(lm, test, progress=True)  # [n]: the test stream, every per-word row paired with it
    plain_tail: list[np.ndarray] = []  # the model's [N, S] last-tenth entropies, what every row is paired with

    def per_word(method: str, params: dict, model, s: int = seed, on: torch.Tensor = prefixes,
                 extra: dict | None = None) -> dict:
        """A per-word sampler's row: its entropy curve from the prefixes `on`, its test CE on the stream, its cost."""
        curve = generation_entropy_curve(model, on, horizon, samples_per_prefix, seed=s, max_batch=max_batch,
                                         progress=True)
        plain_tail.append(curve.tail) if not plain_tail else None
        ms, ratio = timing(model) if s == seed else (None, None)
        return _row(method, params, curve.mean, curve.stderr, curve.tail, plain_tail[0] if on is prefixes
                    else curve.tail, curve_kind="entropy", **test_ce(model), ms_per_token=ms, cost_ratio=ratio,
                    seed=s, **(extra or {}))

    def test_ce(model) -> dict:
        """A per-word sampler's test CE on the stream, and its difference from the model's, paired word by word."""
        logq = plain_logq if model is lm else target_log_probs(model, test, progress=True)
        d = (logq - plain_logq).double().view(-1, score_streams).mean(0)  # [streams]: a stream is one unit
        return {"test_ce_nats": None if torch.isneginf(logq).any() else -logq.mean().item(),
                "test_ce_diff_nats": -float(d.mean()),
                "test_ce_diff_stderr_nats": float(d.std() / math.sqrt(score_streams))}

    rows = [per_word("model", {}, lm)]
    fit_windows, test_windows = windows(valid_tokens, "validation"), windows(test_tokens, "test")
    mine |= {"fit_windows_overlap": overlapping, "reference_test_ce_nats": rows[0]["test_ce_nats"]}
    same_study(["fit_windows_overlap", "reference_test_ce_nats"])
    if extend and not same_value(rows[0]["tail_nats"], extend["rows"][0]["tail_nats"]):
        raise LmcalError(f"analysis.{name}.extend_json: the plain model's last tenth here ({rows[0]['tail_nats']:.6f} "
                         f"nats) is not the earlier run's ({extend['rows'][0]['tail_nats']:.6f}): another model or "
                         "other draws, so its rows cannot get more generations here.")
    plain_tails = {x: plain_tail[0][:n_smc] if x == seed else  # [n, S]: the model's, at each seed the study draws at
                   generation_entropy_curve(lm, prefixes[:n_smc], horizon, samples_per_prefix, seed=x,
                                            max_batch=max_batch, progress=True).tail
                   for x in dict.fromkeys(seeds + before)}
    setup = StudySetup(lm, prefixes[:n_smc].repeat_interleave(samples_per_prefix, 0), samples_per_prefix,
                       fit_windows, test_windows, horizon, L, last, plain_tails, rows[0]["ms_per_token"],
                       prefixes[:timing_prefixes], timing_horizon, timing_repeats, seed, tuple(bracket), xtol,
                       tail_particles, max_batch * 4, tuple(seeds))
    earlier_rows = [r for r in extend["rows"] if r["method"] == "smc"] if extend else []

    def grown(variant: str, tw) -> list[dict]:  # the earlier run's rows of this variant, with more generations
        return [extend_row(setup, r, tw, before) for r in earlier_rows if r["variant"] == variant]

    if extend:
        study = grown("untwisted", None)
    else:
        study = [study_row(setup, k) for k in ks] if untwisted else []  # untwisted, each count fitted for itself
    samplers, sv = {}, None  # method -> the per-word sampler behind its row, for the goal's second measurement
    if soft_value:  # the amortised sampler, α refitted on its own per-word CE; then the twist of SMC
        t_sv = time.perf_counter()
        head, sv, history, refits = train_heads(
            lm, train_tokens, valid_tokens, study[-1]["params"]["alpha"] if sv_alpha is None else sv_alpha,
            sv_rollouts=sv_rollouts, sv_prefix=sv_prefix, sv_steps=sv_steps, sv_iterations=sv_iterations,
            sv_backup_steps=sv_backup_steps, sv_explore=sv_explore, sv_refits=sv_refits, hidden=hidden, rank=rank,
            epochs=epochs, batch_size=batch_size, lr=lr, fit_tokens=fit_tokens, fit_streams=fit_streams,
            prefix_len=prefix_len, seed=seed, max_batch=max_batch, name=name)
        samplers["soft_value"] = soft_value_lm(lm, head, sv.alpha)
        rows.append(per_word("soft_value", {"alpha": sv.alpha, "alpha_stderr": sv.alpha_stderr,
                                            "iterations": sv_iterations}, samplers["soft_value"],
                             extra={"history": history, "refits": refits, "train_seconds": time.perf_counter() - t_sv}))
        if twist:
            tw = soft_value_twist(lm, head)
            if extend:  # the same heads twist the new generations as the earlier ones
                mine["soft_value_alpha"] = {"alpha": sv.alpha, "alpha_stderr": sv.alpha_stderr,
                                            "valid_ce_before_nats": sv.ce_before, "valid_ce_after_nats": sv.ce_after,
                                            "positions": sv.positions}
                same_study(["soft_value_alpha"])
                study += grown("twisted", tw)
            else:
                study += [study_row(setup, k, tw, start_alpha=sv.alpha) for k in ks]
    mark_convergence(study, converge_tol)
    for r in study:
        r["label"] = label(r)
    rows += study
    reuse_fe = future_entropy if same_settings(future_entropy, settings) else None
    heads = [r for r in (reuse_fe or {}).get("rows", []) if str(r["method"]).startswith("future_entropy")]
    if heads:  # the future_entropy stage's head closest to the test perplexity, as that stage measured it
        best = min(heads, key=lambda r: abs(math.log(r["tail_ppl"]) - rows[0]["test_ce_nats"]))
        rows.append({**best, "source": "future_entropy"})
    reuse_dec = decoders if same_settings(decoders, settings) else None
    temp = next((r for r in (reuse_dec or {}).get("rows", []) if r["method"] == "fitted_temperature"), None)
    if temp:  # measured on these prefixes, seeds and test words already; timed here
        samplers["fitted_temperature"] = make_decoder("temperature", lm, temperature=temp["params"]["temperature"])
        level, level_se = clustered_mean(np.asarray(temp["tail_nats_per_generation"]))
        rows.append({**temp, "source": "decoders", "curve_kind": "entropy", "tail_nats": float(level),
                     **test_ce(samplers["fitted_temperature"]),  # paired here: the decoders' rows are not
                     "tail_stderr_nats": float(level_se), "tail_ppl_stderr": exp_or_inf(float(level)) * float(level_se),
                     **dict(zip(("ms_per_token", "cost_ratio"), timing(samplers["fitted_temperature"]), strict=True))})
    else:
        tf = fit_temperature(lm, batchify(valid_tokens[:fit_tokens], fit_streams), progress=True)
        samplers["fitted_temperature"] = make_decoder("temperature", lm, temperature=tf.temperature)
        rows.append(per_word("fitted_temperature", {"temperature": tf.temperature,
                                                    "temperature_stderr": tf.temperature_stderr},
                             samplers["fitted_temperature"]))

    # the goal: among the rows that are Algorithm 1 (a sampler's fewest converged count) or per-word samplers, without
    # a higher test CE, the one closest to the test perplexity over the last tenth on this seed's generations, measured
    # again on fresh prefixes and the next seed; the twisted row with the fewest particles is measured there too
    test_nats = rows[0]["test_ce_nats"]
    # [max(N, goal), P]: the first N as before, whatever goal_prefixes (randperm's order does not depend on the count)
    fresh = random_prefixes(valid_tokens, max(num_prefixes, goal_prefixes or 0), prefix_len, seed=seed + 11)

    def on(r: dict) -> int:  # the fresh prefixes a row is measured again on
        return int(goal_prefixes or (n_smc if r["method"] == "smc" else num_prefixes))

    cache: dict[int, dict] = {}  # id(row) -> its measurement: a row that is both goal and twisted check, once
    for g in (extend or {}).get("goal"), (extend or {}).get("twisted_check"):  # an extended run's, as measured there
        match = g and (study_row_of(g, study) if g["method"] == "smc" else next(
            (r for r in rows if r["method"] == g["method"] and same_value(r["params"], g["params"])), None))
        if match:
            cache[id(match)] = {"tail_nats": g["tail_nats"], "tail_stderr_nats": g["tail_stderr_nats"]}

    def again(r: dict) -> dict:
        if id(r) not in cache:
            cache[id(r)] = measure(r)
        return cache[id(r)]

    def measure(r: dict) -> dict:
        log.info(f"{name}: {row_label(r)} measured again on {on(r)} fresh prefixes ({on(r) * samples_per_prefix} "
                 f"generations, seed {seed + 1})")
        if r["method"] == "smc":
            tw = soft_value_twist(lm, samplers["soft_value"].head) if r["variant"] == "twisted" else None
            level, se = remeasure(setup, fresh[:on(r)], r["params"]["particles"], tw, r["params"]["alpha"], seed + 1)
            return {"tail_nats": level, "tail_stderr_nats": se}
        return per_word(r["method"], r["params"], samplers[r["method"]], s=seed + 1, on=fresh[:on(r)])

    def verdict(r: dict, measured: dict) -> dict:
        level, se = measured["tail_nats"], measured["tail_stderr_nats"]
        return {"method": r["method"], "label": row_label(r), "params": r["params"], "chosen_on_seed": seed,
                "reported_on_seed": seed + 1, "prefixes": on(r), "generations": on(r) * samples_per_prefix,
                "reported_on": f"{on(r)} fresh prefixes (another draw of validation points)",
                "tail_nats": level, "tail_stderr_nats": se, "tail_ppl": exp_or_inf(level),
                "tail_ppl_stderr": exp_or_inf(level) * se, "test_ppl": exp_or_inf(test_nats),
                "test_ce_diff_nats": r.get("test_ce_diff_nats"),
                "test_ce_diff_stderr_nats": r.get("test_ce_diff_stderr_nats"),
                "tail_alpha_stderr_nats": r.get("tail_alpha_stderr_nats"),  # SMC rows: what α*'s noise moves it by
                "within_10_percent": abs(exp_or_inf(level) / exp_or_inf(test_nats) - 1) <= 0.10}

    fair = goal_candidates(rows[1:], samplers)
    goal = None
    if fair:
        chosen = min(fair, key=lambda r: abs(r["tail_nats"] - test_nats))
        goal = {**verdict(chosen, again(chosen)), "candidates": [row_label(r) for r in fair]}
        log.info(f"{name}: goal row {goal['label']}: last tenth {goal['tail_ppl']:.1f} +- {goal['tail_ppl_stderr']:.1f}"
                 f" on fresh prefixes against test perplexity {goal['test_ppl']:.1f}")
    twisted = [r for r in study if r["variant"] == "twisted"]
    twisted_check = verdict(twisted[0], again(twisted[0])) if twisted else None

    ref_ce = rows[0]["test_ce_nats"]
    best = next((r for r in sorted(study, key=lambda r: (r["variant"] != "twisted", -r["params"]["particles"]))
                 if r.get("converged")), ([r for r in study if r["variant"] == "untwisted"] or study)[-1])
    result = {"model": model_name, "corpus": corpus, "rows": rows, "goal": goal, "twisted_check": twisted_check,
              "reference_test_ce_nats": ref_ce, "reference_test_ppl": exp_or_inf(ref_ce),
              "alpha": best["params"]["alpha"], "alpha_stderr": best["params"]["alpha_stderr"],
              "alpha_from": best["label"], "law_horizon": L, "particles": ks, "twist": bool(twist and soft_value),
              "untwisted": bool(untwisted), "sv_alpha": sv_alpha,
              "convergence": converged_summary(study), "soft_value_alpha": None if sv is None else {
                  "alpha": sv.alpha, "alpha_stderr": sv.alpha_stderr, "valid_ce_before_nats": sv.ce_before,
                  "valid_ce_after_nats": sv.ce_after, "positions": sv.positions},
              "smc_prefixes": n_smc, "fit_prefixes": fit_prefixes, "goal_prefixes": goal_prefixes,
              "smc_seeds": before + seeds, "extended": bool(extend),
              "fit_windows_overlap": overlapping,
              "converge_tol": converge_tol, "tail_steps": last,
              "tail_particles": tail_particles, "future_entropy_reused": bool(reuse_fe), "decoders_reused": bool(temp),
              **settings, "unit": unit, "seconds": time.perf_counter() - t0}
    shown = [r for r in rows if r["method"] != "smc"] + [r for r in study if r.get("converged") or
                                                        r["params"]["particles"] == ks[-1]]
    png = entropy_curve_figure(
        {row_label(r) + (" (surprisal -log P̂ of its words)" if r.get("curve_kind") == "surprisal" else ""):
         (np.asarray(r["curve_nats"]), np.asarray(r["stderr_nats"])) for r in shown},
        out / f"{name}.png", reference_nats={"test cross-entropy (the test stream)": ref_ce},
        title=f"{model_name} on {corpus}: Algorithm 1 (SMC over {L} words, soft values) and per-word calibration",
        legend_outside=True, tail_differences={row_label(r): (r["tail_diff_nats"], r["tail_diff_stderr_nats"])
                                               for r in shown[1:]})
    write_text_atomic(out / f"{name}.md", sequence_table(result) + "\n")
    write_json_atomic(out / f"{name}.json", result)
    wandb_log(logger, scalars={f"{name}/{row_label(r)}/{k}": r[k] for r in rows for k in ("tail_ppl", "test_ce_nats")
                               if r.get(k) is not None}, images={f"{name}/figure": png})
    log_curves(logger, f"{name}/curves", "t", range(1, len(rows[0]["curve_nats"]) + 1),
               {row_label(r): r["curve_nats"] for r in rows if r.get("curve_nats")})  # keys: methods, not fitted values
    log_config(logger, {f"{name}/alpha": result.get("alpha"), f"{name}/alpha_stderr": result.get("alpha_stderr")})
    log.info(f"{name}: {len(rows)} rows in {result['seconds']:.0f} s; {out / (name + '.json')}\n"
             f"{sequence_table(result)}")
    return result


def goal_candidates(rows: list[dict], per_word) -> list[dict]:
    """The rows the goal is chosen among: per-word samplers (methods in `per_word`) and Algorithm 1's rows, each
    without a higher test CE than the model's. A converged count agrees with twice (half) its particles, so the two
    estimate one law: a sampler (SMC, twisted or not) stands there by its fewest converged count alone, the one that
    costs least, and its goal measurement on fresh prefixes costs no more than its twisted check."""
    def fewest(r: dict) -> bool:
        return r["method"] != "smc" or not any(
            o["method"] == "smc" and o.get("variant") == r.get("variant") and o.get("converged")
            and o["params"]["particles"] < r["params"]["particles"] for o in rows)
    return [r for r in rows if (r.get("converged") or r["method"] in per_word) and fewest(r)
            and r.get("test_ce_diff_nats") is not None and r["test_ce_diff_nats"] <= 0]


def _extendable(extend: dict, name: str, seeds: list[int], given, ks: list[int], untwisted: bool,
                twist: bool) -> list[int]:
    """Checks that `extend` (an earlier result of this stage) can get more generations at `seeds` with these rows;
    returns the seeds its rows drew at (a run from before smc_seeds was kept: its stage seed)."""
    rows = extend.get("rows") if isinstance(extend, dict) else None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows) or "law_horizon" not in (
            extend) or not any(r.get("method") == "smc" for r in rows):
        raise LmcalError(f"analysis.{name}.extend_json names no result of this stage with SMC rows (a "
                         f"{name}.json that a finished run wrote).")
    if given is None:
        raise LmcalError(f"analysis.{name}.extend_json gives its rows more generations at other seeds: name them "
                         f"with analysis.{name}.smc_seeds (for example [1000, 2000]).")
    before = [int(x) for x in drawn_seeds(extend)]
    if twice := sorted(set(before) & set(seeds)):
        raise LmcalError(f"analysis.{name}.smc_seeds={list(seeds)}: the earlier run drew at {twice} already; give "
                         f"seeds it has not drawn at (its smc_seeds are {before}).")
    have = (sorted(extend.get("particles") or []), bool(extend.get("untwisted", True)), bool(extend.get("twist")))
    if have != (ks, bool(untwisted), bool(twist)):
        raise LmcalError(f"analysis.{name}.extend_json: the earlier run's rows are particles={have[0]}, untwisted="
                         f"{str(have[1]).lower()}, twist={str(have[2]).lower()}; run with the same (here: particles="
                         f"{ks}, untwisted={str(bool(untwisted)).lower()}, twist={str(bool(twist)).lower()}).")
    return before


def _call(t, out, logger, earlier, future_entropy_json=None, decoders_json=None, extend_json=None, **s):
    fe = earlier_result(earlier, "sequence_calibration", "future_entropy", future_entropy_json,
                        "leave the future-entropy row out")
    dec = earlier_result(earlier, "sequence_calibration", "decoders", decoders_json, "fit the temperature here")
    if "train" not in t:
        raise LmcalError("The sequence_calibration stage trains its soft-value heads on rollouts from the training "
                         "text, which this model's target does not carry.")
    return sequence_calibration_stage(t["lm"], t["train"], t["valid"], t["test"], out, future_entropy=fe,
                                      decoders=dec, extend=read_result(extend_json, "sequence_calibration",
                                                                       "extend_json"),
                                      unit=t["unit"], **stage_context(t, logger), **s)


STAGE = Stage("sequence_calibration", sequence_calibration_stage, _call, frozenset({"full", "hf"}),
              lambda r: {"sequence_calibration": [
                  {k: row.get(k) for k in ("method", "params", "tail_ppl", "tail_ppl_stderr", "test_ce_nats",
                                           "ms_per_token", "test_ce_diff_nats", "test_ce_diff_stderr_nats",
                                           "tail_diff_nats", "tail_diff_stderr_nats", "cost_ratio", "source", "label",
                                           "variant", "converged", "ess_per_particle", "test_ce_bias_nats")}
                  for row in r["rows"]]},
              entry_settings=("future_entropy_json", "decoders_json", "extend_json"),
              uses=("decoders", "future_entropy"))
