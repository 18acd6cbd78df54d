"""What decides whether lookahead calibration's effect is lost by its approximation or absent from the model: the
calibration stage's two extra measurements, their tables and their figure.

- approximation: at states of the model's own plain generations, E_{P_a}[H_next] - E_P[H_next] of exact lookahead
  against that of each candidate rule's law, every H_next exact (lmcal.core.lookahead_law.hnext_shifts): no
  generation noise, so it says how much of the exact tilt each rule keeps.
- dose-response: a in {k a*} x the candidate rules, each generating law's last tenth (paired with the plain model's
  generations, same prefixes and seeds) and its test CE (paired with the model's, position by position).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from lmcal.core.calibration import calibrated, law_positions
from lmcal.core.entropy_rate import clustered_mean, generation_entropy_curve
from lmcal.core.expfit import stream_block_sums
from lmcal.core.lookahead_law import Rule, hnext_shifts, law_row_terms, make_rule
from lmcal.errors import LmcalError
from lmcal.stages.configs import GenerationConfig


def rules_of(specs: list[dict] | None, what: str, tail_samples: int = 16) -> list[Rule]:
    """Candidate rules from settings [{topk: 16}, {cover: 0.95}, {topk: null} (exact), ...], each checked; a rule
    without its own tail_samples draws the stage's (`tail_samples`), so that {topk: 16} is the stage's own law."""
    rules = []
    for spec in specs or []:
        if not isinstance(spec, dict) or set(spec) - {"topk", "cover", "cover_max", "tail_samples"}:
            raise LmcalError(f"{what}: {spec!r} is not a candidate rule; each is a mapping of topk, cover, cover_max "
                             "and tail_samples, e.g. {topk: 16}, {cover: 0.95} or {topk: null} (exact lookahead).")
        rules.append(make_rule(spec.get("topk"), spec.get("cover"), spec.get("cover_max"),
                               spec.get("tail_samples", tail_samples)))
    return rules


def rule_from_text(text: str) -> Rule:
    """A rule written as on a command line: top-K, cover-C, cover-C-MAX (at most MAX candidates) or exact."""
    parts = text.split("-")
    try:
        if parts == ["exact"]:
            return make_rule()
        if parts[0] == "top" and len(parts) == 2:
            return make_rule(topk=int(parts[1]))
        if parts[0] == "cover" and len(parts) in (2, 3):
            return make_rule(cover=float(parts[1]), cover_max=int(parts[2]) if len(parts) == 3 else None)
    except ValueError:
        pass
    raise LmcalError(f"rule {text!r}: a candidate rule is top-K, cover-C, cover-C-MAX (at most MAX candidates) or "
                     "exact, e.g. top-16, cover-0.95, cover-0.95-512.")


def _clustered(x: torch.Tensor, n: int) -> tuple[float, float]:
    """Mean and standard error of positions x [P] in step-major order of n generations (position i is generation
    i % n), generations as clusters."""
    per = x.double().view(-1, n).mean(0).numpy()  # [n]
    return float(per.mean()), float(per.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan


def approximation_table(lm, prefixes: torch.Tensor, horizon: int, steps: int, rules: list[Rule], alpha: float,
                        multiples: list[float], seed: int = 0, epsilon: float = 0.0, progress: bool = True) -> dict:
    """The noise-free measure: one plain generation from each of prefixes [N, L], `steps` positions each, spread
    evenly over the horizon (the last at its end); at each, exact lookahead and every rule's law at a = k alpha for
    each multiple k. Rows: each law's mean shift of E[H_next] (nats per word) and, paired, what it loses of exact
    lookahead's (its shift minus exact's) and keeps (the ratio of the means), generations as clusters."""
    at = sorted({max(1, round(horizon * (j + 1) / steps)) for j in range(steps)})
    alphas = [k * alpha for k in multiples]
    t0 = time.perf_counter()
    out = hnext_shifts(lm, prefixes, horizon, at, rules, alphas, seed, epsilon, progress=progress)
    n = prefixes.size(0)
    rows = []
    for r in {r.label: r for r in [Rule(), *rules]}.values():  # exact first, each law once
        row = {"rule": r.label, "settings": r.settings(), "candidates_mean": out["candidates"].get(r.label),
               "mass_mean": out["mass"].get(r.label),
               "shift_nats": [], "shift_stderr_nats": [], "lost_nats": [], "lost_stderr_nats": [], "kept": []}
        for j in range(len(alphas)):
            s, se = _clustered(out[r.label][j], n)
            lost, lost_se = _clustered(out[r.label][j] - out["exact"][j], n)
            ex = out["exact"][j].double().mean().item()
            row["shift_nats"].append(s)
            row["shift_stderr_nats"].append(se)
            row["lost_nats"].append(lost)
            row["lost_stderr_nats"].append(lost_se)
            row["kept"].append(s / ex if ex != 0 else math.nan)
        rows.append(row)
    return {"alpha": alpha, "multiples": list(multiples), "alphas": alphas, "generations": n, "steps": at,
            "positions": n * len(at), "cap": out["cap"], "rows": rows, "seconds": time.perf_counter() - t0,
            "vocab_size": lm.vocab_size}


@torch.no_grad()
def law_test_ce(lm, test: torch.Tensor, rule: Rule, alphas: list[float], seed: int, epsilon: float,
                cluster_size: int = 100) -> dict:
    """The rule's law's test CE at each alpha on time-major streams test [S, B] (every position after the first):
    the CE the calibrated StepLM scores (lmcal.core.lookahead_law), each alpha from one lookahead pass whose
    statistics are reduced step by step (none kept), and its paired difference from the model's CE (the law at
    a = 0), blocks of `cluster_size` positions of a stream as units."""
    ces, sizes = [], []  # per step: [B, 1 + A] CE_t at a = 0 and at each alpha
    for logw, h, logq_y, slot, size in law_positions(lm, test, rule, epsilon, seed=seed):
        logw, h = logw.double(), h.double()
        ces.append(torch.stack([law_row_terms(logw, h, logq_y.double(), slot, rule.draws, a)[0]
                                for a in (0.0, *alphas)], 1).cpu())
        sizes.append(size.double().cpu())
    ce = torch.cat(ces)  # [n, 1 + A], position order t-major
    base = ce[:, 0]
    out = {"candidates_mean": torch.cat(sizes).mean().item(), "positions": base.numel(),
           "model_ce_nats": base.mean().item(), "at": []}
    for j in range(len(alphas)):
        d = ce[:, 1 + j] - base
        se = stream_block_sums(d, test.size(1), cluster_size).pow(2).sum().sqrt().item() / d.numel()
        out["at"].append({"test_ce_nats": ce[:, 1 + j].mean().item(), "test_ce_diff_nats": d.mean().item(),
                          "test_ce_diff_stderr_nats": se})
    return out


def dose_response(lm, alpha: float, rules: list[Rule], multiples: list[float], prefixes: torch.Tensor,
                  test: torch.Tensor, gen: GenerationConfig, *, epsilon: float = 0.0, plain=None,
                  reuse: dict | None = None, cluster_size: int = 100) -> dict:
    """Each rule's law at a = k alpha for each multiple k: its generations from prefixes [N, L] (gen's horizon,
    samples_per_prefix, seed and max_batch; the plain model's `plain` curve paired with them, generated here when
    None), its last tenth's paired difference from the plain model's and from the first rule's at the same a, and its
    test CE on streams test. reuse: {(rule label, multiple): an EntropyCurve already generated with these settings}."""
    t0 = time.perf_counter()
    horizon, samples_per_prefix, seed = gen.horizon, gen.samples_per_prefix, gen.seed
    if plain is None:
        plain = _generate(calibrated(lm, 0.0, epsilon=epsilon), prefixes, gen)
    rows, first = [], {}
    for r in rules:
        ce = law_test_ce(lm, test, r, [k * alpha for k in multiples], seed, epsilon, cluster_size)
        for k, at in zip(multiples, ce["at"], strict=True):
            t = time.perf_counter()
            curve = (reuse or {}).get((r.label, k))
            if curve is None:
                law = calibrated(lm, k * alpha, r.topk, epsilon, tail_samples=r.tail_samples, seed=seed, cover=r.cover,
                                 cover_max=r.cover_max)
                curve = _generate(law, prefixes, gen)
            first.setdefault(k, curve.tail)
            diff, diff_se = clustered_mean(curve.tail - plain.tail)
            vs, vs_se = clustered_mean(curve.tail - first[k])
            level, level_se = clustered_mean(curve.tail)
            rows.append({"rule": r.label, "settings": r.settings(), "multiple": k, "alpha": k * alpha,
                         "generations": curve.num_generations, "vs_rule": rules[0].label,
                         "tail_nats": float(level), "tail_stderr_nats": float(level_se),
                         "tail_diff_nats": float(diff), "tail_diff_stderr_nats": float(diff_se),
                         "vs_first_nats": float(vs), "vs_first_stderr_nats": float(vs_se),
                         **at, "candidates_mean": ce["candidates_mean"],
                         "generation_seconds": curve.generation_seconds,
                         "ms_per_word": 1000.0 * curve.generation_seconds / (curve.num_generations * horizon),
                         "seconds": time.perf_counter() - t,
                         "tail_nats_per_generation": curve.tail.tolist()})
    return {"alpha": alpha, "multiples": list(multiples), "rules": [r.label for r in rules],
            "num_prefixes": prefixes.size(0), "samples_per_prefix": samples_per_prefix,
            "generations": prefixes.size(0) * samples_per_prefix, "horizon": horizon, "seed": seed,
            "test_tokens": ce["positions"], "model_test_ce_nats": ce["model_ce_nats"], "cluster_size": cluster_size,
            "plain_tail_nats": float(plain.tail.mean()),
            "plain_tail_nats_per_generation": plain.tail.tolist(), "rows": rows,
            "seconds": time.perf_counter() - t0}


def _generate(model, prefixes: torch.Tensor, gen: GenerationConfig):
    """The entropy curve of a law's generations from prefixes [N, L], with gen's settings."""
    return generation_entropy_curve(model, prefixes, gen.horizon, gen.samples_per_prefix, seed=gen.seed,
                                    max_batch=gen.max_batch, progress=True)


# ---------------------------------------------------------------------------------------------------------------------
# Tables and the figure (REPORT.md, the stage's markdown, bench/calibration_topk.py)
# ---------------------------------------------------------------------------------------------------------------------


def approximation_markdown(ap: dict) -> str:
    """The noise-free table: each law's shift of E[H_next] at each multiple of alpha*, and what it keeps of exact
    lookahead's (paired)."""
    ks = ap["multiples"]
    head = " | ".join(f"shift at {k:g}α* (nats)" for k in ks)
    lines = [f"| rule | candidates / position | their mass | {head} | kept at α* | lost at α* (nats, paired) |",
             "|---|---|---|" + "---|" * len(ks) + "---|---|"]
    for r in ap["rows"]:
        c = r["candidates_mean"]
        cells = " | ".join(f"{s:+.4f} ± {se:.4f}" for s, se in zip(r["shift_nats"], r["shift_stderr_nats"],
                                                                     strict=True))
        lost = "–" if r["rule"] == "exact" else f"{r['lost_nats'][0]:+.4f} ± {r['lost_stderr_nats'][0]:.4f}"
        mass = f"{r['mass_mean']:.3f}" if r.get("mass_mean") is not None else "–"
        lines.append(f"| {r['rule']} | {ap['vocab_size'] if c is None else f'{c:,.1f}'} | {mass} | {cells} | "
                     f"{r['kept'][0]:.2f} | {lost} |")
    return "\n".join(lines) + "\n"


