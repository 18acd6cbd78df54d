"""Every count and size bounded before work (issue 77, item 4): the goal rows' goal_prefixes (a range, and its model
steps in the size machinery, refused with the value that fits), the power-law source's tail exponent, the generated
sources' tables (order x vocabulary, naming data.corpus_kwargs.order), a scale sweep's data.bptt against each job's
model, and a Hugging Face config's sizes. Each refused in one paragraph, exit 2, nothing written: in process where the
arithmetic is the point, through the entry points in subprocesses where the exit code and the files left are."""

import json

import pytest
from omegaconf import OmegaConf

from lmcal.data.powerlaw import make_powerlaw_chain
from lmcal.errors import DataError, LmcalError
from lmcal.pipeline.sizes import count_problems, goal_steps_per_prefix, model_of, size_problems, size_refusal
from lmcal.utils.budget import MAX_TOKEN_STEPS, source_table_problem
from lmcal.utils.settings import composed
from lmcal.utils.validate import check_config
from tests.test_hostile_inputs import assert_one_paragraph, run

GB = 2**30


def _train_cfg(*overrides):
    import lmcal.stages  # noqa: F401  (registers the stages' settings schemas, which the analysis presets list)

    return composed("lmcal.train", ["experiment=cpu", *overrides])


def _sequence_settings(**changes) -> dict:
    cfg = _train_cfg()
    return {**OmegaConf.to_container(cfg.analysis.sequence_calibration, resolve=True), **changes}


def test_goal_prefixes_has_a_range():
    with pytest.raises(LmcalError, match=r"goal_prefixes=10000000 .*must be null or an integer in \[1, 1,000,000\]"):
        check_config(_train_cfg("analysis.sequence_calibration.goal_prefixes=10000000"))
    check_config(_train_cfg("analysis.sequence_calibration.goal_prefixes=200"))


