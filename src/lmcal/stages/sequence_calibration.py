"""The sequence_calibration stage: the paper's Algorithm 1, P̂_α(w_1..L) ∝ P̂(w_1..L)^(1+α), by sequential Monte Carlo
at each particle count, twisted (a soft-value head as the twist) and untwisted, and amortised by the soft-value heads,
beside the plain model, the best future-entropy row and the fitted temperature, on the same prefixes and seeds
(lmcal.core.smc, lmcal.core.sequence_fit, lmcal.core.soft_value; the SMC rows: lmcal.stages.smc_rows; which of them
are Algorithm 1: lmcal.stages.convergence; the table: lmcal.stages.sequence_table).

Which law each row estimates. The SMC rows: Algorithm 1's law over L = law_horizon words (2 x the horizon by default),
fitted, generated and scored over L words and read over its first `horizon` words, far from its end; each row at its
own particle count and twist, end to end, and called Algorithm 1 only where it agrees with twice (or half) its
particles (convergence.mark_convergence). The soft-value heads: that law's infinite-horizon limit, per word,
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
from lmcal.core.soft_value import TwistAtAlpha, soft_value_lm
from lmcal.data.batching import batchify
from lmcal.errors import LmcalError
from lmcal.stages.configs import SequenceCalibrationConfig
from lmcal.stages.convergence import (
    SAME_STUDY,
    converged_summary,
    label,
    mark_convergence,
    same_value,
    study_differences,
)
from lmcal.stages.goal_rows import goal_rows
from lmcal.stages.per_word import Bench, per_word_row, word_test_ce, word_timing
from lmcal.stages.plots import entropy_curve_figure
from lmcal.stages.rows import generation_settings, same_settings
from lmcal.stages.sequence_table import row_label, sequence_table
from lmcal.stages.smc_rows import StudySetup, extend_row, study_row
from lmcal.stages.stage import Result, Stage, earlier_result, read_result
from lmcal.stages.sv_heads import horizon_twists, train_heads
from lmcal.stages.wandb_run import log_config, log_curves, wandb_log
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")
NAME = "sequence_calibration"


class SequenceCalibrationResult(Result):
    """Every row of the comparison (the plain model, the soft-value heads, the SMC study, the earlier stages' rows),
    the convergence verdicts and the goal rows measured again on fresh prefixes."""

    def table(self) -> str:
        return sequence_table(self.record) + "\n"

    def _shown(self) -> list[dict]:
        """The rows drawn: every row but SMC's, and SMC's converged rows or its most particles."""
        r = self.record
        return [x for x in r["rows"] if x["method"] != "smc"] + [
            x for x in r["rows"] if x["method"] == "smc" and (x.get("converged") or
                                                            x["params"]["particles"] == r["particles"][-1])]

    def figure(self, path: Path) -> Path:
        """The entropy of each per-word row's next word against t (one quantity on the axis; SMC's rows, whose
        curves are surprisals, are in the extra figure), and every row's paired last-tenth difference below."""
        r, shown = self.record, self._shown()
        return entropy_curve_figure(
            {row_label(x): (np.asarray(x["curve_nats"]), np.asarray(x["stderr_nats"])) for x in shown
             if x.get("curve_kind") != "surprisal"},
            path, reference_nats={"test cross-entropy (the test stream)": r["reference_test_ce_nats"]},
            title=f"{r['model']} on {r['corpus']}: the entropy of the next word under per-word calibration; "
                  f"below, every row's last tenth (Algorithm 1: SMC over {r['law_horizon']} words)",
            legend_outside=True, tail_differences={row_label(x): (x["tail_diff_nats"], x["tail_diff_stderr_nats"])
                                                   for x in shown[1:]})

    def extras(self, out: Path, name: str) -> dict[str, Path]:
        """<name>_surprisal.png: the surprisal -log P̂ of the words SMC's rows drew, against t, beside the plain
        model's entropy (the mean surprisal of its own words) and the test cross-entropy (that of the true words)."""
        r, shown = self.record, self._shown()
        smc = [x for x in shown if x.get("curve_kind") == "surprisal"]
        if not smc:
            return {}
        model = next(x for x in r["rows"] if x["method"] == "model")
        curves = {"model: its entropy (the mean surprisal of its own words)":
                  (np.asarray(model["curve_nats"]), np.asarray(model["stderr_nats"]))}
        curves |= {row_label(x): (np.asarray(x["curve_nats"]), np.asarray(x["stderr_nats"])) for x in smc}
        png = entropy_curve_figure(
            curves, out / f"{name}_surprisal.png", legend_outside=True,
            quantity="surprisal -log P̂ of the t-th word drawn",
            reference_nats={"test cross-entropy (the true words' surprisal)": r["reference_test_ce_nats"]},
            title=f"{r['model']} on {r['corpus']}: Algorithm 1 by SMC, the surprisal -log P̂ of the words drawn")
        return {"surprisal": png}

    def log_wandb(self, logger, name: str, images: dict[str, Path]) -> None:
        r, rows = self.record, self.record["rows"]
        wandb_log(logger, scalars={f"{name}/{row_label(x)}/{k}": x[k] for x in rows
                                   for k in ("tail_ppl", "test_ce_nats") if x.get(k) is not None}, images=images)
        log_curves(logger, f"{name}/curves", "t", range(1, len(rows[0]["curve_nats"]) + 1),
                   {row_label(x): x["curve_nats"] for x in rows if x.get("curve_nats")})  # keys: methods, not fits
        log_config(logger, {f"{name}/alpha": r.get("alpha"), f"{name}/alpha_stderr": r.get("alpha_stderr")})

    def line(self, name: str) -> str:
        r = self.record
        return f"{name}: {len(r['rows'])} rows in {r['seconds']:.0f} s; {r['convergence']}"


