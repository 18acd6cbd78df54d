"""The settings of every analysis stage, one dataclass each: the schema of analysis.<name> (registered in Hydra's
ConfigStore, so that composing a config checks names and types) and the one source of its defaults. The YAML presets
under conf/analysis/ override these; conf/analysis/default.yaml only links settings that follow another stage's.

Kept free of torch, so that a config can be composed and checked before the heavy imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationConfig:
    """Free generations from true-text prefixes: the settings every generating stage shares."""

    num_prefixes: int = 100  # random validation points (the paper: more than 100)
    samples_per_prefix: int = 5  # generations per point (the paper: more than 500 generations in all)
    prefix_len: int = 100  # tokens of true validation text before each point fed to the model
    horizon: int = 700  # generated words per generation
    seed: int = 0
    max_batch: int = 1024  # generations advanced together; more are done in chunks


@dataclass
class EntropyRateConfig(GenerationConfig):
    """analysis.entropy_rate: the entropy of the t-th generated word (Table 1, Figure 2)."""

    every_n_epochs: int | None = None  # also run during training every N epochs (on the current weights)


@dataclass
class ScoringConfig(GenerationConfig):
    """A fit on validation text and a score on test text, beside the generations."""

    fit_tokens: int = 20_000  # validation tokens alpha* is fitted on ...
    fit_streams: int = 20  # ... read as this many parallel streams
    score_tokens: int | None = None  # test tokens scored before/after (null: all)
    score_streams: int = 10


@dataclass
class LawConfig(ScoringConfig):
    """Which words get their own lookahead tilt (lmcal.core.lookahead_law); the rest share one."""

    min_context: int = 100  # each fit stream reads this many tokens before its positions count

    topk: int | None = None  # null with cover null: every word (exact lookahead, the paper's); k: the k most likely
    cover: float | None = None  # or the smallest set of most likely words holding this share of the mass ...
    cover_max: int | None = None  # ... at most this many (null: as many as the memory budget holds for one row)
    tail_samples: int = 16  # the rest share one tilt, estimated from this many words drawn from it


@dataclass
class ApproximationConfig:
    """What each candidate rule keeps of exact lookahead's shift of E[H_next], at states of plain generations."""

    generations: int = 30  # of this many plain generations (the first prefixes) ...
    steps: int = 10  # ... at this many steps each, spread over the horizon (V model steps per position)


@dataclass
class DoseResponseConfig:
    """alpha = k alpha* for each multiple k and candidate rule: the law's last tenth (paired) and test CE."""

    multiples: list[float] = field(default_factory=lambda: [1, 3, 10])
    # each {topk: k}, {cover: c, cover_max: m} or {topk: null} (exact lookahead)
    rules: list[Any] = field(default_factory=lambda: [{"topk": 16}, {"topk": 256}, {"cover": 0.95}])
    num_prefixes: int | None = None  # its generations: the first this many prefixes (null: the stage's) ...
    samples_per_prefix: int | None = 1  # ... this many each (null: the stage's samples_per_prefix)
    score_tokens: int | None = 20_000  # test tokens of each law's test CE (null: the stage's score_tokens)


@dataclass
class CalibrationConfig(LawConfig):
    """analysis.calibration: lookahead calibration (Algorithm 2, Figure 3)."""

    uniform_weight: float = 0.0  # calibrate the mixture (1 - w) P + w * uniform (the paper's epsilon)
    approximation: ApproximationConfig | None = field(default_factory=ApproximationConfig)  # null: skipped
    dose_response: DoseResponseConfig | None = field(default_factory=DoseResponseConfig)  # null: skipped


def _default_methods() -> list[dict]:
    return [{"name": "temperature", "temperature": 0.8},  # llama.cpp's default temperature
            {"name": "top_k", "k": 50},  # transformers' default
            {"name": "top_p", "p": 0.95},  # llama.cpp's default
            {"name": "typical", "mass": 0.95},  # Meister et al. 2022
            {"name": "eta", "eta_cutoff": 0.0003},  # Hewitt et al. 2022
            {"name": "min_p", "min_p": 0.05},  # llama.cpp's default
            {"name": "mirostat", "target_surprise": 5.0, "learning_rate": 0.1}]  # llama.cpp's (bits)


@dataclass
class DecodersConfig(LawConfig):
    """analysis.decoders: every decoding method on one figure and table (lmcal.core.decoders)."""

    methods: list[Any] = field(default_factory=_default_methods)  # {name: ..., **params} each
    fitted: list[str] = field(default_factory=lambda: ["temperature", "calibration"])  # T* of P^(1/T); lookahead
    calibration_json: str | None = None  # a calibration stage's calibration.json to take its row from
    mix_epsilon: float = 1e-6  # held-out CE of (1 - eps) q + eps * uniform: finite for truncating decoders too


@dataclass
class TimingConfig:
    """ms per generated word of every method, on timing_prefixes x samples_per_prefix generations."""

    timing_prefixes: int = 20
    timing_horizon: int = 30  # generations of this many words (the best of timing_repeats runs)
    timing_repeats: int = 3


