"""The preflight of `train` and `evaluate`: before any work, in seconds, every stage's sizes against the model it will
meet: its context (the plan check's own arithmetic, lmcal.pipeline.check.size_problems), its vocabulary, and the
memory of the device it runs on (its share, where the pipeline runs several processes on one GPU). What does not fit
is refused in one paragraph naming the stage, the key, its value and the limit, with settings that fit. `make
reproduce` runs the plan check (lmcal.pipeline.check.check), which uses the same arithmetic for every stage of its
profile, and sizes the stages that will share a GPU together (check_shared_gpu: a sweep's jobs side by side, or
stages at once under jobs=N).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import OmegaConf

from lmcal.errors import LmcalError
from lmcal.pipeline.sizes import GB, Model, bytes_text, model_of, setting, size_problems, size_refusal
from lmcal.utils.budget import memory_bytes

CUDA_CONTEXT_BYTES = 0.5 * GB  # what a process holds on a GPU before its first tensor: CUDA context, cuBLAS workspace


def checkpoint_model(hp: dict, vocab: int, corpus: dict[str, int]) -> Model:
    """The model of a checkpoint of `python -m lmcal.train` (its hyper_parameters) and the corpus as read."""
    return model_of(OmegaConf.create({"model": hp["net"], "data": hp.get("data_cfg") or {"name": "ptb"}}), vocab,
                    corpus)


def hf_model(config, corpus: dict[str, int], name: str) -> Model:
    """The model a Hugging Face config describes (its context: n_positions, else max_position_embeddings; None for a
    model without either), with the corpus as its tokenizer reads it."""
    key = next((k for k in ("n_positions", "max_position_embeddings") if getattr(config, k, None)), None)
    E, L = int(getattr(config, "hidden_size", 0) or 0), int(getattr(config, "num_hidden_layers", 0) or 0)
    V = int(config.vocab_size)
    body = 12 * E * E * L  # attention and MLP matrices, 4E inner
    return Model("transformer", int(getattr(config, key)) if key else None, V, E, L, body + V * E, 2.0 * (body + V * E),
                 dict(corpus), heads=int(getattr(config, "num_attention_heads", 1) or 1),
                 context_key=f"{key} in its config.json", what=f"Hugging Face model ({name})")


def device_bytes(device: str) -> int:
    """Memory of the device the stages run on: the GPU's, else this machine's RAM (0: not known)."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return memory_bytes()


def gpu_sharers(device: str, env: dict | None = None) -> int:
    """How many processes the pipeline runs on the GPU `device` is (LMCAL_GPU_SHARERS, lmcal.pipeline.devices), 1 on
    the CPU or where it is not set."""
    env = os.environ if env is None else env
    try:
        return max(1, int(env.get("LMCAL_GPU_SHARERS", "1"))) if str(device).startswith("cuda") else 1
    except ValueError:
        return 1


def held_bytes(name: str, a: dict, m: Model, value_bytes: int = 4) -> tuple[float, float, str]:
    """(bytes a generation row holds, rows at once, what) of stage `name`'s generations, the tensors that do not adapt
    to memory as the lookahead's chunks do: each row's next-word log-probs and probabilities [V], and a transformer's
    key/value cache 2 x layers x [T, E] of value_bytes each; (0, 0, "") for a stage that generates nothing."""
    if "max_batch" not in a or "horizon" not in a:
        return 0.0, 0.0, ""
    rows = min(a["max_batch"], a.get("num_prefixes", a["max_batch"]) * a.get("samples_per_prefix", 1))
    T, what = a["prefix_len"] + a["horizon"], f"[max_batch, V] = [{a['max_batch']:,}, {m.vocab:,}] log-probs"
    per_row = 2 * 4.0 * m.vocab
    if m.kind == "transformer":
        per_row += 2.0 * m.layers * T * m.emb * value_bytes
        what += f" and a key/value cache 2 x {m.layers} x [max_batch, T, E] = [{a['max_batch']:,}, {T}, {m.emb}]"
    return per_row, rows, what


