"""A KV cache of fixed capacity for the engine's own forward (`mcsd.forward.llama`).

Every layer's keys live in one buffer (layers, B, H_kv, capacity, D), its
values in another, allocated once and reused across generations; a forward
writes its block at given slots (`index_copy_`) and attends over the first
`length + Q` of them. Nothing is concatenated, no tensor is made per layer and
step, and the buffers keep their address, which is what a captured CUDA graph
needs. Only `reserve` reallocates, when a sequence outgrows the capacity (one
copy of what is held, capacity at least doubled).

The length is a Python integer kept by the cache, not read from a tensor:
`truncate` only lowers it, and `commit` moves the accepted entries down with
one gather and one write per buffer for all layers together.

It answers `get_seq_length`, `truncate` and `commit`, so `mcsd.forward.kv_cache`'s
helpers (`cache_length`, `truncate`, `commit`) take it as they take
transformers' DynamicCache.
"""

from __future__ import annotations

import torch

from . import hugepages

HEADROOM = 256            # positions reserved beyond what is needed when the buffers are (re)allocated


class StaticCache:
    """Keys and values of every layer in two buffers of fixed capacity.

    Args:
        layers, kv_heads, head_dim: the model's shape.
        dtype, device: of the buffers (the model's).

    Attributes:
        length: positions held.
        capacity: positions the buffers hold before `reserve` must grow them (0 before the first).
        keys, values: (layers, 1, H_kv, capacity, D) buffers, or None before the first `reserve`.
        layer_keys, layer_values: per layer, (1, H_kv, capacity, D) views of the buffers.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        self.shape = (layers, 1, kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.length = 0
        self.capacity = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.layer_keys: list[torch.Tensor] = []
        self.layer_values: list[torch.Tensor] = []

    def get_seq_length(self) -> int:
        """Positions held (the name transformers' caches answer to)."""
        return self.length

    def reset(self) -> None:
        """Hold nothing; the buffers stay allocated."""
        self.length = 0

    def reserve(self, need: int) -> None:
        """Make room for `need` positions (reallocating, held entries copied, only when they do not fit)."""
        if need <= self.capacity:
            return
        capacity = max(need + HEADROOM, 2 * self.capacity)
        layers, b, h, _, d = self.shape
        keys = torch.empty(layers, b, h, capacity, d, dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        if self.length:
            keys[:, :, :, :self.length].copy_(self.keys[:, :, :, :self.length])
            values[:, :, :, :self.length].copy_(self.values[:, :, :, :self.length])
        self.keys, self.values, self.capacity = keys, values, capacity
        hugepages.advise((keys, values))
        self.layer_keys, self.layer_values = list(keys.unbind(0)), list(values.unbind(0))

    def zero_unwritten(self) -> None:
        """Zero every entry past `length` (buffers from `reserve` are not initialised there)."""
        self.keys[:, :, :, self.length:].zero_()
        self.values[:, :, :, self.length:].zero_()

    def next_slots(self, n: int) -> torch.Tensor:
        """Room for `n` more positions, and their slots (n,) length .. length+n-1 on the cache's device;
        the caller sets `length` once the block is written."""
        self.reserve(self.length + n)
        return torch.arange(self.length, self.length + n, device=self.device)

    def truncate(self, length: int) -> None:
        """Drop every position from `length` on."""
        self.length = min(self.length, length)

    def commit(self, prefix_len: int, keep: torch.Tensor) -> None:
        """Keep `prefix_len` positions plus the entries at offsets `keep` (k,) after them (ascending),
        moved down to prefix_len .. prefix_len+k-1; everything after is dropped."""
        k = keep.numel()
        if keep.tolist() != list(range(k)):                 # else: already in place (a chain, a plain step)
            src = keep.to(self.device) + prefix_len
            for buf in (self.keys, self.values):
                # gather first (a copy), then write: safe where the ranges overlap
                buf[:, :, :, prefix_len:prefix_len + k] = buf.index_select(3, src)
        self.length = prefix_len + k

    def commit_rows(self, prefix_len: int, rows: torch.Tensor, kept: int) -> None:
        """`commit` with the accepted offsets as a device tensor, read nowhere on the host: the entries
        at offsets `rows` (R,) after `prefix_len` are gathered and written at prefix_len .. prefix_len+R-1
        whatever their values (the fixed-shape round's padded path), and the first `kept` of them stay.
        The buffers must hold prefix_len + R positions (the verified block wrote at least that many)."""
        r = rows.numel()
        src = rows.to(self.device) + prefix_len
        for buf in (self.keys, self.values):
            buf[:, :, :, prefix_len:prefix_len + r] = buf.index_select(3, src)     # gather, then write
        self.length = prefix_len + kept

    def nbytes(self) -> int:
        """Bytes the buffers take."""
        return 0 if self.keys is None else 2 * self.keys.nbytes
