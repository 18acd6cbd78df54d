"""The valid range of every setting that has one, in one table, with no config library: `Range`, `RULES` (dotted key,
a `*` matching any one part -> (range, what the setting is)), `DECODER_RULES` (decoder -> {parameter: range}) and
the old names of renamed settings. lmcal.utils.validate applies them to a composed config; the decoders read
DECODER_RULES directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """A number in [lo, hi] (ends open where said), an integer if `integer`; None allowed if `optional`; or one of
    `choices`."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    optional: bool = False
    choices: tuple | None = None
    also: tuple = ()  # extra allowed values outside the range (-1 for "no limit")

    def ok(self, v) -> bool:
        if v is None:
            return self.optional or (self.choices is not None and None in self.choices)
        if self.choices is not None:
            return v in self.choices
        if v in self.also and not isinstance(v, bool):
            return True
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        if self.integer and int(v) != v:
            return False
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return self.hi is None or (v < self.hi or (not self.hi_open and v == self.hi))

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join("null" if c is None else str(c).lower() if isinstance(c, bool) else str(c)
                                         for c in self.choices)
        kind = "an integer" if self.integer else "a number"
        lo, hi = _number(self.lo), _number(self.hi)
        if self.lo is not None and self.hi is not None:
            text = f"{kind} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{kind} {'>' if self.lo_open else '≥'} {lo}"
        elif self.hi is not None:
            text = f"{kind} {'<' if self.hi_open else '≤'} {hi}"
        else:
            text = f"a finite {kind[2:] if kind.startswith('a ') else kind[3:]}"
        text += "".join(f", or {a}" for a in self.also)
        return ("null or " + text) if self.optional else text


def _number(x) -> str:
    """1, 0.5, 4,294,967,295 (an integer in full), 1e-06."""
    if x is None:
        return ""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) >= 1e4 else f"{x:g}"


COUNT = Range(lo=1, integer=True)             # 1, 2, 3, ...


OPT_COUNT = Range(lo=1, integer=True, optional=True)


SEED = Range(lo=0, hi=2**32 - 1, integer=True)  # numpy's and Lightning's seeds are 32-bit


NONNEG_INT = Range(lo=0, integer=True)


POSITIVE = Range(lo=0, lo_open=True)


NONNEG = Range(lo=0)


PROB_OPEN_HI = Range(lo=0, hi=1, hi_open=True)  # dropouts, epsilons: [0, 1)


BOOL = Range(choices=(True, False))  # true or false (a string such as "maybe" is refused)


