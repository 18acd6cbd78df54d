"""bench/sequence_fresh.py on a finished sequence_calibration run: its twisted check measured again in parts gives the
stage's own number on the stage's fresh prefixes, with the run's heads trained again or read from the file it wrote;
parts resume, refuse to overlap, and a heads file of another kind is refused in one paragraph."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lmcal.core.entropy_rate import clustered_mean
from lmcal.train import train
from lmcal.utils.settings import CONF_DIR
from tests.conftest import DATA_ROOT, HAVE_PTB

ROOT = Path(__file__).resolve().parents[1]


def _tool(*args, check=True):
    r = subprocess.run([sys.executable, "bench/sequence_fresh.py", *map(str, args)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_a_runs_twisted_check_measured_again_in_parts_is_the_stages_own_number(tmp_path, data_overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke", "logger=none", "analysis.stages=[]",
                                          "trainer.max_epochs=1", "data.max_train_tokens=4000",
                                          "trainer.enable_progress_bar=false", *data_overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "train")
    ckpt = train(cfg)["best_ckpt"]
    run = tmp_path / "run"
    sc = "analysis.sequence_calibration."
    r = subprocess.run([sys.executable, "-m", "lmcal.evaluate", f"ckpt={ckpt}", "stages=[sequence_calibration]",
                        "analysis=smoke", "logger=none", "device=cpu", f"{sc}particles=[2]", f"{sc}untwisted=false",
                        f"{sc}sv_alpha=0.05", f"{sc}num_prefixes=3", f"{sc}samples_per_prefix=2", f"{sc}prefix_len=5",
                        f"{sc}horizon=10", f"{sc}goal_prefixes=5", f"{sc}fit_prefixes=4", f"{sc}max_batch=16",
                        f"hydra.run.dir={run}", *([f"data_root={DATA_ROOT}"] if HAVE_PTB else [])],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    check = json.loads((run / "sequence_calibration.json").read_text())["twisted_check"]
    assert check["prefixes"] == 5 and check["params"]["particles"] == 2
    data = ["--data-root", DATA_ROOT] if HAVE_PTB else []
    out = tmp_path / "fresh"

    # the stage's 5 fresh prefixes in parts of 2 (0-1, 2-3, 4), the heads trained again: the stage's number
    _tool("--run", run, "--dir", out, "--ckpt", ckpt, "--device", "cpu", "--prefixes", "0:5", "--part", "2", *data)
    parts = [json.loads((out / f"part_{a}_{b}.json").read_text()) for a, b in ((0, 2), (2, 4), (4, 5))]
    level, se = clustered_mean(np.concatenate([np.asarray(p["tail_nats_per_generation"]) for p in parts]))
    # the same draws: equal up to float rounding (another process sums in other orders: 3e-9 relative on PTB), where
    # other draws of a run this small differ in the first decimal
    assert level == pytest.approx(check["tail_nats"], rel=1e-6)
    assert se == pytest.approx(check["tail_stderr_nats"], rel=1e-4)
    assert (out / "heads.pt").is_file() and all(p["seed"] == 1 and p["device"] == "cpu" for p in parts)

    # resumed: nothing measured again; more prefixes with the heads read from their file
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    r = _tool("--run", run, "--dir", out, "--ckpt", ckpt, "--device", "cpu", "--prefixes", "0:5", "--part", "2", *data)
    assert "already" in r.stdout and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    _tool("--run", run, "--dir", out, "--ckpt", ckpt, "--device", "cpu", "--prefixes", "5:7", "--heads",
          out / "heads.pt", *data)
    page = tmp_path / "page.md"
    r = _tool("--run", run, "--dir", out, "--out", page)
    text = page.read_text()
    assert "The law that generates is the law that was fitted and scored" in text and "| all 7 | 4 | 14 |" in text
    assert f"{check['tail_ppl']:.2f} ± {check['tail_ppl_stderr']:.2f} in the stage (the same draws: " in text
    assert "Verdict (" in text and "on 7 fresh prefixes (14 generations) and seed 1" in text

    # refused, one paragraph each, nothing written: overlapping parts, a heads file of another kind, a bad range
    before = sorted(p.name for p in out.iterdir())
    r = _tool("--run", run, "--dir", out, "--ckpt", ckpt, "--device", "cpu", "--prefixes", "1:3", *data, check=False)
    assert r.returncode == 2 and "overlap" in r.stderr and "Traceback" not in r.stderr
    torch.save({"format": 1, "state_dict": {"x": torch.zeros(2)}, "in_dim": 3, "hidden": 1, "rank": 1},
               tmp_path / "other.pt")
    r = _tool("--run", run, "--dir", out, "--ckpt", ckpt, "--device", "cpu", "--prefixes", "7:8", "--heads",
              tmp_path / "other.pt", *data, check=False)
    assert r.returncode == 2 and "heads file is not one" in r.stderr and "Traceback" not in r.stderr
    r = _tool("--run", run, "--dir", out, "--ckpt", ckpt, "--prefixes", "8:7", check=False)
    assert r.returncode == 2 and "LO:HI" in r.stderr
    r = _tool("--run", tmp_path / "nowhere", "--out", page, check=False)
    assert r.returncode == 2 and "is not there" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == before


def _fake_run(tmp_path: Path, name: str = "run", particles: int = 4, alpha: float = 0.01) -> Path:
    """A sequence_calibration run's two files, as the stage writes them, for the report alone (no model)."""
    from lmcal.stages.smc_fresh import NEEDED

    config = {k: 1 for k in NEEDED} | {"sv_explore": 0.5, "lr": 3e-3, "sv_alpha": 0.03, "score_tokens": None}
    params = {"particles": particles, "alpha": alpha, "alpha_stderr": 0.001}
    check = {"method": "smc", "label": f"twisted SMC, {particles} particles", "prefixes": 3, "params": params,
             "tail_nats": 4.0, "tail_stderr_nats": 0.1, "tail_ppl": 54.6, "tail_ppl_stderr": 5.5}
    row = {"method": "smc", "variant": "twisted", "params": params, "fit": {"settled": True}}
    result = {"twisted_check": check, "soft_value_alpha": {"alpha": 0.012}, "sv_alpha": 0.03, "seed": 0,
              "prefix_len": 5, "samples_per_prefix": 2, "horizon": 10, "law_horizon": 20, "tail_steps": 1,
              "num_prefixes": 3, "goal_prefixes": 3, "reference_test_ce_nats": 4.6, "tail_particles": None,
              "converge_tol": 0.1, "rows": [{"method": "model"}, row]}
    run = tmp_path / name
    run.mkdir()
    (run / "sequence_calibration.json").write_text(json.dumps(result))
    (run / "evaluation.json").write_text(json.dumps({"config": {"analysis": {"sequence_calibration": config}}}))
    return run


