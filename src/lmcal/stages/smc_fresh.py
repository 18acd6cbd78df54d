"""A finished sequence_calibration run's twisted check (its twisted row with the fewest particles, at the run's α*)
measured again on more fresh prefixes, part by part: bench/sequence_fresh.py.

The stage measures that row on `goal_prefixes` fresh prefixes once; whether its level is within 10% of the test
perplexity can need thousands more (lmcal.reporting.claims.units_to_decide). Here each part is a range [lo, hi) of the
stage's own fresh draw (random_prefixes at seed + 11, whose order does not depend on the count), generated at the
stage's seed + 1 with every row's draws keyed by its index in that draw (smc_generate's first_id): parts give what one
call over all of them gives, and [0, goal_prefixes) gives the stage's own number. The law is the run's: its α*, its
law horizon, its nested runs, twisted by its own soft-value heads, trained again from the run's settings (a pure
function of them on one device) or read from a file written here, and shown to be the run's by their own α refit,
which must equal the run's to 1e-5 relative (1e-4 for a file's, refitted on another device).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lmcal.core.calibration import target_log_probs
from lmcal.core.sampling import random_prefixes
from lmcal.core.soft_value import new_head, soft_value_twist
from lmcal.data.batching import batchify
from lmcal.errors import LmcalError
from lmcal.stages.smc_study import fresh_tails, study_row_of
from lmcal.stages.sv_heads import refit_alpha, train_heads

HEADS_FORMAT = 1
NEEDED = ("sv_alpha", "sv_rollouts", "sv_prefix", "sv_steps", "sv_iterations", "sv_backup_steps", "sv_explore",
          "sv_refits", "hidden", "rank", "epochs", "batch_size", "lr", "fit_tokens", "fit_streams", "score_tokens",
          "score_streams", "max_batch")


def fresh_setup(result: dict, config: dict, where: str = "the run") -> dict:
    """What measuring a finished run's twisted check again needs, from its sequence_calibration.json (`result`) and
    its evaluation.json's config.analysis.sequence_calibration (`config`), each value checked to be a number of the
    right kind: never a path or code. LmcalError, one paragraph, where the run cannot be measured again."""
    c = result.get("twisted_check") if isinstance(result, dict) else None
    if not isinstance(c, dict) or c.get("method") != "smc" or not isinstance(result.get("soft_value_alpha"), dict):
        raise LmcalError(f"{where} has no twisted check to measure again (a sequence_calibration run with twisted SMC "
                         "rows and soft-value heads writes one): nothing was run.")
    missing = [k for k in NEEDED if not isinstance(config, dict) or k not in config]
    if missing:
        raise LmcalError(f"{where}'s evaluation.json does not hold the stage's settings (config.analysis."
                         f"sequence_calibration: {', '.join(missing)} missing): nothing was run.")
    ints = ("sv_rollouts", "sv_prefix", "sv_steps", "sv_iterations", "sv_backup_steps", "sv_refits", "hidden", "rank",
            "epochs", "batch_size", "fit_tokens", "fit_streams", "score_streams", "max_batch")
    out = {k: config[k] for k in NEEDED}
    out |= {k: result.get(k) for k in ("seed", "prefix_len", "samples_per_prefix", "horizon", "law_horizon",
                                       "tail_steps", "num_prefixes", "goal_prefixes", "reference_test_ce_nats")}
    out |= {"tail_particles": result.get("tail_particles"), "particles": c["params"].get("particles"),
            "alpha": c["params"].get("alpha"), "label": c.get("label"), "check": c,
            "heads_alpha": result["soft_value_alpha"].get("alpha"),
            "sv_trained_at": _first_trained_at(result), "alpha_stderr": c["params"].get("alpha_stderr"),
            "fit_settled": _fit_settled(result, c), "converge_tol": result.get("converge_tol")}
    bad = [k for k in (*ints, "seed", "prefix_len", "samples_per_prefix", "horizon", "law_horizon", "tail_steps",
                       "num_prefixes", "particles") if not (isinstance(out[k], int) and not isinstance(out[k], bool))]
    bad += [k for k in ("alpha", "heads_alpha", "reference_test_ce_nats", "sv_explore", "lr", "sv_trained_at")
            if not (isinstance(out[k], (int, float)) and not isinstance(out[k], bool) and math.isfinite(out[k]))]
    bad += [k for k in ("score_tokens", "tail_particles", "goal_prefixes")
            if out[k] is not None and not (isinstance(out[k], int) and not isinstance(out[k], bool))]
    bad += [k for k in ("alpha_stderr", "converge_tol") if out[k] is not None and not (
        isinstance(out[k], (int, float)) and not isinstance(out[k], bool) and math.isfinite(out[k]))]
    if bad:
        raise LmcalError(f"{where}: {', '.join(bad)} in its result or settings are not what a sequence_calibration "
                         "run writes (numbers of the right kind): nothing was run.")
    return out


def _first_trained_at(result: dict):
    """The α the run's heads were first trained at: its sv_alpha, else (null: the untwisted rows' α*) as its soft-value
    row records it."""
    sv = next((r for r in result.get("rows") or [] if isinstance(r, dict) and r.get("method") == "soft_value"), {})
    refits = sv.get("refits") if isinstance(sv.get("refits"), list) else []
    first = refits[0].get("trained_at_alpha") if refits and isinstance(refits[0], dict) else None
    return result.get("sv_alpha") if result.get("sv_alpha") is not None else first


def _fit_settled(result: dict, c: dict) -> bool | None:
    """Whether the fit of the check's study row (its twisted row of the same params) found its own root; None where
    the run has no such row."""
    rows = [r for r in result.get("rows") or [] if isinstance(r, dict) and {"method", "params", "variant"} <= r.keys()]
    row = study_row_of(c, rows)
    fit = row.get("fit") if row else None
    return fit.get("settled") is True if isinstance(fit, dict) else None


def check_model(lm, test_tokens: torch.Tensor, s: dict) -> float:
    """The model's test CE as the stage scored it; LmcalError unless it is the run's to 1e-5 relative (another model
    or corpus differs in the second digit, another device in the seventh)."""
    test = batchify(test_tokens[:s["score_tokens"]] if s["score_tokens"] else test_tokens, s["score_streams"])
    ce = -target_log_probs(lm, test).double().mean().item()
    if not math.isclose(ce, s["reference_test_ce_nats"], rel_tol=1e-5):
        raise LmcalError(f"this model's test CE is {ce:.6f} nats, the run's {s['reference_test_ce_nats']:.6f}: another "
                         "model or corpus than the run's. Nothing was measured.")
    return ce


def heads_of(lm, train_tokens, valid_tokens, s: dict, heads: dict | None = None):
    """The run's soft-value heads: read from `heads` (the dict this returns third, saved and read back with
    weights_only=True) or trained again from its settings; their own α refit checked against the run's. Returns
    (head, their α, the file's dict to save)."""
    if heads is None:
        head, sv, _, _ = train_heads(lm, train_tokens, valid_tokens, s["sv_trained_at"], **{
            k: s[k] for k in ("sv_rollouts", "sv_prefix", "sv_steps", "sv_iterations", "sv_backup_steps",
                              "sv_explore", "sv_refits", "hidden", "rank", "epochs", "batch_size", "lr", "fit_tokens",
                              "fit_streams", "prefix_len", "seed", "max_batch")})
        alpha = sv.alpha
    else:
        head = _head_from(lm, heads, s)
        alpha = refit_alpha(lm, head, valid_tokens, s["fit_tokens"], s["fit_streams"], s["prefix_len"]).alpha
    # trained again, they must be the run's to the last digits (another device's training differs far more); read from
    # a file, the weights are the run's and only the refit's rounding may differ between devices
    if not math.isclose(alpha, s["heads_alpha"], rel_tol=1e-5 if heads is None else 1e-4):
        how = "read from the heads file" if heads is not None else "trained again here"
        raise LmcalError(f"the soft-value heads {how} refit their α to {alpha:.8f}, the run's to {s['heads_alpha']:.8f}"
                         ": they are not the run's heads (another device or build trains others; bring the heads "
                         "file written where the run's heads were trained again, with --heads). Nothing was measured.")
    state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    return head, alpha, {"format": HEADS_FORMAT, "hidden": s["hidden"], "rank": s["rank"], "alpha": alpha,
                         "in_dim": head.trunk[0].in_features, "state_dict": state}


def _head_from(lm, heads: dict, s: dict):
    """A head built as the run's and given the file's weights, or LmcalError: a file of another format, settings or
    model."""
    ok = (isinstance(heads, dict) and heads.get("format") == HEADS_FORMAT and isinstance(heads.get("state_dict"), dict)
          and all(isinstance(v, torch.Tensor) for v in heads["state_dict"].values())
          and isinstance(heads.get("in_dim"), int) and (heads.get("hidden"), heads.get("rank")) == (s["hidden"],
                                                                                                    s["rank"]))
    if not ok:
        raise LmcalError("the heads file is not one bench/sequence_fresh.py wrote for this run's settings (format "
                         f"{HEADS_FORMAT}, hidden {s['hidden']}, rank {s['rank']}): nothing was measured.")
    head = new_head(lm, heads["in_dim"], hidden=s["hidden"], rank=s["rank"], seed=s["seed"])
    try:
        head.load_state_dict(heads["state_dict"], strict=True)
    except RuntimeError as e:
        raise LmcalError(f"the heads file does not fit this model's heads ({str(e).splitlines()[0]}): another model's "
                         "heads. Nothing was measured.") from None
    return head.to(getattr(lm, "device", None) or "cpu").eval()


def measure_part(lm, head, valid_tokens, s: dict, lo: int, hi: int, max_batch: int) -> np.ndarray:
    """The twisted check's last tenth [hi - lo, S] on the fresh prefixes [lo, hi) of the stage's draw, at its seed + 1
    (each row keyed by its index in the draw: any split of [0, n) gives one call's numbers)."""
    fresh = random_prefixes(valid_tokens, hi, s["prefix_len"], seed=s["seed"] + 11)[lo:hi]  # [hi - lo, P]
    return fresh_tails(lm, fresh, s["particles"], soft_value_twist(lm, head), s["alpha"], s["seed"] + 1,
                       samples_per_prefix=s["samples_per_prefix"], horizon=s["horizon"], law_horizon=s["law_horizon"],
                       last=s["tail_steps"], tail_particles=s["tail_particles"], max_batch=max_batch, first=lo)