RULES: dict[str, tuple[Range, str]] = {
    "seed": (SEED, "the run's random seed"),
    # data
    "data.batch_size": (COUNT, "token streams per training batch"),
    "data.eval_batch_size": (COUNT, "streams per validation batch"),
    "data.test_batch_size": (COUNT, "streams per test batch"),
    "data.bptt": (Range(lo=2, integer=True), "tokens per backpropagation window"),
    "data.max_train_tokens": (Range(lo=2, integer=True, optional=True), "training tokens kept (null: all)"),
    "data.max_eval_tokens": (Range(lo=2, integer=True, optional=True), "validation/test tokens kept (null: all)"),
    # the generated corpora (data=markov, data.name=synthetic)
    "data.corpus_kwargs.vocab_size": (Range(lo=2, integer=True), "the generated corpus's vocabulary"),
    "data.corpus_kwargs.order": (COUNT, "the Markov source's order"),
    "data.corpus_kwargs.support": (COUNT, "tokens that share each Markov row's mass"),
    "data.corpus_kwargs.smoothing": (Range(lo=0, hi=1, lo_open=True), "mass each Markov row spreads over all tokens"),
    "data.corpus_kwargs.n_train": (Range(lo=2, integer=True), "the generated corpus's training tokens"),
    "data.corpus_kwargs.n_valid": (Range(lo=2, integer=True), "the generated corpus's validation tokens"),
    "data.corpus_kwargs.n_test": (Range(lo=2, integer=True), "the generated corpus's test tokens"),
    "data.corpus_kwargs.seed": (SEED, "the generated corpus's seed"),
    "data.corpus_kwargs.tail_exponent": (Range(lo=0, hi=8, lo_open=True), "the power-law source's tail exponent s "
                                         "(p_r ~ r^-s; past 8 nearly all of each row's mass is on one word, and the "
                                         "source's stationary law does not converge)"),
    # model (AWD-LSTM; the Hugging Face adapter's own keys below)
    "model.emb_size": (COUNT, "embedding size"),
    "model.hidden_size": (COUNT, "LSTM hidden size"),
    "model.num_layers": (COUNT, "LSTM layers"),
    "model.dropout": (PROB_OPEN_HI, "output dropout"),
    "model.dropouth": (PROB_OPEN_HI, "dropout between layers"),
    "model.dropouti": (PROB_OPEN_HI, "input-embedding dropout"),
    "model.dropoute": (PROB_OPEN_HI, "embedding (word) dropout"),
    "model.wdrop": (PROB_OPEN_HI, "DropConnect on hidden-to-hidden weights"),
    "model.n_positions": (Range(lo=2, integer=True), "the transformer's context (learned positions)"),
    "model.n_embd": (COUNT, "the transformer's width"),
    "model.n_layer": (COUNT, "transformer blocks"),
    "model.n_head": (COUNT, "attention heads"),
    "model.attn_dropout": (PROB_OPEN_HI, "attention dropout"),
    "model.embd_dropout": (PROB_OPEN_HI, "embedding dropout"),
    "model.memory_tau": (OPT_COUNT, "the limited-memory model's state reset, in tokens (null: full context)"),
    "model.score_tokens": (OPT_COUNT, "test tokens of a Hugging Face model's test cross-entropy"),
    "model.context": (OPT_COUNT, "scoring window of a Hugging Face model"),
    "model.max_tokens": (OPT_COUNT, "tokens kept of each text"),
    "model.dtype": (Range(choices=(None, "float32", "bfloat16", "float16", "auto")), "a Hugging Face model's dtype"),
    "model.train_tokens": (Range(lo=1, optional=True), "tokens a Hugging Face model was trained on (null: unknown)"),
    # trainer
    "trainer.max_epochs": (Range(lo=1, integer=True, also=(-1,)), "training epochs (-1: until trainer.max_time)"),
    # optimisation
    "optim.lr": (POSITIVE, "learning rate"),
    "optim.weight_decay": (NONNEG, "weight decay"),
    "optim.clip": (Range(lo=0, optional=True), "gradient-norm clipping (0 or null: none)"),
    "optim.ar_weight": (NONNEG, "activation regularisation (AR) weight"),
    "optim.tar_weight": (NONNEG, "temporal activation regularisation (TAR) weight"),
    "optim.nonmono": (COUNT, "NT-ASGD's non-monotone interval, in epochs"),
    "optim.optimizer": (Range(choices=("sgd", "adam", "adamw")), "optimiser"),
    "optim.warmup_steps": (NONNEG_INT, "steps of linear learning-rate warm-up"),
    "optim.schedule": (Range(choices=(None, "cosine")), "learning-rate schedule"),
    "optim.divergence_factor": (Range(lo=1, lo_open=True, optional=True),
                                "stop when the training cross-entropy exceeds this many times log(V)"),
    # analysis: generation settings (entropy_rate, and the stages that share them)
    "analysis.*.num_prefixes": (COUNT, "validation points generations start from"),
    "analysis.*.samples_per_prefix": (COUNT, "generations per point"),
    "analysis.*.prefix_len": (COUNT, "tokens of true text before each point"),
    "analysis.*.horizon": (COUNT, "generated tokens per generation"),
    "analysis.*.seed": (SEED, "sampling seed"),
    "analysis.*.max_batch": (COUNT, "generations advanced together"),
    "analysis.memory_budget_gb": (Range(lo=0, lo_open=True, optional=True),
                                   "GB one lookahead chunk may hold (null: from the device)"),
    "analysis.entropy_rate.every_n_epochs": (OPT_COUNT, "entropy-rate curve every N epochs during training"),
    # analysis: fitting and scoring
    "analysis.*.fit_tokens": (Range(lo=2, integer=True, optional=True), "validation tokens the fit uses"),
    "analysis.*.fit_streams": (COUNT, "parallel streams of the fit"),
    "analysis.*.score_tokens": (Range(lo=2, integer=True, optional=True), "test tokens scored (null: all)"),
    "analysis.*.score_streams": (COUNT, "parallel streams of test scoring"),
    "analysis.*.topk": (OPT_COUNT, "lookahead candidates per position (null with cover null: exact, the whole "
                        "vocabulary)"),
    "analysis.*.cover": (Range(lo=0, hi=1, lo_open=True, optional=True),
                         "share of the mass the lookahead's candidates hold (null: topk's rule)"),
    "analysis.*.cover_max": (OPT_COUNT, "most lookahead candidates of the covering rule (null: the memory budget's)"),
    "analysis.*.uniform_weight": (PROB_OPEN_HI, "weight of the uniform distribution mixed in"),
    "analysis.decoders.mix_epsilon": (Range(lo=0, hi=1, lo_open=True, hi_open=True),
                                      "uniform mass mixed in for a finite held-out cross-entropy"),
    "analysis.*.tail_samples": (COUNT, "words drawn for the shared tilt of the words outside the candidates"),
    "analysis.calibration.approximation.generations": (COUNT, "plain generations of the approximation table"),
    "analysis.calibration.approximation.steps": (COUNT, "positions of each generation in the approximation table"),
    "analysis.calibration.dose_response.num_prefixes": (OPT_COUNT, "prefixes of the dose-response's generations"),
    "analysis.calibration.dose_response.samples_per_prefix": (OPT_COUNT, "the dose-response's generations per prefix"),
    "analysis.calibration.dose_response.score_tokens": (Range(lo=2, integer=True, optional=True),
                                                        "test tokens of the dose-response's laws' CE"),
    "analysis.*.min_context": (NONNEG_INT, "tokens each fit stream reads before its positions count"),
    "analysis.memory.limited": (Range(choices=("trained", "window")),
                                "the tau-limited model: trained (a tau-model) or window (the model on tau tokens)"),
    "analysis.memory.tau": (OPT_COUNT, "the window length of limited=window"),
    "analysis.memory.jackknife": (Range(choices=("onestep", "exact")), "alpha's refit per jackknife replicate"),
    "analysis.memory.cluster_size": (COUNT, "consecutive positions per unit of the standard error"),
    "analysis.memory.windows_per_batch": (COUNT, "tau-windows per forward of the limited model"),
    "analysis.memory.store_dtype": (Range(choices=("float32", "float16", "bfloat16")), "dtype of the kept fit rows"),
    "analysis.memory.rows": (Range(choices=("auto", "device", "cpu", "stream")),
                             "where the fit's rows stay: the model's device, the CPU, or recomputed on every pass"),
    "analysis.future_entropy.rollouts": (Range(lo=2, integer=True), "rollouts the heads learn from"),
    "analysis.future_entropy.rollout_prefix": (COUNT, "true tokens each rollout reads first"),
    "analysis.future_entropy.rollout_steps": (OPT_COUNT, "free words each rollout runs (null: the horizon)"),
    "analysis.future_entropy.examples_per_rollout": (COUNT, "examples per rollout"),
    "analysis.future_entropy.hidden": (COUNT, "width of a future-entropy head"),
    "analysis.future_entropy.rank": (COUNT, "rank of a future-entropy head's word map"),
    "analysis.future_entropy.epochs": (COUNT, "training passes of a future-entropy head"),
    "analysis.future_entropy.batch_size": (COUNT, "examples per step of a head's training"),
    "analysis.future_entropy.lr": (POSITIVE, "a head's learning rate"),
    "analysis.future_entropy.weight_decay": (NONNEG, "a head's weight decay"),
    "analysis.future_entropy.exact_lookahead": (Range(choices=("auto", True, False)), "exact one-step lookahead too"),
    "analysis.future_entropy.exact_max_vocab": (COUNT, "largest vocabulary exact lookahead runs on with auto"),
    "analysis.future_entropy.cluster_size": (COUNT, "consecutive positions per unit of the standard error"),
    "analysis.*.timing_prefixes": (COUNT, "prefixes of the timing run"),
    "analysis.*.timing_horizon": (COUNT, "generated words of the timing run"),
    "analysis.*.timing_repeats": (COUNT, "timing runs, of which the fastest counts"),
    "analysis.future_entropy.mix_epsilon": (Range(lo=0, hi=1, lo_open=True, hi_open=True),
                                            "uniform mass mixed in for a finite held-out cross-entropy"),
    "analysis.sequence_calibration.particles": (None, "SMC particles per generation, one row each"),
    "analysis.sequence_calibration.smc_prefixes": (OPT_COUNT, "prefixes the SMC rows generate from (null: all)"),
    "analysis.sequence_calibration.goal_prefixes": (Range(lo=1, hi=10**6, integer=True, optional=True),
                                                    "fresh prefixes the goal rows are measured again on (null: as "
                                                    "many as each row's own)"),
    "analysis.sequence_calibration.fit_prefixes": (Range(lo=2, integer=True), "continuations alpha* is fitted on"),
    "analysis.sequence_calibration.tail_particles": (OPT_COUNT, "SMC particles of the last tenth's entropy (null: "
                                                                "the row's own)"),
    "analysis.sequence_calibration.law_horizon": (OPT_COUNT, "words Algorithm 1's law runs over (null: 2 x horizon)"),
    "analysis.sequence_calibration.twist": (Range(choices=(True, False)), "SMC twisted by the soft-value heads too"),
    "analysis.sequence_calibration.untwisted": (Range(choices=(True, False)), "SMC untwisted too (false: needs "
                                                "sv_alpha)"),
    "analysis.sequence_calibration.sv_alpha": (Range(lo=-1, lo_open=True, optional=True),
                                               "alpha the soft-value heads are first trained at (null: the untwisted "
                                               "rows' largest count's)"),
    "analysis.sequence_calibration.sv_refits": (NONNEG_INT, "times the heads' alpha is refitted and they retrain"),
    "analysis.sequence_calibration.xtol": (POSITIVE, "alpha*'s tolerance"),
    "analysis.sequence_calibration.converge_tol": (Range(lo=0, lo_open=True, optional=True),
                                                   "nats within which K and 2K particles' last tenths must be shown "
                                                   "to agree (null: not refuted is enough)"),
    "analysis.sequence_calibration.sv_rollouts": (COUNT, "rollouts of each soft-value round"),
    "analysis.sequence_calibration.sv_prefix": (COUNT, "true tokens each soft-value rollout reads first"),
    "analysis.sequence_calibration.sv_steps": (COUNT, "words each soft-value rollout samples"),
    "analysis.sequence_calibration.sv_iterations": (COUNT, "rounds of relative value iteration"),
    "analysis.sequence_calibration.sv_backup_steps": (COUNT, "soft Bellman residuals summed into a target"),
    "analysis.sequence_calibration.sv_explore": (Range(lo=0, hi=1), "share of rollouts with a uniform first word"),
    "analysis.sequence_calibration.hidden": (COUNT, "width of a soft-value head"),
    "analysis.sequence_calibration.rank": (COUNT, "rank of a soft-value head's word map"),
    "analysis.sequence_calibration.epochs": (COUNT, "regression passes per soft-value round"),
    "analysis.sequence_calibration.batch_size": (COUNT, "examples per step of a head's regression"),
    "analysis.sequence_calibration.lr": (POSITIVE, "a soft-value head's learning rate"),
    # make reproduce (the profile's own keys; more in PROFILE_RULES)
    "jobs": (COUNT, "stages run side by side"),
    "taus": (None, "the tau-models' memory lengths"),  # a list: each an integer >= 1 (checked below)
    "markov.taus": (None, "the Markov source's tau-models' memory lengths"),
}


