"""The sizes the plan check and the preflight check (lmcal.pipeline.check, lmcal.pipeline.preflight): the model a
stage meets (its kind, context, vocabulary, step FLOPs and corpus), the streams each stage feeds it, and the refusal
that names the keys that do not fit and the settings that do."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from lmcal.errors import LmcalError
from lmcal.pipeline.timing import BATCHED_TFLOPS
from lmcal.utils.budget import MAX_TOKEN_STEPS

# Tokens of each split (PTB with its <eos>; the Markov source's come from its config). A corpus not listed is
# checked only where a stage names its token counts.
CORPUS_TOKENS = {"ptb": {"train": 929_589, "valid": 73_760, "test": 82_430}}
PTB_VOCAB = 10_000
GB = 1e9
GOAL_TEXT = "would measure its goal rows again"  # (count_problems' words: a stage that would run on, not fail)


@dataclass
class Model:
    """What a stage's model is, from its training stage's composed config."""

    kind: str                     # "awd_lstm" | "transformer"
    context: int | None           # tokens it can read (None: unbounded, a recurrent state)
    vocab: int
    emb: int
    layers: int
    params: int                   # all parameters (tied embeddings counted once)
    step_flops: float             # forward FLOPs of one token step, output layer included
    corpus: dict = field(default_factory=dict)   # {split: tokens} where known
    heads: int = 1                # attention heads (the transformer)
    context_key: str = "model.n_positions"  # where its context is set, for the messages
    what: str = ""                # the model in messages ("" : its kind)
    candidate_share: float = 1.0  # a lookahead candidate's FLOPs over a step's (the LSTM's skip h W_hh: lmcal.models.
                                  # step_lm.LSTMStepLM.candidate_features)


def model_of(train_cfg: DictConfig, vocab: int | None = None, corpus: dict | None = None) -> Model:
    """The model of a training config (its `model` and `data` nodes); `vocab` and `corpus` ({split: tokens}): the
    corpus as read, where it has been (else PTB's and the Markov source's sizes from the config)."""
    m, d = train_cfg.model, train_cfg.data
    if vocab is not None:
        V, corpus = int(vocab), dict(corpus or {})
    elif d.name in ("markov", "powerlaw"):  # the generated sources: their sizes are their settings
        ck = d.corpus_kwargs
        V, corpus = int(ck.vocab_size), {"train": int(ck.n_train), "valid": int(ck.n_valid), "test": int(ck.n_test)}
    else:
        V, corpus = PTB_VOCAB, dict(CORPUS_TOKENS.get(str(d.name), {}))
    for split, limit in (("train", d.get("max_train_tokens")), ("valid", d.get("max_eval_tokens")),
                         ("test", d.get("max_eval_tokens"))):
        if limit and split in corpus and vocab is None:
            corpus[split] = min(corpus[split], int(limit))
    if str(m._target_).endswith("GPTLM"):
        E, L, n = int(m.n_embd), int(m.n_layer), int(m.n_positions)
        inner = int(m.n_inner or 4 * E)
        body = L * (4 * E * E + 2 * E * inner)  # attention q,k,v,o and the MLP matrices
        small = L * (9 * E + inner) + 2 * E  # their biases and the layer norms
        return Model("transformer", n, V, E, L, body + small + V * E + n * E, 2.0 * (body + V * E), corpus,
                     heads=int(m.n_head))
    E, H, L = int(m.emb_size), int(m.hidden_size), int(m.num_layers)
    tied = bool(m.get("tie_weights", True))
    lstm = 0
    for i in range(L):
        n_in, n_out = (E if i == 0 else H), (E if (i == L - 1 and tied) else H)
        lstm += 4 * n_out * (n_in + n_out) + 8 * n_out
    out = E if tied else H
    recurrent = sum(4 * n * n for n in ([H] * (L - 1) + [E if tied else H]))  # h W_hh^T of each layer
    step = 2.0 * (lstm + V * out)
    return Model("awd_lstm", None, V, out, L, V * E + lstm + V * (0 if tied else out) + V, step, corpus,
                 candidate_share=(step - 2.0 * recurrent) / step)


def bytes_text(b: float) -> str:  # 1.60 GB, 665.8 MB
    return f"{b / GB:.2f} GB" if b >= 0.1 * GB else f"{b / 1e6:.1f} MB"


def stream_sizes(name: str, a: dict, m: Model, memory_tau: int | None) -> list[tuple[str, int]]:
    """(what, with which keys; tokens) of every stream stage `name` (settings `a`) feeds its model in one piece."""
    sizes = []
    if "horizon" in a:
        sizes.append((f"prefix_len + horizon = {a['prefix_len']} + {a['horizon']}", a["prefix_len"] + a["horizon"]))
    if "timing_horizon" in a:
        sizes.append((f"prefix_len + timing_horizon = {a['prefix_len']} + {a['timing_horizon']}",
                      a["prefix_len"] + a["timing_horizon"]))
    if "fit_streams" in a and name != "sequence_calibration":  # its fit reads prefix + horizon windows instead
        fit = fit_tokens(a, m)
        if fit:
            sizes.append((f"fit_tokens / fit_streams = {fit:,} / {a['fit_streams']}", fit // a["fit_streams"]))
    if "score_streams" in a:
        test = m.corpus.get("test")
        score = min(a["score_tokens"], test) if a["score_tokens"] and test else a["score_tokens"] or test
        if score:
            sizes.append((f"score_tokens / score_streams = {score:,} / {a['score_streams']}",
                          score // a["score_streams"]))
    if name == "future_entropy":
        k = max(a["horizon_k"]) if isinstance(a["horizon_k"], list) else a["horizon_k"]
        steps = a.get("rollout_steps") or a["horizon"]  # null: the horizon
        sizes.append((f"rollout_prefix + rollout_steps + max(horizon_k) = {a['rollout_prefix']} + "
                      f"{steps} + {k}", a["rollout_prefix"] + steps + k))
    if name == "sequence_calibration":  # Algorithm 1's law: fitted, generated and scored over law_horizon words
        law = a.get("law_horizon") or 2 * a["horizon"]
        sizes.append((f"prefix_len + law_horizon = {a['prefix_len']} + {law}"
                      + ("" if a.get("law_horizon") else " (null: 2 x horizon)"), a["prefix_len"] + law))
        if a.get("soft_value"):
            sizes.append((f"sv_prefix + sv_steps = {a['sv_prefix']} + {a['sv_steps']}",
                          a["sv_prefix"] + a["sv_steps"]))
    if name == "memory":
        tau = a.get("tau") or memory_tau
        if tau:
            sizes.append((f"memory window tau = {tau}", int(tau)))
    return sizes


def fit_tokens(a: dict, m: Model) -> int:
    """Validation tokens a stage fits on: fit_tokens (null: the whole split), at most the split's own."""
    return min(a["fit_tokens"] or m.corpus.get("valid", 0), m.corpus.get("valid", a["fit_tokens"] or 0))


