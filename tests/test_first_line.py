"""The first line of a command comes before its heavy imports (torch, Hydra, Lightning, matplotlib): a user sees
that it started at once, not after a silent quarter of a minute. Checked by what is imported when the first line is
printed, not by a timing (speed targets live in bench/)."""

import subprocess
import sys

import pytest

PROBE = """
import builtins, sys
first = []
real = builtins.print
def print_(*a, **k):
    if not first:
        first.append(sorted(m for m in ("torch", "hydra", "pytorch_lightning", "matplotlib") if m in sys.modules))
        real("HEAVY", first[0], file=sys.stderr)
    real(*a, **k)
builtins.print = print_
import {module} as entry
try:
    entry.main({argv!r})
except SystemExit:
    pass
if not first:  # --help: argparse writes without print; nothing heavy may load at all
    print_()
"""


@pytest.mark.parametrize("module, argv", [
    ("lmcal.reproduce", ["profile=smoke", "check=true", "out=OUT"]),
    ("lmcal.report", ["DIR", "--wandb", "disabled"]),
    ("lmcal.report", ["--help"]),
    ("lmcal.reproduce", ["--help"]),
])
def test_the_first_line_comes_before_the_heavy_imports(tmp_path, module, argv):
    (tmp_path / "DIR").mkdir()
    argv = [a.replace("OUT", str(tmp_path / "out")).replace("DIR", str(tmp_path / "DIR")) for a in argv]
    r = subprocess.run([sys.executable, "-c", PROBE.format(module=module, argv=argv)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    heavy = next(ln for ln in r.stderr.splitlines() if ln.startswith("HEAVY"))
    assert heavy == "HEAVY []", r.stderr[-2000:]
