"""The plan check of `make reproduce ... ARGS='check=true'`: every stage of a profile composed and range-checked, and
every size checked against the model the stage will meet, in seconds and with no GPU, before anything runs.

    python -m lmcal.reproduce profile=paper check=true    # prints the plan; exit 0, or 2 with one paragraph

For a model of bounded context (the transformer: model.n_positions) each stream it reads must fit it: prefix_len +
horizon of the generations, fit_tokens / fit_streams and score_tokens / score_streams of the fitted and scored
streams (the lookahead feeds one candidate after the last read token, so a stream of S tokens takes S positions),
the rollouts of future_entropy and sequence_calibration, the timing runs, the memory windows tau and the training
window. The plan lists, per stage, those sizes, the largest tensors it holds (their peak memory) and its model steps;
the wall-time figure is an estimate from FLOP counts at a stated device rate, labelled so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lmcal.core.lookahead import CUDA_MAX_CHUNK
from lmcal.errors import LmcalError
from lmcal.models.hf import shared_candidate_bytes
from lmcal.pipeline.plan import plan
from lmcal.utils.settings import CONF_DIR, composed
from lmcal.utils.validate import check_config

# Tokens of each split (PTB with its <eos>; the Markov source's come from its config). A corpus not listed is
# checked only where a stage names its token counts.
CORPUS_TOKENS = {"ptb": {"train": 929_589, "valid": 73_760, "test": 82_430}}
PTB_VOCAB = 10_000
# The device the wall-time estimate is for, and the rates assumed sustained on it: stated assumptions, not
# measurements (no GPU has run this project). The precision policy keeps TF32 off (lmcal.utils.device), so the peak is
# an H100 SXM's ~67 TFLOP/s of dense FP32, not its TF32 tensor-core rate. Batched work (transformer training, the
# analysis stages' wide batches and lookahead chunks) is taken at 25 TFLOP/s (37% of it). The AWD-LSTM's training
# steps 20 streams through 3 layers token by token: latency-bound, 5 TFLOP/s (27 s a PTB epoch of the paper model).
# Trainings side by side on the one GPU (the tau-models under hydra/launcher=local_parallel) overlap until together
# they reach the batched rate. The FLOP counts per token are exact for the matmuls (the cpu training bench,
# docs/bench/train_throughput.md, measures the same 1.45e8 FLOP a paper-model token).
DEVICE, PEAK_TFLOPS, GPU_FREE_GB = "one H100-class GPU", 67.0, 80.0
RATES = {"batched": 25.0, "recurrent training": 5.0}  # TFLOP/s
SIDE_BY_SIDE_LAUNCHER = "hydra/launcher=local_parallel"  # a sweep's jobs as parallel local processes (joblib)
GB = 1e9


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
    candidate_share: float = 1.0  # a lookahead candidate's FLOPs over a step's (the LSTM's skip h W_hh: lmcal.models.
                                  # step_lm.LSTMStepLM.candidate_features)


def model_of(train_cfg: DictConfig) -> Model:
    m, d = train_cfg.model, train_cfg.data
    if d.name == "markov":
        ck = d.corpus_kwargs
        V, corpus = int(ck.vocab_size), {"train": int(ck.n_train), "valid": int(ck.n_valid), "test": int(ck.n_test)}
    else:
        V, corpus = PTB_VOCAB, dict(CORPUS_TOKENS.get(str(d.name), {}))
    for split, limit in (("train", d.get("max_train_tokens")), ("valid", d.get("max_eval_tokens")),
                         ("test", d.get("max_eval_tokens"))):
        if limit and split in corpus:
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


def _bytes(b: float) -> str:
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
        fit = min(a["fit_tokens"] or m.corpus.get("valid", 0), m.corpus.get("valid", a["fit_tokens"] or 0))
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
    if name == "sequence_calibration" and a.get("soft_value"):
        sizes.append((f"sv_prefix + sv_steps = {a['sv_prefix']} + {a['sv_steps']}", a["sv_prefix"] + a["sv_steps"]))
    if name == "memory":
        tau = a.get("tau") or memory_tau
        if tau:
            sizes.append((f"memory window tau = {tau}", int(tau)))
    return sizes


def _score_tokens(a: dict, m: Model) -> int:
    """Test tokens a stage scores: score_tokens (null: the whole test split), at most the split's own."""
    return min(a["score_tokens"], m.corpus.get("test", a["score_tokens"])) if a.get("score_tokens") \
        else m.corpus.get("test", 0)


