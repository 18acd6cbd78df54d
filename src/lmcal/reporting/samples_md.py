"""REPORT.md's generations as words, as the paper's Table 2 shows them: the first generation from each of a few
prefixes, plain and calibrated, from the same prefix and the same uniforms, each with its mean entropy over the last
tenth of the horizon (the calibration stage keeps their token ids; the base checkpoint's vocabulary reads them).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from lmcal.errors import LmcalError
from lmcal.reporting.results import read_json

log = logging.getLogger("lmcal")


def words(ids: list[int], itos: list[str]) -> str:
    """Token ids as text for a Markdown code span: one space between words, backticks replaced (they would end the
    span), ids outside the vocabulary as '?'."""
    return " ".join(itos[i] if 0 <= i < len(itos) else "?" for i in ids).replace("`", "'")


def samples_markdown(samples: list[dict], itos: list[str], tail_steps: int, prefix_words: int = 15,
                     head_words: int = 30) -> list[str]:
    """The section's lines: for each kept generation, the prefix's last words, then plain and calibrated: the first
    `head_words` generated words and the last `tail_steps` (the last tenth, whose entropy the mean is), with exp of
    that mean."""
    if not samples:
        return []
    lines = ["## Generations, as words", "",
             f"The first generation from each of the first {len(samples)} prefixes, plain and calibrated, from "
             "the same prefix and the same uniforms (the calibration stage's): the prefix's last "
             f"{prefix_words} words, the first {head_words} generated words, and the last {tail_steps} (the "
             "last tenth of the horizon); exp H: exp of that generation's mean entropy over the last tenth. "
             "One generation's tail is noisy: the levels with their standard errors are in the calibration "
             "section.", ""]
    for k, s in enumerate(samples, 1):
        lines += [f"**Prefix {k}:** `… {words(s['prefix'][-prefix_words:], itos)}`", ""]
        for label, ids, tail in (("plain", s["before"], s["tail_nats_before"]),
                                 ("calibrated", s["after"], s["tail_nats"])):
            cut = len(ids) > head_words + tail_steps
            text = (f"{words(ids[:head_words], itos)} … {words(ids[-tail_steps:], itos)}" if cut
                    else words(ids, itos))
            lines.append(f"- {label} (exp H, last tenth {math.exp(tail):.1f}): `{text}`")
        lines.append("")
    return lines


def calibration_samples_markdown(out: Path, dataset: str) -> list[str]:
    """The section from a reproduction's folder: calibration.json's kept generations, read with the vocabulary of the
    base model's corpus; none where the stage kept none or the vocabulary cannot be read (said in the log)."""
    from lmcal.models.checkpoint import checkpoint_data, read_checkpoint

    cal = read_json(out / dataset / "calibration" / "calibration.json")
    if not cal.get("samples"):
        return []
    try:
        ckpt = out / dataset / "base" / "checkpoints" / "best.ckpt"
        itos = checkpoint_data(read_checkpoint(ckpt), path=ckpt).prepare().itos
    except (OSError, LmcalError) as e:
        log.warning(f"REPORT.md: the generations are left out as words, the vocabulary could not be read: {e}")
        return []
    return samples_markdown(cal["samples"], itos, cal["tail_steps"])
