"""The optimiser's settings of a training run: one dataclass, the one source of their defaults, kept apart from the
Lightning module so that the settings' checks (lmcal.training.known_keys) read them without importing Lightning."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OptimConfig:
    """The optimiser settings of a training run (conf/train.yaml's `optim`); the checkpoint keeps them as the plain
    mapping `hyper_parameters.optim`."""

    optimizer: str = "sgd"  # sgd | adam | adamw
    betas: tuple[float, float] = (0.9, 0.999)  # adam, adamw
    lr: float = 30.0
    weight_decay: float = 1.2e-6
    clip: float | None = 0.25  # gradient-norm clipping (0 or None: none)
    ar_weight: float = 2.0  # activation regularisation (AR)
    tar_weight: float = 1.0  # temporal activation regularisation (TAR)
    asgd: bool = True  # NT-ASGD: switch to averaged SGD when validation stalls
    nonmono: int = 5
    schedule: str | None = None  # None: constant lr; cosine: decay to 0 over trainer.max_epochs
    warmup_steps: int = 0  # linear warm-up of the lr over the first N steps
    divergence_factor: float | None = 3.0  # stop when the training CE exceeds this x log(V) (None: non-finite only)

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))  # a list from YAML

    def as_dict(self) -> dict:
        return {**asdict(self), "betas": list(self.betas)}