def candidates(rule: dict, m: Model) -> int:
    """Lookahead steps a position takes under a candidate rule (lmcal.core.lookahead_law): top-k, k + the tail draws;
    cover, at most cover_max (else the vocabulary: the memory budget's cap holds every word of these models) + the
    draws; exact, the vocabulary."""
    if rule.get("topk"):
        return int(rule["topk"]) + int(rule.get("tail_samples") or 16)
    if rule.get("cover"):
        return min(m.vocab, int(rule.get("cover_max") or m.vocab)) + int(rule.get("tail_samples") or 16)
    return m.vocab


def look_steps(rule: dict, m: Model) -> float:
    """A position's lookahead in step equivalents: its candidates, each the share of a model step it costs."""
    return candidates(rule, m) * m.candidate_share


def calibration_extras(a: dict, m: Model) -> float:
    """Model steps of the calibration stage's approximation table (exact lookahead at its positions of plain
    generations) and dose-response (each rule's test CE, one lookahead pass, and its generations at each multiple;
    the stage's own at a* reused where the generations are the same)."""
    steps, length = 0.0, a.get("prefix_len", 0) + a.get("horizon", 0)
    ap, dr = a.get("approximation"), a.get("dose_response")
    rules = (dr or {}).get("rules") or []
    if ap and rules:
        steps += ap.get("generations", 30) * (length + ap.get("steps", 10) * m.vocab * m.candidate_share)
    if dr and rules:
        n = (dr.get("num_prefixes") or a["num_prefixes"]) * (dr.get("samples_per_prefix") or a["samples_per_prefix"])
        score = min(dr.get("score_tokens") or _score_tokens(a, m), m.corpus.get("test", 10**12))
        for rule in rules:
            steps += score * (1 + look_steps(rule, m))
            steps += len(dr.get("multiples") or [1]) * n * (a["prefix_len"] + a["horizon"] * (1 + look_steps(rule, m)))
    return steps


def model_steps(name: str, a: dict, m: Model, memory_tau: int | None = None) -> float:
    """Model token steps of an analysis stage (the main terms; the arithmetic is in each line), a lookahead candidate
    counted as the share of a step it costs (Model.candidate_share)."""
    gen = a.get("num_prefixes", 0) * a.get("samples_per_prefix", 0) * (a.get("prefix_len", 0) + a.get("horizon", 0))
    look = 1 + look_steps(a, m) if "tail_samples" in a else 1
    fit = min(a.get("fit_tokens") or 0, m.corpus.get("valid", 0)) if "fit_tokens" in a else 0
    score = _score_tokens(a, m) if "score_tokens" in a else 0
    if name == "entropy_rate":
        return gen
    if name == "calibration":  # the fit's lookahead, the test scored before and after, plain and calibrated
        # generations (the calibrated ones' prompts read by the base model, their lookahead after each word only)
        words = a.get("num_prefixes", 0) * a.get("samples_per_prefix", 0) * a.get("horizon", 0)
        return fit * look + score * (1 + look) + gen + words * look + calibration_extras(a, m)
    if name == "decoders":  # seven decoders and the fitted temperature, a plain step each (calibration row reused)
        return fit + 8 * (score + gen)
    if name == "future_entropy":
        k = max(a["horizon_k"]) if isinstance(a["horizon_k"], list) else a["horizon_k"]
        heads = len(a["horizon_k"]) * len(a["discount"])
        steps = a.get("rollout_steps") or a["horizon"]
        return a["rollouts"] * (a["rollout_prefix"] + steps + k) + fit + (heads + 1) * (score + gen)
    if name == "sequence_calibration":  # SMC rows, alpha*'s ~10 bracketing fits, the soft-value rounds
        window = a["prefix_len"] + a["horizon"]
        smc = sum(a["particles"]) * gen + 10 * a["fit_prefixes"] * a["fit_particles"] * window
        sv = a["sv_iterations"] * a["sv_rollouts"] * (a["sv_prefix"] + a["sv_steps"]) if a.get("soft_value") else 0
        return smc + sv + score + gen
    if name == "memory":  # both models on every test token; a tau-window (or a tau-model, exactly) tau steps a token
        return score * (1 + (a.get("tau") or memory_tau or 1))
    return 0.0