def test_goal_prefixes_beyond_a_stages_steps_are_refused_with_the_count_that_fits():
    m = model_of(_train_cfg())
    a = _sequence_settings(goal_prefixes=500_000)
    per = goal_steps_per_prefix(a)  # 2 x 3 runs x 4 particles x 3 generations x (100 + 400) words
    assert per == 6 * min(a["particles"]) * a["samples_per_prefix"] * (a["prefix_len"] + 2 * a["horizon"])
    text, fits = size_problems("sequence_calibration", a, m)
    assert fits == {"goal_prefixes": MAX_TOKEN_STEPS // per}
    assert text.startswith("would measure its goal rows again on goal_prefixes = 500,000") and " h at an" in text
    e = size_refusal([("Stage 'sequence_calibration'", text, {f"analysis.sequence_calibration.{k}": v
                                                              for k, v in fits.items()})], "on the command line")
    assert "would run for hours when it got there" in str(e) and "add force_size=true" in str(e)
    assert size_problems("sequence_calibration", a, m, force=True) == ("", {})  # force_size=true: as asked
    assert f"analysis.sequence_calibration.goal_prefixes={MAX_TOKEN_STEPS // per}" in str(e)
    assert count_problems("sequence_calibration", {**a, "goal_prefixes": MAX_TOKEN_STEPS // per}, m) == ("", {})
    assert count_problems("sequence_calibration", {**a, "goal_prefixes": None}, m) == ("", {})


def test_the_tail_exponent_has_a_range_checked_up_front():
    with pytest.raises(LmcalError, match=r"tail_exponent=1000000000.0 .*must be a number in \(0, 8\]"):
        check_config(_train_cfg("data=powerlaw", "data.corpus_kwargs.tail_exponent=1e9"))
    check_config(_train_cfg("data=powerlaw", "data.corpus_kwargs.tail_exponent=2"))
    with pytest.raises(DataError, match="data.corpus_kwargs.*tail_exponent"):
        make_powerlaw_chain(16, 1, 9.0)  # the library's own call says the same


@pytest.mark.parametrize("name, vocab, order, fits", [("markov", 64, 4, 3), ("powerlaw", 256, 4, 2),
                                                      ("powerlaw", 256, 10**9, 2), ("markov", 10**6, 1, None)])
def test_a_generated_sources_table_is_bounded_naming_its_order(name, vocab, order, fits):
    why = source_table_problem({"name": name, "corpus_kwargs": {"vocab_size": vocab, "order": order}}, 24 * GB)
    assert why.startswith(f"data.corpus_kwargs.order={order:,} with vocab_size={vocab:,}")
    assert (f"data.corpus_kwargs.order={fits} fits" if fits else "lower vocab_size") in why
    assert source_table_problem({"name": name, "corpus_kwargs": {"vocab_size": vocab, "order": 1}}, 2**50) is None


def test_the_defaults_tables_fit():
    for name in ("markov", "powerlaw"):
        assert source_table_problem({"name": name, "corpus_kwargs": {}}, 8 * GB) is None
    assert source_table_problem({"name": "markov", "corpus_kwargs": {"order": 4}}, 8 * GB) is None  # 16^5 entries


def test_the_plan_check_refuses_goal_prefixes_past_a_stages_steps(tmp_path):
    out = tmp_path / "out"
    r = run("lmcal.reproduce", ["profile=cpu", "check=true", f"out={out}", "logger=none",
                                "analysis=[analysis=cpu,analysis.sequence_calibration.goal_prefixes=500000]"], tmp_path)
    assert_one_paragraph(r, "Stage 'sequence_calibration' would measure its goal rows again on goal_prefixes = 500,000",
                         "analysis.sequence_calibration.goal_prefixes=277777")
    assert not out.exists()
    r = run("lmcal.reproduce", ["profile=cpu", "check=true", f"out={out}", "logger=none", "force_size=true",
                                "analysis=[analysis=cpu,analysis.sequence_calibration.goal_prefixes=500000]"], tmp_path)
    assert r.returncode == 0 and "Plan of the cpu profile" in r.stdout, r.stderr[-2000:]  # as the user meant it


def test_training_on_a_tail_exponent_out_of_range_writes_nothing(tmp_path):
    out = tmp_path / "run"
    r = run("lmcal.train", ["experiment=smoke", "logger=none", "data=powerlaw", "data.corpus_kwargs.tail_exponent=1e9",
                            f"hydra.run.dir={out}"], tmp_path)
    assert_one_paragraph(r, "data.corpus_kwargs.tail_exponent=1000000000.0", "(0, 8]")
    assert not out.exists()


def test_a_scale_sweep_whose_bptt_exceeds_a_jobs_context_starts_no_job(tmp_path):
    out = tmp_path / "out"
    r = run("lmcal.reproduce", ["profile=scale", f"out={out}", "logger=none", "sweeps.awd_lstm=null",
                                "sweeps.powerlaw=null", "sweeps.transformer=[experiment=scale_transformer,"
                                                        "data.bptt=100000]"], tmp_path)
    assert_one_paragraph(r, "data.bptt = 100000", "context of 256 (model.n_positions)")
    assert not out.exists()


def _hf_folder(tmp_path, **changes):
    from tests.test_hf import tiny_folder

    folder = tiny_folder(tmp_path)
    for name, (key, value) in changes.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    return folder


@pytest.mark.parametrize("change, needle", [
    ({"config": ("n_layer", -1)}, "n_layer=-1 (must be an integer in [1, 10,000])"),
    ({"config": ("vocab_size", 10**12)}, "vocab_size=1000000000000"),
    ({"config": ("n_embd", "64")}, "n_embd=64 (must be an integer"),
    ({"config": ("auto_map", {"AutoModelForCausalLM": "evil.Model"})}, "auto_map names the folder's own code"),
    ({"tokenizer_config": ("tokenizer_class", "EvilTok")}, "tokenizer_class='EvilTok' is no tokenizer")])
def test_a_hugging_face_folder_of_no_sane_size_or_its_own_code_is_refused(change, needle, tmp_path):
    pytest.importorskip("transformers")
    from lmcal.models.hf import load_hf_model, load_hf_tokenizer

    folder = _hf_folder(tmp_path, **change)
    for load in (load_hf_tokenizer, load_hf_model):
        with pytest.raises(LmcalError, match="trust_remote_code=False") as e:
            load(folder)
        assert needle in str(e.value) and str(folder) in str(e.value)


def test_evaluate_on_a_hugging_face_config_with_negative_layers_leaves_no_run_folder(tmp_path):
    pytest.importorskip("transformers")
    folder, out = _hf_folder(tmp_path, config=("n_layer", -1)), tmp_path / "eval"
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat\n" * 20)
    r = run("lmcal.evaluate", ["model=hf", f"model.name_or_path={folder}", f"model.valid_text={text}",
                               f"model.test_text={text}", "stages=[entropy_rate]", "analysis=smoke", "logger=none",
                               f"hydra.run.dir={out}"], tmp_path)
    assert_one_paragraph(r, "n_layer=-1")
    assert not out.exists()
