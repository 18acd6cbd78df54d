"""Shared fixtures. Tests that need the real corpus find it through $LMCAL_DATA_ROOT;
without it they fall back to a small synthetic corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmcal.pipeline.devices import thread_env  # (loads no torch)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # a worker's share of the cores, for it and the entry points it starts (read as torch loads, just below), as the
    # pipeline gives stages side by side; a user's OMP_NUM_THREADS holds
    os.environ.update(thread_env(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

from lmcal.data.corpora import PTB_SHA256  # noqa: E402

DATA_ROOT = os.environ.get("LMCAL_DATA_ROOT")
DATA_ROOT = str(Path(DATA_ROOT).resolve()) if DATA_ROOT else None  # subprocesses run in other folders
HAVE_PTB = bool(DATA_ROOT) and all((Path(DATA_ROOT) / "ptb" / f).is_file() for f in PTB_SHA256)
_NO_PTB = "real PTB not found: set LMCAL_DATA_ROOT to a folder holding ptb/"


def needs_ptb(test):
    """Skipped without the real corpus; marked ptb: make test-slow runs it where LMCAL_DATA_ROOT has it."""
    return pytest.mark.ptb(pytest.mark.skipif(not HAVE_PTB, reason=_NO_PTB)(test))


@pytest.fixture
def data_overrides() -> list[str]:
    """Hydra overrides for a corpus that is always there: real PTB when found, else synthetic."""
    if HAVE_PTB:
        return [f"data.root={DATA_ROOT}"]
    return ["data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, n_test: 3000}"]


# the longest files, first: with workers (make test's TEST_JOBS) a file stays on one worker, and one handed out last
# would keep the others waiting (test_reproduce: the smoke reproduction, several times over)
FIRST = ("test_reproduce.py", "test_paper_mini.py", "test_check.py")


def pytest_collection_modifyitems(config, items):
    """The FIRST files lead; tests marked gpu run only where CUDA is present (make gpu-check), elsewhere they are
    skipped, saying why.
    (Tests that take `data_overrides` run in make test on whichever corpus is found; they are not marked ptb, so
    make test-slow does not run them a second time.)"""
    import torch

    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (a gpu test): none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