def _parts(out: Path, particles: int, alpha: float, spans, tails) -> None:
    """Parts as the script writes them, tails(lo, hi) giving each one's [hi - lo, 2]."""
    out.mkdir(exist_ok=True)
    for lo, hi, device in spans:
        (out / f"part_{lo}_{hi}.json").write_text(json.dumps({
            "label": f"twisted SMC, {particles} particles", "particles": particles, "alpha": alpha, "seed": 1,
            "prefixes": [lo, hi], "samples_per_prefix": 2, "heads_alpha": 0.012, "device": device, "seconds": 10.0,
            "tail_nats_per_generation": np.asarray(tails(lo, hi)).tolist()}))


def test_the_verdict_is_read_at_the_planned_count_and_only_an_interim_reading_before(tmp_path):
    """--planned: with fewer prefixes the page gives an interim reading and no verdict (reading it as parts land and
    stopping when it turns is optional stopping); at the planned count, the verdict and when it was read. Adjacent
    parts of one device share a row of the page."""
    run = _fake_run(tmp_path)
    out = tmp_path / "fresh"
    rng = np.random.default_rng(0)
    _parts(out, 4, 0.01, ((0, 3, "cpu"), (3, 6, "cpu"), (10, 12, "cuda")),
           lambda lo, hi: rng.normal(4.6, 0.01, (hi - lo, 2)))
    page = tmp_path / "page.md"
    _tool("--run", run, "--dir", out, "--out", page, "--planned", 20)
    text = page.read_text()
    assert "Interim, 8 of the 20 prefixes planned, 12 to measure" in text and "Verdict (" not in text
    assert "would decide it" not in text
    assert "nats apart: not the stage's draws" in text  # prefixes 0-2 are the stage's, whose 4.0 these are not
    assert "| 0–5 | 2 | 12 |" in text and "| 10–11 | 1 | 4 |" in text and "| all 8 | 3 | 16 |" in text
    _tool("--run", run, "--dir", out, "--out", page, "--planned", 8)
    text = page.read_text()
    assert "Verdict (within, read at 8 prefixes, 8 planned before they were measured;" in text
    assert "Interim" not in text
    r = _tool("--run", run, "--dir", out, "--out", page, "--planned", "0", check=False)
    assert r.returncode == 2 and "--planned 0" in r.stderr


