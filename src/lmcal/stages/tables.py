"""Markdown tables of stage results: Table 1, the decoders' table and the memory table (beside the paper's values).
"""

from __future__ import annotations

from lmcal import paper
from lmcal.utils.numbers import format_ce, format_params


def table1_markdown(rows: list[dict]) -> str:
    """The paper's Table 1 layout: model, corpus, test ppl, EntRate (= exp of the last step's entropy)."""
    lines = ["| model | corpus | test ppl | EntRate |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['corpus']} | {r['test_ppl']:.1f} | {r['entrate_ppl']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def _tail_diff(r: dict) -> str:
    """The paired difference from the plain model over the last tenth of the horizon, '± se' (– if not measured)."""
    if r.get("tail_diff_nats") is None:
        return "–"
    return f"{r['tail_diff_nats']:+.3f} ± {r['tail_diff_stderr_nats']:.3f}"


def decoders_table(rows: list[dict]) -> str:
    """Markdown: one row per method, entropies of the t = 1 and last generated words, EntRate, the paired difference
    of the last tenth's mean entropy from the plain model (± se, clustered by prefix) and held-out costs."""
    several = len({r.get("model") for r in rows}) > 1  # rows of several models (lmcal.report): a column names each
    first = "| model " if several else ""
    lines = [first + "| method | parameters | entropy t=1 (nats) | entropy t=horizon (nats) | EntRate | "
             "Δ entropy, last tenth, vs model (nats) | test CE (nats) | zero-prob. fraction | CE on kept words | "
             "CE, ε-mixed |", ("|---" if several else "") + "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append((f"| {r['model']} " if several else "") + f"| {r['method']} | {format_params(r['params'])} | "
                     f"{r['entropy_t1_nats']:.3f} | "
                     f"{r['entropy_last_nats']:.3f} | {r['entrate_ppl']:.1f} | {_tail_diff(r)} | "
                     f"{format_ce(r['test_ce_nats'])} | {r['zero_prob_fraction']:.4f} | "
                     f"{format_ce(r['test_ce_kept_nats'])} | {format_ce(r['test_ce_mixed_nats'])} |")
    return "\n".join(lines) + "\n"


def _pm(r: dict | None, key: str, se: str, digits: int = 4) -> str:
    """'value ± se' of r[key] (– where the result does not have it: a memory.json from before the key existed)."""
    if not r or r.get(key) is None:
        return "–"
    return f"{r[key]:.{digits}f}" + (f" ± {r[se]:.{digits}f}" if r.get(se) is not None else "")


def memory_table(rows: list[dict]) -> str:
    """Markdown: per tau and limited model P~ (trained tau-model, or the base model on tau-token windows): CE(P||P~),
    ΔCE, the I_tau bound (± 1 se) fitted on the reported rows, cross-fitted, alpha*, and the two-parameter variant
    (beta*, alpha* and its bound); the paper's values beside ours (PTB), the exact I_tau beside (Markov source)."""
    ptb = rows[0]["corpus"] == "ptb"
    exact = any(r.get("exact_mi_nats") is not None for r in rows)
    cols = ["tau", "P̃", "CE(P‖P̃)", "ΔCE", "I_tau upper bound", "cross-fitted", "alpha*", "with temperature",
            "beta*, alpha*"]
    after = (2, 4, 6)  # ours whose paper's value follows (PTB): CE(P‖P̃), the bound, alpha*
    if ptb:
        cols = [c for i, col in enumerate(cols) for c in ([col, "paper"] if i in after else [col])]
    if exact:
        cols.append("exact I_tau")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        two = r.get("two_parameter")
        cells = [str(r["tau"]), r.get("limited", "trained"), f"{r['ce_limited_nats']:.4f}", _pm(r, "delta_ce_nats",
                 "delta_ce_stderr_nats"), _pm(r, "mi_upper_bound_nats", "mi_stderr_nats"),
                 _pm(r, "mi_upper_bound_crossfit_nats", ""), _pm(r, "alpha", "alpha_stderr", 5),
                 _pm(two, "mi_upper_bound_nats", "mi_stderr_nats"),
                 f"{two['beta']:.4f}, {two['alpha']:.5f}" if two else "–"]
        if ptb:
            p = paper.MEMORY_PTB.get(int(r["tau"]))
            theirs = [f"{v:.4f}" if i < 2 else f"{v:.5f}" for i, v in enumerate(p)] if p else ["–"] * 3
            cells = [c for i, cell in enumerate(cells) for c in ([cell, theirs[after.index(i)]] if i in after
                                                                  else [cell])]
        if exact:
            cells.append("–" if r.get("exact_mi_nats") is None else f"{r['exact_mi_nats']:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    r0 = rows[0]
    lines.append("")
    lines.append(f"Nats per token on {r0['test_tokens']:,} test tokens. P̃: trained = the τ-model, window = the base "
                 "model itself fed only the last τ tokens. alpha* of P̂·P̃^alpha is fitted on the rows the bound is "
                 "reported on, so the bound is the mean KL(P̂_alpha*‖P̃) ≥ 0; ± is one standard error: a "
                 f"delete-one-block jackknife over blocks of {r0['cluster_size']:,} positions with alpha refitted in "
                 "each replicate. Cross-fitted: alpha* fitted on one half of the blocks, the bound scored on the "
                 "other, both ways. ΔCE = CE(P‖P̃) − CE(P‖P̂). With temperature: P̂^beta·P̃^alpha fitted jointly, meant "
                 "to keep a mere sharpening of P̂ from counting as memory; read it beside beta* (far from 1, the "
                 "calibrated model is largely a re-weighting of P̂ itself).")
    return "\n".join(lines) + "\n"


def results_markdown(rows: list[tuple[str, str, float, float | None]]) -> str:
    """The table an evaluation ends with, in the manner of lm-evaluation-harness: stage | metric | value | ± se."""
    def num(v: float) -> str:
        return f"{v:,.1f}" if abs(v) >= 1000 else f"{v:.4f}"

    lines = ["| stage | metric | value | ± se |", "|---|---|---:|---:|"]
    lines += [f"| {stage} | {metric} | {num(v)} | {'' if se is None else '± ' + num(se)} |"
              for stage, metric, v, se in rows]
    return "\n".join(lines) + "\n"