def approximation_note(ap: dict) -> str:
    return (f"E_{{P_α}}[H_next] − E_P[H_next], nats per word, at {ap['positions']} positions of the model's own plain "
            f"generations ({ap['generations']} generations, steps {', '.join(map(str, ap['steps']))}), every H_next "
            f"exact (α* = {ap['alpha']:.4g}); ± one standard error, generations as clusters. Their mass: the mean "
            "share of P's mass the rule's candidates hold there. Kept: the rule's mean "
            "shift over exact lookahead's; lost: its shift minus exact's, paired position by position. The tail "
            "draws are those generation makes.")


def dose_markdown(dr: dict, extra: list[dict] | None = None) -> str:
    """The dose-response table: one row per (multiple, rule), each the generating law's."""
    first = dr["rules"][0]
    lines = [f"| α | rule | candidates / word | Δ last tenth vs model (nats) | vs {first} (nats) | test CE (nats) | "
             "Δ test CE vs model (nats) | ms / word |", "|---|---|---|---|---|---|---|---|"]
    rows = sorted([*dr["rows"], *(extra or [])], key=lambda r: (r["multiple"], "device" in r))
    for r in rows:
        paired = r["rule"] != first and r.get("vs_rule", first) == first and r.get("vs_first_nats") is not None
        vs = f"{r['vs_first_nats']:+.3f} ± {r['vs_first_stderr_nats']:.3f}" if paired else "–"
        where = row_label(r, dr, ", its own plain generations")
        lines.append(f"| {r['multiple']:g}α* = {r['alpha']:.4f} | {where} | {r['candidates_mean']:,.1f} | "
                     f"{r['tail_diff_nats']:+.3f} ± {r['tail_diff_stderr_nats']:.3f} | {vs} | "
                     f"{r['test_ce_nats']:.4f} | {r['test_ce_diff_nats']:+.4f} ± {r['test_ce_diff_stderr_nats']:.4f} | "
                     + (f"{r['ms_per_word']:.2f} |" if r.get("ms_per_word") is not None else "– |"))
    return "\n".join(lines) + "\n"


