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


COMPARABLE_FACTOR = 3.0  # a model whose test perplexity is more than this times the paper's is not compared with it


def comparability(r: dict) -> str | None:
    """Why results.json `r`'s model is not comparable with the paper's (None: it is): a smoke run, or a base model
    whose test perplexity is more than COMPARABLE_FACTOR times the paper's AWD-LSTM's."""
    from lmcal import paper

    ppl, ref = (r.get("base") or {}).get("test_ppl"), paper.AWD_LSTM_PTB["test_ppl"]
    if r.get("profile") == "smoke":
        return f"a smoke run (a toy model, test perplexity {ppl:.1f}, to check that every stage runs)" \
            if finite(ppl) else "a smoke run (a toy model, to check that every stage runs)"
    if finite(ppl) and ppl > COMPARABLE_FACTOR * ref:
        return (f"its base model's test perplexity, {ppl:.1f}, is more than {COMPARABLE_FACTOR:g} times the paper's "
                f"{ref}")
    return None


def shown(verdict: str, yes: set[str] = YES) -> str:
    """'yes', 'no' or 'undecided', with the verdict word the test gave; 'not comparable' for a model far from the
    paper's (comparability)."""
    if verdict == "not_comparable":
        return "– (not comparable)"
    yn = "yes" if verdict in yes else "undecided" if verdict in UNDECIDED else "no"
    return f"{yn} ({verdict.replace('_', ' ')})"
