"""The outcome of a tilted family's fit whose held-out CE has no minimum inside its bound: an exception that carries
what stays known at the edge, its JSON keys, and the words shown in place of a fitted number."""

from __future__ import annotations

import math


class NoFiniteMinimum(RuntimeError):
    """The held-out CE of a tilted family has no minimum inside |parameter| < bound: it still falls at the bound (on
    degenerate rows, e.g. a statistic largest at every true next word, the infimum is at infinity). A result about the
    rows, not a fault: the stages record it. Carries

        bound        the bound on each |parameter|,
        direction    the unit (max-norm) direction the fit was moving in, one float per parameter ([+-1.0] for alpha),
        at_bound     the parameters on the edge of [-bound, bound]^k along that direction,
        ce_at_bound  CE there (nats),
        slope        dCE along `direction` there (negative: CE still falls; a minimum within 1e-6 of the bound can
                     give a slope of about 0).
    """

    def __init__(self, what: str, name: str, bound: float, direction: list[float], at_bound: list[float],
                 ce_at_bound: float, slope: float):
        self.what, self.bound, self.direction, self.at_bound = what, float(bound), direction, at_bound
        self.ce_at_bound, self.slope = float(ce_at_bound), float(slope)
        super().__init__(f"{what}: CE({name}) has its minimum at or beyond |{name}| = {bound}; degenerate rows? (CE "
                         f"{self.ce_at_bound:.6g} nats at {name} = {_fmt(at_bound)}, slope {self.slope:.3g} along "
                         f"{_fmt(direction)})")

    @property
    def sign(self) -> float:
        """The sign of the last parameter's direction (the alpha of every family here): +1.0 or -1.0 (0.0 flat)."""
        return math.copysign(1.0, self.direction[-1]) if self.direction[-1] else 0.0

    def record(self) -> dict:
        """The outcome as JSON keys, the same in every stage that records it."""
        return {"no_finite_minimum": True, "alpha_bound": self.bound, "fit_direction": list(self.direction),
                "fit_at_bound": list(self.at_bound), "fit_ce_at_bound_nats": self.ce_at_bound,
                "fit_ce_slope_at_bound": self.slope}


def no_minimum_label(record: dict, name: str = "α", table: bool = False) -> str:
    """The words shown in place of a fitted number for a fit recorded by NoFiniteMinimum.record; `table`: with its
    pipes escaped, for a cell of a Markdown table."""
    text = f"no finite minimum (CE still falls at |{name}| = {record.get('alpha_bound', 100.0):g})"
    return text.replace("|", "\\|") if table else text


def _fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:g}" for x in xs) if len(xs) > 1 else f"{xs[0]:g}"
