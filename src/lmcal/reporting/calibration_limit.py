"""Which limits lookahead calibration, its candidate rule or the model: the verdict written from the
noise-free approximation table and the dose-response (lmcal.stages.dose_response), never from one step's EntRate."""

from __future__ import annotations

import math

from lmcal.reporting.claim import Claim, Z, finite, paper_calibration_nats


def _at_star(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("multiple") == 1]


def _evidence(ap: dict, dr: dict, extra: list[dict] | None, z: float) -> dict:
    """The numbers calibration_limit decides on: exact lookahead's shift at a* and what the cheapest rule keeps of
    it, the rows that move the last tenth beyond the cheapest rule's, and those that move it with their test CE."""
    j = ap["multiples"].index(1) if 1 in ap["multiples"] else 0
    rows = {r["rule"]: r for r in ap["rows"]}
    ex, cheap = rows["exact"], rows.get(dr["rules"][0])
    e, e_se = ex["shift_nats"][j], ex["shift_stderr_nats"][j]
    measured = finite(e_se) and abs(e) > z * e_se
    s, lost, lost_se, kept = (cheap[k][j] for k in ("shift_nats", "lost_nats", "lost_stderr_nats", "kept"))
    sign = math.copysign(1.0, ap["alpha"]) if ap["alpha"] else 0.0
    first = dr["rules"][0]  # a row's vs_first is paired with that rule's generations in its own run
    every = [*dr["rows"], *(extra or [])]
    grows = [r for r in every if r["rule"] != first and r.get("vs_rule", first) == first
             and finite(r.get("vs_first_nats")) and finite(r.get("vs_first_stderr_nats"))
             and sign * r["vs_first_nats"] > z * r["vs_first_stderr_nats"]]
    star = _at_star(every)
    # the goal: a rule beyond the cheapest that moves the last tenth beyond z se with a test CE not shown above
    moved = [r for r in every if r["rule"] != first and sign * r["tail_diff_nats"] > z * r["tail_diff_stderr_nats"]]
    return {"j": j, "first": first, "cheap": cheap, "e": e, "e_se": e_se, "measured": measured, "kept": kept,
            "loses": measured and abs(s) < abs(e) and abs(lost) > z * lost_se and kept < 0.5,
            "keeps": measured and (abs(lost) <= z * lost_se or kept >= 0.5), "grows": grows, "star": star,
            "effects": [r for r in star if abs(r["tail_diff_nats"]) > z * r["tail_diff_stderr_nats"]],
            "moved": moved, "ok": [r for r in moved if finite(d := r.get("test_ce_diff_nats"))
                                   and d <= z * r["test_ce_diff_stderr_nats"]]}


def _goal_row_text(r: dict, dr: dict) -> str:
    from lmcal.stages.dose_response import row_label

    return (f"{row_label(r, dr)} at {r['multiple']:g}α*, {r['tail_diff_nats']:+.3f} ± "
            f"{r['tail_diff_stderr_nats']:.3f} nats, " + (
                f"test CE {r['test_ce_diff_nats']:+.4f} ± {r['test_ce_diff_stderr_nats']:.4f}"
                if finite(r.get("test_ce_diff_nats")) else "no test CE"))


def _goal_sentence(ok: list[dict], moved: list[dict], dr: dict, first: str, z: float) -> str:
    """The rules beyond the cheapest that move the last tenth with a test CE not above the model's."""
    p = paper_calibration_nats()
    # how far each goal row lies from the paper's effect, in its own standard errors
    gaps = ", ".join(f"{abs(r['tail_diff_nats'] - p) / r['tail_diff_stderr_nats']:.1f}" for r in ok)
    rows = lambda rs: "; ".join(_goal_row_text(r, dr) for r in rs)
    if ok:
        return (f" Beyond {first}, {rows(ok)} {'moves' if len(ok) == 1 else 'move'} the last tenth beyond "
                f"{z:g} standard errors with a test CE not above the model's ({gaps} standard errors from the paper's "
                f"{p:+.2f}).")
    return (f" No rule beyond {first} moves the last tenth beyond {z:g} standard errors with a test CE not above the "
            "model's" + (f"; those that move it: {rows(moved)}." if moved else "."))


