"""Hugging Face causal LMs as StepLMs (transformers is optional: imported only when a model is built or loaded): the
adapter HFCausalLM, its key/value cache that forks without copying the past, windowed test scoring, and loading a
folder written by save_pretrained."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import torch

from lmcal.errors import LmcalError

# Cache layers whose `update` rebinds its tensors to a torch.cat (never writes into them): a shallow copy of such a
# layer is an independent cache that shares the past's storage. Exact type names on purpose: subclasses such as the
# quantized layers keep buffers they update in place, and go through the (copying) fallback of fork_cache.
_REBINDING_LAYERS = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer"})


class _Store:
    """Key/value buffers [B, heads, capacity, head_dim] shared by the cache layers of one line of states; `frontier`:
    how many positions the latest writer filled."""

    __slots__ = ("keys", "values", "frontier")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, frontier: int):
        self.keys, self.values, self.frontier = keys, values, frontier


def _store_from(keys: torch.Tensor, values: torch.Tensor, n: int, extra: int, limit: int | None = None,
                exact: bool = False) -> _Store:
    """A new store holding keys/values[:, :, :n] with room for at least `extra` more positions (capacity doubled, but
    never past `limit`, the model's context, when it is known; `exact`: room for `extra` only, for a fork that takes
    one step and is dropped, as the lookahead's are)."""
    B, H, _, D = keys.shape
    cap = n + extra if exact else max(64, 2 * (n + extra))
    if limit and not exact:
        cap = max(n + extra, min(cap, limit))
    k, v = keys.new_empty(B, H, cap, D), values.new_empty(B, H, cap, values.size(-1))
    k[:, :, :n], v[:, :, :n] = keys[:, :, :n], values[:, :, :n]
    return _Store(k, v, n)


@functools.lru_cache(maxsize=1)
def _forkable_layer_class():
    """A transformers (>= 5) cache layer that writes each step's keys and values into a preallocated buffer instead
    of concatenating (a growing cache's torch.cat copies the whole past every step: quadratic in the horizon).

    States share buffers safely: a layer owns positions [0, n) of its store. A step writes in place when nobody has
    written past n (store.frontier == n); otherwise, or when the buffer is full, it first copies its n positions to
    a new buffer. So a state stepped twice (the lookahead steps one state once per candidate) never sees another
    state's keys, and a chain of steps (generation) writes in place."""
    from transformers.cache_utils import DynamicLayer

    class ForkableLayer(DynamicLayer):
        def __init__(self, store: _Store | None = None, n: int = 0, limit: int | None = None):
            super().__init__()
            self.store, self.n, self.limit = store, n, limit
            self.is_initialized = store is not None

        @property
        def keys(self):
            return None if self.store is None else self.store.keys[:, :, :self.n]

        @keys.setter
        def keys(self, value):  # the base class's __init__ sets None; nothing else writes it
            if value is not None:
                raise AttributeError("a ForkableLayer's keys live in its store")

        @property
        def values(self):
            return None if self.store is None else self.store.values[:, :, :self.n]

        @values.setter
        def values(self, value):
            if value is not None:
                raise AttributeError("a ForkableLayer's values live in its store")

        def lazy_initialization(self, key_states, value_states):
            self.store, self.n = _store_from(key_states, value_states, 0, key_states.size(-2), self.limit), 0
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            q, st, n = key_states.size(-2), self.store, self.n
            if st.frontier != n or n + q > st.keys.size(-2):  # another state wrote past n, or no room: copy first
                st = self.store = _store_from(st.keys, st.values, n, q, self.limit)
            st.keys[:, :, n:n + q], st.values[:, :, n:n + q] = key_states, value_states
            st.frontier = self.n = n + q
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.n

        def fork(self, index: torch.Tensor | None = None, exact: bool = False):
            """This layer's state for another line of steps; with `index`, of batch rows `index` (copied; `exact`:
            with room for one more position only)."""
            if self.store is None or index is None:
                return ForkableLayer(self.store, self.n, self.limit)
            st = self.store
            n = self.n  # only the positions this state owns are gathered
            idx = index.to(st.keys.device)  # each layer's own device (a model spread by device_map)
            return ForkableLayer(_store_from(st.keys[idx, :, :n], st.values[idx, :, :n], n, 1, self.limit, exact), n,
                                 self.limit)

    return ForkableLayer


def _new_cache(limit: int | None = None):
    """An empty cache of ForkableLayers (transformers >= 5), or None: the model makes its own (older versions)."""
    try:
        from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: F401  (>= 5: per-layer caches)
        layer = _forkable_layer_class()
        return Cache(layer_class_to_replicate=functools.partial(layer, limit=limit))
    except (ImportError, TypeError, ValueError):
        return None


def fork_cache(past, index: torch.Tensor | None = None, exact: bool = False):
    """A cache that the model may extend without touching `past`; with `index` [B'], of batch rows `index` only
    (`exact`: our layers give the rows room for one more step only).

    Handles the cache layouts of transformers >= 4.40: a Cache whose `layers` hold keys/values (>= 4.56), the
    DynamicCache with `key_cache`/`value_cache` lists (4.40 - 4.55), and the legacy tuple of per-layer (key, value)
    tuples, each tensor [B, heads, T, head_dim]. Only containers are copied; tensors are shared, or indexed (which
    makes new ones). Any other cache class is deep-copied first: correct, at the price of copying the whole cache.
    """
    if isinstance(past, (tuple, list)):  # legacy format: tuples are immutable, the model builds new ones
        return past if index is None else tuple(tuple(t[index] for t in layer) for layer in past)
    layers = getattr(past, "layers", None)
    if layers and all(hasattr(layer, "fork") for layer in layers):  # ours: forks share or copy their buffers
        new = copy.copy(past)
        new.layers = [layer.fork(index, exact) for layer in layers]
        return new
    if layers is not None and all(type(layer).__name__ in _REBINDING_LAYERS for layer in layers):
        new = copy.copy(past)
        new.layers = [copy.copy(layer) for layer in layers]
        if index is not None:
            for layer in new.layers:
                if layer.is_initialized:
                    i = index.to(layer.keys.device)  # [B'] on the layer's own device (device_map)
                    layer.keys, layer.values = layer.keys[i], layer.values[i]  # [B', heads, T, head_dim]
        return new
    if layers is None and type(past).__name__ == "DynamicCache" and hasattr(past, "key_cache"):
        new = copy.copy(past)  # 4.40 - 4.55: update assigns into these lists, so the lists are copied
        pick = (lambda t: t) if index is None else (lambda t: t[index] if t.numel() else t)
        new.key_cache, new.value_cache = [pick(k) for k in past.key_cache], [pick(v) for v in past.value_cache]
        return new
    new = copy.deepcopy(past)
    if index is not None:
        new.batch_select_indices(index)
    return new


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

    # Architectures whose logits are exactly the output embedding applied to the base model's last hidden state (no
    # logit scaling or soft-capping): for these, `features` and `head` give the fused lookahead entropies.
    _PLAIN_HEAD = frozenset({"gpt2"})

    def init_state(self, batch_size: int):
        return None, 0

    def _past(self, past):
        """The cache to hand the model: a fork of `past` (which stays as it is), or a new one."""
        return _new_cache(self.max_positions) if past is None else fork_cache(past)

    def _check_position(self, n: int) -> None:
        if self.max_positions is not None and n >= self.max_positions:
            raise LmcalError(f"The model takes at most {self.max_positions} tokens of context "
                             f"(config max_position_embeddings/n_positions) and was asked for token {n + 1}. Use "
                             "shorter prefixes or a shorter generation horizon.")

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
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=True, past_key_values=self._past(past),
                         logits_to_keep=1)
        return out.logits[:, -1].float().log_softmax(-1), (out.past_key_values, n + L)

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
        out = self.model.base_model(input_ids=tokens, position_ids=torch.full_like(tokens, n), use_cache=True,
                                    past_key_values=self._past(past))
        return out.last_hidden_state[:, -1], (out.past_key_values, n + 1)

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


