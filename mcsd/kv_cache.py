"""Key/value cache bookkeeping: keep the accepted path, drop the rest.

A verify (or draft) forward appends one cache entry per tree node after the
committed prefix. Once a path is accepted, its entries are moved down so that
the cache again holds one contiguous sequence, and everything after it is cut.
Only the handful of accepted entries is copied; the prefix is never touched.

Works on transformers' `DynamicCache` (its per-layer `keys` / `values`
tensors, shape (B, H_kv, T, D)). Sliding-window and quantised caches are not
supported: they reorder or compress entries and cannot be committed this way.
"""

from __future__ import annotations

import torch


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
    k = keep.numel()
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        src = keep.to(layer.keys.device) + prefix_len
        # Gather first (a copy), then write: safe even where ranges overlap.
        layer.keys[:, :, prefix_len:prefix_len + k] = layer.keys.index_select(-2, src)
        layer.values[:, :, prefix_len:prefix_len + k] = layer.values.index_select(-2, src)
        layer.keys = layer.keys[:, :, :prefix_len + k]
        layer.values = layer.values[:, :, :prefix_len + k]


def truncate(cache, length: int) -> None:
    """Drop every position from `length` on."""
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
