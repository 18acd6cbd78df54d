"""The per-run record of entropy miscalibration against scale, `scale.json`, beside a run's metrics: what the model is
(parameters, training tokens), its test cross-entropy, its generations' entropy curve and last tenth, the gap
between them with standard errors, and the fitted temperature's and lookahead calibration's paired effects with the
test cross-entropy of each. It is read off the results of the entropy_rate, calibration and decoders stages (run by
the registry, lmcal.stages.run_stages), never recomputed: `python -m lmcal.train` (analysis.stages=[entropy_rate,
...]) and `python -m lmcal.evaluate stages=[entropy_rate,...]` write it whenever entropy_rate ran, and
`python -m lmcal.report` fits the power law across the records it finds (lmcal.reporting.scale_report).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from lmcal.core.scaling import gap, stream_ce
from lmcal.stages.wandb_run import wandb_group
from lmcal.utils import records
from lmcal.utils.io import write_json_atomic
from lmcal.utils.numbers import exp_or_inf
from lmcal.utils.records import Maybe, Range

log = logging.getLogger("lmcal")

RECORD = "scale.json"
METRICS = {"train_tokens?": Maybe(Range(0, integer=True)), "epochs?": Maybe(Range(0, integer=True))}  # what it reads
EFFECT_KEYS = ("tail_diff_nats", "tail_diff_stderr_nats", "test_ce_nats")


def effects(stages: dict) -> dict:
    """The fitted temperature's and calibration's paired effects on the last tenth (against the plain model, the same
    prefixes and uniforms) and the test CE of each and of the plain model on the same scored test tokens: from the
    decoders stage's rows where it ran, else calibration's own (no temperature)."""
    out = {}
    dec, cal = stages.get("decoders"), stages.get("calibration")
    rows = {r["method"]: r for r in (dec or {}).get("rows", [])}
    if "model" in rows:
        out["model"] = {"test_ce_nats": rows["model"]["test_ce_nats"]}
    if "fitted_temperature" in rows:
        r = rows["fitted_temperature"]
        out["fitted_temperature"] = {**{k: r[k] for k in EFFECT_KEYS}, "temperature": r["params"]["temperature"],
                                     "temperature_stderr": r["params"].get("temperature_stderr")}
    if "calibration" in rows:
        r = rows["calibration"]
        out["calibration"] = {**{k: r[k] for k in EFFECT_KEYS}, "alpha": r["params"]["alpha"],
                              "alpha_stderr": r["params"].get("alpha_stderr")}
    elif cal:
        out.setdefault("model", {"test_ce_nats": cal["test_ce_before_nats"]})
        out["calibration"] = {"tail_diff_nats": cal["tail_diff_nats"],
                              "tail_diff_stderr_nats": cal["tail_diff_stderr_nats"],
                              "test_ce_nats": cal["test_ce_after_nats"], "alpha": cal["alpha"],
                              "alpha_stderr": cal["alpha_stderr"]}
    if out and (dec or cal):
        src = dec or cal
        out["settings"] = {k: src.get(k) for k in ("num_prefixes", "samples_per_prefix", "horizon", "test_tokens")
                           if src.get(k) is not None}
    return out


def scale_record(stages: dict, *, model: str, family: str, corpus: str, params: int | None,
                 train_tokens: int | None, test_ce: float, test_ce_stderr: float | None = None, unit: str = "word",
                 **extra) -> dict:
    """The record of one run from its stage results {stage: result} (entropy_rate required). `extra` adds what the
    entry point knows (data_tokens, epochs, tail_exponent, true_entropy_rate_nats, wandb_group, ...)."""
    er = stages["entropy_rate"]
    per_gen = np.asarray(er["tail_nats_per_generation"], dtype=np.float64)  # [N, S]
    per_prefix = per_gen.mean(axis=1)  # [N]: a prefix's generations are one cluster
    g = gap(per_prefix, test_ce, test_ce_stderr)
    return {"model": model, "family": family, "corpus": corpus, "unit": unit, "params": params,
            "train_tokens": train_tokens, **extra,
            "test_ce_nats": test_ce, "test_ce_stderr_nats": test_ce_stderr, "test_ppl": exp_or_inf(test_ce),
            **g, "tail_ppl": exp_or_inf(g["tail_nats"]), "tail_nats_per_prefix": per_prefix.tolist(),
            "curve_nats": er["curve_nats"], "stderr_nats": er["stderr_nats"], "horizon": er["horizon"],
            "num_prefixes": er["num_prefixes"], "samples_per_prefix": er["samples_per_prefix"],
            "prefix_len": er["prefix_len"], "seed": er["seed"], "effects": effects(stages)}


def ce_stderr(lm, test_tokens, context: int | None, max_tokens: int | None = None) -> tuple[float, int]:
    """The standard error of a model's test cross-entropy (nats), from blocks of 100 consecutive tokens of one more
    pass over the test text (its first `max_tokens`), read as streams of at most 1,000 tokens (or the model's
    context), and the tokens that pass scored."""
    tokens = test_tokens[:max_tokens] if max_tokens else test_tokens
    _, se, n = stream_ce(lm, tokens, max_len=min(context or 1000, 1000))
    return se, n


def write_scale_record(out_dir: str | Path, stages: dict, **kw) -> dict | None:
    """`scale.json` in out_dir when the entropy_rate stage ran (else nothing); returns the record."""
    if not stages.get("entropy_rate") or "tail_nats_per_generation" not in stages["entropy_rate"]:
        return None
    rec = scale_record(stages, **kw)
    write_json_atomic(Path(out_dir) / RECORD, rec)
    eff = rec["effects"]
    said = "; ".join(f"{k.replace('_', ' ')} {v['tail_diff_nats']:+.3f} ± {v['tail_diff_stderr_nats']:.3f} nats"
                     for k, v in eff.items() if isinstance(v, dict) and "tail_diff_nats" in v)
    se = rec["gap_stderr_nats"]
    log.info(f"scale: {rec['model']}, {rec['params'] or '?'} parameters, {rec['train_tokens'] or '?'} training "
             f"tokens: gap {rec['gap_nats']:+.4f} ± {se if math.isfinite(se) else float('nan'):.4f} nats (last tenth "
             f"{rec['tail_nats']:.4f}, test CE {rec['test_ce_nats']:.4f})" + (f"; {said}" if said else "")
             + f"; {Path(out_dir) / RECORD}")
    return rec


def family_of(model_name: str) -> str:
    """A trained network's family from its name ('AWD-LSTM 200/400/3': AWD-LSTM; 'Transformer 4x256, ...')."""
    return str(model_name).split(" ")[0]


