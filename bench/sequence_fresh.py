"""Algorithm 1's twisted check measured again on more fresh prefixes, part by part, on any device: a finished
sequence_calibration run's twisted row with the fewest particles, at the run's α* and twisted by the run's own
soft-value heads (lmcal.stages.smc_fresh), and the verdict REPORT.md's rule gives on all its parts together.

    python bench/sequence_fresh.py --run RUN --ckpt CKPT [--data-root ROOT] [--device cpu] --prefixes 600:1200 \\
        [--part 200] [--heads FILE] [--dir RUN/fresh] [--max-batch N]          # measure prefixes 600..1199
    python bench/sequence_fresh.py --run RUN [--dir RUN/fresh] [--planned N] --out docs/bench/sequence_fresh.md
                                                                                        # the verdict (read at N)
    python bench/sequence_fresh.py --run RUN ... --twice RUN2 [--twice-dir RUN2/fresh] [--twice-planned M] --out ...
                                                                # and whether 2K particles agree (read at M prefixes)

RUN is the stage's folder (its sequence_calibration.json and evaluation.json, as python -m lmcal.evaluate writes
them). Each part of --part prefixes lands in --dir as part_<lo>_<hi>.json once measured: a killed run loses one part
at most, and a part already there is not measured again. The heads are trained again from the run's settings the
first time (on the device that trained the run's, they are its heads: their α refit must equal the run's) and saved
as --dir/heads.pt; another machine takes that file with --heads (read as tensors: weights_only=True). Prefixes
[0, goal_prefixes) are the stage's own fresh ones, at its seed: measured here they give its number again. --planned
fixes, before they are measured, how many prefixes the verdict is read at (units_to_decide on the first ones says how
many): with fewer, the page gives an interim reading only, since a verdict read as parts land and stopped when it
turns would be stated with more confidence than it has.

--twice: the row's convergence on these fresh prefixes. RUN2 is a run of the same study at twice the particles (its
own α*, fitted at its own count; the same law, seeds and heads), measured here in its own parts (--run RUN2 --dir
RUN2/fresh --prefixes ...); the two rows, paired by prefix on the prefixes both hold, are judged by the study's own
rule (lmcal.stages.smc_study.mark_convergence), and the row is named Algorithm 1 only where they agree. As with the
verdict, --twice-planned fixes beforehand how many prefixes that is read at: fewer give an interim reading, and the
row keeps the run's name.

The project's own measurement (the cpu profile's model, docs/bench/sequence_fresh.md) keeps the run's two JSON files
and every part in git, in docs/bench/sequence_fresh/ (--run docs/bench/sequence_fresh/run --dir
docs/bench/sequence_fresh; heads.pt stays out of git): the 5,600 prefixes take about ten core-hours, more than one
sitting, and parts left on a scratch disk were once lost with it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from lmcal.core.entropy_rate import clustered_mean
from lmcal.errors import LmcalError
from lmcal.models.step_lm import as_step_lm
from lmcal.reporting.claims import units_to_decide, within
from lmcal.reporting.docs import add_out_option, provenance, save_bench
from lmcal.stages.smc_fresh import check_model, fresh_setup, heads_of, measure_part
from lmcal.stages.smc_study import Z, convergence_word, label, mark_convergence, study_differences
from lmcal.stages.targets import load_checkpoint_and_data
from lmcal.utils.boundary import boundary
from lmcal.utils.device import apply_precision_policy
from lmcal.utils.io import read_json, write_json_atomic

PART = re.compile(r"part_(\d+)_(\d+)\.json")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S")  # progress lines, as the stages' own
    logging.getLogger("lmcal").setLevel(logging.INFO)
    with boundary():
        run(argv)


def run(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the finished sequence_calibration run's folder")
    ap.add_argument("--dir", type=Path, help="where the parts and heads.pt go (default: RUN/fresh)")
    ap.add_argument("--ckpt", help="the run's checkpoint (to measure)")
    ap.add_argument("--data-root", help="the folder holding the corpus (default: as the checkpoint's settings say)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefixes", help="LO:HI, the fresh prefixes to measure (0 is the stage's first)")
    ap.add_argument("--part", type=int, default=200, help="prefixes a part, each saved as it finishes")
    ap.add_argument("--heads", type=Path, help="a heads.pt written by this script for the same run")
    ap.add_argument("--max-batch", type=int, help="particles a batch (default: 4 x the run's max_batch, as its SMC)")
    ap.add_argument("--planned", type=int, help="the prefixes in all at which the verdict is read, fixed before "
                    "measuring them (units_to_decide on the first ones): fewer give an interim verdict only")
    ap.add_argument("--twice", type=Path, help="a run of the same study at twice the particles: the page tests the "
                    "row's convergence against its parts on the same fresh prefixes")
    ap.add_argument("--twice-dir", type=Path, help="--twice's parts (default: RUN2/fresh)")
    ap.add_argument("--twice-planned", type=int, help="the prefixes in common at which convergence is read, fixed "
                    "before measuring them: fewer give an interim reading")
    ap.add_argument("--title", default="Algorithm 1's twisted check on more fresh prefixes", help="the page's")
    add_out_option(ap, "sequence_fresh")
    args = ap.parse_args(argv)
    if (args.prefixes is None) != (args.ckpt is None):
        ap.error("give --ckpt and --prefixes to measure, or neither (with --out) to write the verdict")
    if args.planned is not None and args.planned < 1:
        ap.error(f"--planned {args.planned}: give the number of prefixes the verdict is read at (at least 1)")
    if args.twice_planned is not None and args.twice_planned < 1:
        ap.error(f"--twice-planned {args.twice_planned}: give the number of prefixes convergence is read at (at "
                 "least 1)")
    if (args.twice_dir or args.twice_planned) and args.twice is None:
        ap.error("--twice-dir and --twice-planned go with --twice RUN2")
    s = setup(args.run)
    out = args.dir or args.run / "fresh"
    argv_text = "python bench/sequence_fresh.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    if args.prefixes is not None:
        measure(args, s, out, argv_text)
    if args.out or args.prefixes is None:
        report(args, s, out, argv_text)


def setup(run_dir: Path) -> dict:
    files = [run_dir / "sequence_calibration.json", run_dir / "evaluation.json"]
    for f in files:
        if not f.is_file():
            raise LmcalError(f"{f} is not there: --run takes the folder of a finished sequence_calibration run "
                             "(python -m lmcal.evaluate 'stages=[sequence_calibration]' writes both files).")
    try:
        result, ev = read_json(files[0]), read_json(files[1])
        config = ev["config"]["analysis"]["sequence_calibration"]
    except (ValueError, KeyError, TypeError) as e:
        raise LmcalError(f"{run_dir}: its JSON files are not a sequence_calibration run's ({e!r}).") from None
    return fresh_setup(result, config, str(run_dir))


def ranges(text: str, part: int) -> list[tuple[int, int]]:
    m = re.fullmatch(r"(\d+):(\d+)", text or "")
    if not m or int(m[1]) >= int(m[2]) or part < 1:
        raise LmcalError(f"--prefixes {text!r} --part {part}: give LO:HI with 0 <= LO < HI, and a part of at least "
                         "one prefix.")
    lo, hi = int(m[1]), int(m[2])
    return [(a, min(a + part, hi)) for a in range(lo, hi, part)]


def measure(args, s: dict, out: Path, argv_text: str) -> None:
    todo = [r for r in ranges(args.prefixes, args.part) if not (out / f"part_{r[0]}_{r[1]}.json").is_file()]
    found = read_parts(out, s)  # the parts there already: theirs must not overlap the new ones
    clash = [(a, b) for a, b in todo for c, d, _ in found if a < d and c < b]
    if clash:
        raise LmcalError(f"{out} holds parts that overlap {clash[0][0]}:{clash[0][1]} without being it: measure "
                         "the same parts again (the same --part), or other prefixes. Nothing was measured.")
    if not todo:
        print(f"every part of {args.prefixes} is in {out} already")
        return
    apply_precision_policy()  # TF32 off, as the stage ran (lmcal.utils.device)
    net, _, dm = load_checkpoint_and_data(args.ckpt, args.data_root, args.device)
    lm = as_step_lm(net)
    check_model(lm, dm.tokens("test"), s)
    heads_file = args.heads or (out / "heads.pt" if (out / "heads.pt").is_file() else None)
    saved = torch.load(heads_file, map_location="cpu", weights_only=True) if heads_file else None
    head, alpha, to_save = heads_of(lm, dm.tokens("train"), dm.tokens("valid"), s, saved)
    out.mkdir(parents=True, exist_ok=True)
    if heads_file is None:
        tmp = out / f".heads.pt.{os.getpid()}"
        torch.save(to_save, tmp)
        os.replace(tmp, out / "heads.pt")
    print(f"{s['label']} at alpha {s['alpha']:.6f}, heads' alpha {alpha:.6f} (the run's), on "
          f"{args.device}: {len(todo)} part(s) of {args.prefixes}", flush=True)
    for lo, hi in todo:
        t0 = time.perf_counter()
        tails = measure_part(lm, head, dm.tokens("valid"), s, lo, hi, args.max_batch or 4 * s["max_batch"])
        level, se = clustered_mean(tails)
        write_json_atomic(out / f"part_{lo}_{hi}.json", {
            "label": s["label"], "particles": s["particles"], "alpha": s["alpha"], "seed": s["seed"] + 1,
            "prefixes": [lo, hi], "samples_per_prefix": s["samples_per_prefix"], "heads_alpha": alpha,
            "tail_nats_per_generation": tails.tolist(), "device": str(args.device),
            "seconds": time.perf_counter() - t0, "provenance": provenance(argv_text)})
        print(f"prefixes {lo}:{hi}: {math.exp(level):.1f} +- {math.exp(level) * se:.1f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


def read_parts(out: Path, s: dict) -> list[tuple[int, int, dict]]:
    """The parts in `out` for this run's row, by their first prefix; LmcalError for a part of another row."""
    parts = []
    for f in sorted(out.glob("part_*.json")) if out.is_dir() else []:
        m = PART.fullmatch(f.name)
        try:
            p = read_json(f)
            tails = np.asarray(p["tail_nats_per_generation"], float)
            same = (m and p["prefixes"] == [int(m[1]), int(m[2])] and p["particles"] == s["particles"]
                    and p["alpha"] == s["alpha"] and p["seed"] == s["seed"] + 1
                    and tails.shape == (int(m[2]) - int(m[1]), s["samples_per_prefix"]))
        except (ValueError, KeyError, TypeError):
            same = False
        if not same:
            raise LmcalError(f"{f} is not a part of {s['label']} at this run's α* and seed (another run's, or "
                             "edited): move it out of the folder.")
        parts.append((int(m[1]), int(m[2]), p | {"tails": tails}))
    parts.sort(key=lambda x: x[0])
    for (_, b, _), (c, d, _) in zip(parts, parts[1:], strict=False):
        if c < b:
            raise LmcalError(f"{out} holds parts that overlap ({c}:{d} starts before {b}): keep one of them.")
    return parts


