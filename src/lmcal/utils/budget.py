"""Sizes beyond reason, refused before any work (unless force_size=true): a setting far past any run of the paper
(generation lengths, generations per point, memory lengths), a network whose training would not fit in this machine's
memory, a generated source (Markov, power law) whose table would not, or generation stages whose work or results
would not. Each refusal shows the estimate it rests on. (A memory length longer than the text it is read on is
refused too, whatever force_size says: `tau_too_long`.)
"""

from __future__ import annotations

import math
import os

# the largest value of each generation setting that is still a plausible run (the paper: 100, 5 and 700 with more than
# 100 points; a 100k-token context is larger than any model here reads)
CAPS = {"num_prefixes": 10**6, "samples_per_prefix": 10**5, "prefix_len": 10**5, "horizon": 10**5}
MAX_TAU = 10**5  # a memory length (model.memory_tau, analysis.memory.tau): as long as the longest context above
MAX_TOKEN_STEPS = 10**10  # generated or prefix tokens of one stage: the paper's settings are about 4 x 10^5
VOCAB = 10_000  # PTB's vocabulary, for the network's size before the corpus is read
SIZE_KEYS = ("emb_size", "hidden_size", "num_layers", "n_embd", "n_layer", "n_positions")
BYTES_PER_PARAMETER = 16  # float32 weights, gradients and two optimiser (or averaging) buffers


def memory_bytes() -> int:
    """This machine's memory (RAM), or 0 where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def network_parameters(model: dict) -> int | None:
    """About how many parameters the network `model` (a conf/model node) has; None for one not built here."""
    target = str(model.get("_target_") or "")

    def n(key, default=0):
        v = model.get(key, default)
        return v if isinstance(v, int) and not isinstance(v, bool) else default

    if target.endswith("AWDLSTM"):
        e, h, layers = n("emb_size"), n("hidden_size"), max(n("num_layers", 1), 1)
        return VOCAB * e + 4 * (e + h + 2) * h * layers  # embedding (tied to the output) and the LSTMs' gates
    if target.endswith("GPTLM"):
        d, layers = n("n_embd"), n("n_layer")
        return 12 * d * d * layers + (VOCAB + n("n_positions")) * d
    return None


def tau_too_long(key: str, tau: int, tokens: int, split: str) -> str:
    """The sentence refusing a memory length `tau` that is not shorter than the `tokens` of the split it is read on
    (the plan check and the run say the same: lmcal.pipeline.check, lmcal.train, lmcal.stages.memory)."""
    return (f"{key}={tau:,} is not shorter than the {tokens:,} {split} tokens it is read on: no window would ever "
            "be cut, so the tau-limited model would be the full model. Nothing was run.")


def _gb(b: float) -> str:
    return f"{b / 1e9:,.1f} GB" if b < 1e12 else f"{b / 1e12:,.3g} TB"


def oversized(cfg: dict) -> list[str]:
    """What is beyond reason in the resolved config `cfg` (a plain dict), each with its estimate."""
    found, ram = [], memory_bytes()
    model = cfg.get("model")
    params = network_parameters(model) if isinstance(model, dict) else None
    if params is not None and ram and params * BYTES_PER_PARAMETER > ram:
        sizes = ", ".join(f"model.{k}={model[k]:,}" for k in SIZE_KEYS if isinstance(model.get(k), int))
        found.append(f"the network ({sizes}) has about {params:.3g} parameters, whose training needs about "
                     f"{_gb(params * BYTES_PER_PARAMETER)} of memory, more than this machine's {_gb(ram)}")
    taus = [("model.memory_tau", model.get("memory_tau") if isinstance(model, dict) else None),
            ("analysis.memory.tau", ((cfg.get("analysis") or {}).get("memory") or {}).get("tau")
             if isinstance(cfg.get("analysis"), dict) else None)]
    for key, tau in taus:
        if isinstance(tau, int) and not isinstance(tau, bool) and tau > MAX_TAU:
            found.append(f"{key}={tau:,} (at most {MAX_TAU:,}): a tau-limited model reads up to tau tokens again for "
                         "every token it scores, and no corpus here is that long")
    if why := source_table_problem(cfg.get("data"), ram):
        found.append(why)
    analysis = cfg.get("analysis")
    for name, node in (analysis.items() if isinstance(analysis, dict) else []):
        if not isinstance(node, dict) or not all(isinstance(node.get(k), int) for k in CAPS):
            continue
        big = [f"analysis.{name}.{k}={node[k]:,} (at most {cap:,})" for k, cap in CAPS.items() if node[k] > cap]
        steps = node["num_prefixes"] * node["samples_per_prefix"] * (node["prefix_len"] + node["horizon"])
        results = node["num_prefixes"] * node["samples_per_prefix"] * node["horizon"] * 8  # float64 per step
        if big or steps > MAX_TOKEN_STEPS or (ram and results > ram / 2):
            found.append(f"{', '.join(big) or f'the {name} stage'}: num_prefixes x samples_per_prefix x (prefix_len "
                         f"+ horizon) = {steps:.3g} model steps (the paper's settings: 4e+05; at most "
                         f"{MAX_TOKEN_STEPS:.0e}), with about {_gb(results)} of per-step results")
    return found


TABLE_BYTES_PER_ENTRY = 64  # measured peak of lmcal.data.markov / powerlaw per [V^order, V] entry: the float64 table,
# the random draws and ranks that build it, the stationary iteration's product, the sampler's CDF and its Python lists
SOURCE_DEFAULTS = {"markov": (16, 2), "powerlaw": (256, 1)}  # (vocab_size, order) of conf/data/<name>.yaml


def source_table_problem(data, ram: int) -> str | None:
    """Why a generated source's table (data=markov, data=powerlaw: [V^order, V] float64) would not fit in half this
    machine's memory `ram` while it is built and sampled, naming data.corpus_kwargs.order and the largest that
    fits; None where it fits (or is not such a source)."""
    if not isinstance(data, dict) or data.get("name") not in SOURCE_DEFAULTS or not ram:
        return None
    ck, (v0, k0) = data.get("corpus_kwargs") or {}, SOURCE_DEFAULTS[data["name"]]
    v, k = ck.get("vocab_size", v0), ck.get("order", k0)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (v, k)) or v < 2:
        return None  # (the ranges' message)
    room = math.log(ram / 2 / TABLE_BYTES_PER_ENTRY)  # (logarithms: order=10**9 is no number to raise V to)
    if (k + 1) * math.log(v) <= room:
        return None
    fits = int(room / math.log(v)) - 1  # the largest order j with V^(j + 1) entries within half the memory
    fix = f"data.corpus_kwargs.order={fits} fits" if fits >= 1 else "no order fits this vocabulary: lower vocab_size"
    entries = math.exp((k + 1) * math.log(v)) if (k + 1) * math.log(v) < 600 else None
    size = (f"{entries:.3g} entries, about {_gb(TABLE_BYTES_PER_ENTRY * entries)} while it is built and sampled "
            f"({TABLE_BYTES_PER_ENTRY} bytes an entry)" if entries else "entries beyond any memory")
    return (f"data.corpus_kwargs.order={k:,} with vocab_size={v:,}: the {data['name']} source's table [V^order, V] "
            f"has {v:,}^{k + 1:,} = {size}, more than half this machine's {_gb(ram)} ({fix})")
