"""Every stage's settings have one source: its dataclass (lmcal.stages.configs), the schema of analysis.<name>. The
composed default config equals the dataclasses' defaults, compose refuses unknown names and wrong types, and no stage's
compute keeps defaults of its own."""

import dataclasses
import inspect

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lmcal.errors import LmcalError
from lmcal.stages import STAGES
from lmcal.stages.registry import check_settings, settings_of
from lmcal.utils.settings import CONF_DIR


def _compose(overrides=()):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def test_the_default_config_is_the_dataclasses_defaults():
    analysis = _compose().analysis
    for name, stage in STAGES.items():
        if name not in analysis:
            continue  # a plugin's stage (its node is given on the command line)
        assert OmegaConf.get_type(analysis[name]) is stage.config, name
        composed = OmegaConf.to_container(analysis[name], resolve=True)
        assert composed == dataclasses.asdict(stage.config()), name


def test_every_builtin_stage_has_its_schema_in_the_default_config():
    analysis = _compose().analysis
    builtin = ("entropy_rate", "calibration", "decoders", "future_entropy", "sequence_calibration", "memory")
    assert all(n in analysis and OmegaConf.get_type(analysis[n]) is STAGES[n].config for n in builtin)


def test_compute_takes_a_target_and_its_settings_and_no_defaults():
    for name, stage in STAGES.items():
        params = list(inspect.signature(stage.compute).parameters.values())
        assert [p.name for p in params] == ["target", "settings"], name
        assert all(p.default is inspect.Parameter.empty for p in params), name


def test_linked_settings_follow_the_stage_they_link_to():
    analysis = _compose(["analysis.entropy_rate.horizon=33", "analysis.calibration.topk=8"]).analysis
    assert analysis.calibration.horizon == analysis.decoders.horizon == analysis.sequence_calibration.horizon == 33
    assert analysis.decoders.topk == analysis.future_entropy.topk == 8


@pytest.mark.parametrize("override", ["analysis.entropy_rate.horizon=abc", "analysis.calibration.nope=1",
                                      "analysis.memory.tau=[1,2]", "analysis.sequence_calibration.particles=x"])
def test_compose_refuses_unknown_names_and_wrong_types(override):
    with pytest.raises(ConfigCompositionException):
        _compose([override])


def test_settings_from_python_are_checked_the_same_way():
    assert settings_of("calibration", {"topk": 4}).topk == 4
    assert settings_of("calibration", {"dose_response": {"multiples": [2]}}).dose_response.rules  # defaults kept
    assert check_settings("memory", {})["rows"] == "auto"
    with pytest.raises(LmcalError, match=r"analysis\.entropy_rate\.horizon: Value 'abc'"):
        settings_of("entropy_rate", {"horizon": "abc"})
    with pytest.raises(LmcalError, match="Unknown setting analysis.memory.nope; the memory stage takes limited"):
        settings_of("memory", {"nope": 1})