def peak_tensors(name: str, a: dict, m: Model, budget_gb: float | None = None) -> list[tuple[str, float]]:
    """(tensor [shape], bytes) of the largest tensors stage `name` holds at once (fp32 unless said). The lookahead's
    chunk is sized as lmcal.core.lookahead.chunk_sizes does on CUDA: analysis.memory_budget_gb (null: half the free
    memory of the GPU, taken here as GPU_FREE_GB) over what each candidate holds (the transformer's: its share of its
    row's past, which the row's candidates read together, lmcal.models.hf.shared_candidate_bytes) and its [V]
    logits."""
    V, out = m.vocab, []
    B = a.get("max_batch")
    if B:
        out.append((f"next-word log-probs [max_batch, V] = [{B:,}, {V:,}]", 4.0 * B * V))
    T = a.get("prefix_len", 0) + a.get("horizon", 0)
    if name == "calibration":  # the fit's statistics, kept on the CPU: logw and H of each position's atoms
        fit = min(a.get("fit_tokens") or m.corpus.get("valid", 0), m.corpus.get("valid", 10**12))
        out.append((f"fit statistics 2 x [fit positions, candidates] = 2 x [{fit:,}, {candidates(a, m):,}] "
                    "(CPU memory)", 8.0 * fit * candidates(a, m)))
    if B and "tail_samples" in a:
        cands = B * candidates(a, m)  # candidates per generated word
        per_row = cands // B
        # the transformer's candidates of a row share its past: one layer's keys and values, [T, E] each, one row
        own = shared_candidate_bytes(2.0 * T * m.emb * 4, T, per_row, m.heads, m.emb) if m.kind == "transformer" \
            else 0.0
        budget = (budget_gb or GPU_FREE_GB / 2) * 1e9
        chunk = int(min(cands, CUDA_MAX_CHUNK, max(1, budget // (own + 12.0 * V))))
        what = "share of its row's past" if m.kind == "transformer" else "state"
        out.append((f"lookahead chunk: {chunk:,} of {cands:,} candidates ({budget / 1e9:g} GB budget) x ({what} "
                    f"{_bytes(own)} + [V] logits x 3)", chunk * (own + 12.0 * V)))
    if m.kind == "transformer" and B:
        kv = 2.0 * m.layers * B * T * m.emb * 4
        out.append((f"KV cache 2 x layers x [max_batch, T, E] = 2 x {m.layers} x [{B:,}, {T}, {m.emb}]", kv))
    if name == "memory":
        out.append(_memory_rows(a, m, budget_gb))
    return out


def side_by_side(cmd: list[str], n: int) -> int:
    """How many of a training sweep's `n` jobs run at once on the one GPU: hydra.launcher.n_jobs (its preset's default
    where not given) under hydra/launcher=local_parallel, else 1 (the basic launcher runs them one after another; a
    Slurm launcher spreads them over GPUs the one-GPU estimate does not have)."""
    if SIDE_BY_SIDE_LAUNCHER not in cmd:
        return 1
    given = [o.split("=", 1)[1] for o in cmd if o.startswith("hydra.launcher.n_jobs=")]
    default = OmegaConf.load(CONF_DIR / "hydra" / "launcher" / "local_parallel.yaml").n_jobs
    return max(1, min(n, int(given[-1] if given else default)))


def _memory_rows(a: dict, m: Model, budget_gb: float | None) -> tuple[str, float]:
    """The memory stage's fit rows where analysis.memory.rows keeps them (lmcal.stages.memory.rows_where), on the
    GPU: auto keeps them there when they fit the budget (null: half of GPU_FREE_GB), else streams them."""
    n = _score_tokens(a, m)
    dtype, rows = a.get("store_dtype", "float32"), a.get("rows", "auto")
    size = 2.0 * m.vocab * {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]  # one row of log P^ and log P~
    why, where = f"rows={rows}", {"cpu": "on the CPU", "device": "on the model's device"}.get(rows)
    if rows == "auto":
        budget = (budget_gb or GPU_FREE_GB / 2) * GB
        fits = n * size <= budget
        why += f": {_bytes(n * size)} {'within' if fits else 'over'} the {budget / GB:g} GB budget"
        why += "; a model on the CPU keeps them there" if fits else ""
        rows, where = ("device", "on the GPU") if fits else ("stream", None)
    if rows == "stream":
        c = min(n, a.get("windows_per_batch", 512))
        return (f"streamed rows, one chunk 2 x [{c:,}, {m.vocab:,}] {dtype} ({why}; recomputed on each pass of the "
                "fit)", c * size)
    return f"kept rows 2 x [N, V] {dtype} = 2 x [{n:,}, {m.vocab:,}] {where} ({why})", n * size


def stream_passes(a: dict, m: Model) -> int:
    """Passes the memory stage's fit makes over its rows, each a forward of both models when they are streamed: about
    25 with the one-step jackknife, and 25 + 11 per block with jackknife=exact (counted on random rows: 25, 24, 25 and
    47, 80, 132, 238 for 2, 5, 10 and 20 blocks)."""
    if a.get("jackknife", "onestep") != "exact":
        return 25
    n = _score_tokens(a, m)
    return 25 + 11 * -(-n // int(a.get("cluster_size", 2000)))


def _refuse(stage: str, m: Model, bad: list[tuple[str, int]], fix: str) -> LmcalError:
    listed = "; ".join(f"{what} = {size:,} tokens" for what, size in bad)
    return LmcalError(
        f"Stage '{stage}' would feed its {m.kind} more tokens than its context of {m.context} (model.n_positions): "
        f"{listed}. It would fail when it got there, after the stages before it had run; nothing was run. {fix}")


def check(cfg: DictConfig) -> str:
    """The plan of profile `cfg` as text, every stage composed and range-checked (lmcal.utils.rules) and every size
    checked against the model it meets; raises LmcalError naming the stage, the keys and the limit otherwise."""
    stages = plan(cfg)
    models: dict[str, Model] = {}  # training stage dir -> its model
    lines, est, groups = [], [], []  # est: (name, FLOP, rate kind) one at a time; groups: trainings side by side
    for st in stages:
        if "fn" in st:
            lines.append(f"{st['name']}: results.json, REPORT.md (in-process)")
            continue
        entry, overrides = st["cmd"][2], [o for o in st["cmd"][3:] if o != "-m"]
        where = f"Stage '{st['name']}' (python -m {entry}): "
        if entry == "lmcal.train":
            taus = [None] if "taus" not in st else list(st["taus"])
            at_once, group = side_by_side(st["cmd"], len(taus)), []
            for t in taus:
                c = composed(entry, overrides + ([f"model.memory_tau={t}"] if t else []))
                check_config(c, where=where)  # every setting in its range (lmcal.utils.rules), as the run will
                m = model_of(c)
                models[str(st["taus"][t] if t else st["dir"])] = m
                bptt, batch = int(c.data.bptt), int(c.data.batch_size)
                if m.context and bptt > m.context:
                    raise _refuse(st["name"], m, [(f"data.bptt = {bptt}", bptt)],
                                  f"Set data.bptt <= {m.context} in {st['name'].replace('_base', '')}.base.")
                epochs = int(c.trainer.max_epochs)
                tokens = m.corpus.get("train", 0) * max(epochs, 0)
                flops = 3 * m.step_flops * tokens
                peak = [(f"logits [bptt, batch, V] = [{bptt}, {batch}, {m.vocab:,}] and their gradient",
                         2 * 4.0 * bptt * batch * m.vocab),
                        (f"parameters, gradients, optimiser state: 4 x {m.params:,} fp32", 16.0 * m.params)]
                lines.append(f"{st['name']}{'' if t is None else f' tau={t}'}: {m.kind} ({m.params:,} parameters, "
                             f"context {m.context or 'unbounded'}, V {m.vocab:,}), {epochs} epochs x "
                             f"{m.corpus.get('train', 0):,} tokens = {tokens:,} tokens, "
                             f"3 x {m.step_flops:.3g} FLOP x tokens = {flops:.3g} FLOP; peak: "
                             + "; ".join(f"{w} {_bytes(b)}" for w, b in peak))
                if at_once > 1:  # timed together below
                    group.append((flops, sum(b for _, b in peak)))
                else:
                    est.append((st["name"] + ("" if t is None else f" tau={t}"), flops,
                                "recurrent training" if m.kind == "awd_lstm" else "batched"))
            if group:
                groups.append((st["name"], len(group), at_once, [f for f, _ in group]))
                lines.append(f"{st['name']}: the {len(group)} trainings side by side on the one GPU, {at_once} at once "
                             f"({SIDE_BY_SIDE_LAUNCHER}): peak {at_once} x {_bytes(max(b for _, b in group))} of the "
                             "tensors above, plus each process's CUDA context")
            continue
        c = composed(entry, overrides)
        check_config(c, where=where)
        ckpt = next(o.split("=", 1)[1] for o in overrides if o.startswith("ckpt="))
        m = next((mm for d, mm in models.items() if ckpt.startswith(d + os.sep)), None)  # tau_1 is not tau_10
        if m is None:
            lines.append(f"{st['name']}: model of {ckpt} not planned here; sizes not checked")
            continue
        name = list(c.stages)[0]
        a = OmegaConf.to_container(c.analysis[name], resolve=True)
        mem_tau = next((int(o.split("=")[1]) for o in overrides if o.startswith("model.memory_tau=")), None)
        if name == "memory" and "tau_" in ckpt:  # a tau-model's own memory length
            mem_tau = int(next(p for p in Path(ckpt).parts if p.startswith("tau_"))[4:])
        sizes = stream_sizes(name, a, m, mem_tau)
        if m.context:
            bad = [(w, s) for w, s in sizes if s > m.context]
            if bad:
                part = "transformer.analysis" if st["name"].startswith("transformer_") else "analysis"
                raise _refuse(st["name"], m, bad, f"In the profile's {part}, lower analysis.{name}'s prefix_len or "
                              "horizon (or the other lengths named), or raise fit_streams or score_streams, until "
                              f"each is at most {m.context}.")
        steps = model_steps(name, a, m, mem_tau)
        peak = peak_tensors(name, a, m, c.analysis.get("memory_budget_gb"))
        passes = stream_passes(a, m) if any(w.startswith("streamed rows") for w, _ in peak) else 1
        steps *= passes  # streamed memory rows: both models' forward again on every pass of the fit
        flops = steps * m.step_flops
        est.append((st["name"], flops, "batched"))
        top = max(peak, key=lambda p: p[1]) if peak else None
        lines.append(f"{st['name']}: {name} on the {m.kind} ({m.context or 'unbounded'} context); streams "
                     + (", ".join(f"{w} -> {s:,}" for w, s in sizes) or "none") + "; ~"
                     + (f"{passes} passes x {steps / passes:.3g} = " if passes > 1 else "")
                     + f"{steps:.3g} model steps = "
                     f"{flops:.3g} FLOP; peak: " + ("; ".join(f"{w} {_bytes(b)}" for w, b in peak) or "small")
                     + (f" (largest {_bytes(top[1])})" if top else ""))
    seconds = {n: f / (RATES[kind] * 1e12) for n, f, kind in est}
    by_kind = {k: sum(f for _, f, kind in est if kind == k) for k in RATES}
    terms = [f"{by_kind[k]:.3g} FLOP / {r:g}e12 ({k}, one at a time)" for k, r in RATES.items() if by_kind[k]]
    serial = 0.0  # what the side-by-side trainings would add if their GPU work did not overlap at all
    for name, n, k, flops in groups:  # each alone latency-bound; together at most the batched rate
        rounds, slow, fast = math.ceil(n / k), RATES["recurrent training"], RATES["batched"]
        seconds[f"{name} ({n} side by side)"] = t = max(rounds * max(flops) / (slow * 1e12), sum(flops) / (fast * 1e12))
        terms.append(f"max({rounds} x {max(flops):.3g} FLOP / {slow:g}e12, {sum(flops):.3g} FLOP / {fast:g}e12) "
                     f"= {t:,.0f} s ({name}: {n} side by side, {k} at once)")
        serial += sum(flops) / (slow * 1e12) - t
    total = sum(seconds.values())
    head = [f"Plan of the {cfg.profile} profile: {len(stages)} stages, all composed and within their ranges; every "
            "stream fits its model's context.", ""]
    tail = ["", f"Wall time on {DEVICE}: an ESTIMATE from FLOP counts at assumed rates, not a measurement "
            "(stages one after another, trainings side by side where the profile's launcher runs them so, "
            "kernel-launch overheads not counted). Assumed sustained rates: "
            + ", ".join(f"{k} {r:g} TFLOP/s ({100 * r / PEAK_TFLOPS:.0f}% of a {PEAK_TFLOPS:g} TFLOP/s dense FP32 "
                        "peak: TF32 is off)" for k, r in RATES.items()) + ". "
            + " + ".join(terms) + f" = {total:,.0f} s = {total / 3600:.1f} h.",
            "Largest stages: " + ", ".join(f"{n} {t / 3600:.2f} h" for n, t in
                                           sorted(seconds.items(), key=lambda e: -e[1])[:6])]
    if groups:  # processes share one GPU's compute only where the GPU runs their kernels concurrently
        tail.append("Trainings side by side overlap on the GPU's compute where it runs their kernels concurrently: "
                    "start NVIDIA MPS (nvidia-cuda-mps-control -d) before make reproduce. Without it the GPU "
                    "time-slices between the processes and overlaps only their CPU-side gaps; if their GPU work did "
                    f"not overlap at all, they would add {serial:,.0f} s: {(total + serial) / 3600:.1f} h in all.")
    return "\n".join(head + lines + tail)

