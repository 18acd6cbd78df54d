"""results.json of a reproduction, built from the files its stages wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from lmcal.stages.registry import STAGES
from lmcal.utils import records
from lmcal.utils.numbers import exp_or_inf
from lmcal.utils.records import Each, Maybe, Of, problem, unsound

PAPER_STAGES = ("entropy_rate", "calibration", "decoders")  # the full model's stages every report has

NUM = (int, float, type(None))  # a number, or null where strict JSON wrote a non-finite one beside its reason
CURVE, ERRORS = Of(float, 1), Of(Maybe(float), 1)  # a curve (one value a step), its standard errors (null: unknown)
_CAL_SCALARS = ("alpha", "alpha_stderr", "test_ppl_before", "test_ppl_after", "entrate_ppl_before",
                "entrate_ppl_after", "topk", "tail_samples", "min_context", "fit_tokens", "test_tokens", "tail_steps",
                "tail_ppl_before", "tail_ppl_after", "tail_diff_nats", "tail_diff_stderr_nats")
_CAL_LISTS = ("curve_nats", "stderr_nats", "curve_nats_before", "stderr_nats_before", "diff_curve_nats",
              "diff_stderr_nats")
_MEMORY = ("ce_limited_nats", "mi_upper_bound_nats", "mi_stderr_nats", "alpha", "alpha_stderr",
           "entropy_calibrated_nats", "mi_upper_bound_crossfit_nats", "delta_ce_nats", "delta_ce_stderr_nats",
           "test_tokens", "cluster_size", "ce_full_nats", "ce_full_stderr_nats", "exact_mi_nats")
# What the report reads from each file a stage writes, with its type: a file that lacks one of these keys, or holds
# another type, is not whole, and its stage runs again (lmcal.pipeline.schedule.finished_file).
NEEDS: dict[str, dict[str, tuple | type]] = {
    "metrics.json": {"model": str, "val_ppl": NUM, "test_ppl": NUM, "test_ce_nats": NUM, "epochs": int,
                     "params": int, "markov_order": NUM, "true_entropy_rate_nats": NUM},
    "entropy_rate.json": {"horizon": int, "num_generations": int, "curve_nats": CURVE, "stderr_nats": ERRORS,
                          "entrate_ppl": NUM, "test_ppl": NUM},
    "calibration.json": {**dict.fromkeys(_CAL_SCALARS, NUM),
                         **{k: ERRORS if "stderr" in k else CURVE for k in _CAL_LISTS}},
    "decoders.json": {"rows": Of(dict, 1)},
    "memory.json": {"tau": int, "limited": str, "two_parameter": object, **dict.fromkeys(_MEMORY, NUM)},
}
DECODER_ROW = ("method", "params", "entrate_ppl", "test_ce_nats", "zero_prob_fraction", "test_ce_kept_nats",
               "test_ce_mixed_nats", "entropy_t1_nats", "entropy_last_nats", "tail_diff_nats", "tail_diff_stderr_nats",
               "curve_nats")


def not_whole(path: Path, r: dict) -> str | None:
    """Why the result `r`, read from `path`, lacks what its readers need (a key, or a key's type), or None. An
    evaluation.json in a stage's folder must hold that stage's results. Any record: nothing nested deeper, no number
    other than finite ones (lmcal.utils.records.unsound)."""
    if why := unsound(r):
        return why
    needs = NEEDS.get(path.name, {})
    missing = [k for k in needs if k not in r]
    wrong = [why for k, t in needs.items() if k in r and (why := problem(r[k], t, k))]
    if path.name == "decoders.json" and isinstance(r.get("rows"), list):
        wrong += [f"row {i} lacks {', '.join(k for k in DECODER_ROW if k not in row)}" if isinstance(row, dict)
                  else f"row {i} is a {type(row).__name__}" for i, row in enumerate(r["rows"])
                  if not isinstance(row, dict) or any(k not in row for k in DECODER_ROW)]
    stage = path.parent.name
    if path.name == "evaluation.json" and stage in STAGES and not isinstance(r.get(stage), dict):
        missing.append(stage)
    if not missing and not wrong:
        return None
    return "; ".join(([f"it lacks {', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}"] if missing else [])
                     + wrong[:3])



# a stage's record (lmcal.utils.records's spec)
RECORD = {"status": str, "settings": dict, "dir?": str, "cmd?": Maybe(list), "seconds?": float,
          "started_at?": Maybe((float, str)), "finished_at?": Maybe((float, str)), "matmul_gflop_per_s?": NUM}


def stage_record(path: Path, warn: bool = True) -> dict | None:
    """A stage's record (<out>/stages/<stage>.json), or None when there is none or it is not whole (it does not
    parse, nests too deeply, holds NaN, lacks its status or settings, or holds a key of another type: "not done",
    with a warning naming it where `warn`)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        r, why = records.load(path, dict)
    except OSError as e:
        r, why = None, " ".join(str(e).split())[:120]
    kind = "does not parse"
    if why is None and (why := problem(r, RECORD)):
        kind = "is not whole"
    if why is None:
        return r
    if warn:
        print(f"warning: {path} {kind} ({why}); taking its stage as not done, so it runs again.", file=sys.stderr,
              flush=True)
    return None