def load_hf_model(name_or_path, device="cpu", dtype=None, device_map=None) -> HFCausalLM:
    """A causal LM and its tokenizer as an HFCausalLM on `device`, from a local folder or the Hugging Face hub;
    with `device_map` (e.g. "auto", or {"": "cuda:0"}), spread across the devices by transformers/accelerate
    instead (`device` is then not used: each layer stays where the map put it).

    An existing path must be a folder written by `save_pretrained` (model and tokenizer); it is read from disk only.
    No code from the folder or the hub runs (trust_remote_code=False): a model that needs its own Python is refused.
    A path that does not exist but looks like a hub id ("gpt2", "openai-community/gpt2") is handed to
    `from_pretrained`, which honours HF_HUB_OFFLINE=1 (then only the local hub cache is searched). dtype: a torch
    dtype, its name ("bfloat16") or None (float32). Every failure is one LmcalError saying what was tried.
    """
    transformers = import_transformers()
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
    target = str(path) if local else name
    if local and (path / "config.json").is_file() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise LmcalError(f"{path} holds a model but no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), so "
                         "it could not read text. Save the tokenizer beside the model: "
                         "tokenizer.save_pretrained(folder).")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(target, **where)
        model = transformers.AutoModelForCausalLM.from_pretrained(target, **kwargs)
    except Exception as e:  # OSError, ValueError, network errors...: all mean "could not load it from there"
        detail = " ".join(str(e).split())[:300]
        raise LmcalError(f"Could not load a Hugging Face causal LM and its tokenizer from {source}: "
                         f"{type(e).__name__}: {detail}. " + how) from None
    return HFCausalLM(model, tokenizer, None if device_map is not None else device)