def fitting_settings(name: str, a: dict, m: Model, memory_tau: int | None = None) -> dict:
    """{key: value} of stage `name`'s settings `a` changed so that every stream fits m's context (prefix_len at most
    half of it, the horizons and rollouts shortened, the streams more numerous) and each fit stream is longer than
    min_context: the settings a refusal proposes."""
    c, b = m.context, dict(a)
    for _ in range(4):  # a change shortens streams only: a few rounds settle
        bad = [w.split(" = ")[0] for w, s in stream_sizes(name, b, m, memory_tau) if c and s > c]
        for key in bad:
            if key.startswith(("prefix_len + ", "sv_prefix")):
                first = "prefix_len" if key.startswith("prefix_len") else "sv_prefix"
                b[first] = max(1, c // 4) if b[first] > c // 2 else b[first]
                b[key.split(" + ")[1]] = max(1, c - b[first])
            elif key.startswith(("fit_tokens", "score_tokens")):
                fit = key.startswith("fit")
                b[f"{key[:key.index('_')]}_streams"] = -(-(fit_tokens(b, m) if fit else score_tokens(b, m)) // c)
            elif key.startswith("rollout_prefix"):
                ks = [k for k in (b["horizon_k"] if isinstance(b["horizon_k"], list) else [b["horizon_k"]])
                      if k <= c // 2] or [1]
                b["horizon_k"] = ks if isinstance(b["horizon_k"], list) else ks[0]
                b["rollout_prefix"] = min(b["rollout_prefix"], max(1, c // 4))
                b["rollout_steps"] = max(1, c - b["rollout_prefix"] - max(ks))
            elif key.startswith("memory window"):
                b["tau"] = c
        if short := short_fit_streams(name, b, m):
            b["min_context"] = short // 2
        if not bad and not short:
            break
    return {k: v for k, v in b.items() if v != a.get(k)}


def short_fit_streams(name: str, a: dict, m: Model) -> int:
    """The length of stage `name`'s fit streams where it is not more than min_context (nothing to fit), else 0."""
    fit = fit_tokens(a, m) if "min_context" in a and "fit_streams" in a and name != "sequence_calibration" else 0
    return fit // a["fit_streams"] if fit and fit // a["fit_streams"] <= max(1, a["min_context"]) else 0


def size_problems(name: str, a: dict, m: Model, memory_tau: int | None = None,
                  force: bool = False) -> tuple[str, dict]:
    """What in stage `name`'s settings `a` does not fit model `m`, as sentences naming the keys, their values and the
    limit ("" when everything fits), and the settings that fit ({key: value}, fitting_settings). force (force_size):
    counts beyond the steps one stage may take (count_problems) pass; what cannot fit the model still does not."""
    bad = [(w, s) for w, s in stream_sizes(name, a, m, memory_tau) if m.context and s > m.context]
    text = (f"would feed its {m.what or m.kind} more tokens than its context of {m.context} ({m.context_key}): "
            + "; ".join(f"{what} = {size:,} tokens" for what, size in bad) + ".") if bad else ""
    if short := short_fit_streams(name, a, m):
        text += (" Its" if text else "would read") + (
            f" fit streams of fit_tokens / fit_streams = {fit_tokens(a, m):,} / {a['fit_streams']} = {short:,} "
            f"tokens, not longer than min_context = {a['min_context']} (the tokens each reads before its positions "
            "count): nothing to fit.")
    fits = fitting_settings(name, a, m, memory_tau) if text else {}
    counted, fewer = count_problems(name, a, m) if not force else ("", {})
    return (f"{text} It {counted}" if text and counted else text or counted), {**fits, **fewer}


def goal_steps_per_prefix(a: dict) -> int:
    """Model steps the sequence_calibration stage's goal rows take per fresh prefix (goal_prefixes): its
    samples_per_prefix generations by the fewest-particle SMC row, each generated and its last tenth read by two nested
    runs (2 x 3 runs), over prefix_len + law_horizon words, as lmcal.pipeline.check.model_steps counts them."""
    window = a["prefix_len"] + (a.get("law_horizon") or 2 * a["horizon"])
    smc = bool(a.get("untwisted", True)) or bool(a.get("twist") and a.get("soft_value"))
    fewest = min((int(k) for k in (a.get("particles") or []) if smc), default=1)
    return 6 * fewest * a["samples_per_prefix"] * window


def count_problems(name: str, a: dict, m: Model) -> tuple[str, dict]:
    """What of stage `name`'s counts would take more model steps than one stage may (MAX_TOKEN_STEPS, the bound of
    lmcal.utils.budget): a sentence with the estimate (steps, and hours at the assumed BATCHED_TFLOPS), and
    {key: the largest value that fits}; ("", {}) when it fits. The goal rows' goal_prefixes: the one count that the
    generation settings' caps do not bound."""
    if name != "sequence_calibration" or not a.get("goal_prefixes"):
        return "", {}
    n, per = int(a["goal_prefixes"]), goal_steps_per_prefix(a)
    if n * per <= MAX_TOKEN_STEPS:
        return "", {}
    hours = n * per * m.step_flops / (BATCHED_TFLOPS * 1e12) / 3600
    return (f"{GOAL_TEXT} on goal_prefixes = {n:,} fresh prefixes, {per:,} model steps each "
            f"(2 x 3 runs x the fewest particles x samples_per_prefix x (prefix_len + law_horizon)): {n * per:.3g} "
            f"steps, about {hours:,.1f} h at an assumed {BATCHED_TFLOPS:g} TFLOP/s, more than the "
            f"{MAX_TOKEN_STEPS:.0e} steps one stage may take.", {"goal_prefixes": max(1, MAX_TOKEN_STEPS // per)})


def setting(key: str, v) -> str:  # key=value as a Hydra override
    return f"{key}=[{','.join(map(str, v))}]" if isinstance(v, (list, tuple)) else f"{key}={v}"


def size_refusal(problems: list[tuple[str, str, dict]], how: str) -> LmcalError:
    """One paragraph: problems (subject, what size_problems says, {key: value that fits}); how: where they go."""
    fits = [setting(k, v) for _, _, f in problems for k, v in f.items()]
    head = "A setting that fits" if len(fits) == 1 else "Settings that fit"
    fix = f"{head}: {' '.join(fits)} ({how})." if fits else how
    outcome = "run for hours" if all(t.startswith(GOAL_TEXT) and " It " not in t for _, t, _ in problems) else "fail"
    return LmcalError(" ".join(f"{subject} {text}" for subject, text, _ in problems)
                      + f" {'It' if len(problems) == 1 else 'Each'} would {outcome} when it got there; nothing was "
                      f"run. {fix}" + (" Or, if you mean it, add force_size=true to the command line."
                                       if outcome == "run for hours" else ""))


def score_tokens(a: dict, m: Model) -> int:
    """Test tokens a stage scores: score_tokens (null: the whole test split), at most the split's own."""
    return min(a["score_tokens"], m.corpus.get("test", a["score_tokens"])) if a.get("score_tokens") \
        else m.corpus.get("test", 0)