def report(args, s: dict, out: Path, argv_text: str) -> None:
    parts = read_parts(out, s)
    if not parts:
        raise LmcalError(f"{out} holds no parts: measure some first (--ckpt and --prefixes).")
    pair = twice(args, s, parts) if args.twice else None
    name = pair["label"] if pair else s["label"]
    tails = np.concatenate([p["tails"] for _, _, p in parts])  # [N, S]
    level, se = (float(x) for x in clustered_mean(tails))
    n, gens = tails.shape[0], tails.size
    span = ", ".join(f"{b[0][0]}–{b[-1][1] - 1}" for b in blocks(parts, most=None, by_device=False))
    devices = ", ".join(sorted({p["device"] for _, _, p in parts}))
    lines = [f"The law that generates is the law that was fitted and scored: the twisted check of the run in "
             f"`{args.run}` ({name}), P̂_α ∝ P̂^(1+α) over L = {s['law_horizon']} words at its α* = "
             f"{s['alpha']:.5f}, generated by SMC at {s['particles']} particles twisted by the run's own soft-value "
             f"heads (their α refit {parts[0][2]['heads_alpha']:.5f}, the run's), read over the first "
             f"{s['horizon']} words; the last {s['tail_steps']} words' entropy by nested SMC runs; "
             f"{s['samples_per_prefix']} generations from each fresh prefix (another draw of validation points, the "
             f"stage's: {span}) at seed {s['seed'] + 1}; on {devices}. Prefixes are the units of the standard error.",
             "",
             "| prefixes | parts | generations | exp H, last tenth | device | seconds |", "|---|---|---|---|---|---|"]
    for block in blocks(parts):
        t = np.concatenate([p["tails"] for _, _, p in block])
        lv, e = (float(x) for x in clustered_mean(t))
        secs = sum(p["seconds"] for _, _, p in block)
        lines.append(f"| {block[0][0]}–{block[-1][1] - 1} | {len(block)} | {t.size:,} | {math.exp(lv):.1f} ± "
                     f"{math.exp(lv) * e:.1f} | {block[0][2]['device']} | {secs:.0f} |")
    lines += [f"| all {n:,} | {len(parts)} | {gens:,} | {math.exp(level):.1f} ± {math.exp(level) * se:.1f} | | "
              f"{sum(p['seconds'] for _, _, p in parts):.0f} |", ""]
    if own := own_prefixes(parts, s):
        lines += [own, ""]
    if pair:
        lines += [pair["text"], ""]
    claim = within(f"{name}, on {n:,} fresh prefixes ({gens:,} generations) and seed {s['seed'] + 1},", level,
                   se, math.exp(s["reference_test_ce_nats"]))
    planned = args.planned
    interim = bool(planned) and n < planned  # before the count fixed in advance: a verdict now is optional stopping
    if interim:
        lines.append(f"Interim, {n:,} of the {planned:,} prefixes planned, {planned - n:,} to measure (the verdict is "
                     f"read once, at {planned:,}: reading it as parts land and stopping when it turns would overstate "
                     f"it): {claim.sentence}")
    else:
        when = f", read at {n:,} prefixes, {planned:,} planned before they were measured" if planned else ""
        lines.append(f"Verdict ({claim.verdict}{when}; lmcal.reporting.claims.within): {claim.sentence}")
    more = units_to_decide(level, se, n, math.exp(s["reference_test_ce_nats"]))
    if more and not interim:
        lines.append(f"At this level about {more:,} prefixes in all would decide it ({more - n:,} more), if each "
                     f"prefix's spread stays what these {n:,} show (lmcal.reporting.claims.units_to_decide).")
    if s["check"].get("tail_alpha_stderr_nats") is not None:
        lines.append(f"That is the law at the run's fitted α*; α*'s standard error would move its level by "
                     f"±{s['check']['tail_alpha_stderr_nats']:.3f} nats more.")
    body = "\n".join(lines)
    print(body)
    save_bench(args.out, args.title, body, command=argv_text)


