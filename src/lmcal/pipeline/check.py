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

import os

from omegaconf import DictConfig, OmegaConf

from lmcal.core.lookahead import CUDA_MAX_CHUNK, LOGIT_ROWS
from lmcal.errors import LmcalError
from lmcal.models.hf import shared_candidate_bytes
from lmcal.pipeline.devices import SIDE_BY_SIDE, launcher_jobs
from lmcal.pipeline.plan import plan
from lmcal.pipeline.plan_text import details_section, stage_table, wrap
from lmcal.pipeline.preflight import GpuPeak, check_shared_gpu
from lmcal.pipeline.sizes import (
    GB,
    Model,
    bytes_text,
    model_of,
    score_tokens,
    setting,
    size_problems,
    size_refusal,
    stream_sizes,
)
from lmcal.pipeline.timing import (
    ANCHOR,
    BATCHED_TFLOPS,
    BUSY,
    MEASURED_ON,
    STEP_FIXED_MS,
    STEP_PER_TIME_STEP_MS,
    TERMS,
    Job,
    analysis_overheads,
    hours,
    idle_job,
    lstm_epoch_seconds,
    measured_rates,
    schedule,
    side_by_side_group,
    term,
    training_overheads,
)
from lmcal.training.known_keys import check_known_keys
from lmcal.utils.budget import tau_too_long
from lmcal.utils.settings import composed
from lmcal.utils.validate import check_config

