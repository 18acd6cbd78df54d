"""How numbers read in tables and logs: perplexities that overflow to inf, parameters as 'k=v', cross-entropies.
"""

from __future__ import annotations

import math


def exp_or_inf(x: float) -> float:
    """exp(x), or inf where it overflows: the perplexity of a cross-entropy beyond ~709 nats is inf, not a crash."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def format_params(params: dict, digits: int = 4, drop: tuple[str, ...] = (), empty: str = "–") -> str:
    """"k=v, ..." with floats to `digits` significant digits, leaving out keys that contain any of `drop`; `empty`
    if none is left."""
    return ", ".join(f"{k}={v:.{digits}g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
                     if not any(d in k for d in drop)) or empty


def format_ce(nats: float | None) -> str:
    """A cross-entropy for a table: None (a word of probability 0) reads as ∞."""
    return "∞" if nats is None else f"{nats:.4f}"
