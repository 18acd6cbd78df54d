"""The sequence_calibration stage's report table: which law each row estimates over which words (and the SMC rows'
draws), every row's table, the SMC convergence table, the heads' α and the goal rows (the stage's `<name>.md`;
REPORT.md reuses it)."""

from __future__ import annotations

from lmcal.stages.convergence import converged_summary, label
from lmcal.utils.numbers import exp_or_inf, format_ce, format_params


def row_label(r: dict) -> str:
    """A row's name in the stage's tables, figure and logs."""
    p = r["params"]
    if r["method"] == "smc":
        return r.get("label") or label(r)
    if "horizon_k" in p:
        return f"future-entropy head K={p['horizon_k']}, γ={p['discount']:g}" + (", with β" if "beta" in p else "")
    return {"model": "model", "soft_value": "soft-value heads", "fitted_temperature": "fitted temperature"}.get(
        r["method"], r["method"])


def _spread(result: dict) -> str:
    return "evenly spaced, overlapping" if result["fit_windows_overlap"]["validation"] else "evenly spaced, disjoint"


def seeds_phrase(result: dict) -> str:
    """The seeds the SMC rows drew at, as a sentence names them: "seed 0", or "seeds [0, 1000]" for a grown study."""
    seeds = result["smc_seeds"]
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds}"


def _draws(result: dict) -> str:
    """How the SMC rows drew at more than one seed (an extended study), else nothing."""
    seeds = result["smc_seeds"]
    if len(seeds) < 2:
        return ""
    S = result["samples_per_prefix"]
    return (f", {S} a prefix at each of the seeds {seeds} ({S * len(seeds) * result['smc_prefixes']:,} generations a "
            "row" + (", grown from an earlier run at its own α*" if result.get("extended") else "") + ")")


def laws_sentence(result: dict) -> str:
    """Which law each row estimates, and over which words: the setup sentence of the stage's table."""
    return (f"Rows and the laws they estimate: the SMC rows, Algorithm 1's law P̂_α(w_1..L) ∝ P̂^(1+α) over L = "
            f"{result['law_horizon']} words, each with α* fitted at its own particle count and twist on "
            f"{result['fit_prefixes']} validation continuations of {result['law_horizon']} words "
            f"({_spread(result)}), generated over {result['law_horizon']} words from the first "
            f"{result['smc_prefixes']} prefixes{_draws(result)} and read over the first "
            f"{result['horizon']} (last tenth: the sequence law's own entropy there, by nested SMC at the row's count"
            "; curve: the surprisal -log P̂ of its words); the soft-value heads, that law's infinite-horizon limit per "
            "word, P ∝ P̂^(1+α) e^Q, with α fitted on their own exact per-word validation CE; the other rows, their "
            "own per-word laws. Each law generates what is fitted and scored for it.")


def sequence_table(result: dict) -> str:
    """The stage's Markdown: every row's table, the SMC convergence table, the heads' α, and the goal rows."""
    lines = [laws_sentence(result), "",
             "| method | params | exp H, last tenth | Δ last tenth vs model (nats) | test CE | Δ test CE vs model "
             "| ms / word | × model |", "|" + "---|" * 8]
    for r in result["rows"]:
        tail_d = "–" if r["method"] == "model" else f"{r['tail_diff_nats']:+.3f} ± {r['tail_diff_stderr_nats']:.3f}"
        ce_d = ("–" if r["method"] == "model" or r.get("test_ce_diff_nats") is None else
                f"{r['test_ce_diff_nats']:+.4f} ± {r['test_ce_diff_stderr_nats']:.4f}")
        ms = "–" if r.get("ms_per_token") is None else f"{r['ms_per_token']:.3f}"
        ratio = "–" if r.get("cost_ratio") is None else f"{r['cost_ratio']:.2f}"
        se = r.get("tail_ppl_stderr")
        lines.append(f"| {row_label(r)} | {format_params(r['params'], drop=('stderr', 'horizon_k', 'discount'))} | "
                     f"{r['tail_ppl']:.1f}" + (f" ± {se:.1f}" if se is not None else "") + f" | {tail_d} | "
                     f"{format_ce(r.get('test_ce_nats'))} | {ce_d} | {ms} | {ratio} |")
    study = [r for r in result["rows"] if r["method"] == "smc"]
    tol = result.get("converge_tol")
    shown = ("" if tol is None else f", and the last tenth's 2-standard-error interval within ±{tol:g} nats (not "
             "shown: no disagreement, but the interval reaches beyond)")
    each = ("each count twisted and untwisted" if result["untwisted"] else
            f"each count twisted only, the heads first trained at α = {result.get('sv_alpha')}")
    lines += ["", f"The convergence study ({each}, on the same prefixes and seeds; "
              "converged: its last tenth, paired by prefix, and α* within 2 standard errors of the row with twice "
              f"its particles, or half for the largest{shown}; ± from α*: what α*'s standard error moves the last "
              "tenth by, |d/dα| × se(α*), the slope from the covariance of each generation's last tenth with its "
              "log P̂ within each prefix (the last tenth's own ± is conditional on α*); exp EntRate, all L words: "
              "the law's entropy rate over all its words from the same prefixes, the quantity its fit matches to the "
              "validation CE (the paper's EntRate = CE), where the last tenth reads inside the law; fit: CE(α*) − "
              "EntRate(α*) "
              "on the fit's own particles, zero at the root up to its tolerance; test CE at the row's own count, with "
              "log Ẑ's estimated downward bias in brackets, per word):", "", study_table(study).rstrip("\n"), "",
              converged_summary(study)]  # from the rows, as the table: the wording of this code, not the run's
    sv = result.get("soft_value_alpha")
    if sv:
        lines += ["", f"Soft-value heads: α = {sv['alpha']:.4f} ± {sv['alpha_stderr']:.4f}, fitted on their own exact "
                  f"per-word CE on {sv['positions']:,} validation positions ({sv['valid_ce_before_nats']:.4f} → "
                  f"{sv['valid_ce_after_nats']:.4f} nats)."]
    g = result.get("goal")
    if not g:
        lines += ["", "No row that is Algorithm 1 or a per-word sampler has a paired test CE at or below the model's, "
                  "so none is chosen for the goal (the last tenth closest to the test perplexity without a higher "
                  "test CE)."]
    else:
        lines += ["", f"Closest to the test perplexity ({g['test_ppl']:.1f}) over the last tenth, among the rows that "
                  "are Algorithm 1 (each sampler at its fewest converged count) or per-word samplers whose test CE is "
                  f"not higher than the model's, on the generations of seed {g['chosen_on_seed']}: {g['label']}. "
                  f"On {g['reported_on']} and seed {g['reported_on_seed']}: {g['tail_ppl']:.1f} ± "
                  f"{g['tail_ppl_stderr']:.1f} (REPORT.md tests it "
                  "against the goal of 10% of the test perplexity at 2 standard errors: lmcal.reporting.claims)."]
    c = result.get("twisted_check")
    if c:
        lines += ["", f"The twisted row with the fewest particles ({c['label']}), on {c['prefixes']} "
                  f"fresh prefixes and seed {c['reported_on_seed']}: {c['tail_ppl']:.1f} ± {c['tail_ppl_stderr']:.1f} "
                  f"against the test perplexity {c['test_ppl']:.1f}."]
    return "\n".join(lines) + "\n"