GPU_FREE_GB = 80.0  # the free memory of one H100-class GPU, for the memory budgets' null (half of it)

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
        score = min(dr.get("score_tokens") or score_tokens(a, m), m.corpus.get("test", 10**12))
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
    score = score_tokens(a, m) if "score_tokens" in a else 0
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
    if name == "sequence_calibration":  # per SMC row (untwisted, and twisted, at each count k): ~4 fit runs and 2
        # test runs on fit_prefixes windows, the generations, and the last tenth's two nested runs (each re-reading a
        # path and running to the law's end), all of prefix_len + law_horizon words
        window = a["prefix_len"] + (a.get("law_horizon") or 2 * a["horizon"])
        n = min(a.get("smc_prefixes") or a["num_prefixes"], a["num_prefixes"]) * a["samples_per_prefix"]
        counts = list(a["particles"]) * (bool(a.get("untwisted", True)) + bool(a.get("twist") and a.get("soft_value")))
        smc = sum(k * (6 * a["fit_prefixes"] + n) * window + (a.get("tail_particles") or k) * 2 * n * window
                  for k in counts)
        # the goal rows measured again on fresh prefixes: the twisted row with the fewest particles (and the goal row,
        # if an SMC row), each generating and reading its last tenth by two nested runs
        goal = (a.get("goal_prefixes") or n // a["samples_per_prefix"]) * a["samples_per_prefix"]
        smc += 2 * 3 * min(counts) * goal * window
        sv = (a["sv_iterations"] * (1 + a.get("sv_refits", 0) / 2) * a["sv_rollouts"] * (a["sv_prefix"] + a["sv_steps"])
              if a.get("soft_value") else 0)
        # each row's reference check (untwisted SMC at check_particles on the fit windows), and the twist's
        # finite-horizon head: trained once over the law's horizon, then retrained at ~3 of each twisted row's α
        checks = len(counts) * a.get("check_particles", 256) * min(a.get("check_prefixes") or a["fit_prefixes"],
                                                                  a["fit_prefixes"]) * window
        twisted = len(a["particles"]) if a.get("twist") and a.get("soft_value") else 0
        heads = bool(twisted) * a["sv_iterations"] * a["sv_rollouts"] * (window + a["sv_prefix"]) * (
            1 + 3 * twisted / 2)
        return smc + sv + checks + heads + score + gen
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
        chunk = int(min(cands, CUDA_MAX_CHUNK, max(1, budget // (own + 4.0 * LOGIT_ROWS * V))))
        what = "share of its row's past" if m.kind == "transformer" else "state"
        out.append((f"lookahead chunk: {chunk:,} of {cands:,} candidates ({budget / 1e9:g} GB budget) x ({what} "
                    f"{bytes_text(own)} + [V] logits x {LOGIT_ROWS})", chunk * (own + 4.0 * LOGIT_ROWS * V)))
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
    return max(1, min(n, launcher_jobs(cmd)))


def _memory_rows(a: dict, m: Model, budget_gb: float | None) -> tuple[str, float]:
    """The memory stage's fit rows where analysis.memory.rows keeps them (lmcal.stages.memory.rows_where), on the
    GPU: auto keeps them there when they fit the budget (null: half of GPU_FREE_GB), else streams them."""
    n = score_tokens(a, m)
    dtype, rows = a.get("store_dtype", "float32"), a.get("rows", "auto")
    size = 2.0 * m.vocab * {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]  # one row of log P^ and log P~
    why, where = f"rows={rows}", {"cpu": "on the CPU", "device": "on the model's device"}.get(rows)
    if rows == "auto":
        budget = (budget_gb or GPU_FREE_GB / 2) * GB
        fits = n * size <= budget
        why += f": {bytes_text(n * size)} {'within' if fits else 'over'} the {budget / GB:g} GB budget"
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
    n = score_tokens(a, m)
    return 25 + 11 * -(-n // int(a.get("cluster_size", 2000)))


def _training_run(st: dict, where: str, t, c: DictConfig, m: Model) -> tuple[str, tuple]:
    """One training run of a stage (t: its tau, or None) checked against its model: its plan line, and its (seconds
    of its epochs alone, busy share, GpuPeak, seconds beside its epochs with the GPU idle)."""
    if t:
        n = m.corpus.get("train")
        if n and int(t) >= n:
            raise LmcalError(where + tau_too_long("model.memory_tau", int(t), n, "training") + " Lower "
                             "taus (or markov.taus), or train on more text (data.max_train_tokens).")
    bptt, batch = int(c.data.bptt), int(c.data.batch_size)
    if m.context and bptt > m.context:
        raise size_refusal([(f"Stage '{st['name']}'", f"would feed its {m.kind} more tokens than its "
                             f"context of {m.context} ({m.context_key}): data.bptt = {bptt:,} tokens.",
                             {"data.bptt": m.context})],
                           f"in the profile's {st['name'].replace('_base', '.base')}")
    epochs = max(int(c.trainer.max_epochs), 0)
    tokens = m.corpus.get("train", 0) * epochs
    flops = 3 * m.step_flops * tokens
    peak = [(f"logits [bptt, batch, V] = [{bptt}, {batch}, {m.vocab:,}] and their gradient",
             2 * 4.0 * bptt * batch * m.vocab),
            (f"parameters, gradients, optimiser state: 4 x {m.params:,} fp32", 16.0 * m.params)]
    if m.kind == "awd_lstm":  # latency-bound: the measured step, per window of sequential steps
        epoch, how = lstm_epoch_seconds(m.corpus.get("train", 0), m.corpus.get("valid", 0), batch, bptt,
                                        t, int(c.data.eval_batch_size))
        seconds, busy = epochs * epoch, BUSY["tau training" if t else "recurrent training"]
        time_text = f"{epochs} epochs x ({how}) = {seconds / 3600:.2f} h"
    else:
        seconds, busy = flops / (BATCHED_TFLOPS * 1e12), BUSY["batched"]
        time_text = f"{flops:.3g} FLOP / {BATCHED_TFLOPS:g}e12 = {seconds / 3600:.2f} h"
    extra, how = training_overheads(epochs, m.corpus.get("test", 0), bptt, 8.0 * m.params)
    time_text += f", + {how} (the GPU idle)"
    line = (f"{st['name']}{'' if t is None else f' tau={t}'}: {m.kind} ({m.params:,} parameters, "
            f"context {m.context or 'unbounded'}, V {m.vocab:,}), {epochs} epochs x "
            f"{m.corpus.get('train', 0):,} tokens = {tokens:,} tokens, batch {batch}, "
            f"3 x {m.step_flops:.3g} FLOP x tokens = {flops:.3g} FLOP; time alone: {time_text}; peak: "
            + "; ".join(f"{w} {bytes_text(b)}" for w, b in peak))
    name = st["name"] + ("" if t is None else f" tau={t}")
    gpu = GpuPeak(name, 16.0 * m.params, 2 * 4.0 * bptt * m.vocab, "data.batch_size", batch)  # as `peak` above
    return line, (seconds, busy, gpu, extra)


def _training_stage(st: dict, models: dict, tau_of: dict, lines: list[str]) -> Job:
    """A training stage (one run, or a tau-model per tau) composed, range-checked and sized; its models recorded
    in `models` (by folder) and `tau_of`, its plan lines added to `lines`; returns its job."""
    entry, overrides = st["cmd"][2], [o for o in st["cmd"][3:] if o != "-m"]
    where = f"Stage '{st['name']}' (python -m {entry}): "
    taus = [None] if "taus" not in st else list(st["taus"])
    at_once, group = side_by_side(st["cmd"], len(taus)), []  # group: (seconds, busy, peak bytes) per run
    for t in taus:
        c = composed(entry, overrides + ([f"model.memory_tau={t}"] if t else []))
        check_known_keys(c, entry)  # every key read by something, as the run will check
        check_config(c, where=where)  # every setting in its range (lmcal.utils.rules), as the run will
        m = model_of(c)
        models[str(st["taus"][t] if t else st["dir"])] = m
        if t:
            tau_of[str(st["taus"][t])] = int(t)
        line, run = _training_run(st, where, t, c, m)
        lines.append(line)
        group.append(run)
    wall, busy = side_by_side_group([g[0] for g in group], [g[1] for g in group], at_once)
    idle = max(g[3] for g in group) * -(-len(group) // at_once)  # each batch of runs side by side pays it once
    if at_once > 1:
        key = st["name"].removesuffix("tau_models").replace("_", ".") + "tau"  # tau_models: tau, markov_...: markov.tau
        check_shared_gpu([g[2] for g in group], at_once, 1, GPU_FREE_GB * GB, f"in the profile's {key}",
                         jobs_key="hydra.launcher.n_jobs")
        most = bytes_text(max(g[2].bytes for g in group))
        lines.append(f"{st['name']}: the {len(group)} trainings side by side on the one GPU, {at_once} at once "
                     f"({SIDE_BY_SIDE}): peak {at_once} x {most} of the "
                     f"tensors above, plus each process's CUDA context; time-sliced: {wall / 3600:.2f} h "
                     f"against {sum(g[0] for g in group) / 3600:.2f} h one after another")
    what = ("" if len(group) == 1 else f"{len(group)} x ") + f"{m.kind}, {m.params / 1e6:.1f}M parameters"
    return idle_job(st["name"], wall, busy, idle, tuple(st["deps"]), what=what)


def _check_memory_tau(where: str, a: dict, m: Model, mem_tau: int | None) -> None:
    tau, test = a.get("tau") or mem_tau, score_tokens(a, m)
    if tau and test and int(tau) >= test:
        raise LmcalError(where + tau_too_long("tau", int(tau), test, "test") + " Lower it, or score more "
                         "tokens (analysis.memory.score_tokens).")


def _analysis_stage(cfg: DictConfig, st: dict, models: dict, tau_of: dict,
                    rates: dict[str, float]) -> tuple[str, Job | None]:
    """An analysis stage composed, range-checked and sized against the model it meets (planned earlier in
    `models`): its plan line and its job (None where its model is not planned here), its FLOPs at the rate
    `make gpu-check` measured for its kind where `rates` has one, else at the assumed BATCHED_TFLOPS."""
    entry, overrides = st["cmd"][2], [o for o in st["cmd"][3:] if o != "-m"]
    where = f"Stage '{st['name']}' (python -m {entry}): "
    c = composed(entry, overrides)
    check_known_keys(c, entry)
    check_config(c, where=where)
    ckpt = next(o.split("=", 1)[1] for o in overrides if o.startswith("ckpt="))
    m = next((mm for d, mm in models.items() if ckpt.startswith(d + os.sep)), None)  # tau_1 is not tau_10
    if m is None:
        return f"{st['name']}: model of {ckpt} not planned here; sizes not checked", None
    name = list(c.stages)[0]
    a = OmegaConf.to_container(c.analysis[name], resolve=True)
    mem_tau = next((int(o.split("=")[1]) for o in overrides if o.startswith("model.memory_tau=")), None)
    if name == "memory":  # a tau-model's own memory length (its training stage's folder holds the checkpoint)
        mem_tau = next((t for d, t in tau_of.items() if ckpt.startswith(d + os.sep)), mem_tau)
        _check_memory_tau(where, a, m, mem_tau)
    sizes = stream_sizes(name, a, m, mem_tau)
    problem, fits = size_problems(name, a, m, mem_tau, force=bool(c.get("force_size")))
    if problem:
        part = next((p for p in ("transformer", "markov") if st["name"].startswith(p + "_")), None)
        key = f"{part}.analysis" if part else "analysis"
        listed = [*(cfg[part].analysis if part else cfg.analysis),
                  *(setting(f"analysis.{name}.{k}", v) for k, v in fits.items())]
        fits = {f"analysis.{name}.{k}": v for k, v in fits.items()}
        raise size_refusal([(f"Stage '{st['name']}'", problem, fits)],
                           f"in the profile's {key}: ARGS='{key}=[{','.join(listed)}]'")
    steps = model_steps(name, a, m, mem_tau)
    peak = peak_tensors(name, a, m, c.analysis.get("memory_budget_gb"))
    passes = stream_passes(a, m) if any(w.startswith("streamed rows") for w, _ in peak) else 1
    steps *= passes  # streamed memory rows: both models' forward again on every pass of the fit
    flops = steps * m.step_flops
    top = max(peak, key=lambda p: p[1]) if peak else None
    line = (f"{st['name']}: {name} on the {m.kind} ({m.context or 'unbounded'} context); streams "
            + (", ".join(f"{w} -> {s:,}" for w, s in sizes) or "none") + "; ~"
            + (f"{passes} passes x {steps / passes:.3g} = " if passes > 1 else "")
            + f"{steps:.3g} model steps = "
            f"{flops:.3g} FLOP; peak: " + ("; ".join(f"{w} {bytes_text(b)}" for w, b in peak) or "small")
            + (f" (largest {bytes_text(top[1])})" if top else ""))
    rate, heads = rates.get(name, BATCHED_TFLOPS), head_count(name, a)
    extra = analysis_overheads(name, heads)
    how = f"start-up, fit{f', {heads} heads' if heads else ''}"
    line += (f"; time alone: {flops:.3g} FLOP / {rate:.3g}e12{' (measured)' if name in rates else ''} + "
             f"{extra:.0f} s ({how}) = {flops / (rate * 1e12) + extra:.0f} s")
    return line, idle_job(st["name"], flops / (rate * 1e12), BUSY["batched"], extra, tuple(st["deps"]), flops, name,
                          f"{name} on the {m.kind}")


def head_count(name: str, a: dict) -> int:
    """The small heads an analysis stage trains: future_entropy's one per K and discount; sequence_calibration's
    soft-value heads and each twisted row's finite-horizon head."""
    if name == "future_entropy":
        ks, ds = a.get("horizon_k") or [], a.get("discount") or []
        return (len(ks) if isinstance(ks, list) else 1) * (len(ds) if isinstance(ds, list) else 1)
    if name == "sequence_calibration" and a.get("soft_value"):
        return 1 + (len(a.get("particles") or []) if a.get("twist") else 0)
    return 0


def _plan_tail(cfg: DictConfig, jobs: list[Job], total: float, rates: dict[str, float]) -> list[str]:
    alone = {j.name: j.seconds for j in jobs}
    measured = (f" FLOP rates measured by make gpu-check ({RATES_FILE}): "
                + ", ".join(f"{k} {v:.3g} TFLOP/s" for k, v in sorted(rates.items())) + ";") if rates else ""
    return [f"Wall time on one GPU: an ESTIMATE, {hours(total)} (stages one after another: "
            f"{hours(sum(alone.values()))}).{measured} AWD-LSTM trainings at the step measured on {MEASURED_ON}: "
            f"{STEP_FIXED_MS:g} ms + {STEP_PER_TIME_STEP_MS:g} ms per sequential time step at batch 20 (a PTB epoch of "
            f"the paper model: 13 s; {ANCHOR}); the other stages' FLOPs at an assumed {BATCHED_TFLOPS:g} TFLOP/s "
            f"(TF32 off). Scheduled as make reproduce runs them: jobs={int(cfg.get('jobs', 1))} stages at a time "
            "where their dependencies allow (tau-models not warm-started from the base model beside it), a sweep's "
            "jobs as its launcher runs them; stages on the one GPU share it by time-slicing (each keeps it busy "
            "for a measured or assumed share of its time: lmcal.pipeline.timing); NVIDIA MPS, which could overlap "
            "their kernels further, is not assumed.",
            "Largest stages (alone): " + ", ".join(f"{n} {t / 3600:.2f} h" for n, t in
                                                   sorted(alone.items(), key=lambda e: -e[1])[:6]),
            "Terms beside the steps and FLOPs: " + "; ".join(f"{k} {t.value:g} ({t.source})" for k, t in
                                                             TERMS.items())]


RATES_FILE = "docs/bench/gpu_rates.json"  # written by make gpu-check's paper_mini part, copied there from its out


def check(cfg: DictConfig, estimates: dict | None = None, rates: dict[str, float] | None = None,
          terms: dict | None = None) -> str:
    """The plan of profile `cfg` as text, every stage composed and range-checked (lmcal.utils.rules) and every size
    checked against the model it meets; raises LmcalError naming the stage, the keys and the limit otherwise.
    `estimates`, where given, gets each stage's estimated seconds (the console's ETAs scale them to this machine);
    `rates` ({stage kind: TFLOP/s}; default: docs/bench/gpu_rates.json's, if there) replace the assumed rate;
    `terms`, where given, gets each stage's {seconds, flops, idle_seconds}."""
    if rates is None:
        from lmcal.reporting.docs import DOCS

        rates = measured_rates(DOCS.parent / RATES_FILE)
    stages = plan(cfg)
    models: dict[str, Model] = {}  # training stage dir -> its model
    tau_of: dict[str, int] = {}  # a tau-model's training stage dir -> its memory length
    lines, jobs = [], []  # jobs: each stage's time alone on the GPU, its busy share, its deps (pipeline.timing)
    for st in stages:
        if "fn" in st:
            lines.append(f"{st['name']}: results.json, REPORT.md (in-process); time: {term('report (s)'):g} s")
            jobs.append(Job(st["name"], term("report (s)"), 0.0, tuple(st["deps"]), what="results.json, REPORT.md"))
        elif st["cmd"][2] == "lmcal.train":
            jobs.append(_training_stage(st, models, tau_of, lines))
        else:
            line, job = _analysis_stage(cfg, st, models, tau_of, rates)
            lines.append(line)
            jobs += [job] if job else []
    for j in jobs if estimates is not None else ():  # the console's ETAs scale them
        estimates[j.name] = estimates.get(j.name, 0.0) + j.seconds
    wall, spans = schedule(jobs, max(1, int(cfg.get("jobs", 1))))
    for j in jobs if terms is not None else ():  # make gpu-check's measured rates divide by them
        terms[j.name] = {"seconds": j.seconds, "flops": j.flops, "idle_seconds": j.idle, "kind": j.kind,
                         "ends_at": spans[j.name][1], "pipeline_seconds": wall}
    head = wrap(f"Plan of the {cfg.profile} profile: {len(stages)} stages, all composed and within their ranges; "
                "every stream fits its model's context.")
    runs = [tuple(ln.split(": ", 1)) for ln in lines]  # (stage, or stage and tau; its arithmetic)
    tail = [ln for p in _plan_tail(cfg, jobs, wall, rates) for ln in wrap(p)]
    return "\n".join(head + [""] + stage_table(jobs, spans) + [""] + tail + [""] + details_section(runs))