@dataclass
class FutureEntropyConfig(TimingConfig, LawConfig):
    """analysis.future_entropy: calibration against future-entropy heads (lmcal.core.future_entropy)."""

    horizon_k: list[int] = field(default_factory=lambda: [1, 5, 20, 100])  # a head per K (and per discount, K > 1)
    discount: list[float] = field(default_factory=lambda: [1.0, 0.95])  # sum_{j<=K} discount^(j-1) H_{t+j}
    rollouts: int = 800  # rollouts from random training-text points (half start with the true word)
    rollout_prefix: int = 50  # true tokens each rollout reads first
    rollout_steps: int | None = None  # free words each rollout runs past its prefix (null: the horizon)
    examples_per_rollout: int = 50  # examples per rollout, spread evenly over its steps
    hidden: int = 256  # the head: gelu(A f + a) of this width ...
    rank: int = 64  # ... and a rank-r map of the model's output embedding
    epochs: int = 8  # passes over the examples (AdamW, one-cycle rate)
    batch_size: int = 512
    lr: float = 3e-3
    weight_decay: float = 1e-4
    temperature: bool = True  # also fit P^beta exp(alpha g), the two-parameter family
    exact_lookahead: Any = "auto"  # exact one-step lookahead too: true, false, or auto (vocabularies <= the max)
    exact_max_vocab: int = 2000
    cluster_size: int = 100  # positions per block of a stream: the units of the standard errors
    decoders_json: str | None = None  # a decoders stage's decoders.json, whose rows join the table
    mix_epsilon: float = 1e-6


@dataclass
class SequenceCalibrationConfig(TimingConfig, ScoringConfig):
    """analysis.sequence_calibration: Algorithm 1, P^_a(w_1..L) ~ P^(w_1..L)^(1+a), by SMC and soft-value heads."""

    particles: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])  # SMC particles per generation
    twist: bool = True  # also SMC twisted by the soft-value heads (needs soft_value)
    untwisted: bool = True  # also SMC untwisted (false: the twisted rows only, which needs sv_alpha)
    sv_alpha: float | None = None  # the alpha the heads are first trained at (null: the largest count's alpha*)
    law_horizon: int | None = None  # the words the law runs over (null: 2 x horizon)
    smc_prefixes: int | None = None  # the SMC rows generate from the first this many prefixes (null: all)
    goal_prefixes: int | None = None  # the goal rows again on this many fresh prefixes (null: their own count)
    fit_prefixes: int = 40  # alpha* on this many validation continuations of law_horizon words
    bracket: list[float] = field(default_factory=lambda: [-0.5, 1.0])  # alpha*'s bracket (the moment is monotone)
    xtol: float = 2e-3  # alpha*'s tolerance
    converge_tol: float | None = 0.1  # K and 2K particles agree: their paired 2-se interval within +-this (nats)
    tail_particles: int | None = None  # the nested SMC runs for the last tenth's entropy (null: the row's count)
    check_particles: int = 256  # each SMC row's reference: untwisted SMC at this many particles on ...
    check_prefixes: int | None = None  # ... the first this many fit windows (null: all), the fitted moment compared
    soft_value: bool = True  # also the soft-value heads: P ~ P^^(1+a) exp(Q), Q by relative value iteration ...
    sv_rollouts: int = 200  # ... on rollouts from this many training-text points ...
    sv_prefix: int = 50  # ... each reading this many true tokens ...
    sv_steps: int = 20  # ... and sampling this many words with the current head ...
    sv_iterations: int = 10  # ... for this many rounds (half as many after each refit) ...
    sv_backup_steps: int = 10  # ... with targets summing this many soft Bellman residuals along the path
    sv_explore: float = 0.5  # the share of rollouts whose first word is uniform
    sv_refits: int = 1  # the heads' alpha refitted on their own validation CE, and the heads retrained, this often
    hidden: int = 128  # the head's width ...
    rank: int = 64  # ... and the rank of its word map
    epochs: int = 4  # regression passes per round
    batch_size: int = 512
    lr: float = 3e-3
    smc_seeds: list[int] | None = None  # the SMC rows generate at each of these seeds, joined (null: seed)
    future_entropy_json: str | None = None  # a future_entropy stage's result, whose closest head joins the table
    decoders_json: str | None = None  # a decoders stage's result, whose fitted temperature joins the table
    extend_json: str | None = None  # a finished run's JSON: its SMC rows get more generations at smc_seeds


@dataclass
class MemoryConfig:
    """analysis.memory: the I_tau bound (Section 5): P^ the full model, P~ a tau-limited one, on the test text."""

    limited: str = "trained"  # P~: trained (the tau-model checkpoint) or window (the model on tau-token windows)
    tau: int | None = None  # limited=window: the window length (null: a tau-model's own memory_tau)
    score_tokens: int | None = None  # test tokens alpha* is fitted on and the bound reported on (null: all)
    cluster_size: int = 2000  # consecutive positions per block: the units of the standard errors (jackknife)
    jackknife: str = "onestep"  # each block's refit of alpha: onestep (one Newton step) or exact (a refit)
    windows_per_batch: int = 512  # tau-windows fed side by side (and rows per chunk)
    store_dtype: str = "float32"  # of the kept rows; float16 halves their memory
    rows: str = "auto"  # where the fit's 2 x N x V rows stay: cpu, device, stream (recomputed each pass), or auto


CONFIGS: dict[str, type] = {"entropy_rate": EntropyRateConfig, "calibration": CalibrationConfig,
                            "decoders": DecodersConfig, "future_entropy": FutureEntropyConfig,
                            "sequence_calibration": SequenceCalibrationConfig, "memory": MemoryConfig}


def store_schemas(configs: dict[str, type] | None = None) -> None:
    """Registers each stage's settings as the schema analysis_schema/<name> in Hydra's ConfigStore, which
    conf/analysis/default.yaml lists first (so that a config composed from it is typed)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, cls in (configs or CONFIGS).items():
        cs.store(group="analysis_schema", name=name, node=cls)