def test_twice_the_particles_on_the_same_fresh_prefixes_names_the_row_by_the_studys_convergence_rule(tmp_path):
    """--twice: the row and the same study's row at twice its particles, paired on the prefixes both hold, judged by
    mark_convergence's rule: agreement names the row Algorithm 1 (in the claim too), a shift of 0.3 nats is a
    disagreement, a noisy pair is 'not shown'; before --twice-planned the reading is interim and the run's name
    stays; a run of other particles or another law is refused in one paragraph."""
    run, run2 = _fake_run(tmp_path), _fake_run(tmp_path, "run8", 8, 0.0102)
    rng = np.random.default_rng(1)
    base = rng.normal(4.6, 0.02, (40, 2))  # [prefix, S]: what both rows would give, up to a little noise
    _parts(tmp_path / "fresh", 4, 0.01, ((0, 20, "cpu"), (20, 40, "cpu")), lambda lo, hi: base[lo:hi])
    _parts(run2 / "fresh", 8, 0.0102, ((0, 3, "cpu"), (3, 20, "cpu"), (20, 30, "cpu")),
           lambda lo, hi: base[lo:hi] + rng.normal(0, 0.005, (hi - lo, 2)))
    page = tmp_path / "page.md"
    _tool("--run", run, "--dir", tmp_path / "fresh", "--out", page, "--twice", run2, "--twice-planned", 30)
    text = page.read_text()
    assert "on the 30 fresh prefixes both measured (0–29), paired by prefix" in text
    assert "| 4 | 0.01000 ± 0.00100 |" in text and "| 8 | 0.01020 ± 0.00100 |" in text and "| yes |" in text
    assert "4 and 8 particles agree (read at 30 prefixes, 30 planned before they were measured)" in text
    assert "named Algorithm 1 (twisted SMC, 4 particles)" in text
    assert "The 8-particle row's parts, prefixes 0–2, the stage's own: " in text  # its stage's 3 fresh prefixes
    assert "(Algorithm 1 (twisted SMC, 4 particles))" in text  # the setup sentence
    assert "Algorithm 1 (twisted SMC, 4 particles), on 40 fresh prefixes (80 generations)" in text  # the claim

    _tool("--run", run, "--dir", tmp_path / "fresh", "--out", page, "--twice", run2, "--twice-planned", 40)
    text = page.read_text()
    assert "Interim, 30 of the 40 prefixes planned, 10 to measure" in text and "| interim |" in text
    assert "Algorithm 1 (" not in text and "twisted SMC, 4 particles, on 40 fresh prefixes" in text

    shifted = tmp_path / "run8b"
    shutil.copytree(run2, shifted)
    for f in (shifted / "fresh").glob("part_*.json"):
        p = json.loads(f.read_text())
        p["tail_nats_per_generation"] = (np.asarray(p["tail_nats_per_generation"]) + 0.3).tolist()
        f.write_text(json.dumps(p))
    _tool("--run", run, "--dir", tmp_path / "fresh", "--out", page, "--twice", shifted)
    text = page.read_text()
    assert "4 and 8 particles disagree: the row is not converged" in text and "| **no** |" in text
    assert "twisted SMC, 4 particles, not converged, on 40 fresh prefixes" in text
    noisy = tmp_path / "run8c"
    shutil.copytree(run2, noisy)
    for f in (noisy / "fresh").glob("part_*.json"):
        p = json.loads(f.read_text())
        p["tail_nats_per_generation"] = (np.asarray(p["tail_nats_per_generation"])
                                         + rng.normal(0, 0.5, (len(p["tail_nats_per_generation"]), 2))).tolist()
        f.write_text(json.dumps(p))
    _tool("--run", run, "--dir", tmp_path / "fresh", "--out", page, "--twice", noisy)
    assert "convergence not shown" in page.read_text()

    other = _fake_run(tmp_path, "run16", 16, 0.01)
    r = _tool("--run", run, "--dir", tmp_path / "fresh", "--out", page, "--twice", other, check=False)
    assert r.returncode == 2 and "particles 4 against 16 (twice them wanted)" in r.stderr
    assert "Traceback" not in r.stderr
    law = tmp_path / "run8d"
    shutil.copytree(run2, law)
    res = json.loads((law / "sequence_calibration.json").read_text())
    (law / "sequence_calibration.json").write_text(json.dumps(res | {"law_horizon": 40}))
    r = _tool("--run", run, "--dir", tmp_path / "fresh", "--out", page, "--twice", law, check=False)
    assert r.returncode == 2 and "law_horizon 20 against 40" in r.stderr
    r = _tool("--run", run, "--dir", tmp_path / "fresh", "--out", page, "--twice-planned", 3, check=False)
    assert r.returncode == 2 and "go with --twice" in r.stderr


