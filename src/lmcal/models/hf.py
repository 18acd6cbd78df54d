"""Hugging Face causal LMs as StepLMs (transformers is optional: imported only when a model is built or loaded): the
adapter HFCausalLM, windowed test scoring, and loading a folder written by save_pretrained. Its key/value caches (forks
that do not copy the past, and the lookahead's shared past) are lmcal.models.hf_cache."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import torch

from lmcal.errors import LmcalError
from lmcal.models.hf_cache import fork_cache, new_cache, shared_past_cache


def candidate_width(emb: int, n: int) -> int:
    """The most lookahead candidates of one row in one sequence of queries (HFCausalLM.candidate_step), for a model of
    width `emb` after n tokens. Each candidate also attends the others' k positions (masked): 4 E k FLOPs a layer
    against its own 24 E^2 + 4 E n, so k <= (6 E + n) / 8 keeps the extra under 1/8."""
    return max(16, (6 * emb + n) // 8)


def shared_candidate_bytes(layer_bytes: float, n: int, per_row: int, heads: int, emb: int) -> float:
    """Bytes one candidate holds in HFCausalLM.candidate_step, `per_row` candidates a row after n tokens: its share
    of its row's past of one layer (layer_bytes: one row's keys and values of that layer) gathered and extended by
    the row's k candidates (two copies, the gather and the concatenation, of n + k positions), and one layer's
    attention scores [heads, n + k] and activations (about 12 E floats)."""
    k = max(1, min(per_row, candidate_width(emb, n)))
    return 2.0 * layer_bytes * (n + k) / n / k + 4.0 * (heads * (n + k) + 12 * emb)


class HFCausalLM:
    """A Hugging Face causal LM (e.g. GPT2LMHeadModel) as a StepLM, one cached forward per step.

    State = (past, n): the model's key/value cache of every row (None before the first token) and n, the number of
    tokens fed, the same for all rows, so rows need no padding or attention mask and the position of the next token
    is n. `step` and `select` never modify a state they are given: both hand the model a fork of the cache (see
    fork_cache), so a state can be stepped or fanned out again later (the lookahead reuses one state V times).
    """

    def __init__(self, model, tokenizer=None, device=None):
        if device is not None:
            model = model.to(device)
        self.model = model.eval()  # no dropout: the model's predictive distribution
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        head = model.get_output_embeddings()
        # the logits' width, which may exceed len(tokenizer) (padded embeddings); for GPT-2 both are 50257
        self.vocab_size = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        cfg = model.config
        self.max_positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        # the cache's keyword: `cache` from transformers 5.2x, which drops the older `past_key_values` in 5.40
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    # Architectures whose logits are exactly the output embedding applied to the base model's last hidden state (no
    # logit scaling or soft-capping): for these, `features` and `head` give the fused lookahead entropies.
    _PLAIN_HEAD = frozenset({"gpt2"})
    # Architectures whose lookahead candidates share their row's past in one forward (candidate_step): positions come
    # from position_ids (GPT-2's learned ones, Llama's rotary ones) and attention is full, so a 4D mask states it
    # exactly (a model with a sliding window would lose its window to the mask); attention implementations that take
    # such a mask.
    _SHARED_PAST, _MASKED_ATTENTION = frozenset({"gpt2", "llama"}), frozenset({"sdpa", "eager"})

    def init_state(self, batch_size: int):
        return None, 0

    def _past(self, past):
        """The cache to hand the model: a fork of `past` (which stays as it is), or a new one."""
        return new_cache(self.max_positions) if past is None else fork_cache(past)

    def _forward(self, module, past, **kwargs):
        """module(**kwargs) with the cache `past` under this transformers' keyword: (output, the cache it returns)."""
        out = module(**kwargs, use_cache=True, **{self._cache_kw: past})
        return out, getattr(out, self._cache_kw)

    def _check_position(self, n: int) -> None:
        if self.max_positions is not None and n >= self.max_positions:
            raise LmcalError(f"The model takes at most {self.max_positions} tokens of context "
                             f"(config max_position_embeddings/n_positions) and was asked for token {n + 1}. Every "
                             "stream a stage feeds it must fit: prefix_len + horizon of the generations, "
                             "fit_tokens / fit_streams and score_tokens / score_streams of the fitted and scored "
                             "streams (raise fit_streams or score_streams to shorten them), the rollouts' lengths "
                             "and a memory window tau. `make reproduce ... ARGS='check=true'` checks a profile's "
                             "sizes before anything runs.")

    def step(self, tokens, state):
        return self.prefill(tokens[:, None], state)  # [B, V]

    @torch.no_grad()
    def prefill(self, tokens, state):
        """`step` over tokens [B, L] in one cached forward: (log-probs [B, V] after the last token, the state after
        all L). Only the last position's logits are computed (the prompt's others would be thrown away)."""
        past, n = state
        L = tokens.size(1)
        self._check_position(n + L - 1)
        tokens = tokens.to(self.device)  # [B, L]
        # positions explicit, so no model has to infer them from the cache
        positions = (n + torch.arange(L, device=self.device)).expand_as(tokens)  # [B, L]
        out, past = self._forward(self.model, self._past(past), input_ids=tokens, position_ids=positions,
                                  logits_to_keep=1)
        return out.logits[:, -1].float().log_softmax(-1), (past, n + L)

    @property
    def head(self):
        """(weight [V, E], bias or None) of the output layer where the logits are exactly that layer applied to the
        last hidden state (see _PLAIN_HEAD), else None."""
        if getattr(self.model.config, "model_type", None) not in self._PLAIN_HEAD:
            return None
        out = self.model.get_output_embeddings()
        return out.weight, getattr(out, "bias", None)

    @torch.no_grad()
    def features(self, tokens, state):
        """The base model's last hidden state f [B, E] after feeding tokens [B] (step's log-probs are
        log_softmax(head(f))), and the new state; only where `head` is not None."""
        past, n = state
        self._check_position(n)
        tokens = tokens.to(self.device)[:, None]  # [B, 1]
        out, past = self._forward(self.model.base_model, self._past(past), input_ids=tokens,
                                  position_ids=torch.full_like(tokens, n))
        return out.last_hidden_state[:, -1], (past, n + 1)

    @torch.no_grad()
    def window_log_probs(self, windows: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Log-probabilities [b, keep, V] of the token after each of the last `keep` positions of windows [b, T], each
        window read from scratch in one uncached forward (positions 0..T-1)."""
        self._check_position(windows.size(1) - 1)
        out = self.model(input_ids=windows.to(self.device), use_cache=False, logits_to_keep=keep)
        return out.logits[:, -keep:].float().log_softmax(-1)

    def select(self, state, index):
        past, n = state
        return (None if past is None else fork_cache(past, index.to(self.device))), n

    def select_for_step(self, state, index):
        """`select` for a state that takes one step and is dropped (the lookahead's candidates): each row's copy of
        the cache has room for that step only, half what a growing buffer reserves."""
        past, n = state
        return (None if past is None else fork_cache(past, index.to(self.device), exact=True)), n

    def shares_past(self, state) -> bool:
        """Whether the lookahead's candidates of `state` can read their row's past once (candidate_step) rather than
        each from a copy of it (select_for_step): see _SHARED_PAST."""
        cfg = self.model.config
        return (getattr(cfg, "model_type", None) in self._SHARED_PAST
                and getattr(cfg, "_attn_implementation", None) in self._MASKED_ATTENTION
                and shared_past_cache(state[0], torch.zeros(0, dtype=torch.long)) is not None)

    def candidate_width(self, state) -> int:
        return candidate_width(self.model.config.hidden_size, state[1])

    @torch.no_grad()
    def candidate_step(self, tokens, state, rows, features: bool = False) -> torch.Tensor:
        """Each candidate word tokens[i] fed for one step to row rows[i] of `state` (which stays as it is): log-probs
        [c, V], or with `features` the last hidden states [c, E] (see `features`). The candidates of a row go in as
        one sequence of queries, all at position n, under a 4D mask by which each sees the row's n past positions and
        itself only; so the row's past is read once per layer (shared_past_cache), not copied for every candidate."""
        past, n = state
        self._check_position(n)
        dev, c = self.device, tokens.numel()
        rows, tokens = rows.to(dev), tokens.to(dev)
        # each candidate's piece p (at most `width` candidates of one row: a run of rows[] split) and column j in it
        _, counts = torch.unique_consecutive(rows, return_counts=True)  # [u]
        width = min(self.candidate_width(state), int(counts.max()))
        j = torch.arange(c, device=dev) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)  # [c]
        pieces = (counts + width - 1) // width  # [u]
        p = torch.repeat_interleave(pieces.cumsum(0) - pieces, counts) + torch.div(j, width, rounding_mode="floor")
        j = j % width
        g = int(pieces.sum())
        x = torch.zeros(g, width, dtype=torch.long, device=dev)  # [g, k]: padding columns are read and dropped
        x[p, j] = tokens
        piece_rows = torch.zeros(g, dtype=torch.long, device=dev)
        piece_rows[p] = rows
        see = torch.ones(g, 1, width, n + width, dtype=torch.bool, device=dev)  # [g, 1, k, n + k]: the past ...
        see[..., n:] = torch.eye(width, dtype=torch.bool, device=dev)  # ... and itself
        if self.model.config._attn_implementation == "eager":  # eager adds the mask to the scores
            dtype = next(self.model.parameters()).dtype
            see = torch.zeros(see.shape, dtype=dtype, device=dev).masked_fill_(~see, torch.finfo(dtype).min)
        kwargs = {"input_ids": x, "position_ids": torch.full_like(x, n), "attention_mask": see}
        cache = shared_past_cache(past, piece_rows)
        if features:
            return self._forward(self.model.base_model, cache, **kwargs)[0].last_hidden_state[p, j]  # [c, E]
        logits = self._forward(self.model, cache, **kwargs, logits_to_keep=0)[0].logits  # [g, k, V]
        return logits[p, j].float().log_softmax(-1)  # [c, V]

    def candidate_bytes(self, state, per_row: int) -> float:
        """Bytes one lookahead candidate holds, `per_row` candidates a row: with a shared past (candidate_step), its
        share of its row's past gathered for one layer (twice: the gather and the concatenation) and one layer's
        attention scores and activations; else its copy of the cache (row_bytes)."""
        if not self.shares_past(state):
            return self.row_bytes(state)
        past, n = state
        layer = max(2 * la.keys[0].numel() * la.keys.element_size() for la in past.layers)  # one row, keys + values
        cfg = self.model.config
        return shared_candidate_bytes(layer, n, per_row, cfg.num_attention_heads, cfg.hidden_size)

    def row_bytes(self, state) -> int:
        """Bytes of one row's copy of the key/value cache of `state`, one step grown (the lookahead's budget)."""
        past, n = state
        if past is None:
            return 0
        layers = getattr(past, "layers", None)
        if layers is not None:
            kv = [layer.keys for layer in layers if getattr(layer, "keys", None) is not None]
        elif isinstance(past, (tuple, list)):
            kv = [layer[0] for layer in past]
        else:
            kv = list(getattr(past, "key_cache", []))
        return sum(2 * k.size(1) * (n + 1) * k.size(-1) * k.element_size() for k in kv if k.dim() == 4)


@torch.no_grad()
def hf_cross_entropy(lm: HFCausalLM, tokens: torch.Tensor, context: int | None = None,
                     batch_size: int = 8) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats per model token) of a 1-D stream tokens [S] under lm's model, and the
    number of tokens scored (S - 1): windows of `context` tokens (default: the model's maximum) overlapping by one
    token, each scored by one uncached forward (batched), so every token but the first is predicted once, from the
    tokens before it in its window (at least 0, at most context - 1 of them)."""
    c = int(context or lm.max_positions or 1024)
    if c < 2:
        raise LmcalError(f"model.context={c}: a scoring window needs at least 2 tokens.")
    S = tokens.numel()
    starts = list(range(0, max(S - 1, 1), c - 1))
    total, n = 0.0, 0
    for i in range(0, len(starts), batch_size):
        group = [tokens[a:a + c] for a in starts[i:i + batch_size]]
        for length in sorted({len(w) for w in group} - {0, 1}):  # the last window may be shorter: its own forward
            x = torch.stack([w for w in group if len(w) == length]).to(lm.device)  # [b, length]
            logp = lm.model(input_ids=x).logits[:, :-1].float().log_softmax(-1)  # [b, length-1, V]
            total -= logp.gather(2, x[:, 1:, None]).double().sum().item()
            n += x[:, 1:].numel()
    if n == 0:
        raise LmcalError(f"Nothing to score: the test text has {S} token(s).")
    return total / n, n


# what tokenizer.save_pretrained writes, for every kind of tokenizer (fast, BPE, WordPiece, SentencePiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise LmcalError("Hugging Face models need the transformers package, which is not installed. Install "
                         "the optional extra: pip install -e '.[hf]' (or: pip install 'transformers>=4.40').") from None
    return transformers


# a config's sizes, each a positive integer at most this (far past any causal LM: the largest have ~200 layers,
# widths ~3e4, vocabularies ~3e5, contexts ~1e7); null is allowed where transformers reads it as "the default"
HF_SIZES = {"n_layer": 10**4, "num_hidden_layers": 10**4, "n_embd": 10**6, "hidden_size": 10**6, "d_model": 10**6,
            "n_head": 10**5, "num_attention_heads": 10**5, "num_key_value_heads": 10**5, "vocab_size": 10**8,
            "n_positions": 10**8, "max_position_embeddings": 10**8, "n_ctx": 10**8, "n_inner": 10**7,
            "intermediate_size": 10**7}
HF_NULLABLE = ("n_inner", "num_key_value_heads", "intermediate_size")


def hf_config_problems(config: dict, transformers) -> list[str]:
    """What in a Hugging Face config (config.json, or tokenizer_config.json, as a dict) would build something other
    than a built-in transformers class of sane size: its own code (auto_map, or a tokenizer_class transformers does
    not have: it would load as some built-in class instead, silently), or a size that is not a positive integer
    within HF_SIZES."""
    found = []
    if config.get("auto_map"):
        m = config["auto_map"]
        named = ", ".join(f"{k}: {v}" for k, v in m.items()) if isinstance(m, dict) else str(m)
        found.append(f"auto_map names the folder's own code ({named[:120]})")
    tok = config.get("tokenizer_class")
    if tok is not None and not (isinstance(tok, str) and tok.isidentifier()
                                and (hasattr(transformers, tok) or hasattr(transformers, tok + "Fast"))):
        found.append(f"tokenizer_class={str(tok)[:60]!r} is no tokenizer of transformers (its own code)")
    for key, most in HF_SIZES.items():
        v = config.get(key, 1)
        if v is None and key in HF_NULLABLE:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
            found.append(f"{key}={str(v)[:40]} (must be an integer in [1, {most:,}])")
    return found


def check_hf_config(config: dict, what: str, transformers) -> None:
    """Refuses, in one paragraph, a config whose problems (hf_config_problems) would run code not in transformers or
    build a model of no sane size; `what`: the file, in words. Nothing is built or run before it."""
    if found := hf_config_problems(config, transformers):
        raise LmcalError(f"{what}: " + "; ".join(found) + ". Models are loaded with trust_remote_code=False: no "
                         "code from a folder or the hub runs, so a model or tokenizer that names its own is refused "
                         "rather than loaded as some built-in class, and a size outside its range is refused before "
                         "anything is built. Nothing was loaded. Save the model with a built-in transformers class "
                         "(model.save_pretrained(folder), tokenizer.save_pretrained(folder)), or fix the value.")


def _check_folder(path: Path, transformers) -> None:
    """A local folder's config.json and tokenizer_config.json, read as JSON, checked before transformers reads them
    (check_hf_config); a file that does not parse is left to transformers' own message."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            raw = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict):
            check_hf_config(raw, f"{path / name}", transformers)


def _hf_source(name_or_path) -> tuple[str, dict, str, str]:
    """(what to hand from_pretrained, its keywords for reading without running code, the source in words, how to
    supply a model) of a local folder or hub id, each refused in one paragraph where it cannot hold a model."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    local = path.exists()
    if local and not path.is_dir():
        raise LmcalError(f"{path} is a file, but a Hugging Face model is a folder (config.json, weights, tokenizer "
                         "files), as written by model.save_pretrained(folder) and tokenizer.save_pretrained(folder).")
    how = ("Supply a local folder holding the model and its tokenizer, written by model.save_pretrained(folder) and "
           "tokenizer.save_pretrained(folder) on a machine that has them, or a hub id on a machine that can reach "
           "the Hugging Face hub (with HF_HUB_OFFLINE=1 only models already in the local hub cache are found).")
    if not local and not _HUB_ID.fullmatch(name):
        raise LmcalError(f"No Hugging Face model folder at {path}: the path does not exist (and does not look like "
                         "a hub id, so the hub was not asked). " + how)
    source = f"the local folder {path}" if local else f"the hub id {name!r} (no such local folder)"
    # never the folder's own Python (config.json's auto_map), and never a prompt asking whether to run it
    where = {"local_files_only": True, "trust_remote_code": False} if local else {"trust_remote_code": False}
    if local and (path / "config.json").is_file() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise LmcalError(f"{path} holds a model but no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), so "
                         "it could not read text. Save the tokenizer beside the model: "
                         "tokenizer.save_pretrained(folder).")
    if local:
        _check_folder(path, import_transformers())
    return str(path) if local else name, where, source, how


def _loaded(load, source: str, how: str):
    """load(), any failure of it one paragraph saying what was tried: OSError, ValueError, network errors... all mean
    "could not load it from there"."""
    try:
        return load()
    except Exception as e:
        detail = " ".join(str(e).split())[:300]
        raise LmcalError(f"Could not load a Hugging Face causal LM and its tokenizer from {source}: "
                         f"{type(e).__name__}: {detail}. " + how) from None


def load_hf_tokenizer(name_or_path):
    """(tokenizer, config) of a Hugging Face model, without its weights: what its sizes are checked against before
    the model is loaded (seconds). Refused as load_hf_model refuses."""
    transformers = import_transformers()
    target, where, source, how = _hf_source(name_or_path)
    tokenizer, config = _loaded(lambda: (transformers.AutoTokenizer.from_pretrained(target, **where),
                                         transformers.AutoConfig.from_pretrained(target, **where)), source, how)
    check_hf_config(config.to_dict(), f"The config of {source}", transformers)  # (a hub model's, as read)
    return tokenizer, config


def load_hf_model(name_or_path, device="cpu", dtype=None, device_map=None, tokenizer=None) -> HFCausalLM:
    """A causal LM and its tokenizer as an HFCausalLM on `device`, from a local folder or the Hugging Face hub;
    with `device_map` (e.g. "auto", or {"": "cuda:0"}), spread across the devices by transformers/accelerate
    instead (`device` is then not used: each layer stays where the map put it). `tokenizer`: one already loaded
    (load_hf_tokenizer).

    An existing path must be a folder written by `save_pretrained` (model and tokenizer); it is read from disk only.
    No code from the folder or the hub runs (trust_remote_code=False): a model that needs its own Python is refused.
    A path that does not exist but looks like a hub id ("gpt2", "openai-community/gpt2") is handed to
    `from_pretrained`, which honours HF_HUB_OFFLINE=1 (then only the local hub cache is searched). dtype: a torch
    dtype, its name ("bfloat16") or None (float32). Every failure is one LmcalError saying what was tried.
    """
    transformers = import_transformers()
    target, where, source, how = _hf_source(name_or_path)
    kwargs = dict(where)
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise LmcalError(f"Unknown dtype {dtype!r}: use a torch dtype name such as float32, bfloat16 or "
                             "float16, or auto (the dtype the weights were saved in).")
        dtype = getattr(torch, dtype)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if dtype is not None:  # the keyword was renamed from torch_dtype in 4.56
        kwargs["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = dtype
    if device_map is not None:
        try:
            import accelerate  # noqa: F401  (transformers needs it for device_map)
        except ImportError:
            raise LmcalError(f"model.device_map={device_map!r} needs the accelerate package, which is not installed. "
                             "Install it (pip install accelerate, or the optional extra: pip install -e '.[hf]'), "
                             "or set model.device_map=null to load the model on one device.") from None
        kwargs["device_map"] = device_map
    config = _loaded(lambda: transformers.AutoConfig.from_pretrained(target, **where), source, how)
    check_hf_config(config.to_dict(), f"The config of {source}", transformers)  # before anything is built
    tokenizer, model = _loaded(lambda: (tokenizer or transformers.AutoTokenizer.from_pretrained(target, **where),
                                        transformers.AutoModelForCausalLM.from_pretrained(target, config=config,
                                                                                          **kwargs)),
                               source, how)
    return HFCausalLM(model, tokenizer, None if device_map is not None else device)