def corpus_info(info: dict) -> dict:
    """What a generated corpus's `info` adds to its runs' records: its exact entropy rate and tail exponent."""
    return {k: info[k] for k in ("tail_exponent",) if k in info} | (
        {"true_entropy_rate_nats": info["entropy_rate_nats"]} if "entropy_rate_nats" in info else {})


def record_run(out_dir: str | Path, stages: dict, lm, test_tokens, logger=None, *, context: int | None = None,
               max_tokens: int | None = None, **kw) -> dict | None:
    """The entry points' one call: the standard error of the test cross-entropy (`ce_stderr`, one more pass over
    the test text) and `write_scale_record`, when the entropy_rate stage ran; the record's numbers also go to the
    W&B run's summary (scale/*)."""
    if not stages.get("entropy_rate"):
        return None
    se, n = ce_stderr(lm, test_tokens, context, max_tokens)
    rec = write_scale_record(out_dir, stages, test_ce_stderr=se, test_ce_stderr_tokens=n,
                             wandb_group=wandb_group(logger), **kw)
    if rec and logger:
        from lmcal.stages.wandb_run import wandb_log

        wandb_log(logger, summary={f"scale/{k}": rec[k] for k in ("params", "train_tokens", "test_ce_nats",
                                                                   "tail_nats", "gap_nats", "gap_stderr_nats")
                                   if isinstance(rec.get(k), (int, float))})
    return rec


def record_evaluation(out_dir: str | Path, cfg, target: dict, stages: dict, logger=None) -> dict | None:
    """`python -m lmcal.evaluate`'s record: a Hugging Face model's parameters read from the model, its training
    tokens from model.train_tokens (the user's figure; null: unknown); a checkpoint's from its network and from the
    metrics.json of the run that trained it (beside its checkpoints/), where there is one."""
    if not stages.get("entropy_rate"):
        return None
    lm, test_ce = target["lm"], stages["entropy_rate"]["test_ce_nats"]
    if target["kind"] == "hf":
        model = lm.model
        return record_run(out_dir, stages, target["lm"], target["test"], logger, context=lm.max_positions,
                          max_tokens=cfg.model.get("score_tokens"), model=target["name"],
                          family=str(getattr(model.config, "model_type", "hf")),
                          corpus=Path(target["results"]["valid_text"]).stem.split(".")[0], unit=target["unit"],
                          params=sum(p.numel() for p in model.parameters()),
                          train_tokens=cfg.model.get("train_tokens"), test_ce=test_ce,
                          name_or_path=str(cfg.model.name_or_path))
    net, ckpt = target["net"], Path(target["ckpt"])
    trained = ckpt.parent.parent / "metrics.json"
    m = records.read(trained, METRICS, "a training's metrics") if trained.is_file() else {}
    info = {}
    if target["corpus"] in ("markov", "powerlaw"):  # a generated source: its tail exponent and exact entropy rate
        from lmcal.models.checkpoint import checkpoint_data, read_checkpoint

        info = corpus_info(checkpoint_data(read_checkpoint(ckpt), None, ckpt).prepare().info)
    return record_run(out_dir, stages, target["lm"], target["test"], logger, context=getattr(net, "n_positions", None),
                      model=target["name"], family=family_of(target["name"]), corpus=target["corpus"],
                      params=sum(p.numel() for p in net.parameters()), train_tokens=m.get("train_tokens"),
                      test_ce=test_ce, data_tokens=int(target["train"].numel()) if "train" in target else None,
                      epochs=m.get("epochs"), ckpt=str(ckpt), **info)