def test_a_runs_settings_are_read_as_numbers_with_one_clear_error():
    """fresh_setup takes only numbers of the right kind from the run's files; the α the heads were first trained at
    comes from sv_alpha, else from the soft-value row's first refit (a run that trained them at the untwisted α*)."""
    from lmcal.errors import LmcalError
    from lmcal.stages.smc_fresh import NEEDED, fresh_setup

    config = {k: 1 for k in NEEDED} | {"sv_explore": 0.5, "lr": 3e-3, "sv_alpha": None, "score_tokens": None}
    result = {"twisted_check": {"method": "smc", "label": "twisted SMC, 4 particles", "prefixes": 5,
                                "params": {"particles": 4, "alpha": 0.01}},
              "soft_value_alpha": {"alpha": 0.012}, "sv_alpha": None, "seed": 0, "prefix_len": 5,
              "samples_per_prefix": 2, "horizon": 10, "law_horizon": 20, "tail_steps": 1, "num_prefixes": 3,
              "goal_prefixes": 5, "reference_test_ce_nats": 4.1, "tail_particles": None,
              "rows": [{"method": "model"}, {"method": "soft_value", "refits": [{"trained_at_alpha": 0.03}]}]}
    s = fresh_setup(result, config)
    assert (s["particles"], s["alpha"], s["heads_alpha"], s["sv_trained_at"]) == (4, 0.01, 0.012, 0.03)
    assert fresh_setup(result | {"sv_alpha": 0.02}, config)["sv_trained_at"] == 0.02
    for bad, match in (({"twisted_check": None}, "no twisted check"),
                       ({"horizon": "200; rm -rf /"}, "horizon"), ({"law_horizon": True}, "law_horizon"),
                       ({"reference_test_ce_nats": float("nan")}, "reference_test_ce_nats")):
        with pytest.raises(LmcalError, match=match):
            fresh_setup(result | bad, config)
    with pytest.raises(LmcalError, match="max_batch missing"):
        fresh_setup(result, {k: v for k, v in config.items() if k != "max_batch"})
