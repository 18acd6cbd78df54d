"""docs/RESULTS.md is regenerated from files runs wrote: reproduction snapshots and saved benchmark tables."""

import json

import pytest

from lmcal.docs import main
from lmcal.errors import LmcalError
from lmcal.reporting.docs import provenance, render, save_bench, snapshot


def _fake_run(folder):
    folder.mkdir()
    prov = {"command": "python -m lmcal.reproduce profile=smoke", "date": "2026-11-23 10:00 UTC",
            "machine": "test cpu, 2 cores, no GPU, torch x", "commit": "abc1234",
            # what the report stage adds (a snapshot of a real reproduction was refused for them)
            "matmul_gflop_per_s": 115.6, "precision": {"tf32_matmul": False, "float32_matmul_precision": "highest"}}
    (folder / "results.json").write_text(json.dumps({"profile": "smoke", "provenance": prov}))
    (folder / "REPORT.md").write_text("# lmcal reproduction\n\n## Entropy\n\n| a | b |\n|---|---|\n| 1.5 | 2 |\n\n"
                                      "![Figure 2](figure2_entropy_rate.png)\n\n| stage | folder |\n|---|---|\n"
                                      "| base | [ptb/base](ptb/base) |\n")
    (folder / "figure2_entropy_rate.png").write_bytes(b"png")


def test_results_md_comes_from_snapshots_and_saved_benchmarks(tmp_path):
    docs = tmp_path / "docs"
    _fake_run(tmp_path / "run")
    dest = snapshot(tmp_path / "run", docs)
    assert dest == docs / "runs" / "smoke" and (dest / "figure2_entropy_rate.png").read_bytes() == b"png"
    save_bench(docs / "bench" / "speed.md", "Speed", "| x | tokens/s |\n|---|---|\n| a | 12 |", command="python b.py")
    text = render(docs)
    assert "## Reproduction, profile `smoke`" in text and "*Command:* `python -m lmcal.reproduce profile=smoke`" in text
    assert "### Entropy" in text and "| 1.5 | 2 |" in text  # the report's own table, a heading level down
    assert "![Figure 2](runs/smoke/figure2_entropy_rate.png)" in text  # figures point into the snapshot
    assert "| base | ptb/base |" in text  # links into the (uncopied) run folders become plain text
    assert "## Benchmark: Speed" in text and "*Command:* `python b.py`" in text and "| a | 12 |" in text
    main(["--docs", str(docs)])
    assert (docs / "RESULTS.md").read_text() == text


def test_a_reports_title_and_provenance_are_not_repeated_under_the_sections(tmp_path):
    """RESULTS.md gave each reproduction two headings and its provenance line twice (the section's, then the
    report's own): the report's title, and its provenance line where it is the section's, are left out."""
    from lmcal.reporting.docs import provenance_line

    docs = tmp_path / "docs"
    _fake_run(tmp_path / "run")
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    line = provenance_line(r["provenance"])
    (tmp_path / "run" / "REPORT.md").write_text(f"# Entropy miscalibration against scale\n\n{line}\n\nbody\n")
    snapshot(tmp_path / "run", docs)
    text = render(docs)
    assert text.count(line) == 1 and "miscalibration" not in text and "body" in text


def test_provenance_names_command_date_machine():
    p = provenance("cmd")
    assert p["command"] == "cmd" and p["date"] and "cores" in p["machine"] and "torch" in p["machine"]


def test_snapshot_of_an_unfinished_run_is_one_paragraph(tmp_path, capsys):
    with pytest.raises(LmcalError, match="holds no finished reproduction"):
        snapshot(tmp_path, tmp_path / "docs")
    with pytest.raises(SystemExit) as e:
        main(["--docs", str(tmp_path / "docs"), "--snapshot", str(tmp_path / "nothing")])
    assert e.value.code == 2 and "no finished reproduction" in capsys.readouterr().err
    assert not (tmp_path / "docs" / "RESULTS.md").exists()


@pytest.mark.parametrize("prov", [["a", "b"], {"command": 3, "date": "d", "machine": "m"},
                                  {"command": "c", "date": "d", "machine": "m", "commit": {"x": 1}}])
def test_a_snapshot_whose_provenance_has_wrong_types_changes_nothing(tmp_path, prov):
    _fake_run(tmp_path / "run")
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    (tmp_path / "run" / "results.json").write_text(json.dumps({**r, "provenance": prov}))
    with pytest.raises(LmcalError, match="provenance"):
        snapshot(tmp_path / "run", tmp_path / "docs")
    assert not (tmp_path / "docs").exists()


def test_results_md_writes_the_claims_an_older_report_lacks(tmp_path):
    """issue 33: a snapshot whose REPORT.md predates lmcal.reporting.claims gets the effect sentences its results.json
    supports, above its report; one whose REPORT.md holds them all gets nothing added."""
    from pathlib import Path

    from lmcal.reporting.claims import results_claims

    # the cpu reproduction issue 33 read (2026-11-24), whose REPORT.md predated the claims module
    cpu = json.loads((Path(__file__).resolve().parent / "fixtures" / "cpu_results_2026-11-24.json").read_text())
    run = tmp_path / "docs" / "runs" / "cpu"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps(cpu))
    (run / "REPORT.md").write_text("# lmcal reproduction\n\nCalibration flattens the drift.\n")
    text = render(tmp_path / "docs")
    claims = results_claims(cpu)
    assert "### What the numbers support" in text and all(c.sentence in text for c in claims)
    assert text.index("### What the numbers support") < text.index("Calibration flattens the drift.")
    assert "Calibration lowers the drift but does not flatten it" in text
    (run / "REPORT.md").write_text("# lmcal reproduction\n\n" + "\n\n".join(c.sentence for c in claims) + "\n")
    assert "### What the numbers support" not in render(tmp_path / "docs")