def read_result(path: Path, spec=None):
    """A stage's result file, whole (its NEEDS, or `spec`, and lmcal.utils.records's check); one paragraph naming
    the file and the key otherwise."""
    return records.read(path, spec or NEEDS.get(Path(path).name, dict), "a whole stage result",
                        "Delete it and rerun the reproduction (make reproduce runs that stage again); nothing was "
                        "written.")


def read_json(path: Path):
    """A result under a reproduction's folder: an evaluation.json holding its stage's results, or any other."""
    path = Path(path)
    stage = path.parent.name
    spec = {stage: dict} if path.name == "evaluation.json" and stage in STAGES else None
    return read_result(path, spec)


def _memory_rows(root: Path, taus, windows: bool) -> list[dict]:
    """Each tau's memory.json under root/memory: the trained tau-model's, then the window's where asked."""
    return [read_json(root / "memory" / f"{kind}tau_{t}" / "memory.json") for t in taus
            for kind in ("", "window_")[:1 + bool(windows)]]


def memory_row(m: dict) -> dict:
    """results.json's row of one memory.json: MEMORY_KEYS, and the outcome of a fit without a finite minimum."""
    return {k: m[k] for k in MEMORY_KEYS} | _present(m, *NO_MINIMUM_KEYS)


def tail_ppl(curve: list[float]) -> float:
    """exp of the mean entropy over the last tenth of the horizon (REPORT.md's last column of Table 1)."""
    return exp_or_inf(sum(curve[-max(1, len(curve) // 10):]) / max(1, len(curve) // 10))


CALIBRATION_KEYS = ("alpha", "alpha_stderr", "test_ppl_before", "test_ppl_after", "curve_nats", "stderr_nats",
                    "curve_nats_before", "stderr_nats_before", "entrate_ppl_before", "entrate_ppl_after", "topk",
                    "tail_samples", "min_context", "fit_tokens", "test_tokens", "tail_steps", "tail_ppl_before",
                    "tail_ppl_after", "tail_diff_nats", "tail_diff_stderr_nats", "diff_curve_nats", "diff_stderr_nats")
DECODER_KEYS = ("method", "params", "entrate_ppl", "test_ce_nats", "zero_prob_fraction", "test_ce_kept_nats",
                "test_ce_mixed_nats", "entropy_t1_nats", "entropy_last_nats", "tail_diff_nats", "tail_diff_stderr_nats")
MEMORY_KEYS = ("model", "tau", "ce_limited_nats", "mi_upper_bound_nats", "mi_stderr_nats", "alpha", "alpha_stderr",
               "entropy_calibrated_nats", "limited", "mi_upper_bound_crossfit_nats", "delta_ce_nats",
               "delta_ce_stderr_nats", "two_parameter", "test_tokens", "cluster_size")
MARKOV_MEMORY_KEYS = ("tau", "mi_upper_bound_nats", "mi_stderr_nats", "exact_mi_nats", "alpha", "limited",
                      "mi_upper_bound_crossfit_nats", "delta_ce_nats", "two_parameter")
# a memory row's fit without a finite minimum (lmcal.core.memory_summary): kept where the row has them, so the report
# shows the outcome in place of a bound
NO_MINIMUM_KEYS = ("no_finite_minimum", "alpha_bound", "at_alpha_bound", "two_parameter_no_minimum")


def _table1_results(cfg: DictConfig, base: dict, er: dict) -> dict:
    return {"base": {k: base[k] for k in ("val_ppl", "test_ppl", "test_ce_nats", "model", "epochs", "params")},
            "entropy_rate": {k: er[k] for k in ("horizon", "num_generations", "curve_nats", "stderr_nats",
                                                "entrate_ppl", "test_ppl")}
            | {"entrate_tail_ppl": tail_ppl(er["curve_nats"])}
            | _present(er, "num_prefixes", "samples_per_prefix", "prefix_len", "seed", "tail_nats",
                       "tail_stderr_nats")}


def _calibration_results(ptb: Path, cal: dict, dec: dict) -> dict:
    return {"calibration": {k: cal[k] for k in CALIBRATION_KEYS}
            | {"entrate_tail_ppl_before": tail_ppl(cal["curve_nats_before"]),
               "entrate_tail_ppl_after": tail_ppl(cal["curve_nats"])}
            | _present(cal, *SETTINGS, "epsilon", "tail_nats_before", "tail_stderr_nats_before", "tail_nats",
                       "tail_stderr_nats", "mass_outside_topk", "true_word_outside_topk", "coverage_positions",
                       "cover", "cover_max", "rule", "candidates_mean", "approximation")
            | calibration_dose(cal, dose_row_files(ptb / "calibration")),
            "decoders": [{k: r[k] for k in DECODER_KEYS} | {"entrate_tail_ppl": tail_ppl(r["curve_nats"])}
                         | _present(r, "tail_nats", "tail_stderr_nats") for r in dec["rows"]],
            "decoders_setup": _present(dec, *SETTINGS, "fit_tokens", "test_tokens", "calibration_reused")}


def _markov_results(cfg: DictConfig, mk: Path) -> dict:
    mbase = read_json(mk / "base" / "metrics.json")
    mmem = _memory_rows(mk, cfg.markov.taus, cfg.markov.get("windows", False))
    return {"order": mbase["markov_order"], "true_entropy_rate_nats": mbase["true_entropy_rate_nats"],
            "estimated_entropy_rate_nats": mmem[0]["ce_full_nats"],
            "estimated_entropy_rate_stderr_nats": mmem[0]["ce_full_stderr_nats"],
            "test_ce_nats": mbase["test_ce_nats"],
            "memory": [{k: m[k] for k in MARKOV_MEMORY_KEYS} | _present(m, "ce_limited_nats", *NO_MINIMUM_KEYS)
                       for m in mmem],
            "oracle": markov_oracle(cfg, mk)}


def _stage_times(out: Path, names: list[str]) -> dict:
    records = {n: stage_record(out / "stages" / f"{n}.json", warn=False) for n in names}
    return {name: {k: r[k] for k in ("seconds", "status", "started_at", "finished_at") if k in r}
            | (stage_profile(Path(r["dir"])) if "dir" in r else {})
            | ({"matmul_gflop_per_s": r["matmul_gflop_per_s"]} if r.get("matmul_gflop_per_s") else {})
            for name, r in records.items() if r is not None and r.get("status") == "done"}


def collect_results(cfg: DictConfig, out: Path, names: list[str]) -> dict:
    """results.json: the numbers of every stage, from the files the stages wrote."""
    ptb = out / cfg.dataset
    base = read_json(ptb / "base" / "metrics.json")
    er = read_json(ptb / "entropy_rate" / "entropy_rate.json")
    mem = [m | {"model": "awd_lstm"} for m in _memory_rows(ptb, cfg.taus, cfg.get("windows", False))]
    tr = transformer_results(cfg, out / "transformer")
    mem += tr.pop("memory", [])
    return {
        "profile": cfg.profile, "dataset": cfg.dataset, **_table1_results(cfg, base, er),
        **_calibration_results(ptb, read_json(ptb / "calibration" / "calibration.json"),
                               read_json(ptb / "decoders" / "decoders.json")),
        "table1": [{"model": base["model"], "corpus": cfg.dataset, "test_ppl": er["test_ppl"],
                    "entrate_ppl": er["entrate_ppl"], "horizon": er["horizon"], "unit": er.get("unit", "word")},
                   *tr.pop("table1", [])],
        "memory": [memory_row(m) for m in mem],
        **({"transformer": tr} if tr else {}),
        "markov": _markov_results(cfg, out / "markov"),
        **{n: _unwrap(n, STAGES[n].summary(read_json(ptb / n / "evaluation.json")[n]))
           for n in cfg.stages if n not in PAPER_STAGES},
        **_chosen_rows(cfg, ptb),
        "stages": _stage_times(out, names),
    }


SETTINGS = ("num_prefixes", "samples_per_prefix", "prefix_len", "horizon", "seed")  # a generation stage's setup


DOSE_ROWS = {"rows": Of(dict), "device?": str, "rules?": Of(str, 1), "own_fit?": Maybe(dict)}


def dose_row_files(folder: Path) -> list[tuple[Path, dict]]:
    """The rows other runs added beside a calibration stage's JSON: each dose_rows_*.json in its folder, by name."""
    return [(p, read_result(p, DOSE_ROWS)) for p in sorted(folder.glob("dose_rows_*.json"))]


def calibration_dose(cal: dict, found: list[tuple[Path, dict]]) -> dict:
    """The calibration stage's dose-response without its per-generation numbers, with the rows other runs added
    beside it (`found`: dose_row_files of its folder, e.g. exact lookahead on a GPU) as extra_rows, each marked with
    its device."""
    dr = cal.get("dose_response")
    if not dr:
        return {}
    drop = ("tail_nats_per_generation", "plain_tail_nats_per_generation")
    files = [f for _, f in found]
    extra = [{k: v for k, v in row.items() if k not in drop} | {"device": f.get("device", "another run")}
             for f in files for row in f["rows"]]
    fits = [{"rule": f["rules"][0], "device": f.get("device", "another run"), **f["own_fit"]} for f in files
            if f.get("own_fit") and f.get("rules")]  # a rule's own alpha*, fitted there on the stage's fit text
    return {"dose_response": {k: v for k, v in dr.items() if k not in drop}
            | {"rows": [{k: v for k, v in r.items() if k not in drop} for r in dr["rows"]], "extra_rows": extra,
               "extra_fits": fits}}


def _present(d: dict, *keys: str) -> dict:
    """The keys of d among `keys` that it has (a stage's file from before a key existed lacks it)."""
    return {k: d[k] for k in keys if k in d}


def _chosen_rows(cfg: DictConfig, ptb: Path) -> dict:
    """The rows chosen on one seed and measured again on the next (future_entropy's best head, sequence_calibration's
    goal row), so that results.json alone supports the claims REPORT.md makes of them (docs/RESULTS.md)."""
    out = {}
    for stage, key, name in (("future_entropy", "best_head", "future_entropy_best_head"),
                             ("sequence_calibration", "goal", "sequence_calibration_goal"),
                             ("sequence_calibration", "twisted_check", "sequence_calibration_twisted_check")):
        if stage in cfg.stages:
            chosen = read_json(ptb / stage / "evaluation.json")[stage].get(key)
            if chosen:
                out[name] = chosen
    return out


def _unwrap(name: str, summary: dict):
    """A stage's summary under its own name: the value itself where the summary is that one key (future_entropy's
    rows), else the summary."""
    return summary[name] if set(summary) == {name} else summary


def transformer_results(cfg: DictConfig, root: Path) -> dict:
    """The transformer part of a reproduction (profile key `transformer`): its training metrics, Table 1 row, the
    summaries of its stages, and its memory rows ("model": "transformer"); {} when the profile has none."""
    tr = cfg.get("transformer")
    if not tr:
        return {}
    base = read_json(root / "base" / "metrics.json")
    # training speed lives with the stage's wall time (results.json "stages"); the folder is relative to the run
    out = {"base": {k: base.get(k) for k in ("model", "val_ppl", "test_ppl", "test_ce_nats", "epochs", "params")}
           | {"hf_folder": str((root / "base" / "hf").relative_to(root.parent))}}
    evals = {n: read_json(root / n / "evaluation.json")[n] for n in STAGES if n in tr.stages}
    for n, r in evals.items():
        out[n] = STAGES[n].summary(r)
    if "entropy_rate" in evals:
        er = evals["entropy_rate"]
        out["entropy_rate"] |= {"horizon": er["horizon"], "num_generations": er["num_generations"],
                                "curve_nats": er["curve_nats"], "stderr_nats": er["stderr_nats"],
                                "test_ppl": er["test_ppl"]}
        out["table1"] = [{"model": "Transformer (ours, PTB)", "corpus": cfg.dataset, "test_ppl": er["test_ppl"],
                          "entrate_ppl": er["entrate_ppl"], "horizon": er["horizon"], "unit": er["unit"]}]
    out["memory"] = [read_json(root / "memory" / f"window_tau_{t}" / "memory.json") | {"model": "transformer"}
                     for t in tr.window_taus]
    return out


# a stage's result with its time profile (lmcal.utils.profiling): what stage_profile reads
PROFILED = {"profile": {"seconds": float, "spans": Each({"seconds": float, "gflop?": float})}}
OPERATIONS = ("forward", "select", "lookahead", "sampling", "entropy", "scoring", "fit", "io")


def stage_profile(folder: Path) -> dict:
    """{"profile": seconds per operation, "forward_gflop"} of the analysis stage whose run folder is `folder` (from
    its evaluation.json; lmcal.utils.profiling), a training stage's {"tokens_per_s", "train_seconds"}, or {}."""
    from lmcal.utils.profiling import by_operation

    if not (folder / "evaluation.json").is_file():
        if not (folder / "metrics.json").is_file():
            return {}
        m = read_result(folder / "metrics.json", {"tokens_per_s?": NUM, "train_seconds?": NUM})
        return {k: m[k] for k in ("tokens_per_s", "train_seconds") if m.get(k) is not None}  # a training stage
    ev = read_result(folder / "evaluation.json", dict)
    for k, v in ev.items():  # (a stage's result with a profile: the profile whole)
        if isinstance(v, dict) and "profile" in v:
            records.check({k: v}, {k: PROFILED}, folder / "evaluation.json", "a whole stage result")
    prof = next((v["profile"] for v in ev.values() if isinstance(v, dict) and "profile" in v), None)
    if not prof:
        return {}
    ops = by_operation(prof["spans"])
    shown = {k: ops.get(k, 0.0) for k in OPERATIONS}
    shown["other"] = max(0.0, prof["seconds"] - sum(shown.values()))
    gflop = sum(v.get("gflop", 0.0) for p, v in prof["spans"].items() if p.rsplit("/", 1)[-1] == "forward")
    return {"profile": shown, "analysis_seconds": prof["seconds"], "forward_gflop": gflop}


def markov_oracle(cfg: DictConfig, mk: Path) -> dict:
    """The same estimators on the Markov source's exact oracles (same corpus and test text as the trained models)."""
    from lmcal.core.memory_summary import markov_oracle_memory
    from lmcal.models.checkpoint import checkpoint_data, read_checkpoint

    dm = checkpoint_data(read_checkpoint(mk / "base" / "checkpoints" / "best.ckpt"))
    corpus = dm.prepare()
    return markov_oracle_memory(corpus.info, dm.tokens("valid"), dm.tokens("test"), list(cfg.markov.taus))
