"""`make gpu-check`'s paper_mini part: the paper profile's miniature run end to end, each stage's measured seconds
beside the plan check's estimate, the GPU's utilisation once a second, and the FLOP rates it measured.

    python tools/paper_mini.py --out outputs/gpu-check/paper_mini [--tiny] [--timeout 480] [ARGS ...]

It runs `python -m lmcal.reproduce profile=paper_mini out=OUT/run ARGS...` (--tiny adds TINY: the same keys with tiny
networks, for a CPU), sampling `nvidia-smi` once a second where there is one, then writes OUT/REPORT.md (a table:
stage | estimate | measured | ratio) and OUT/gpu_rates.json: each analysis kind's FLOPs over its measured seconds
less its idle terms. The plan check reads docs/bench/gpu_rates.json in place of its assumed rate: copy the file
there from a GPU run. Prints the report's lines after a marker line, then one JSON line (for tools/gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- gpu-check part -->"  # a part's own lines for the report follow this line of its output (gpu_check.py)
TINY_LSTM = "model.emb_size=16,model.hidden_size=32,data.max_train_tokens=20000,data.max_eval_tokens=8000"
TINY = [f"base=[experiment=paper,trainer.max_epochs=1,{TINY_LSTM}]",
        f"tau=[experiment=paper,trainer.max_epochs=1,{TINY_LSTM},hydra/launcher=local_parallel,hydra.launcher.n_jobs=2]",
        "transformer.base=[experiment=ptb_transformer,trainer.max_epochs=1,model.n_embd=32,model.n_layer=2,"
        "model.n_head=2,data.max_train_tokens=20000,data.max_eval_tokens=8000]",
        "markov.base=[experiment=markov,trainer.max_epochs=1,data.max_train_tokens=20000]",
        "markov.tau=[experiment=markov,trainer.max_epochs=1,data.max_train_tokens=20000]",
        "jobs=2", "logger=csv"]


def plan_terms(args: list[str]) -> dict:
    """{stage: {seconds, flops, idle_seconds}} of the plan check for the same profile and overrides."""
    sys.path.insert(0, str(ROOT / "src"))
    from lmcal.pipeline.check import check
    from lmcal.pipeline.plan import load_profile

    terms: dict = {}
    check(load_profile(["profile=paper_mini", *args]), terms=terms)
    return terms


def sample_gpu(path: Path) -> subprocess.Popen | None:
    """`nvidia-smi` writing the GPU's utilisation and memory once a second to `path`; None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,index,utilization.gpu,memory.used",
                             "--format=csv,noheader,nounits", "-l", "1"], stdout=open(path, "w"),
                            stderr=subprocess.DEVNULL)


def measured(run: Path) -> dict[str, float]:
    """{stage: seconds} of the stages the run finished (its stages/<name>.json records)."""
    sys.path.insert(0, str(ROOT / "src"))
    from lmcal.utils import records

    out = {}
    for p in sorted((run / "stages").glob("*.json")):
        try:  # (a record that is not whole, or a stage that did not finish: not measured)
            r, why = records.load(p, {"status": str, "seconds?": records.Range(lo=0.0)})
        except OSError:
            continue
        if why is None and r["status"] == "done" and "seconds" in r:
            out[p.stem] = float(r["seconds"])
    return out


def rates(terms: dict, seconds: dict[str, float]) -> dict[str, float]:
    """{kind: TFLOP/s}: each analysis kind's FLOPs over its stages' measured seconds less their idle terms (a stage
    whose measured time is within its idle terms gives none)."""
    flops, busy = {}, {}
    for name, s in seconds.items():
        t = terms.get(name)
        k = t.get("kind") if t else ""
        if not k or not t["flops"] or s <= t["idle_seconds"]:
            continue
        flops[k] = flops.get(k, 0.0) + t["flops"]
        busy[k] = busy.get(k, 0.0) + s - t["idle_seconds"]
    return {k: flops[k] / busy[k] / 1e12 for k in flops if busy[k] > 0}


def table(terms: dict, seconds: dict[str, float], wall: float, planned: float) -> list[str]:
    lines = [f"The whole run: {wall:.0f} s measured against {planned:.0f} s estimated (stages side by side).", "",
             "| stage | estimate (s) | of which idle (s) | measured (s) | measured / estimate |",
             "|---|---:|---:|---:|---:|"]
    for name, t in terms.items():
        s = seconds.get(name)
        ratio = f"{s / t['seconds']:.2f}" if s is not None and t["seconds"] > 0 else "–"
        lines.append(f"| {name} | {t['seconds']:.0f} | {t['idle_seconds']:.0f} | "
                     f"{'not finished' if s is None else f'{s:.0f}'} | {ratio} |")
    return lines


def utilisation(path: Path) -> str:
    """'GPU busy: mean 63%, 412 samples, peak memory 21,400 MiB' from the sampler's file; '' without one."""
    try:
        rows = [ln.split(",") for ln in path.read_text().splitlines() if ln.count(",") >= 3]
        util = [float(r[2]) for r in rows]
        mem = [float(r[3]) for r in rows]
    except (OSError, ValueError, IndexError):
        return ""
    if not util:
        return ""
    return (f"GPU utilisation once a second: mean {sum(util) / len(util):.0f}%, {len(util)} samples, peak memory "
            f"{max(mem):,.0f} MiB ({path.name}).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="outputs/gpu-check/paper_mini")
    ap.add_argument("--tiny", action="store_true", help="tiny networks under the same keys (a CPU's rehearsal)")
    ap.add_argument("--timeout", type=float, default=480.0)
    ap.add_argument("args", nargs="*", help="overrides of the profile (key=value)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args = [*(TINY if a.tiny else []), *a.args, f"out={out / 'run'}"]
    terms = plan_terms(args)
    total = max((t["pipeline_seconds"] for t in terms.values()), default=0.0)
    sampler = sample_gpu(out / "gpu_utilisation.csv")
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "lmcal.reproduce", "profile=paper_mini", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=a.timeout)
        rc, tail = r.returncode, (r.stdout + r.stderr).strip().splitlines()[-15:]
    except subprocess.TimeoutExpired:
        rc, tail = None, [f"timed out after {a.timeout:.0f} s"]
    finally:
        if sampler is not None:
            sampler.terminate()
    wall = time.perf_counter() - t0
    seconds = measured(out / "run")
    got = rates(terms, seconds)
    (out / "gpu_rates.json").write_text(json.dumps({"tflops": got, "measured_s": seconds}, indent=1))
    lines = [f"_{'exit ' + str(rc) if rc is not None else 'timed out'} in {wall:.0f} s; its folder {out / 'run'}_",
             "", *table(terms, seconds, wall, total), "", utilisation(out / "gpu_utilisation.csv"),
             "Measured FLOP rates (gpu_rates.json): " + (", ".join(f"{k} {v:.3g} TFLOP/s" for k, v in
                                                                  sorted(got.items())) or "none"), ""]
    if rc != 0:
        lines += ["```", *tail, "```", ""]
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")
    print(MARK, *lines, sep="\n")
    print(json.dumps({"rc": rc, "seconds": wall, "estimate_s": total, "stages": seconds,
                      "tflops": {k: v for k, v in got.items() if math.isfinite(v)}}))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
