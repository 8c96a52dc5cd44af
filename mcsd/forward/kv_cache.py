"""Key/value cache bookkeeping: keep the accepted path, drop the rest.

A verify (or draft) forward appends one cache entry per tree node after the
committed prefix. Once a path is accepted, its entries are moved down so that
the cache again holds one contiguous sequence, and everything after it is cut.
Only the handful of accepted entries is copied; the prefix is never touched.

Works on transformers' `DynamicCache` (its per-layer `keys` / `values`
tensors, shape (B, H_kv, T, D)). Sliding-window and quantised caches are not
supported: they reorder or compress entries and cannot be committed this way.

The engine's own forward keeps a `mcsd.forward.static_cache.StaticCache`, which
commits and truncates itself: `commit` and `truncate` here hand it over.

`in_place_cache` makes a DynamicCache whose full-attention layers keep their
entries in a buffer allocated ahead (`InPlaceLayer`): a forward writes its
block into the buffer instead of concatenating a new (B, H_kv, T, D) tensor
per layer, which on a CPU also spares a large allocation (often a fresh
memory mapping, page faults included) per layer and forward. `commit` and
`truncate` work on both kinds unchanged: they write into and shorten views.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

HEADROOM = 256            # positions an in-place layer reserves beyond what it holds when it (re)allocates


class InPlaceLayer(DynamicLayer):
    """A DynamicLayer whose `keys` / `values` are views of a preallocated (B, H_kv, capacity, D) buffer.

    `update` copies the block into the buffer after the held positions and
    returns views of everything held; the buffer doubles (one copy) when it is
    full. Anything that replaces `keys` / `values` with a tensor of its own
    (beam reordering, a crop that copies) is adopted into a fresh buffer on the
    next update, so the layer stays correct under transformers' own methods.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buf = self._value_buf = None

    def _views_buffer(self) -> bool:
        return (self._key_buf is not None and self.keys.data_ptr() == self._key_buf.data_ptr()
                and self.values.data_ptr() == self._value_buf.data_ptr())

    def _reallocate(self, need: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        held = self.get_seq_length()
        old = 0 if self._key_buf is None else self._key_buf.shape[-2]
        capacity = max(need + HEADROOM, 2 * old)
        b, h, _, d = key_states.shape
        self._key_buf = key_states.new_empty(b, h, capacity, d)
        self._value_buf = value_states.new_empty(b, h, capacity, value_states.shape[-1])
        if held:
            self._key_buf[:, :, :held].copy_(self.keys)
            self._value_buf[:, :, :held].copy_(self.values)
        self.keys, self.values = self._key_buf[:, :, :held], self._value_buf[:, :, :held]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the block's (B, H_kv, n, D) keys and values after the held positions; returns
        views (B, H_kv, held + n, D) of all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        need = held + key_states.shape[-2]
        buf = self._key_buf
        fits = (buf is not None and need <= buf.shape[-2] and buf.shape[:2] == key_states.shape[:2]
                and buf.dtype == key_states.dtype and (held == 0 or self._views_buffer()))
        if not fits:
            self._reallocate(need, key_states, value_states)
        self._key_buf[:, :, held:need].copy_(key_states)
        self._value_buf[:, :, held:need].copy_(value_states)
        self.keys, self.values = self._key_buf[:, :, :need], self._value_buf[:, :, :need]
        return self.keys, self.values


def in_place_cache(config) -> DynamicCache:
    """A DynamicCache for a model with this config whose plain full-attention layers are
    `InPlaceLayer`s (other layer kinds, e.g. sliding-window ones, stay as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [InPlaceLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"unsupported KV cache type {type(cache).__name__}: mcsd needs transformers' "
            f"DynamicCache with per-layer keys/values (transformers >= 4.56)")
    return layers


def cache_length(cache) -> int:
    """Number of positions held (0 for a fresh cache)."""
    return int(cache.get_seq_length()) if cache is not None else 0


def commit(cache, prefix_len: int, keep: torch.Tensor) -> None:
    """Keep the prefix plus selected entries after it, compacted in order.

    Args:
        cache: a DynamicCache holding at least `prefix_len + max(keep) + 1` positions.
        prefix_len: positions before the tree; kept as they are.
        keep: (k,) long ascending offsets *after the prefix* to keep (e.g. the
            accepted path's node indices); they land at prefix_len .. prefix_len+k-1.
    """
    if hasattr(cache, "commit"):                           # a cache that commits itself (StaticCache)
        cache.commit(prefix_len, keep)
        return
    k = keep.numel()
    if keep.tolist() == list(range(k)):
        # The block's first k entries, already in place (a plain step, a chain accepted so far).
        truncate(cache, prefix_len + k)
        return
    src: dict = {}                                         # device -> positions to gather
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        device = layer.keys.device
        if device not in src:
            src[device] = keep.to(device) + prefix_len
        # Gather first (a copy), then write: safe even where ranges overlap.
        layer.keys[:, :, prefix_len:prefix_len + k] = layer.keys.index_select(-2, src[device])
        layer.values[:, :, prefix_len:prefix_len + k] = layer.values.index_select(-2, src[device])
        layer.keys = layer.keys[:, :, :prefix_len + k]
        layer.values = layer.values[:, :, :prefix_len + k]


def truncate(cache, length: int) -> None:
    """Drop every position from `length` on."""
    if hasattr(cache, "truncate"):                         # a cache that truncates itself (StaticCache)
        cache.truncate(length)
        return
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0 or layer.keys.shape[-2] <= length:
            continue
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def cache_keyword(model) -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` where it has one
    (newer transformers, which deprecate `past_key_values`), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
