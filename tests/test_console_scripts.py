"""The entry points as commands of the virtual environment (pyproject's [project.scripts]): each runs, and Hydra's
shell completion answers for lmcal-train and lmcal-evaluate (it could not under `python -m lmcal.train`)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmcal.utils.settings import PROJECT_ROOT

BIN = Path(sys.executable).parent
_SECTION = (PROJECT_ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
SCRIPTS = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', _SECTION, re.M))  # (tomllib is Python 3.11's)


def test_every_entry_point_is_a_command():
    assert set(SCRIPTS) == {"lmcal-train", "lmcal-evaluate", "lmcal-reproduce", "lmcal-report", "lmcal-docs"}
    for name, target in SCRIPTS.items():
        assert (BIN / name).is_file(), f"{name}: not installed in {BIN} (make install installs it)"
        assert target.split(":")[0] == "lmcal." + name.removeprefix("lmcal-")


def _complete(tmp_path, script: str, line: str) -> list[str]:
    env = {**os.environ, "COMP_LINE": f"{script} {line}"}
    r = subprocess.run([str(BIN / script), "-sc", "query=bash"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


@pytest.mark.parametrize("script, line, expected", [
    ("lmcal-train", "data=", {"data=ptb", "data=markov", "data=powerlaw"}),
    ("lmcal-train", "trainer.max", {"trainer.max_epochs="}),
    ("lmcal-evaluate", "analysis.calibration.to", {"analysis.calibration.topk="}),
])
def test_shell_completion_completes_groups_options_and_keys(tmp_path, script, line, expected):
    assert expected <= set(_complete(tmp_path, script, line))
    assert not list(tmp_path.iterdir())  # a completion writes no run folder


def test_lmcal_train_runs_from_any_folder(tmp_path):
    r = subprocess.run([str(BIN / "lmcal-train"), "--cfg", "job"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "seed:" in r.stdout and not list(tmp_path.iterdir())
