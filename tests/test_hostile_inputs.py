"""Hostile inputs and faults (issue 29): a checkpoint whose settings name code, remote code in a Hugging Face folder,
names from files that would become paths, and every other bad input ending in one `lmcal: error:` paragraph with
exit 2. Through the real entry points, in subprocesses: the exit code, the message and the files left matter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SYNTHETIC = ["data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, n_test: 3000}"]


def run(module, args, cwd, env=None, timeout=300):
    env = {**os.environ, "WANDB_MODE": "disabled", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_paragraph(r, *needles):
    """Exit 2, stderr's first line the one `lmcal: error:` paragraph (printed once, no traceback), naming `needles`."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    err = r.stderr.strip("\n")
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("lmcal: error:") == 1, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.stderr.startswith("lmcal: error:") or lines[-1].startswith("lmcal: error:"), r.stderr[-3000:]
    assert not r.stderr.startswith("\n"), "the first line a user sees is blank"
    for n in needles:
        assert n in err, (n, err[-3000:])


# -- checkpoints name their network, never build code from their settings ------------------------------------------


def _evil_checkpoint(path: Path, victim: Path, where: str) -> None:
    """A checkpoint that passes torch.load(weights_only=True) and whose settings nest `_target_: builtins.open` in
    write mode: Hydra's instantiate on them would truncate `victim`."""
    opener = {"_target_": "builtins.open", "file": str(victim), "mode": "w"}
    net = {"_target_": "lmcal.models.awd_lstm.AWDLSTM", "emb_size": opener, "hidden_size": 8, "num_layers": 1}
    if where == "top":
        net = opener
    torch.save({"hyper_parameters": {"net": net, "vocab_size": 10, "data_cfg": {"name": "synthetic"}},
                "state_dict": {}}, path)
    assert torch.load(path, weights_only=True)["hyper_parameters"]["net"] == net  # safe unpickling lets it through


