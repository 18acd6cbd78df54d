"""The plan check of the paper profiles as one page: each profile's estimate, the time model's terms (measured or
assumed, with their sources), and the paper profile's full plan.

    python bench/plan_check.py [--out docs/bench/plan_check_paper.md]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmcal.pipeline.check import check  # noqa: E402
from lmcal.pipeline.plan import load_profile  # noqa: E402
from lmcal.pipeline.timing import TERMS  # noqa: E402
from lmcal.reporting.provenance import provenance, provenance_line  # noqa: E402

PROFILES = ("paper_mini", "paper", "paper_full")


def estimate(text: str) -> str:
    return re.search(r"an ESTIMATE, ([\d.]+ (?:h|min)) \(stages one after another: ([\d.]+ (?:h|min))\)",
                     text).group(0).split(", ", 1)[1]


def page(plans: dict[str, str], command: str) -> str:
    lines = ["## Plan check of the paper profiles", "", provenance_line(provenance(command)), "",
             f"*Result:* paper_mini {estimate(plans['paper_mini'])}, paper {estimate(plans['paper'])}, paper_full "
             f"{estimate(plans['paper_full'])} on one GPU, by the plan check's time model (estimates, not "
             "measurements).", "",
             "| profile | stages | wall time on one GPU (estimate) |", "|---|---:|---|"]
    for p, text in plans.items():
        stages = int(re.search(r"profile: (\d+) stages", text).group(1))
        lines.append(f"| {p} | {stages} | {estimate(text)} |")
    lines += ["", "The time model's terms beside the measured AWD-LSTM step and the FLOP counts:", "",
              "| term | value | source |", "|---|---:|---|"]
    lines += [f"| {name} | {t.value:g} | {t.source} |" for name, t in TERMS.items()]
    lines += ["", "The paper profile's plan, as `check=true` prints it:", "", "```text", plans["paper"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/bench/plan_check_paper.md")
    a = ap.parse_args(argv)
    plans = {p: check(load_profile([f"profile={p}", "check=true"]), rates=None) for p in PROFILES}
    Path(a.out).write_text(page(plans, "python bench/plan_check.py --out " + a.out))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