def row_label(r: dict, dr: dict, own: str = "") -> str:
    """A dose-response row's rule, with the device and generations of a row another run added."""
    if "device" not in r:
        return r["rule"]
    main = dr.get("generations")
    gens = f", {r['generations']} generations" if r.get("generations", main) != main else ""
    return f"{r['rule']} ({r['device']}{gens}{own})"


def dose_note(dr: dict, main_generations: int | None = None) -> str:
    fewer = (f", fewer than the main rows' {main_generations}" if main_generations and main_generations >
             dr["generations"] else "")
    return (f"Each row is its own generating law (the fitted law's candidates and shared tilt, at α = k α*, α* = "
            f"{dr['alpha']:.4g}): {dr['generations']} generations ({dr['num_prefixes']} prefixes, "
            f"{dr['samples_per_prefix']} each{fewer}) of {dr['horizon']} words, the same prefixes and seeds for "
            f"every row; Δ last tenth: paired with the plain model's generations, and vs {dr['rules'][0]}: with that "
            f"rule's at the same α (± one standard error, clustered by prefix); test CE: the law's own on "
            f"{dr['test_tokens']:,} test tokens, Δ paired with the model's word by word (blocks of "
            f"{dr['cluster_size']} positions); ms / word: the generation's wall time per generated word in this run "
            "(on a shared machine, a rough figure; bench/calibration_topk.py --timing measures it)."
            + "".join(f" {f['rule']}'s own α*, fitted on the same text ({f['device']}): {f['alpha']:.4g} ± "
                      f"{f['alpha_stderr']:.2g}." for f in dr.get("extra_fits") or []))