@pytest.mark.parametrize("where", ["nested", pytest.param("top", marks=pytest.mark.slow)])
def test_a_checkpoint_naming_code_runs_none_of_it_through_evaluate(where, tmp_path):
    victim, evil = tmp_path / "victim.txt", tmp_path / "evil.ckpt"
    victim.write_text("precious")
    _evil_checkpoint(evil, victim, where)
    r = run("lmcal.evaluate", [f"ckpt={evil}", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert_one_paragraph(r, str(evil), "builtins.open" if where == "top" else "emb_size")
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("key", ["init_ckpt", pytest.param("memory.base_ckpt", marks=pytest.mark.slow)])
def test_a_checkpoint_naming_code_runs_none_of_it_through_train(key, tmp_path):
    victim, evil = tmp_path / "victim.txt", tmp_path / "evil.ckpt"
    victim.write_text("precious")
    _evil_checkpoint(evil, victim, "nested")
    extra = ["model.memory_tau=5", "analysis.stages=[memory]"] if key == "memory.base_ckpt" else []
    r = run("lmcal.train", ["experiment=smoke", "logger=none", "trainer.max_epochs=1", *SYNTHETIC, *extra,
                            f"{key}={evil}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert_one_paragraph(r, str(evil), "emb_size")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before training


def test_every_trainable_network_is_in_the_allow_list():
    from lmcal.models.checkpoint import NETWORKS
    from lmcal.train import TRAINABLE

    assert {c.__name__ for c in NETWORKS.values()} >= set(TRAINABLE)


# -- one boundary: every entry point, every class of error a user can act on ----------------------------------------


def _train(tmp_path, *args, env=None):
    return run("lmcal.train", ["experiment=smoke", "logger=none", "trainer.max_epochs=1", *args,
                               f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env=env)


def test_data_root_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = _train(tmp_path, f"data.root={tmp_path / 'afile'}", "data.download=true")
    assert_one_paragraph(r, str(tmp_path / "afile"))


def test_data_root_in_a_symlink_loop(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    r = _train(tmp_path, f"data.root={tmp_path / 'loop'}", "data.download=false")
    assert_one_paragraph(r, str(tmp_path / "loop"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_an_unreadable_corpus_file(tmp_path):
    folder = tmp_path / "data" / "ptb"
    folder.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        (folder / f"ptb.{split}.txt").write_text("a b c\n")
    (folder / "ptb.train.txt").chmod(0)
    r = _train(tmp_path, f"data.root={tmp_path / 'data'}", "data.download=false")
    assert_one_paragraph(r, "ptb.train.txt")


def test_an_output_folder_that_cannot_be_written(tmp_path):
    out = "/sys/lmcal_probe/run"  # not writable, even by root
    r = run("lmcal.train", ["experiment=smoke", "logger=none", *SYNTHETIC, f"hydra.run.dir={out}"], tmp_path)
    assert_one_paragraph(r, "/sys/lmcal_probe")  # Hydra makes the run folder: its error reaches the boundary too
    r = run("lmcal.reproduce", ["profile=smoke", f"out={out}"], tmp_path)
    assert_one_paragraph(r, "/sys/lmcal_probe")
    _memory_json(tmp_path / "runs" / "t5" / "memory.json", "ptb")
    r = run("lmcal.report", [str(tmp_path / "runs"), "--out", out, "--wandb", "disabled"], tmp_path)
    assert_one_paragraph(r, "/sys/lmcal_probe")


def test_non_utf8_text(tmp_path):
    bad = tmp_path / "valid.txt"
    bad.write_bytes(b"the cat \xff\xfe sat\n")
    folder = tmp_path / "hf"
    _tiny_hf_folder(folder)
    r = run("lmcal.evaluate", ["model=hf", f"model.name_or_path={folder}", f"model.valid_text={bad}",
                               f"model.test_text={bad}", "logger=none", "stages=[entropy_rate]",
                               f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert_one_paragraph(r, str(bad), "UTF-8")


SLOW = pytest.mark.slow


@pytest.mark.parametrize("plugin", ["missing", *(pytest.param(p, marks=SLOW) for p in ("raises", "syntax"))])
def test_plugins_that_do_not_import(plugin, tmp_path):
    (tmp_path / "raises_mod.py").write_text("raise RuntimeError('the plugin broke')\n")
    (tmp_path / "syntax_mod.py").write_text("def (:\n")
    name = {"missing": "no_such_mod_29", "raises": "raises_mod", "syntax": "syntax_mod"}[plugin]
    env = {"LMCAL_PLUGINS": name, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    entry_points = [("lmcal.train", ["experiment=smoke"]), ("lmcal.reproduce", ["profile=smoke"]),
                    ("lmcal.evaluate", ["ckpt=x"])]
    for module, args in entry_points[:1] if plugin == "missing" else entry_points:  # (all three: slow tier)
        r = run(module, [*args, f"hydra.run.dir={tmp_path / 'run'}"] if module != "lmcal.reproduce" else
                [*args, f"out={tmp_path / 'out'}"], tmp_path, env=env)
        assert_one_paragraph(r, "LMCAL_PLUGINS", name)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["${oc.env:LMCAL_UNSET_29}", pytest.param("${evil:1}", marks=pytest.mark.slow)])
def test_interpolations_that_fail(value, tmp_path):
    r = _train(tmp_path, *SYNTHETIC, f"data.root={value}")
    assert_one_paragraph(r, "data.root")
    r = run("lmcal.reproduce", ["profile=smoke", f"out={tmp_path / 'out'}", f"dataset={value}"], tmp_path)
    assert_one_paragraph(r, "dataset")
    assert not (tmp_path / "out").exists()


def test_jobs_that_is_not_a_number(tmp_path):
    r = run("lmcal.reproduce", ["profile=smoke", f"out={tmp_path / 'out'}", "jobs=abc"], tmp_path)
    assert_one_paragraph(r, "jobs", "abc")
    assert not (tmp_path / "out" / "profile.yaml").exists()


def _tiny_hf_folder(folder: Path, tokenizer: bool = True) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = ["<unk>", "the", "cat", "sat", "on", "mat"]
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)


# -- no name from a file becomes a path unchecked -------------------------------------------------------------------


def _memory_json(path: Path, corpus: str, tau: int = 5, drop: tuple = ()) -> None:
    r = {"tau": tau, "corpus": corpus, "model": "m", "ce_limited_nats": 5.0, "mi_upper_bound_nats": 0.5,
         "mi_stderr_nats": 0.01, "alpha": 0.001, "alpha_stderr": 0.002, "entropy_calibrated_nats": 4.5,
         "test_tokens": 100, "cluster_size": 10}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in r.items() if k not in drop}))


def test_report_writes_a_traversing_corpus_name_inside_out(tmp_path):
    runs, out, escape = tmp_path / "runs", tmp_path / "a" / "b" / "report", tmp_path / "a" / "x"
    _memory_json(runs / "t5" / "memory.json", "../../x")  # from out, ../../x is tmp_path/a/x
    r = run("lmcal.report", [str(runs), "--out", str(out), "--wandb", "disabled"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list(escape.parent.glob("x.*")) and not list(tmp_path.rglob("x.md"))
    assert {p.name for p in out.iterdir()} >= {"memory_x.md", "memory_x.png", "memory_report.json"}
    assert "written as 'x'" in r.stderr + r.stdout


def test_report_refuses_an_output_file_linked_outside(tmp_path):
    runs, out, victim = tmp_path / "runs", tmp_path / "out", tmp_path / "victim.md"
    _memory_json(runs / "t5" / "memory.json", "ptb")
    out.mkdir()
    victim.write_text("precious")
    (out / "memory_ptb.md").symlink_to(victim)
    r = run("lmcal.report", [str(runs), "--out", str(out), "--wandb", "disabled"], tmp_path)
    assert_one_paragraph(r, "memory_ptb.md", "outside the output folder")
    assert victim.read_text() == "precious"


def test_report_on_results_missing_keys(tmp_path):
    _memory_json(tmp_path / "m" / "t5" / "memory.json", "ptb", drop=("mi_upper_bound_nats",))
    r = run("lmcal.report", [str(tmp_path / "m"), "--wandb", "disabled"], tmp_path)
    assert_one_paragraph(r, "memory.json", "mi_upper_bound_nats")
    dec = tmp_path / "d" / "decoders.json"
    dec.parent.mkdir()
    dec.write_text(json.dumps({"corpus": "ptb", "rows": [{"method": "model"}]}))
    r = run("lmcal.report", [str(tmp_path / "d"), "--wandb", "disabled"], tmp_path)
    assert_one_paragraph(r, "decoders.json", "params")


# -- no remote code from a Hugging Face folder ----------------------------------------------------------------------


def _remote_code_folder(folder: Path, marker: Path) -> None:
    """A folder whose config asks for its own Python (auto_map, an unknown model_type); that Python writes `marker`."""
    _tiny_hf_folder(folder)
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import GPT2Config as EvilConfig\n"
    (folder / "evil.py").write_text(code)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="evil_unknown_29", auto_map={"AutoConfig": "evil.EvilConfig",
                                                       "AutoModelForCausalLM": "evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["evil.EvilConfig", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))


def test_remote_code_is_refused_without_a_prompt(tmp_path, monkeypatch):
    from lmcal.errors import LmcalError
    from lmcal.models.hf import load_hf_model

    folder, marker = tmp_path / "evil_model", tmp_path / "ran"
    _remote_code_folder(folder, marker)
    asked = []
    monkeypatch.setattr("builtins.input", lambda *a: asked.append(a) or "y")  # a user who would say yes
    with pytest.raises(LmcalError, match="evil_model"):
        load_hf_model(folder)
    assert not asked and not marker.exists()
    r = run("lmcal.evaluate", ["model=hf", f"model.name_or_path={folder}", "logger=none",
                               f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert_one_paragraph(r, str(folder))
    assert not marker.exists()


def test_a_folder_without_tokenizer_files_is_refused_as_such(tmp_path):
    from lmcal.errors import LmcalError
    from lmcal.models.hf import load_hf_model

    _tiny_hf_folder(tmp_path / "m", tokenizer=False)
    with pytest.raises(LmcalError, match="no tokenizer files"):
        load_hf_model(tmp_path / "m")


# -- budgets before work --------------------------------------------------------------------------------------------

SRC = Path(__file__).resolve().parents[1] / "src" / "lmcal"


@pytest.mark.parametrize("out", ["/", *(pytest.param(o, marks=pytest.mark.slow) for o in (str(Path.home()), str(SRC),
                                                                                    str(SRC.parents[1])))])
def test_out_is_refused_for_root_home_and_the_projects_own_folders(out, tmp_path):
    before = sorted(Path(out).iterdir())
    r = run("lmcal.reproduce", ["profile=smoke", f"out={out}"], tmp_path)
    assert_one_paragraph(r, "Refusing to write a run into")
    assert sorted(Path(out).iterdir()) == before  # no lock, no folder, no profile.yaml


@pytest.mark.parametrize("name", ["caf\u00e9", *(pytest.param(n, marks=pytest.mark.slow) for n in ("a=b", "a,b"))])
def test_an_out_hydra_cannot_read_is_refused_before_any_folder_is_made(name, tmp_path):
    r = run("lmcal.reproduce", ["profile=smoke", f"out={tmp_path / name / 'run'}"], tmp_path)
    assert_one_paragraph(r, name)  # (Hydra cannot read that path; or, where every stage is composed first, that)
    assert not (tmp_path / name).exists()


SIZES = ["analysis.entropy_rate.horizon=10000000", "analysis.entropy_rate.prefix_len=10000000",
         "analysis.entropy_rate.samples_per_prefix=10000000", "model.hidden_size=10000000"]


@pytest.mark.parametrize("setting", [SIZES[0], *(pytest.param(s, marks=SLOW) for s in SIZES[1:])])
def test_sizes_beyond_reason_stop_train_before_work(setting, tmp_path):
    r = _train(tmp_path, *SYNTHETIC, "analysis.stages=[entropy_rate]", setting)
    assert_one_paragraph(r, "Sizes beyond reason", setting.split("=")[0].rsplit(".", 1)[-1], "force_size=true")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("setting", SIZES)
def test_sizes_beyond_reason_are_refused_unless_forced(setting):
    from hydra import compose, initialize_config_dir

    from lmcal.errors import LmcalError
    from lmcal.utils.settings import CONF_DIR
    from lmcal.utils.validate import check_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for forced in (False, True):
            cfg = compose(config_name="train", overrides=["experiment=smoke", setting, f"force_size={forced}"])
            if forced:
                check_config(cfg)  # the user said so
            else:
                with pytest.raises(LmcalError, match="Sizes beyond reason"):
                    check_config(cfg)


def test_the_presets_are_within_the_budget():
    from hydra import compose, initialize_config_dir

    from lmcal.utils.settings import CONF_DIR
    from lmcal.utils.validate import check_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for exp in sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")):
            check_config(compose(config_name="train", overrides=[f"experiment={exp}"]))
        check_config(compose(config_name="train", overrides=["model=awd_lstm", "analysis=default"]))


# -- the boundary's paragraphs, class by class (in-process: faults that a test cannot cause for real) ---------------


@pytest.mark.parametrize("error,needles", [
    (OSError(28, "No space left on device", "/out/results.json"), ("/out/results.json", "disk is full")),
    (PermissionError(13, "Permission denied", "/out/run"), ("/out/run", "permissions")),
    (OSError(30, "Read-only file system", "/mnt/ro/x"), ("/mnt/ro/x", "read-only")),
    (OSError(40, "Too many levels of symbolic links", "/data/loop"), ("/data/loop", "link")),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), ("Out of memory", "20.00 GiB")),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 800000000000 bytes"), ("Out of memory", "800000000000")),
    (MemoryError(), ("Out of memory",)),
    (UnicodeDecodeError("utf-8", b"ab\xff", 2, 3, "invalid start byte"), ("not UTF-8", "xff")),
])
def test_the_boundary_explains_each_class(error, needles, capsys):
    from lmcal.utils.boundary import boundary, explain

    for n in needles:
        assert n in explain(error)
    with pytest.raises(SystemExit) as e, boundary():
        raise error
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("lmcal: error: ") and err.count("\n") == 1


def test_a_bug_keeps_its_traceback():
    from lmcal.utils.boundary import boundary, explain

    assert explain(KeyError("x")) is None and explain(RuntimeError("shape mismatch")) is None
    with pytest.raises(KeyError), boundary():
        raise KeyError("x")


def test_an_interpolation_error_names_the_key():
    from omegaconf import OmegaConf

    from lmcal.utils.boundary import explain

    cfg = OmegaConf.create({"data": {"root": "${oc.env:LMCAL_UNSET_29}"}})
    with pytest.raises(Exception) as e:
        OmegaConf.to_container(cfg, resolve=True)
    assert "data.root" in explain(e.value) and "LMCAL_UNSET_29" in explain(e.value)


def test_a_corpus_file_that_is_not_utf8_is_named(tmp_path):
    from lmcal.data.corpora import tokenize_lines
    from lmcal.errors import DataError

    bad = tmp_path / "wiki.train.tokens"
    bad.write_bytes("caf\u00e9\n".encode("latin-1"))
    with pytest.raises(DataError, match=f"{bad} is not UTF-8 text"):
        tokenize_lines(bad)


def test_a_snapshots_profile_name_stays_inside_docs_runs(tmp_path):
    from lmcal.reporting.docs import snapshot

    run_dir, docs = tmp_path / "run", tmp_path / "docs"
    run_dir.mkdir()
    whole = json.loads((Path(__file__).parent / "fixtures" / "cpu_results_2026-11-24.json").read_text())
    (run_dir / "results.json").write_text(json.dumps({**whole, "profile": "../../../escaped"}))
    (run_dir / "REPORT.md").write_text("# r\n")
    dest = snapshot(run_dir, docs)
    assert dest == docs / "runs" / "escaped" and (dest / "REPORT.md").is_file()
    assert not (tmp_path / "escaped").exists()
