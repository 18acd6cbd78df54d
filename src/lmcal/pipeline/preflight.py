"""The preflight of `train` and `evaluate`: before any work, in seconds, every stage's sizes against the model it will
meet: its context (the plan check's own arithmetic, lmcal.pipeline.check.size_problems), its vocabulary, and the
memory of the device it runs on. What does not fit is refused in one paragraph naming the stage, the key, its value
and the limit, with settings that fit. `make reproduce` runs the plan check (lmcal.pipeline.check.check), which uses
the same arithmetic for every stage of its profile.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from lmcal.pipeline.sizes import GB, Model, model_of, size_problems, size_refusal
from lmcal.utils.budget import memory_bytes


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
              text_vocab: int | None = None, how: str = "on the command line") -> None:
    """Every stage of `settings` ({name: analysis.<name>}) checked against model `m` on `device`: its streams
    against the context, its generations' tensors against the device's memory; with `bptt` the training windows,
    `score_context` a Hugging Face model's test-scoring window (model.context), `text_vocab` the largest token id of
    the text plus one. Raises one LmcalError listing everything that does not fit, with the settings that do."""
    problems = []
    if bptt and m.context and bptt > m.context:
        problems.append(("Training", f"would feed its {m.kind} more tokens than its context of {m.context} "
                                     f"({m.context_key}): data.bptt = {bptt:,} tokens.", {"data.bptt": m.context}))
    if score_context and m.context and score_context > m.context:
        problems.append(("Scoring the model's test cross-entropy", f"would read windows longer than its context of "
                         f"{m.context} ({m.context_key}): model.context = {score_context:,} tokens.",
                         {"model.context": m.context}))
    memory = device_bytes(device)
    for name, a in settings.items():
        text, fits = size_problems(name, a, m, memory_tau)
        per_row, rows, what = held_bytes(name, {**a, **fits}, m, value_bytes)
        if memory and per_row * rows > memory:
            fits["max_batch"] = max(1, int(0.5 * memory // per_row))
            text += (" It " if text else "") + (
                f"would hold about {per_row * rows / GB:,.1f} GB at once in its generations ({what}), more than the "
                f"{memory / GB:,.1f} GB of {device}.")
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
                    f"{'this machine' if where == 'cpu' else device}.")
        if text:
            problems.append((f"Stage '{name}'", text, {f"analysis.{name}.{k}": v for k, v in fits.items()}))
    if text_vocab and text_vocab > m.vocab:
        problems.append(("The text", f"has token ids up to {text_vocab - 1:,}, beyond the model's vocabulary of "
                         f"{m.vocab:,} ({m.what or m.kind}): the model would read outside its embedding.", {}))
    if problems:
        fix = how if any(f for _, _, f in problems) else (
            "Read the text with the model's own tokenizer (the one saved beside it) or the corpus it was trained on.")
        raise size_refusal(problems, fix)
