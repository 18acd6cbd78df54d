"""Unknown keys refused before any work (lmcal.training.known_keys): every preset's keys are known, a typo is named
with the nearest known keys, and following Hydra's `+key` hint gives that paragraph, not a traceback."""

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from lmcal.errors import LmcalError
from lmcal.training.known_keys import check_known_keys, unknown_keys
from lmcal.utils.settings import CONF_DIR

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
ANALYSES = sorted(p.stem for p in (CONF_DIR / "analysis").glob("*.yaml"))


def _cfg(name, overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_training_preset_has_only_known_keys(experiment):
    assert unknown_keys(_cfg("train", [f"experiment={experiment}"]), "lmcal.train") == []


@pytest.mark.parametrize("analysis", ANALYSES)
def test_every_analysis_preset_has_only_known_keys(analysis):
    cfg = _cfg("evaluate", [f"analysis={analysis}", "ckpt=x.ckpt"])
    assert unknown_keys(cfg, "lmcal.evaluate") == []
    hf = _cfg("evaluate", [f"analysis={analysis}", "model=hf", "model.name_or_path=x"])
    assert unknown_keys(hf, "lmcal.evaluate") == []


@pytest.mark.parametrize("override, key, near", [
    ("+optim.lrr=3", "optim.lrr", "optim.lr"),
    ("+data.bpt=3", "data.bpt", "data.bptt"),
    ("+model.hiden_size=3", "model.hiden_size", "model.hidden_size"),
    ("+trainer.max_epoch=3", "trainer.max_epoch", "trainer.max_epochs"),
    ("+analysis.calibration.topkk=3", "analysis.calibration.topkk", "analysis.calibration.topk"),
    ("+analysis.calibraton.topk=3", "analysis.calibraton", "analysis.calibration"),
    ("+seeed=3", "seeed", "seed"),
])
def test_a_typo_is_named_with_the_nearest_known_key(override, key, near):
    cfg = _cfg("train", ["experiment=smoke", override])
    assert unknown_keys(cfg, "lmcal.train") == [(key, unknown_keys(cfg, "lmcal.train")[0][1])]
    with pytest.raises(LmcalError, match=rf"Unknown setting: {key} \(did you mean {near}[ ?]"):
        check_known_keys(cfg)


def test_following_hydras_append_hint_gives_one_paragraph_and_writes_nothing(tmp_path):
    """Hydra says 'To append to your config use +optim.lrr=3'; that used to end in a TypeError after the data."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"} | {"OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "lmcal.train", "experiment=smoke", "logger=none", f"hydra.run.dir={run}",
                        "+optim.lrr=3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("lmcal: error: Unknown setting: optim.lrr (did you mean optim.lr?)")
    assert not run.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("setting, key", [("base=[experiment=smoke,+optim.lrr=3]", "optim.lrr"),
                                          ("analysis=[analysis=smoke,+analysis.memory.tauu=3]",
                                           "analysis.memory.tauu")])
def test_the_plan_check_refuses_an_unknown_key_of_any_stage(tmp_path, setting, key):
    from lmcal.pipeline.check import check
    from lmcal.pipeline.plan import load_profile

    cfg = load_profile(["profile=smoke", f"out={tmp_path / 'out'}", "check=true", setting])
    with pytest.raises(LmcalError, match=rf"Unknown setting: {key} "):
        check(cfg)
    assert not (tmp_path / "out").exists()


def test_the_trainer_keys_read_from_lightnings_source_are_its_signature():
    """trainer_keys reads Trainer.__init__'s parameters from Lightning's source (no import); they are exactly the
    signature's."""
    import inspect

    import pytorch_lightning as pl

    from lmcal.training.known_keys import trainer_keys

    assert trainer_keys() == set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