def _multiple(row: dict, dr: dict) -> float:
    """A row's α over the stage's α* (its `multiple`, or, for another run's row, its α over this α*)."""
    if row.get("multiple"):
        return float(row["multiple"])
    return abs(row["alpha"] / dr["alpha"]) if dr["alpha"] else 1.0


def dose_figure(dr: dict, path: str | Path, extra: list[dict] | None = None) -> Path:
    """The dose-response: the last tenth's paired change (top) and the test CE's (bottom) against α as a multiple of
    α* (a log axis of α / α*, so that 1α*, 3α*, 10α* read left to right whatever α*'s sign), a line per rule,
    ±1.96 se bars."""
    from lmcal.stages.plots import plt
    from lmcal.utils.io import atomic_path

    path = Path(path)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(6.4, 6.4), dpi=120, sharex=True)
    rows = [*dr["rows"], *(extra or [])]
    labels = list(dict.fromkeys(row_label(r, dr) for r in rows))
    for i, label in enumerate(labels):
        rs = sorted((r for r in rows if row_label(r, dr) == label), key=lambda r: _multiple(r, dr))
        x = np.array([_multiple(r, dr) for r in rs]) * (1 + 0.03 * (i - len(labels) / 2))  # a little apart
        for axis, key in ((ax, "tail_diff"), (bx, "test_ce_diff")):
            axis.errorbar(x, [r[f"{key}_nats"] for r in rs], yerr=[1.96 * r[f"{key}_stderr_nats"] for r in rs],
                          marker="o", ms=4, capsize=3, lw=1.2, label=label)
    for axis in (ax, bx):
        axis.axhline(0.0, color="k", lw=0.8)
        axis.set_xscale("log")
        axis.grid(alpha=0.3)
    ticks = sorted({round(_multiple(r, dr), 3) for r in rows})
    bx.set_xticks(ticks, [f"{m:g}α*" for m in ticks])
    bx.minorticks_off()
    ax.set_ylabel("Δ entropy, last tenth\nvs model (nats, paired)")
    bx.set_ylabel("Δ test CE vs model\n(nats, paired)")
    bx.set_xlabel(f"α, as a multiple of α* = {dr['alpha']:.3g}")
    ax.set_title("Lookahead calibration: dose-response by candidate rule", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path