# the reproduce profile's other settings (lmcal.pipeline.plan.check_profile checks them with RULES, before any work)
PROFILE_RULES: dict[str, tuple[Range, str]] = {
    "transformer.window_taus": (None, "the transformer's window lengths"),
    "bootstrap": (COUNT, "the scale report's bootstrap replicates"),
    "estimate_for": (Range(choices=("cpu", "gpu")), "where check=true's wall time is estimated for"),
    "warm_worker": (BOOL, "stages forked by a warm worker"),
    "check": (BOOL, "the plan check alone"),
    "force": (BOOL, "redo the stages whose settings changed (FORCE=1)"),
    "force_size": (BOOL, "run even sizes beyond reason"),
    "wandb_offline": (BOOL, "W&B offline"),
    "wandb_log_model": (BOOL, "checkpoints uploaded to W&B"),
    "warm_start": (BOOL, "tau-models start from the base model's weights"),
    "windows": (BOOL, "the memory bound on tau-token windows too"),
    "markov.warm_start": (BOOL, "the Markov tau-models start from its base model's weights"),
    "markov.windows": (BOOL, "the Markov memory bound on tau-token windows too"),
}


# settings whose value becomes a folder's or file's name (or a part of one): key -> (most characters, only letters,
# digits and . _ + -, what the setting is); lmcal.utils.safe_paths.name_problem says what a plain name is
NAME_RULES: dict[str, tuple[int, bool, str]] = {
    "task_name": (100, False, "the run's name"),
    "logger.name_suffix": (64, True, "the end of the W&B run's name"),
    "dataset": (100, False, "the dataset, the folder of its stages"),
}


