"""The key/value caches behind HFCausalLM: a cache that forks without copying the past (ForkableLayer, fork_cache),
and the lookahead's shared past (shared_past_cache: many candidate words read their row's past once)."""

from __future__ import annotations

import copy
import functools

import torch

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


def new_cache(limit: int | None = None):
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


@functools.lru_cache(maxsize=1)
def _shared_past_layer_class():
    """A cache layer over one layer's past that many new positions of a row read at once and nobody writes
    (shared_past_cache)."""
    from transformers.cache_utils import DynamicLayer

    class SharedPastLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor):
            super().__init__()
            self.past, self.index = (keys, values), index  # [B, heads, n, head_dim] each; index [g]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            """Rows `index` of the past followed by the new positions, [g, heads, n + k, head_dim]; nothing is kept,
            so the gathered past lives for this layer's attention only."""
            k, v = self.past
            i = self.index.to(k.device)  # each layer's own device (a model spread by device_map)
            return torch.cat([k[i], key_states], -2), torch.cat([v[i], value_states], -2)

        def get_seq_length(self) -> int:
            return self.past[0].size(-2)

    return SharedPastLayer


def shared_past_cache(past, index: torch.Tensor):
    """A read-only cache of rows `index` [g] of `past` (repeats allowed), for one forward that feeds each row several
    new positions (HFCausalLM.candidate_step): the past is gathered once per row and layer while that layer runs,
    never once per new position, and `past` is left as it is. None where `past` is not a Cache of per-layer key/value
    tensors (transformers < 4.56, legacy tuples): the lookahead then forks the cache for each candidate."""
    layers = getattr(past, "layers", None)
    if not layers or not all(isinstance(getattr(la, "keys", None), torch.Tensor) and la.keys.dim() == 4
                             for la in layers):
        return None
    from transformers.cache_utils import Cache

    cls = _shared_past_layer_class()
    return Cache(layers=[cls(la.keys, la.values, index) for la in layers])