def calibration_limit(ap: dict, dr: dict, extra: list[dict] | None = None, z: float = Z) -> Claim:
    """Whether the candidate rule or the model limits lookahead calibration, from the approximation table
    `ap` and the dose-response `dr` (extra: its rows from other runs, e.g. exact lookahead on a GPU):

    - 'approximation': exact lookahead's shift of E[H_next] at a* is measured (beyond z se), the cheapest rule (the
      dose-response's first) loses a significant part of it and keeps less than half, and the last tenth moves
      further with more candidates (a rule's paired difference from the cheapest's, at some multiple of a*, beyond
      z se in the direction of a);
    - 'model': the exact shift is measured, the cheapest rule keeps it (its loss within z se, or at least half
      kept), and no rule changes the last tenth at a* beyond z se;
    - 'undecided' otherwise, saying what is missing.

    Each verdict ends with the goal (numbers["goal_rows"]): the rules beyond the cheapest, at any multiple of a*,
    that move the last tenth beyond z se in the direction of a with a test CE not shown above the model's (its paired
    difference at most z se); or, where none does, those that move it with their test CE."""
    ev = _evidence(ap, dr, extra, z)
    first, cheap, e, e_se, kept = ev["first"], ev["cheap"], ev["e"], ev["e_se"], ev["kept"]
    s, lost, lost_se = (cheap[k][ev["j"]] for k in ("shift_nats", "lost_nats", "lost_stderr_nats"))
    grows, star, effects, ok = ev["grows"], ev["star"], ev["effects"], ev["ok"]
    shift = (f"at α* = {ap['alpha']:.4g}, exact lookahead shifts the expected entropy of the next word by {e:+.4f} ± "
             f"{e_se:.4f} nats at the model's own generations, of which {cheap['rule']} keeps {kept:.0%} "
             f"({s:+.4f}; it loses {lost:+.4f} ± {lost_se:.4f})")
    from lmcal.stages.dose_response import row_label  # (torch, for the tables: only where there is a dose-response)

    each = "; ".join(f"{row_label(r, dr)} {r['tail_diff_nats']:+.3f} ± {r['tail_diff_stderr_nats']:.3f}"
                     for r in star)
    goal = _goal_sentence(ok, ev["moved"], dr, first, z)
    if ev["loses"] and grows:
        g = max(grows, key=lambda r: abs(r["vs_first_nats"]) / r["vs_first_stderr_nats"])
        v = "approximation"
        sentence = (f"The approximation is the limit here: {shift}; and the last tenth moves further with more "
                    f"candidates: {row_label(g, dr)} at {g['multiple']:g}α* changes it by "
                    f"{g['vs_first_nats']:+.3f} ± "
                    f"{g['vs_first_stderr_nats']:.3f} nats beyond {cheap['rule']} (paired). At α*, each rule's change "
                    f"of the last tenth: {each} nats." + goal)
    elif ev["keeps"] and not effects:
        v = "model"
        sentence = (f"The model is the limit here: {shift}, so more candidates add little; and no rule changes the "
                    f"last tenth at α* beyond {z:g} standard errors ({each} nats)." + goal)
    else:
        v = "undecided"
        why = [f"the exact shift is {'not ' if not ev['measured'] else ''}measured ({e:+.4f} ± {e_se:.4f} nats)",
               f"{cheap['rule']} keeps {kept:.0%} of it (loses {lost:+.4f} ± {lost_se:.4f})",
               (f"{len(grows)} dose-response row(s) move the last tenth beyond {cheap['rule']}'s" if grows else
                f"no more covering rule moves the last tenth beyond {cheap['rule']}'s at {z:g} standard errors"),
               f"at α* the rules change the last tenth by {each} nats"]
        sentence = ("Whether the approximation or the model limits lookahead calibration here is undecided: "
                    + "; ".join(why) + "." + goal)
    return Claim("calibration_limit", v, sentence, {"exact_shift": e, "exact_shift_se": e_se, "kept": kept,
                                                     "grows": len(grows), "effects_at_star": len(effects),
                                                     "goal_rows": len(ok)})