def preflight(settings: dict[str, dict], m: Model, memory_tau: int | None = None, *, device: str = "cpu",
              value_bytes: int = 4, bptt: int | None = None, score_context: int | None = None,
              text_vocab: int | None = None, how: str = "on the command line", force: bool = False) -> None:
    """Every stage of `settings` ({name: analysis.<name>}) checked against model `m` on `device`: its streams
    against the context, its generations' tensors against the device's memory; with `bptt` the training windows,
    `score_context` a Hugging Face model's test-scoring window (model.context), `text_vocab` the largest token id of
    the text plus one; force (force_size=true) lets counts beyond one stage's steps through. Raises one LmcalError
    listing everything that does not fit, with the settings that do."""
    problems = []
    if bptt and m.context and bptt > m.context:
        problems.append(("Training", f"would feed its {m.kind} more tokens than its context of {m.context} "
                                     f"({m.context_key}): data.bptt = {bptt:,} tokens.", {"data.bptt": m.context}))
    if score_context and m.context and score_context > m.context:
        problems.append(("Scoring the model's test cross-entropy", f"would read windows longer than its context of "
                         f"{m.context} ({m.context_key}): model.context = {score_context:,} tokens.",
                         {"model.context": m.context}))
    sharers = gpu_sharers(device)
    memory = device_bytes(device) // sharers  # the stages beside it on the GPU hold theirs
    of = f"{device}'s share (1 of the {sharers} processes on it)" if sharers > 1 else device
    for name, a in settings.items():
        text, fits = size_problems(name, a, m, memory_tau, force)
        per_row, rows, what = held_bytes(name, {**a, **fits}, m, value_bytes)
        if memory and per_row * rows > memory:
            fits["max_batch"] = max(1, int(0.5 * memory // per_row))
            text += (" It " if text else "") + (
                f"would hold about {per_row * rows / GB:,.1f} GB at once in its generations ({what}), more than the "
                f"{memory / GB:,.1f} GB of {of}.")
        rows = a.get("rows", "auto")  # kept on the CPU (auto and device too, for a model there), or on the GPU
        where = "cpu" if rows == "cpu" or (rows in ("auto", "device") and not str(device).startswith("cuda")) \
            else device if rows == "device" else None
        if name == "memory" and where:
            n = min(a.get("score_tokens") or m.corpus.get("test", 0), m.corpus.get("test", 10**12))
            kept = 2.0 * n * m.vocab * {"float32": 4, "float16": 2, "bfloat16": 2}[a.get("store_dtype", "float32")]
            limit = memory_bytes() if where == "cpu" else memory
            if limit and kept > limit:
                fits["rows"] = "stream"
                text += (" It " if text else "") + (
                    f"would keep rows 2 x [N, V] = 2 x [{n:,}, {m.vocab:,}] {a.get('store_dtype', 'float32')} "
                    f"(analysis.memory.rows={rows}): {kept / GB:,.1f} GB, more than the {limit / GB:,.1f} GB of "
                    f"{'this machine' if where == 'cpu' else of}.")
        if text:
            problems.append((f"Stage '{name}'", text, {f"analysis.{name}.{k}": v for k, v in fits.items()}))
    if text_vocab and text_vocab > m.vocab:
        problems.append(("The text", f"has token ids up to {text_vocab - 1:,}, beyond the model's vocabulary of "
                         f"{m.vocab:,} ({m.what or m.kind}): the model would read outside its embedding.", {}))
    if problems:
        fix = how if any(f for _, _, f in problems) else (
            "Read the text with the model's own tokenizer (the one saved beside it) or the corpus it was trained on.")
        raise size_refusal(problems, fix)


@dataclass(frozen=True)
class GpuPeak:
    """A stage's (or a sweep job's) peak on its GPU: `fixed` bytes (parameters, optimiser state), and `per_batch`
    bytes for each unit of its batch setting `batch_key`, now `batch` (its logits and their gradient)."""
    name: str
    fixed: float
    per_batch: float = 0.0
    batch_key: str | None = None
    batch: int = 0

    @property
    def bytes(self) -> float:
        return self.fixed + self.per_batch * self.batch


def sharing(peaks: list[GpuPeak], jobs: int, gpus: int = 1) -> list[GpuPeak]:
    """The set that bounds what one GPU holds when `jobs` of `peaks` run at once, spread over `gpus` one each in turn
    (lmcal.pipeline.devices): ceil(jobs / gpus) of them share a GPU, at worst the largest that many."""
    k = -(-min(max(1, jobs), len(peaks)) // max(1, gpus))
    return sorted(peaks, key=lambda p: -p.bytes)[:k]


def held(group: list[GpuPeak], context: float = CUDA_CONTEXT_BYTES) -> float:
    """Bytes a GPU holds with `group` on it: their peaks, and each process's CUDA context."""
    return sum(p.bytes + context for p in group)


def fitting_jobs(peaks: list[GpuPeak], gpus: int, memory: float, context: float = CUDA_CONTEXT_BYTES) -> int:
    """The most of `peaks` at once whose sets sharing a GPU fit `memory` (0: the largest does not fit alone)."""
    return next((j for j in range(len(peaks), 0, -1) if held(sharing(peaks, j, gpus), context) <= memory), 0)


def fitting_batch(group: list[GpuPeak], memory: float, context: float = CUDA_CONTEXT_BYTES) -> tuple[str, int] | None:
    """(key, value) of the largest batch of the set's first batch setting with which the set fits `memory`, every
    member of that setting (a sweep's jobs share theirs) at that batch; None where none does or none has one."""
    key = next((p.batch_key for p in group if p.batch_key and p.per_batch), None)
    if key is None:
        return None
    scaled = [p for p in group if p.batch_key == key]
    rest = held(group, context) - sum(p.per_batch * p.batch for p in scaled)
    batch = int((memory - rest) // sum(p.per_batch for p in scaled))
    return (key, batch) if batch >= 1 else None


def shared_gpu_problem(peaks: list[GpuPeak], jobs: int, gpus: int, memory: float, jobs_key: str = "jobs",
                       where: str = "one GPU", context: float = CUDA_CONTEXT_BYTES) -> tuple[str, dict] | None:
    """What does not fit where `jobs` of `peaks` run at once over `gpus` GPUs of `memory` bytes each: (the sentence
    naming the set that shares a GPU and what it holds, {setting: value} of each alternative that fits: fewer at
    once under `jobs_key`, or a smaller batch); None where it fits or memory is not known."""
    group = sharing(peaks, jobs, gpus)
    total = held(group, context)
    if not memory or total <= memory or not group:
        return None
    names = ", ".join(p.name for p in group[:-1]) + (" and " if len(group) > 1 else "") + group[-1].name
    text = (f"{names}, side by side on {where} ({min(jobs, len(peaks))} at once over {gpus} GPU"
            f"{'s' if gpus > 1 else ''}: {len(group)} on one), would hold about {bytes_text(total)} at once ("
            + " + ".join(bytes_text(p.bytes) for p in group)
            + f", and {bytes_text(context)} of CUDA context each), more than its {bytes_text(memory)}.")
    fits = {}
    at_once = fitting_jobs(peaks, gpus, memory, context)
    if 0 < at_once < min(jobs, len(peaks)):
        fits[jobs_key] = at_once
    batch = fitting_batch(group, memory, context)
    if batch:
        fits[batch[0]] = batch[1]
    return text, fits


def check_shared_gpu(peaks: list[GpuPeak], jobs: int, gpus: int, memory: float, how: str, **kw) -> None:
    """Refuses, in one paragraph, a set of stages that would not fit the GPU they share (shared_gpu_problem), with
    each setting that fits on its own; `how`: where the settings go (e.g. "in the profile's tau")."""
    problem = shared_gpu_problem(peaks, jobs, gpus, memory, **kw)
    if problem is None:
        return
    text, fits = problem
    fix = (f"{'Either setting fits' if len(fits) > 1 else 'A setting that fits'}: "
           + ", or ".join(setting(k, v) for k, v in fits.items()) + f" ({how})." if fits else
           "Not even the largest fits alone: it needs a smaller model or a device with more memory.")
    raise LmcalError(f"{text} They would fail when they got there; nothing was run. {fix}")
