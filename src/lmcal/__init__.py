"""lmcal: calibration, entropy rates and memory in language models (Braverman et al., ICML 2020).

What a user calls from Python is importable from here:

    from lmcal import LogitsStepLM, generation_entropy_curve, fit_lookahead_calibration, calibrated, memory_bound

Each name is loaded on first use (PEP 562), so `python -m lmcal.<entry point>` imports only what that entry point
needs. The layers underneath (lmcal.data, lmcal.models, lmcal.core, lmcal.stages, lmcal.reporting,
lmcal.pipeline) are described in the README's layout section.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    **dict.fromkeys(("StepLM", "LSTMStepLM", "LimitedContextStepLM", "LogitsStepLM", "as_step_lm"),
                    "lmcal.models.step_lm"),
    **dict.fromkeys(("HFCausalLM", "load_hf_model", "hf_cross_entropy"), "lmcal.models.hf"),
    **dict.fromkeys(("MarkovOracle", "DriftingOracle", "DelayedDriftOracle"), "lmcal.models.oracles"),
    **dict.fromkeys(("AWDLSTM",), "lmcal.models.awd_lstm"),
    **dict.fromkeys(("GPTLM",), "lmcal.models.transformer"),
    **dict.fromkeys(("load_net", "read_checkpoint", "register_network", "lstm_from_checkpoint"),
                    "lmcal.models.checkpoint"),
    **dict.fromkeys(("make_markov_chain", "markov_corpus", "markov_entropy_rate", "markov_conditional",
                     "markov_exact_mi", "sample_markov"), "lmcal.data.markov"),
    **dict.fromkeys(("load_corpus", "batchify"), "lmcal.data.batching"),
    **dict.fromkeys(("EntropyCurve", "generation_entropy_curve", "paired_tail_difference", "paired_difference_curve",
                     "entrate_ppl", "tail_steps"), "lmcal.core.entropy_rate"),
    **dict.fromkeys(("random_prefixes", "draw"), "lmcal.core.sampling"),
    **dict.fromkeys(("entropy", "mix_uniform", "lookahead_entropies"), "lmcal.core.lookahead"),
    **dict.fromkeys(("CalibrationFit", "CalibratedLM", "fit_lookahead_calibration", "calibrated", "fit_temperature",
                     "target_log_probs", "score"), "lmcal.core.calibration"),
    **dict.fromkeys(("Rule", "make_rule"), "lmcal.core.lookahead_law"),
    **dict.fromkeys(("fit_alpha", "fit_theta", "calibration_objective"), "lmcal.core.expfit"),
    **dict.fromkeys(("context_rows", "full_context_span"), "lmcal.core.context"),
    **dict.fromkeys(("MemoryBound", "memory_upper_bound", "calibrate_to_limited"), "lmcal.core.memory"),
    **dict.fromkeys(("memory_summary", "markov_oracle_memory"), "lmcal.core.memory_summary"),
    **dict.fromkeys(("memory_bound",), "lmcal.core.window_bound"),
    **dict.fromkeys(("FutureEntropyHead", "FutureCalibratedLM", "rollout_examples", "HeadTraining", "train_head",
                     "fit_rows", "head_rows", "fit_future_calibration"), "lmcal.core.future_entropy"),
    **dict.fromkeys(("make_decoder", "heldout_cost", "DECODERS"), "lmcal.core.decoders"),
    **dict.fromkeys(("SMCResult", "smc_generate", "smc_tail_entropy", "systematic_resample", "reweighted"),
                    "lmcal.core.smc"),
    **dict.fromkeys(("SequenceFit", "RootSearch", "fit_sequence_alpha", "sequence_log_probs", "reference_check"),
                    "lmcal.core.sequence_fit"),
    **dict.fromkeys(("train_soft_value", "soft_value_lm", "soft_value_twist", "SoftValueTraining", "TwistAtAlpha"),
                    "lmcal.core.soft_value"),
    **dict.fromkeys(("FiniteStateLM", "finite_state_lm", "calibrated_log_law", "sequence_ce",
                     "exact_alpha", "perron_limit", "exact_twist"), "lmcal.core.sequence_exact"),
    **dict.fromkeys(("LmcalError", "DataError"), "lmcal.errors"),
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'lmcal' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