def own_prefixes(parts: list[tuple[int, int, dict]], s: dict) -> str | None:
    """The sentence comparing the parts on the stage's own fresh prefixes [0, goal_prefixes) with the stage's number
    (the same draws), or None where the parts do not hold them all."""
    c, g = s["check"], s["check"].get("prefixes")
    own = [p["tails"] for a, b, p in parts if b <= (g or 0)]
    if not g or sum(len(t) for t in own) != g:
        return None
    lv, e = (float(x) for x in clustered_mean(np.concatenate(own)))
    d = lv - c["tail_nats"]
    same = ("identical in every bit" if (lv, e) == (c["tail_nats"], c["tail_stderr_nats"]) else
            f"{d:+.1e} nats apart, the processes' float rounding" if abs(d) <= 1e-6 * abs(c["tail_nats"]) else
            f"{d:+.4f} nats apart: not the stage's draws, so another model, heads or code than the run's")
    return (f"Prefixes 0–{g - 1}, the stage's own: {math.exp(lv):.2f} ± {math.exp(lv) * e:.2f} here, "
            f"{c['tail_ppl']:.2f} ± {c['tail_ppl_stderr']:.2f} in the stage (the same draws: {same}).")


# what the run at twice the particles must share with the row's run for the two to be one study's rows
SAME_LAW = ("seed", "prefix_len", "samples_per_prefix", "horizon", "law_horizon", "tail_steps", "tail_particles",
            "sv_trained_at", "heads_alpha", "reference_test_ce_nats", "converge_tol")