def _plan(s: SequenceCalibrationConfig) -> tuple[list[int], int, list[int]]:
    """The particle counts, the law's horizon L and the SMC seeds the settings ask for; one clear error where they
    cannot run together."""
    ks = sorted({int(k) for k in (s.particles if isinstance(s.particles, (list, tuple)) else [s.particles])})
    if not ks or ks[0] < 1:
        raise LmcalError(f"analysis.{NAME}.particles={s.particles!r}: give one or more positive particle counts.")
    L = int(s.law_horizon or 2 * s.horizon)
    if L < s.horizon:
        raise LmcalError(f"analysis.{NAME}.law_horizon={s.law_horizon} is shorter than the horizon ({s.horizon}): the "
                         "law is read over its first `horizon` words, so it must run at least that long (null: 2 x "
                         "horizon).")
    if s.twist and not s.soft_value:
        raise LmcalError(f"analysis.{NAME}.twist=true twists SMC with the soft-value heads: it needs "
                         f"analysis.{NAME}.soft_value=true (or set twist=false).")
    if not s.untwisted and not (s.twist and s.soft_value):
        raise LmcalError(f"analysis.{NAME}.untwisted=false leaves the twisted SMC rows only, and they need "
                         f"analysis.{NAME}.twist=true and soft_value=true: set those, or untwisted=true.")
    if not s.untwisted and s.sv_alpha is None:
        raise LmcalError(f"analysis.{NAME}.untwisted=false: the soft-value heads are first trained at the untwisted "
                         f"rows' alpha*, which this run does not fit; give analysis.{NAME}.sv_alpha (for example the "
                         "alpha* an earlier run of this stage fitted, its JSON's rows' params.alpha).")
    given = s.smc_seeds
    seeds = [int(x) for x in (given if isinstance(given, (list, tuple)) else [s.seed] if given is None else [given])]
    if len(set(seeds)) != len(seeds) or not seeds:
        raise LmcalError(f"analysis.{NAME}.smc_seeds={given!r}: give one or more different seeds (null: the "
                         f"stage's seed, {s.seed}).")
    return ks, L, seeds


