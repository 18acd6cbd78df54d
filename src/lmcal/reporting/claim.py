"""One effect sentence (a Claim) and the standard errors an effect must exceed; lmcal.reporting.claims states the
tests and writes the sentences."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lmcal import paper

Z = 2.0  # standard errors an effect must exceed to be stated as one


@dataclass(frozen=True)
class Claim:
    """One effect sentence: `verdict` is the test's outcome (a word the checking tests compare), `sentence` the text
    the report prints, `numbers` what it rests on."""

    key: str
    verdict: str
    sentence: str
    numbers: dict = field(default_factory=dict)


def finite(x) -> bool:
    """A number that is neither None, infinite nor NaN."""
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def paper_calibration_nats() -> float:
    """The paper's calibration effect in nats: log((93.1 - 20) / 93.1) = -0.24."""
    base = paper.AWD_LSTM_PTB["entrate_ppl"]
    return math.log((base - paper.CALIBRATION_PPL_DROP) / base)


# the verdicts that show a claim; a verdict listed under UNDECIDED neither shows nor refutes it
YES = {"lowers", "flattens", "more", "within", "approximation"}
UNDECIDED = {"untested", "undecided", "not_shown", "consistent", "flat_not_excluded", "no_trend"}


def shown(verdict: str, yes: set[str] = YES) -> str:
    """'yes', 'no' or 'undecided', with the verdict word the test gave."""
    yn = "yes" if verdict in yes else "undecided" if verdict in UNDECIDED else "no"
    return f"{yn} ({verdict.replace('_', ' ')})"
