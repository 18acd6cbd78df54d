"""Settings checked against lmcal.utils.rules as soon as a config is composed: before any data is read, any W&B run
starts or any training step is taken.

`check_config(cfg)` raises one `LmcalError` naming every bad key, its value and its valid range. A rule applies
where its key is present: the same table serves `train`, `evaluate` and every stage `make reproduce` plans.
"""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.utils.budget import oversized
from lmcal.utils.rules import COUNT, NAME_RULES, RULES, decoder_problems, show_value
from lmcal.utils.safe_paths import name_problem, show


def _leaves(node, prefix: str = ""):
    """(dotted key, resolved value) of every leaf under `node`; values that do not resolve (e.g. ${hydra:...}
    outside a Hydra run) and required values not given yet (???) are left out."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for k in keys:
        key = f"{prefix}{k}"
        if key in ("paths", "hydra"):
            continue
        try:
            if OmegaConf.is_missing(node, k):
                continue
            v = node[k]
        except Exception:  # an interpolation that only resolves inside a Hydra run
            continue
        if isinstance(v, (DictConfig, ListConfig)):
            yield key, OmegaConf.to_container(v, resolve=True) if _resolvable(v) else None
            yield from _leaves(v, key + ".")
        else:
            yield key, v


def _resolvable(node) -> bool:
    try:
        OmegaConf.to_container(node, resolve=True)
        return True
    except Exception:
        return False


def _matches(pattern: str, key: str) -> bool:
    p, k = pattern.split("."), key.split(".")
    return len(p) == len(k) and all(a in ("*", b) for a, b in zip(p, k, strict=True))


def problems(cfg: DictConfig, rules: dict | None = None) -> list[str]:
    """Every out-of-range setting of `cfg`, as 'key=value (what it is: must be ...)' lines (`rules`: RULES's)."""
    found, across = [], []  # (across: rules between keys, after the keys' own)
    for key, value in _leaves(cfg):
        for pattern, (rule, meaning) in (rules or RULES).items():
            if not _matches(pattern, key):
                continue
            if rule is None:  # a list of memory lengths
                ok = isinstance(value, list) and all(COUNT.ok(t) for t in value)
                if not ok:
                    found.append(f"{key}={show_value(value)} ({meaning}: must be a list of integers ≥ 1)")
            elif not rule.ok(value):
                found.append(f"{key}={show_value(value)} ({meaning}: must be {rule.describe()})")
            break
        if key in NAME_RULES and value is not None:  # a name that becomes a folder's or file's
            most, strict, meaning = NAME_RULES[key]
            if why := name_problem(value, most, strict):
                kind = " of letters, digits and . _ + -" if strict else ", no / or \\, not . or .."
                found.append(f"{key}={show(value)} ({meaning}: must be one plain name, at most {most} characters"
                             f"{kind}: {why})")
        if key == "decoder" and isinstance(value, dict):
            found += decoder_problems(value.get("name"), {k: v for k, v in value.items() if k != "name"}, key)
        if key == "data.corpus_kwargs" and isinstance(value, dict):  # (a Markov row's support within the vocabulary)
            v, k = value.get("vocab_size"), value.get("support")
            if all(isinstance(x, int) and not isinstance(x, bool) for x in (v, k)) and k > v:
                across.append(f"data.corpus_kwargs.support={k} (tokens that share each Markov row's mass: must be "
                              f"at most data.corpus_kwargs.vocab_size={v})")
        if key.endswith("calibration.dose_response.rules") and value is not None:
            found += rule_problems(value, key)
        if key == "analysis.decoders.methods" and isinstance(value, list):
            for i, m in enumerate(value):
                if isinstance(m, dict):
                    found += decoder_problems(m.get("name"), {k: v for k, v in m.items() if k != "name"},
                                              f"{key}[{i}]")
    return found + across


RULE_KEYS = {"topk": RULES["analysis.*.topk"], "cover": RULES["analysis.*.cover"],
             "cover_max": RULES["analysis.*.cover_max"], "tail_samples": RULES["analysis.*.tail_samples"]}


def rule_problems(rules, key: str) -> list[str]:
    """Out-of-range lookahead candidate rules (lmcal.core.lookahead_law) of a list such as
    analysis.calibration.dose_response.rules."""
    if not isinstance(rules, list):
        return [f"{key}={show_value(rules)} (candidate rules: must be a list such as [{{topk: 16}}, {{cover: 0.95}}])"]
    found = []
    for i, r in enumerate(rules):
        if not isinstance(r, dict) or set(r) - set(RULE_KEYS):
            found.append(f"{key}[{i}]={show_value(r)} (a candidate rule: a mapping of "
                         f"{', '.join(RULE_KEYS)}, e.g. {{topk: 16}}, {{cover: 0.95}} or {{topk: null}} for exact)")
            continue
        found += [f"{key}[{i}].{k}={show_value(v)} ({RULE_KEYS[k][1]}: must be {RULE_KEYS[k][0].describe()})"
                  for k, v in r.items() if not RULE_KEYS[k][0].ok(v)]
        if r.get("topk") is not None and r.get("cover") is not None:
            found.append(f"{key}[{i}]={show_value(r)} (a rule takes either topk or cover, not both)")
    return found


def check_config(cfg: DictConfig, where: str = "", rules: dict | None = None) -> None:
    """Raise one LmcalError listing every out-of-range setting of `cfg` (`where`: e.g. "stage 'base': "; `rules`:
    RULES's, or a table of its own such as RULES | PROFILE_RULES)."""
    bad = problems(cfg, rules)
    if bad:
        s = "s" if len(bad) > 1 else ""
        raise LmcalError(f"{where}Setting{s} out of range: " + "; ".join(bad) + ". Nothing was run. Fix the value"
                         f"{s} on the command line or in the preset that sets {'them' if s else 'it'}.")
    if not cfg.get("force_size"):
        plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if _resolvable(cfg[k]) else None
                 for k in ("model", "analysis", "data") if isinstance(cfg.get(k), DictConfig)}
        if big := oversized(plain):
            raise LmcalError(f"{where}Sizes beyond reason: " + "; ".join(big) + ". Nothing was run. Lower them, or, "
                             "if you mean it, add force_size=true to the command line.")