def study_table(rows: list[dict]) -> str:
    """The convergence table: particles x twisted/untwisted."""
    lines = ["| sampler | particles | α* | exp H, last tenth | ± from α*, nats | exp EntRate, all L words | vs 2K (or "
             "K/2), nats | K → ∞ (1/K), nats | reference check: α* shift | ESS / K | mean log Ẑ | fit: CE − EntRate | "
             "test CE (log Ẑ bias) | ms / word | × model | converged |", "|" + "---|" * 16]
    for r in sorted(rows, key=lambda r: (r.get("variant") != "twisted", r["params"]["particles"])):
        p, f = r["params"], r["fit"]
        against = ("–" if r.get("converged_against") is None else
                   f"{r['tail_against_nats']:+.3f} ± {r['tail_against_stderr_nats']:.3f} ({r['converged_against']})")
        lines.append(
            f"| {'twisted' if r.get('variant') == 'twisted' else 'untwisted'} | {p['particles']} | {p['alpha']:.4f} ± "
            f"{p['alpha_stderr']:.4f} | {r['tail_ppl']:.1f} ± {r['tail_ppl_stderr']:.1f} | {_from_alpha(r)} | "
            f"{_rate_cell(r)} | {against} | {_beyond_cell(r)} | {_check_cell(r)} | "
            f"{r['ess_per_particle']:.2f} | {r['log_z_mean']:.2f} | {f['ce_minus_entropy_rate_nats']:+.2e} ± "
            f"{f['ce_minus_entropy_rate_stderr_nats']:.1e}{'' if f['settled'] else ' (no root: not settled)'} | "
            f"{r['test_ce_nats']:.4f} ({r['test_ce_bias_nats']:+.4f}) | "
            f"{r['ms_per_token']:.3f} | {r['cost_ratio']:.2f} | {convergence_word(r)} |")
    return "\n".join(lines) + "\n"


def _beyond_cell(r: dict) -> str:
    """The pair's 1/K extrapolation to K → ∞, minus the row's level (convergence._beyond)."""
    if r.get("tail_beyond_nats") is None:
        return "–"
    return f"{r['tail_beyond_nats']:+.3f} ± {r['tail_beyond_stderr_nats']:.3f}"


def _check_cell(r: dict) -> str:
    """The reference check: the shift of the row's α* against untwisted SMC at many particles, and its verdict."""
    c = r.get("reference_check")
    if not c:
        return "–"
    return (f"{c['alpha_shift']:+.4f} ± {c['alpha_shift_stderr']:.4f} within ±{c['tolerance']:.4f}: {c['verdict']} "
            f"({c['particles']} particles, {c['prefixes']} windows)")


def convergence_word(r: dict) -> str:
    """A row's verdict in a table's cell: yes, **no**, not shown (no disagreement, too wide to show agreement), or
    not tested (no row of twice or half its particles)."""
    if r.get("convergence") in ("not shown", "fails the reference check"):
        return r["convergence"] if r["convergence"] == "not shown" else "**no** (reference check)"
    return {True: "yes", False: "**no**", None: "not tested"}[r.get("converged")]


def _rate_cell(r: dict) -> str:
    """A row's law entropy rate over all its L words from the study's prefixes, as exp, with its standard error."""
    if r.get("law_entropy_rate_nats") is None:
        return "–"
    ppl = exp_or_inf(r["law_entropy_rate_nats"])
    return f"{ppl:.1f} ± {ppl * r['law_entropy_rate_stderr_nats']:.1f}"


def _from_alpha(r: dict) -> str:
    """The study table's cell for what α*'s standard error moves the last tenth by: ± slope x se(α*), with the
    slope (d last tenth / dα) and its standard error."""
    if r.get("tail_alpha_stderr_nats") is None:
        return "–"
    se = r.get("tail_alpha_slope_stderr_nats")
    return f"±{r['tail_alpha_stderr_nats']:.3f} (slope {r['tail_alpha_slope_nats']:.0f}" + (
        "" if se is None else f" ± {se:.0f}") + ")"