DECODER_RULES: dict[str, dict[str, Range]] = {
    "temperature": {"temperature": POSITIVE},
    "top_k": {"k": COUNT},
    "top_p": {"p": Range(lo=0, hi=1, lo_open=True)},
    "typical": {"mass": Range(lo=0, hi=1, lo_open=True)},
    "eta": {"eta_cutoff": PROB_OPEN_HI},
    "min_p": {"min_p": Range(lo=0, hi=1)},
    # target_surprise = inf: no cut
    "mirostat": {"target_surprise": Range(lo=0, lo_open=True, also=(math.inf,)), "learning_rate": NONNEG},
}


# (where, old name) -> new name: names that say which quantity they are (Mirostat's tau is not a memory length,
# eta-sampling's epsilon is not the uniform mixture's). `where` is a decoder or an analysis stage.
RENAMED = {("mirostat", "tau"): "target_surprise", ("mirostat", "eta"): "learning_rate",
           ("eta", "epsilon"): "eta_cutoff", ("calibration", "epsilon"): "uniform_weight"}


def renamed_note(where: str, unknown) -> str:
    """' Renamed: old is now new; ...' for the unknown keys of `where` that are old names, else ''."""
    renamed = [f"{k} is now {RENAMED[where, k]}" for k in sorted(unknown) if (where, k) in RENAMED]
    return f" Renamed: {'; '.join(renamed)}." if renamed else ""


def decoder_problems(name: str, params: dict, where: str) -> list[str]:
    """Out-of-range parameters of decoder `name`, as 'where.key=value (must be ...)' lines."""
    rules = DECODER_RULES.get(name, {})
    return [f"{where}.{k}={show_value(v)} (the {name} decoder's {k}: must be {rules[k].describe()})"
            for k, v in params.items() if k in rules and not rules[k].ok(v)]


def show_value(v) -> str:
    return "null" if v is None else repr(v) if isinstance(v, str) else str(v)