def _extendable(extend: dict, s: SequenceCalibrationConfig, seeds: list[int], ks: list[int]) -> list[int]:
    """Checks that `extend` (an earlier result of this stage) can get more generations at `seeds` with these rows;
    returns the seeds its rows drew at."""
    rows = extend.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows) or "law_horizon" not in (
            extend) or not any(r.get("method") == "smc" for r in rows):
        raise LmcalError(f"analysis.{NAME}.extend_json names no result of this stage with SMC rows (a "
                         f"{NAME}.json that a finished run wrote).")
    if s.smc_seeds is None:
        raise LmcalError(f"analysis.{NAME}.extend_json gives its rows more generations at other seeds: name them "
                         f"with analysis.{NAME}.smc_seeds (for example [1000, 2000]).")
    before = [int(x) for x in extend.get("smc_seeds") or []]
    if twice := sorted(set(before) & set(seeds)):
        raise LmcalError(f"analysis.{NAME}.smc_seeds={list(seeds)}: the earlier run drew at {twice} already; give "
                         f"seeds it has not drawn at (its smc_seeds are {before}).")
    twist = s.twist and s.soft_value
    if twist and any(r.get("variant") == "twisted" and not r.get("twist_trainings") for r in rows):
        raise LmcalError(f"analysis.{NAME}.extend_json: its twisted rows do not record the α their twist was trained "
                         "at (twist_trainings), so their twist cannot be built again; run the study afresh.")
    have = (sorted(extend.get("particles") or []), bool(extend.get("untwisted")), bool(extend.get("twist")))
    if have != (ks, bool(s.untwisted), bool(twist)):
        raise LmcalError(f"analysis.{NAME}.extend_json: the earlier run's rows are particles={have[0]}, untwisted="
                         f"{str(have[1]).lower()}, twist={str(have[2]).lower()}; run with the same (here: particles="
                         f"{ks}, untwisted={str(bool(s.untwisted)).lower()}, twist={str(bool(twist)).lower()}).")
    return before


def _same_study(mine: dict, extend: dict | None, keys) -> None:
    """An extended run's settings must be its earlier run's."""
    if extend and (differ := study_differences(mine, extend, keys)):
        raise LmcalError(f"analysis.{NAME}.extend_json: the earlier run is not this study, so its rows cannot get "
                         f"more generations here: {', '.join(differ)} (run with the earlier run's settings and "
                         "other smc_seeds).")