def twice(args, s: dict, parts: list[tuple[int, int, dict]]) -> dict:
    """The row's convergence against --twice's row (twice the particles, its own α*) on the fresh prefixes both hold,
    by the study's rule (mark_convergence): {"label": the row's name, "text": the page's paragraph}. Before
    --twice-planned prefixes in common the reading is interim and the name the run's."""
    s2 = setup(args.twice)
    parts2 = read_parts(args.twice_dir or args.twice / "fresh", s2)
    differ = study_differences(s, s2, SAME_LAW)
    if s2["particles"] != 2 * s["particles"]:
        differ.insert(0, f"particles {s['particles']} against {s2['particles']} (twice them wanted)")
    if differ:
        raise LmcalError(f"{args.twice} is not the same study at twice the particles, so it cannot test this row's "
                         f"convergence: {', '.join(differ)}.")
    if s["alpha_stderr"] is None or s2["alpha_stderr"] is None or s["fit_settled"] is None \
            or s2["fit_settled"] is None:
        raise LmcalError("a run here keeps no standard error of its α* or no fit of its row (written before they were "
                         "kept): run its stage again to test convergence.")
    by = [{lo + i: t for lo, _, p in ps for i, t in enumerate(p["tails"])} for ps in (parts, parts2)]  # prefix: [S]
    common = sorted(by[0].keys() & by[1].keys())
    if not common:
        raise LmcalError(f"the parts of {args.twice} share no fresh prefix with this row's: measure the same ones.")
    rows = [{"variant": "twisted", "params": {"particles": x["particles"], "alpha": x["alpha"],
                                              "alpha_stderr": x["alpha_stderr"]},
             "fit": {"settled": x["fit_settled"]}, "tail_nats_per_generation": np.stack([b[i] for i in common])}
            for x, b in zip((s, s2), by, strict=True)]  # each [n, S], row i of both the same prefix
    tol = s["converge_tol"]
    mark_convergence(rows, tol)
    n, planned = len(common), args.twice_planned
    interim = bool(planned) and n < planned
    span = ", ".join(f"{a}–{b - 1}" for a, b in _spans(common))
    lines = [f"Convergence on these fresh prefixes: the row against `{args.twice}`, the same study at "
             f"{s2['particles']} particles with its own α* (fitted at its own count on the same validation "
             f"continuations; the same law, heads and seed), on the {n:,} fresh prefixes both measured ({span}), "
             f"paired by prefix; converged where the last tenths and the α*s agree within {Z:g} standard errors, both "
             f"fits settled, and the difference's {Z:g}-standard-error interval lies within ±{tol:g} nats "
             "(lmcal.stages.smc_study.mark_convergence, the study's rule):", "",
             "| particles | α* | exp H, last tenth | vs the other, nats | converged |", "|---|---|---|---|---|"]
    for r in rows:
        lv, e = (float(x) for x in clustered_mean(r["tail_nats_per_generation"]))
        word = "interim" if interim else convergence_word(r)
        lines.append(f"| {r['params']['particles']} | {r['params']['alpha']:.5f} ± {r['params']['alpha_stderr']:.5f} "
                     f"| {math.exp(lv):.1f} ± {math.exp(lv) * e:.1f} | {r['tail_against_nats']:+.3f} ± "
                     f"{r['tail_against_stderr_nats']:.3f} | {word} |")
    if own := own_prefixes(parts2, s2):
        lines += ["", f"The {s2['particles']}-particle row's parts, {own[0].lower()}{own[1:]}"]
    r = rows[0]
    if interim:
        lines += ["", f"Interim, {n:,} of the {planned:,} prefixes planned, {planned - n:,} to measure: convergence is "
                      f"read once, at {planned:,}, and until then the row keeps the run's name ({s['label']})."]
        return {"label": s["label"], "text": "\n".join(lines)}
    when = f" (read at {n:,} prefixes, {planned:,} planned before they were measured)" if planned else ""
    say = {"agrees": f"{s['particles']} and {s2['particles']} particles agree{when}: the row converged",
           "disagrees": f"{s['particles']} and {s2['particles']} particles disagree{when}: the row is not converged",
           "not shown": f"no disagreement{when}, but the interval reaches beyond ±{tol:g} nats: convergence not shown"}
    lines += ["", f"{say[r['convergence']]}, and is named {label(r)}."]
    return {"label": label(r), "text": "\n".join(lines)}


def _spans(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted integers as runs [a, b) of consecutive ones."""
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [(a, b) for a, b in out]


def blocks(parts: list[tuple[int, int, dict]], most: int | None = 600, by_device: bool = True
           ) -> list[list[tuple[int, int, dict]]]:
    """Runs of adjacent parts (sorted, as read_parts gives them), each from one device where by_device, at most
    `most` prefixes a run (None: any): the page's rows, and (most=None, by_device=False) the spans it measured."""
    out: list[list[tuple[int, int, dict]]] = []
    for a, b, p in parts:
        last = out[-1] if out else None
        if (last and last[-1][1] == a and (not by_device or last[-1][2]["device"] == p["device"])
                and (most is None or b - last[0][0] <= most)):
            last.append((a, b, p))
        else:
            out.append([(a, b, p)])
    return out


if __name__ == "__main__":
    main()
