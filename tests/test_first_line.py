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


LIGHT = """
import sys
sys.argv = ["lmcal-{name}", *{argv!r}]
from lmcal.{name} import cli
try:
    cli()
except SystemExit as e:
    print("EXIT", e.code, "LIGHTNING", "pytorch_lightning" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("name, argv, code", [
    ("train", ["--help"], 0),
    ("evaluate", ["--help"], 0),
    ("train", ["experiment=smoke", "logger=none", "+optim.lrr=3"], 2),  # a refused setting
    ("train", ["experiment=smoke", "logger=none", "trainer.precision=64-true"], 2),
])
def test_help_and_refusals_of_the_hydra_commands_come_before_lightning(tmp_path, name, argv, code):
    """`lmcal-train --help` and a refused setting answer before Lightning is imported (lmcal.training.run holds it):
    seconds, not the quarter of a minute its import takes on 2 cores."""
    argv = [*argv, f"hydra.run.dir={tmp_path / 'run'}"] if code else argv
    r = subprocess.run([sys.executable, "-c", LIGHT.format(name=name, argv=argv)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert f"EXIT {code} LIGHTNING False" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()