def _windows(tokens: torch.Tensor, split: str, s: SequenceCalibrationConfig, L: int,
             overlapping: dict[str, bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """fit_prefixes windows (prefixes [B, P], continuations [B, L]) spread over a split; records in `overlapping`
    whether their continuations overlap."""
    p, c, disjoint = spread_windows(tokens, s.fit_prefixes, s.prefix_len, L)
    overlapping[split] = not disjoint
    if not disjoint:
        log.warning(f"{NAME}: {s.fit_prefixes} {split} continuations of {L} words overlap (the {split} text holds "
                    f"{(tokens.numel() - s.prefix_len) // L} disjoint ones): their standard errors, which take each "
                    "as an independent unit, are too small")
    return p, c


def _study_setup(b: Bench, L: int, n_smc: int, seeds: list[int], windows: tuple, plain_ms: float) -> StudySetup:
    """What every SMC row shares: the first n_smc prefixes, the fit and test windows, and the model's last tenths at
    each seed the rows draw at (their pairs)."""
    s = b.s
    plain_tails = {x: b.plain_tail[:n_smc] if x == s.seed else  # [n, S]
                   generation_entropy_curve(b.lm, b.prefixes[:n_smc], s.horizon, s.samples_per_prefix, seed=x,
                                            max_batch=s.max_batch, progress=True).tail
                   for x in dict.fromkeys(seeds)}
    return StudySetup(b.lm, b.prefixes[:n_smc].repeat_interleave(s.samples_per_prefix, 0), s.samples_per_prefix,
                      windows[0], windows[1], s.horizon, L, tail_steps(s.horizon), plain_tails, plain_ms,
                      b.prefixes[:s.timing_prefixes], s.timing_horizon, s.timing_repeats, s.seed, tuple(s.bracket),
                      s.xtol, s.tail_particles, s.max_batch * 4, tuple(seeds), s.check_particles, s.check_prefixes)


def _heads_alpha(sv) -> dict:
    return {"alpha": sv.alpha, "alpha_stderr": sv.alpha_stderr, "valid_ce_before_nats": sv.ce_before,
            "valid_ce_after_nats": sv.ce_after, "positions": sv.positions}


def _soft_value(b: Bench, train: torch.Tensor, alpha: float) -> tuple:
    """The amortised sampler, trained first at `alpha`, its α refitted on its own per-word CE: (head, its α, the
    per-word sampler, its row)."""
    t_sv = time.perf_counter()
    head, sv, history, refits = train_heads(b.lm, train, b.valid, alpha, b.s)
    sampler = soft_value_lm(b.lm, head, sv.alpha)
    row = per_word_row(b, "soft_value", {"alpha": sv.alpha, "alpha_stderr": sv.alpha_stderr,
                                      "iterations": b.s.sv_iterations}, sampler,
                    extra={"history": history, "refits": refits, "train_seconds": time.perf_counter() - t_sv})
    return head, sv, sampler, row


def _study(setup: StudySetup, b: Bench, train: torch.Tensor, ks: list[int], extend: dict | None,
           mine: dict) -> tuple[list[dict], tuple | None, dict[int, TwistAtAlpha] | None]:
    """The SMC rows, untwisted (each count fitted for itself) then twisted by a finite-horizon head made for each
    row's α, each marked converged or not; an extended run's rows get more generations instead. Returns them,
    _soft_value's answer (None without heads) and each twisted row's twist by its particles (None without)."""
    s = b.s
    earlier = [r for r in extend["rows"] if r["method"] == "smc"] if extend else []
    if extend:
        study = [extend_row(setup, r, None) for r in earlier if r["variant"] == "untwisted"]
    else:
        study = [study_row(setup, k) for k in ks] if s.untwisted else []
    heads, twists = None, None
    if s.soft_value:
        start = study[-1]["params"]["alpha"] if s.sv_alpha is None else s.sv_alpha
        heads = _soft_value(b, train, start)
        if s.twist:
            base = horizon_twists(b.lm, train, s, setup.law_horizon, start)
            if extend:  # the twist is made again for each earlier row's α
                mine["soft_value_alpha"] = _heads_alpha(heads[1])
                _same_study(mine, extend, ["soft_value_alpha"])
                rows = [r for r in earlier if r["variant"] == "twisted"]
                twists = {r["params"]["particles"]: base.fork().replay(r["twist_trainings"]) for r in rows}
                study += [extend_row(setup, r, twists[r["params"]["particles"]](r["params"]["alpha"])) for r in rows]
            else:
                twists = {k: base.fork() for k in ks}  # each row's own: a function of its own fit alone
                study += [study_row(setup, k, twists[k], start_alpha=start) for k in ks]
    mark_convergence(study, s.converge_tol)
    for r in study:
        r["label"] = label(r)
    return study, heads, twists


def _earlier_rows(b: Bench, fe: dict | None, dec: dict | None, settings: dict,
                  samplers: dict) -> tuple[list, bool, bool]:
    """The future_entropy stage's head closest to the test perplexity (as that stage measured it) and the decoders
    stage's fitted temperature (timed and scored here), where their generation settings are these; the temperature
    fitted here otherwise. Returns the rows, whether the future-entropy row was reused and whether the temperature was
    the decoders'."""
    s, rows = b.s, []
    test_nats = -b.plain_logq.mean().item()
    reuse_fe = fe if same_settings(fe, settings) else None
    heads = [r for r in (reuse_fe or {}).get("rows", []) if str(r["method"]).startswith("future_entropy")]
    if heads:
        best = min(heads, key=lambda r: abs(math.log(r["tail_ppl"]) - test_nats))
        rows.append({**best, "source": "future_entropy"})
    reuse_dec = dec if same_settings(dec, settings) else None
    temp = next((r for r in (reuse_dec or {}).get("rows", []) if r["method"] == "fitted_temperature"), None)
    if temp:  # measured on these prefixes, seeds and test words already; timed here
        samplers["fitted_temperature"] = make_decoder("temperature", b.lm, temperature=temp["params"]["temperature"])
        level, level_se = clustered_mean(np.asarray(temp["tail_nats_per_generation"]))
        rows.append({**temp, "source": "decoders", "curve_kind": "entropy", "tail_nats": float(level),
                     **word_test_ce(b, samplers["fitted_temperature"]),  # paired here: the decoders' rows are not
                     "tail_stderr_nats": float(level_se), "tail_ppl_stderr": exp_or_inf(float(level)) * float(level_se),
                     **dict(zip(("ms_per_token", "cost_ratio"), word_timing(b, samplers["fitted_temperature"]),
                                strict=True))})
    else:
        tf = fit_temperature(b.lm, batchify(b.valid[:s.fit_tokens], s.fit_streams), progress=True)
        samplers["fitted_temperature"] = make_decoder("temperature", b.lm, temperature=tf.temperature)
        rows.append(per_word_row(b, "fitted_temperature", {"temperature": tf.temperature,
                                                        "temperature_stderr": tf.temperature_stderr},
                              samplers["fitted_temperature"]))
    return rows, bool(reuse_fe), bool(temp)


def _record(mine: dict, rows: list[dict], checks: tuple, sv, more: dict) -> dict:
    """The stage's JSON: its rows, goal rows (checks: goal, twisted check), the α* of its most trusted SMC row (the
    twisted row with the most particles that converged, else the untwisted row with the most), its settings."""
    study = [r for r in rows if r["method"] == "smc"]
    best = next((r for r in sorted(study, key=lambda r: (r["variant"] != "twisted", -r["params"]["particles"]))
                 if r.get("converged")), ([r for r in study if r["variant"] == "untwisted"] or study)[-1])
    ref_ce = rows[0]["test_ce_nats"]
    m = mine
    return {"model": m["model"], "corpus": m["corpus"], "rows": rows, "goal": checks[0], "twisted_check": checks[1],
            "reference_test_ce_nats": ref_ce, "reference_test_ppl": exp_or_inf(ref_ce),
            "alpha": best["params"]["alpha"], "alpha_stderr": best["params"]["alpha_stderr"],
            "alpha_from": best["label"], "law_horizon": m["law_horizon"], "particles": more["particles"],
            "twist": more["twist"], "untwisted": more["untwisted"], "sv_alpha": m["sv_alpha"],
            "convergence": converged_summary(study), "soft_value_alpha": None if sv is None else _heads_alpha(sv),
            "smc_prefixes": m["smc_prefixes"], "fit_prefixes": m["fit_prefixes"], "goal_prefixes": m["goal_prefixes"],
            "smc_seeds": more["smc_seeds"], "extended": more["extended"],
            "fit_windows_overlap": m["fit_windows_overlap"], "converge_tol": m["converge_tol"],
            "tail_steps": m["tail_steps"], "tail_particles": m["tail_particles"],
            "future_entropy_reused": more["future_entropy_reused"], "decoders_reused": more["decoders_reused"],
            **{k: m[k] for k in more["generation_keys"]}, "unit": more["unit"], "seconds": more["seconds"]}


def compute(target: dict, settings: SequenceCalibrationConfig) -> SequenceCalibrationResult:
    """Algorithm 1 (module docstring): the plain model; SMC at each count of `particles` untwisted, each with α*
    fitted at that count on `fit_prefixes` validation continuations of law_horizon (null: 2 x horizon) words (evenly
    spaced over the validation text, disjoint where it holds that many: lmcal.core.sampling.spread_windows; the test
    CE's test continuations alike), from the first `smc_prefixes` prefixes (all when null), the goal rows measured
    again on `goal_prefixes` fresh ones (null: as many as the row's own); the soft-value heads trained at the largest
    count's α* (or `sv_alpha`) on rollouts from the training text, their α refitted on the first `fit_tokens`
    validation tokens and the head retrained `sv_refits` times; SMC twisted by that head at each count (`twist`;
    untwisted=False: the twisted rows only, the heads first trained at `sv_alpha`); the rows of the earlier stages
    (future_entropy: its best head; decoders: the fitted temperature, else fitted here) when their generation and
    scoring settings are these. The SMC rows generate S a prefix at each of `smc_seeds` (null: `seed`), joined along
    S. `extend_json`: an earlier result of this stage whose study rows get more generations, at their own α* (not
    fitted again), at `smc_seeds` (none of its own), their fit, test CE, cost and goal rows kept (its settings must
    be this run's)."""
    s = settings
    if target.get("train") is None:
        raise LmcalError(f"The {NAME} stage trains its soft-value heads on rollouts from the training text, which this "
                         "model's target does not carry.")
    fe = earlier_result(target, NAME, "future_entropy", s.future_entropy_json)
    dec = earlier_result(target, NAME, "decoders", s.decoders_json)
    extend = read_result(s.extend_json, NAME, "extend_json")
    t0 = time.perf_counter()
    ks, L, seeds = _plan(s)
    before = _extendable(extend, s, seeds, ks) if extend else []
    lm, valid = target["lm"], target["valid"]
    prefixes = random_prefixes(valid, s.num_prefixes, s.prefix_len, seed=s.seed)  # [N, P]: as every other stage
    test = batchify(target["test"][:s.score_tokens] if s.score_tokens else target["test"], s.score_streams)
    b = Bench(lm, s, valid, prefixes, test)
    n_smc = min(prefixes.size(0), s.smc_prefixes or prefixes.size(0))
    gen = generation_settings(prefixes, s.samples_per_prefix, s.prefix_len, s.horizon, s.seed, test, s.score_streams)
    mine = {"model": target["name"], "corpus": target["corpus"], **gen, "smc_prefixes": n_smc, "law_horizon": L,
            "fit_prefixes": s.fit_prefixes, "tail_steps": tail_steps(s.horizon), "tail_particles": s.tail_particles,
            "converge_tol": s.converge_tol, "goal_prefixes": s.goal_prefixes, "sv_alpha": s.sv_alpha}
    _same_study(mine, extend, [k for k in mine if k in SAME_STUDY or k in ("goal_prefixes", "sv_alpha")])
    b.plain_logq = target_log_probs(lm, test, progress=True)  # [n]: every per-word row is paired with it
    rows = [per_word_row(b, "model", {}, lm)]
    overlapping: dict[str, bool] = {}  # split -> whether its windows' continuations overlap
    windows = _windows(valid, "validation", s, L, overlapping), _windows(target["test"], "test", s, L, overlapping)
    mine |= {"fit_windows_overlap": overlapping, "reference_test_ce_nats": rows[0]["test_ce_nats"]}
    _same_study(mine, extend, ["fit_windows_overlap", "reference_test_ce_nats"])
    if extend and not same_value(rows[0]["tail_nats"], extend["rows"][0]["tail_nats"]):
        raise LmcalError(f"analysis.{NAME}.extend_json: the plain model's last tenth here ({rows[0]['tail_nats']:.6f} "
                         f"nats) is not the earlier run's ({extend['rows'][0]['tail_nats']:.6f}): another model or "
                         "other draws, so its rows cannot get more generations here.")
    setup = _study_setup(b, L, n_smc, seeds, windows, rows[0]["ms_per_token"])
    study, heads, twists = _study(setup, b, target["train"], ks, extend, mine)
    samplers = {} if heads is None else {"soft_value": heads[2]}  # method -> its per-word sampler, for the goal
    if twists:
        samplers["twists"] = twists  # the twisted rows' twists by particles, each made for its row's α
    rows += ([] if heads is None else [heads[3]]) + study
    more_rows, fe_reused, dec_reused = _earlier_rows(b, fe, dec, gen, samplers)
    rows += more_rows
    checks = goal_rows(b, setup, rows, study, samplers, extend)
    return SequenceCalibrationResult(_record(mine, rows, checks, None if heads is None else heads[1], {
        "particles": ks, "twist": bool(s.twist and s.soft_value), "untwisted": bool(s.untwisted),
        "smc_seeds": before + seeds, "extended": bool(extend), "future_entropy_reused": fe_reused,
        "decoders_reused": dec_reused, "generation_keys": list(gen), "unit": target["unit"],
        "seconds": time.perf_counter() - t0}))


STAGE = Stage(NAME, SequenceCalibrationConfig, compute, frozenset({"full", "hf"}),
              lambda r: {NAME: [
                  {k: row.get(k) for k in ("method", "params", "tail_ppl", "tail_ppl_stderr", "test_ce_nats",
                                           "ms_per_token", "test_ce_diff_nats", "test_ce_diff_stderr_nats",
                                           "tail_diff_nats", "tail_diff_stderr_nats", "cost_ratio", "source", "label",
                                           "variant", "converged", "ess_per_particle", "test_ce_bias_nats")}
                  for row in r["rows"]]},
              uses=("decoders", "future_entropy"))
