"""Several sequences in one forward: a KV cache of B slots and the engine's own forward over a flat
batch of their rows.

A slot is one sequence's cache, with its own length; a forward takes a block of rows from each of
any number of slots (a prompt's chunk, a last token, a tree), lays them one after another as a flat
batch of R rows, and runs the decoder layers once over all of them: the products (q / k / v, the
output projection, the MLP, the LM head) see R rows, while each block's keys and values go to its own
slot and its rows attend over their own slot only, under the block's own mask (its slot's committed
prefix plus whatever of the block it may see). Nothing in a row's computation reads another slot.

Why a row's answer is the one it gets alone:
- a float32 model on the native q4 kernel (`mcsd.forward.native`) runs every layer in one call
  (`native.layers_slots`), whose products, norms and attention compute every row on its own in a fixed
  order: a row's hidden state is, bit for bit, what the lone forward (`native.layers`) gives it; the LM
  head runs once over every block's rows where its product is native too (`quant.row_invariant`), else
  (torch's product) on each block's own rows, as it would alone, so the logits are the lone run's bit
  for bit, whatever else is in the batch;
- any other model runs operation by operation on its own modules (`mcsd.forward.llama`), attention per
  block exactly as the lone forward calls it; the norms, rotary tables and activations are row-wise,
  but a dense matmul (torch's) over R rows may round a row's result differently in the last bits from
  one over that block's rows alone (measured on the tests' tiny float32 models: up to 6e-8). That has
  not changed a greedy token in the tests; where two logits tie to the last bit it could, as a tree's
  rows can against a plain step in the lone loop. In bfloat16 the rounding by row count is coarser
  (an H200 run found 1-2 of 6 batched answers equal to their lone ones): nothing is promised there.
- on torch's int4 kernel a q4 model's forward reads the dense weights where it starts a sequence with
  `quant.PREFILL_ROWS` rows or more: here that choice is each block's own (`Block.dense`: a prompt's
  chunks follow its lone prefill of the whole prompt), the blocks of each kind in a forward of their
  own, never the whole batch's row count. The products themselves are torch's (not row-invariant).
So the lone logits, bit for bit, are promised on the native q4 / q4q8 layers only
(`BatchDecoder.exact`); elsewhere a batched answer may part from its lone one near a tie.

In fixed shapes (`SlotBlocks`, the GPU's path): every slot of the cache runs each round, its block
padded to the round's bucket of rows (the largest block's), so that one forward of (slots, rows) is
one captured CUDA graph per bucket, replayed; a slot without a block runs padding rows alone. Its
products, attention and LM head are torch's over the whole (slots, rows) batch, so on a dense model
a row's logits may differ from its lone forward's in the last bits, as `SlotForward`'s do.

Memory: `SlotCache` holds every slot at one capacity (the longest slot's), bounded by its `limit` (the
context window and one block), and gives the room back when the longest sequence leaves.

Limitations: Llama-family models on the engine's own forward only (`mcsd.forward.llama.supports`);
no hidden states (no feature drafter reads them: a model drafter drafts only for a request alone,
on the lone round's cache, `mcsd.decoding.batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch

from . import graphs, kernels, native, quant
from .attention import additive_mask
from .llama import LeanForward, _rms_norm
from .static_cache import HEADROOM



class SlotCache:
    """Keys and values of B sequences (slots), every layer in two buffers of one capacity for all slots.

    Memory: the buffers hold B x capacity positions, so every slot takes the longest slot's room. The
    capacity grows (doubling, held entries copied) only when a block does not fit, never past `limit`,
    and shrinks again when a slot leaves and the longest held sequence needs a quarter of it or less:
    one long request grows the others' room at most to `limit` and only while it is held. The most
    the buffers ever take is `bound_bytes` (B x limit positions).

    Args:
        slots: B, the most sequences held at once.
        layers, kv_heads, head_dim: the model's shape.
        dtype, device: of the buffers (the model's).
        limit: the most positions a slot may hold (its sequence and the rows of one block after it:
            `BatchDecoder` gives the context window plus its largest block); None: no bound.

    Attributes:
        lengths: positions each slot holds (B Python ints).
        capacity: positions a slot holds before `reserve` must grow the buffers (0 before the first).
        layer_keys, layer_values: per layer, (B, H_kv, capacity, D) views of the buffers.
    """

    def __init__(self, slots: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 limit: int | None = None):
        if limit is not None and limit < 1:
            raise ValueError(f"a slot cache's limit must be >= 1 position, got {limit}")
        self.slots, self.layers, self.kv_heads, self.head_dim = slots, layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.limit = limit
        self.lengths = [0] * slots
        self.capacity = 0
        self.keys: torch.Tensor | None = None        # (layers, B, H_kv, capacity, D)
        self.values: torch.Tensor | None = None
        self.layer_keys: list[torch.Tensor] = []
        self.layer_values: list[torch.Tensor] = []

    @classmethod
    def for_model(cls, lean: LeanForward, slots: int, limit: int | None = None) -> "SlotCache":
        weight = lean.embed.weight
        return cls(slots, len(lean.layers), lean.kv_heads, lean.head_dim, weight.dtype, weight.device, limit)

    @property
    def position_bytes(self) -> int:
        """Bytes one position of one slot takes (keys and values, every layer)."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * item

    @property
    def nbytes(self) -> int:
        """Bytes the buffers take now."""
        return self.slots * self.capacity * self.position_bytes

    @property
    def bound_bytes(self) -> int | None:
        """The most bytes the buffers may ever take (B x limit positions), or None without a limit."""
        return None if self.limit is None else self.slots * self.limit * self.position_bytes

    def reserve(self, need: int) -> None:
        """Room for `need` positions in every slot (reallocating, held entries copied, only when they do
        not fit); a ValueError past `limit`."""
        if need <= self.capacity:
            return
        if self.limit is not None and need > self.limit:
            raise ValueError(f"a slot needs {need} positions, past the slot cache's limit of {self.limit}")
        capacity = max(need + HEADROOM, 2 * self.capacity)
        self._resize(capacity if self.limit is None else min(capacity, self.limit))

    def _resize(self, capacity: int) -> None:
        """Buffers of `capacity` positions a slot, zero-filled, every slot's held entries copied."""
        keys = torch.zeros(self.layers, self.slots, self.kv_heads, capacity, self.head_dim, dtype=self.dtype,
                           device=self.device)
        values = torch.zeros_like(keys)
        held = min(self.capacity, capacity)              # every slot's entries up to there
        if held:
            keys[..., :held, :].copy_(self.keys[..., :held, :])
            values[..., :held, :].copy_(self.values[..., :held, :])
        self.keys, self.values, self.capacity = keys, values, capacity
        self.layer_keys, self.layer_values = list(keys.unbind(0)), list(values.unbind(0))

    def free(self, slot: int) -> None:
        """The slot holds nothing (a new sequence may take it); the buffers shrink where the longest
        sequence still held needs a quarter of them or less."""
        self.lengths[slot] = 0
        fits = max(self.lengths) + HEADROOM
        if self.capacity > HEADROOM and 4 * fits <= self.capacity:
            self._resize(fits)

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The slot holds these L positions ((layers, H_kv, L, D) each: a lone sequence's cache, say)."""
        n = keys.shape[2]
        self.reserve(n)
        self.keys[:, slot, :, :n].copy_(keys)
        self.values[:, slot, :, :n].copy_(values)
        self.lengths[slot] = n

    def commit(self, slot: int, prefix_len: int, keep: torch.Tensor) -> None:
        """Keep the slot's `prefix_len` positions plus its entries at offsets `keep` (k,) after them
        (ascending), moved down to prefix_len .. prefix_len+k-1; everything after is dropped."""
        k = keep.numel()
        if keep.tolist() != list(range(k)):                 # else: already in place (a plain step, a chain)
            src = keep.to(self.device) + prefix_len
            for buf in (self.keys, self.values):
                part = buf[:, slot]                             # (layers, H_kv, capacity, D)
                part[:, :, prefix_len:prefix_len + k] = part.index_select(2, src)   # gather, then write
        self.lengths[slot] = prefix_len + k


class Block(NamedTuple):
    """One slot's rows in a batched forward.

    Attributes:
        slot: the slot whose sequence the rows continue (written after its held positions).
        tokens: (Q,) long.
        positions: (Q,) long absolute positions.
        allowed: (Q, Q) bool, which of the block's rows each row sees (the slot's held positions are
            seen by every row): causal for a prompt's chunk, the ancestor mask for a tree.
        last_only: only the last row's logits are wanted (a prompt's chunk).
        prompt_rows: for a prompt's chunk, the whole prompt's rows: what its lone prefill feeds at
            once (on torch's int4 kernel that prefill reads the dense weights from
            `quant.PREFILL_ROWS` rows on, and so does each of its chunks here); 0 for a tree.
    """

    slot: int
    tokens: torch.Tensor
    positions: torch.Tensor
    allowed: torch.Tensor
    last_only: bool = False
    prompt_rows: int = 0

    @property
    def dense(self) -> bool:
        """Its rows read a q4 model's dense weights, as its lone forward's do (`quant.starts_dense`)."""
        return self.prompt_rows > 0 and quant.starts_dense(self.prompt_rows, 0)


class SlotForward:
    """The engine's own forward (`mcsd.forward.llama.LeanForward`) over a flat batch of slots' blocks.

    Args:
        lean: the target's own forward (its modules, weights and native plan are what run).
        model: the transformers model (its q4 hooks decide the dense path of a prompt's rows).
        kernel_table: which CPU matmul path a block of R rows runs on, or None.
    """

    def __init__(self, lean: LeanForward, model: torch.nn.Module, kernel_table: kernels.KernelTable | None = None):
        self.lean, self.model, self.kernel_table = lean, model, kernel_table

    @torch.inference_mode()
    def __call__(self, cache: SlotCache, blocks: list[Block]) -> list[torch.Tensor]:
        """Run the blocks (at most one a slot) in one forward; each slot's cache then holds its block
        after its held positions.

        Returns:
            per block, its logits (Q, V), or (1, V) with `last_only`.
        """
        if len({b.slot for b in blocks}) != len(blocks):
            raise ValueError("a batched forward takes at most one block a slot")
        dense = [b.dense for b in blocks]
        if all(dense) or not any(dense):
            return self._forward(cache, blocks, dense[0])
        # on torch's int4 kernel, the blocks whose lone forward reads the dense weights (a long prompt's
        # chunks) run apart from those on the 4-bit weights: the choice is each prompt's, not the batch's
        logits = [None] * len(blocks)
        for group in (True, False):
            picked = [i for i, d in enumerate(dense) if d == group]
            for i, out in zip(picked, self._forward(cache, [blocks[i] for i in picked], group)):
                logits[i] = out
        return logits

    def _forward(self, cache: SlotCache, blocks: list[Block], dense: bool) -> list[torch.Tensor]:
        """`__call__` over blocks that all read the dense weights (`dense`) or all the 4-bit ones."""
        lean, device = self.lean, cache.device
        starts = [cache.lengths[b.slot] for b in blocks]
        sizes = [b.tokens.numel() for b in blocks]
        bounds = list(accumulate(sizes, initial=0))          # block i's rows: bounds[i] .. bounds[i+1]-1
        cache.reserve(max(s + q for s, q in zip(starts, sizes)))
        rows = sum(sizes)
        masks = [additive_mask(b.allowed.to(device), s, cache.dtype) for b, s in zip(blocks, starts)]  # (1,1,Q,s+Q)
        tokens = torch.cat([b.tokens.to(device) for b in blocks])[None]                 # (1, R)
        positions = torch.cat([b.positions.to(device) for b in blocks])[None]           # (1, R)
        slots = torch.cat([torch.arange(s, s + q, device=device) for s, q in zip(starts, sizes)])   # (R,)
        # as the blocks' lone forwards choose (a q4 model on torch's int4 kernel): a prefill of this many rows
        which = (max(b.prompt_rows for b in blocks), 0) if dense else (rows, 1)
        with kernels.running(self.kernel_table, rows), quant.forward_rows(self.model, *which):
            h = lean.embed(tokens)                                                     # (1, R, C)
            cos, sin = lean._rotary(h, positions)                                      # (1, R, 1, D)
            plan = lean.native_layers()
            if plan is not None:
                h = self._in_one_call(h, cos, sin, cache, blocks, starts, bounds, masks, slots)
            else:
                h = self._by_op(h, cos, sin, cache, blocks, bounds, masks, slots)
            h = _rms_norm(h, lean.norm, lean.one_call)
            picks = [(r1 - 1 if b.last_only else r0, r1) for b, r0, r1 in zip(blocks, bounds, bounds[1:])]
            if plan is not None and not quant.row_invariant(lean.lm_head, h.dtype):
                # every row so far is what its block alone gives (the native layers); the LM head on
                # torch's product runs on each block's own rows, as alone, to keep it so (a native head
                # computes each row on its own: one call over all of them)
                logits = []
                for r0, r1 in picks:
                    with kernels.running(self.kernel_table, r1 - r0):
                        logits.append(lean.lm_head(h[:, r0:r1])[0])
            else:
                wanted = torch.cat([torch.arange(r0, r1) for r0, r1 in picks]).to(device)
                logits = list(lean.lm_head(h[:, wanted])[0].split([r1 - r0 for r0, r1 in picks]))
        for b, s, q in zip(blocks, starts, sizes):
            cache.lengths[b.slot] = s + q
        return logits

    def _in_one_call(self, h, cos, sin, cache, blocks, starts, bounds, masks, slots):
        """Every decoder layer in one native call over every block's rows (`native.layers_slots`)."""
        rows, width = h.shape[1], max(m.shape[-1] for m in masks)
        mask = h.new_full((rows, width), float("-inf"))                                 # (R, K) additive
        for m, r0, r1 in zip(masks, bounds, bounds[1:]):
            mask[r0:r1, :m.shape[-1]] = m[0, 0]
        first = torch.tensor(bounds)
        which = torch.tensor([b.slot for b in blocks])
        lens = torch.tensor([s + r1 - r0 for s, r0, r1 in zip(starts, bounds, bounds[1:])])
        cos_rows, sin_rows = cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous()      # (R, D)
        slots = slots.to(torch.long).contiguous()
        out = torch.empty_like(h)
        native.layers_slots(self.lean.plan_array(), h, out, cos_rows, sin_rows, cache.keys, cache.values, first, which,
                            slots, lens, mask)
        return out

    def _by_op(self, h, cos, sin, cache, blocks, bounds, masks, slots):
        """Each decoder layer operation by operation on the model's own modules (as
        `LeanForward._by_op`), the products over every row, attention per block over its own slot."""
        lean = self.lean
        for i, m in enumerate(lean.layers):
            q, k, v = lean._attention_inputs(m, h, cos, sin)                  # (1, R, H or H_kv, D)
            outs = []
            for b, mask, r0, r1 in zip(blocks, masks, bounds, bounds[1:]):
                keys = cache.layer_keys[i][b.slot:b.slot + 1]                  # (1, H_kv, capacity, D)
                values = cache.layer_values[i][b.slot:b.slot + 1]
                part = slots[r0:r1]
                keys.index_copy_(2, part, k[:, r0:r1].transpose(1, 2))
                values.index_copy_(2, part, v[:, r0:r1].transpose(1, 2))
                k_len, qb = mask.shape[-1], q[:, r0:r1]
                if lean.one_call and qb.dtype == torch.float32:                # one call, rows on their own
                    outs.append(native.attention(qb[0], keys[0], values[0], k_len, mask[0, 0].contiguous(),
                                                 m.scaling).view(1, r1 - r0, -1))
                else:
                    out = torch.nn.functional.scaled_dot_product_attention(
                        qb.transpose(1, 2), keys[:, :, :k_len], values[:, :, :k_len], attn_mask=mask,
                        scale=m.scaling, **lean.grouped)                        # (1, H, Q, D)
                    outs.append(out.transpose(1, 2).reshape(1, r1 - r0, -1))
            h = lean._mlp(m, h + m.o(torch.cat(outs, dim=1)))                  # (1, R, C)
        return h


@dataclass
class _Bucket:
    """One bucket's persistent inputs over every slot, its graph (or None: eager) and its logits."""

    tokens: torch.Tensor             # (S, R) long
    positions: torch.Tensor          # (S, R) long
    write: torch.Tensor              # (S, R) long: the cache entry each row's keys and values go to
    allowed: torch.Tensor            # (S, R, capacity) bool: the entries each row sees
    slot_of: torch.Tensor            # (S, R) long: each row's slot (constant)
    graph: "torch.cuda.CUDAGraph | None" = None
    out: torch.Tensor | None = None  # (S, R, V) logits


class SlotBlocks(graphs.Graphed):
    """`SlotForward`'s round in fixed shapes, captured as CUDA graphs: every slot of the cache, each
    block padded to R rows, R the round's bucket (`mcsd.forward.graphs.BUCKETS`, by its largest block).

    A block's rows go to its slot's entries after what the slot holds, as `SlotForward` writes them; its
    padding rows (token 0, the block's last position) are written after the block and see only
    themselves, and a slot without a block runs R such rows after what it holds: the commit never keeps
    them and no real row sees them. Attention spans each slot's whole capacity with a mask, so the
    shapes hold from round to round; the inputs are written into the bucket's buffers in place, on
    their device, and its logits copied out of the graph's. A round whose largest block is past
    the largest bucket (a long prompt's chunk) runs eagerly at its own shape (`SlotForward`).

    Args:
        lean, model, kernel_table: as `SlotForward` takes them.
        capture: capture and replay CUDA graphs (the model on CUDA); False runs the same shapes eagerly.

    Attributes: those of `mcsd.forward.graphs.Graphed` (built, captures, capture_s, failure), and
        eager: the `SlotForward` that runs rounds past the largest bucket.
    """

    def __init__(self, lean: LeanForward, model: torch.nn.Module, kernel_table: kernels.KernelTable | None = None,
                 capture: bool = True):
        super().__init__(capture)
        self.lean, self.model, self.kernel_table = lean, model, kernel_table
        self.eager = SlotForward(lean, model, kernel_table)

    @torch.inference_mode()
    def __call__(self, cache: SlotCache, blocks: list[Block]) -> list[torch.Tensor]:
        """As `SlotForward.__call__`: the blocks (at most one a slot) in one forward; per block its logits."""
        if len({b.slot for b in blocks}) != len(blocks):
            raise ValueError("a batched forward takes at most one block a slot")
        sizes = [b.tokens.numel() for b in blocks]
        r = graphs.bucket_of(max(sizes))
        if r is None or any(b.dense for b in blocks):     # past the buckets, or a prompt on dense weights
            return self.eager(cache, blocks)
        begin = list(cache.lengths)                          # where each slot's rows go
        cache.reserve(max(begin) + r)
        entry, fresh = self._entry(r, cache, lambda: self._new_bucket(cache, r))
        self._fill(entry, cache, blocks, begin)
        rows = cache.slots * r
        with kernels.running(self.kernel_table, rows), quant.forward_rows(self.model, rows, 1):
            logits = self._launch(entry, fresh, lambda e: self._run(e, cache))
        out = []
        for b, q in zip(blocks, sizes):
            got = logits[b.slot, q - 1:q] if b.last_only else logits[b.slot, :q]
            out.append(got.clone() if entry.graph is not None else got)   # the next replay writes over them
            cache.lengths[b.slot] = begin[b.slot] + q
        return out

    def _new_buffers(self, cache: SlotCache) -> None:
        """Nothing to zero: `SlotCache.reserve` makes its buffers zero-filled."""

    @staticmethod
    def _new_bucket(cache: SlotCache, r: int) -> _Bucket:
        s, dev = cache.slots, cache.device
        return _Bucket(tokens=torch.zeros(s, r, dtype=torch.long, device=dev),
                       positions=torch.zeros(s, r, dtype=torch.long, device=dev),
                       write=torch.zeros(s, r, dtype=torch.long, device=dev),
                       allowed=torch.zeros(s, r, cache.capacity, dtype=torch.bool, device=dev),
                       slot_of=torch.arange(s, device=dev)[:, None].expand(s, r).contiguous())

    @staticmethod
    def _fill(entry: _Bucket, cache: SlotCache, blocks: list[Block], begin: list[int]) -> None:
        """The round's blocks, padded, into the bucket's buffers in place, on their device (no host read:
        the blocks' tensors are copied where they are, the slots' lengths are the host's)."""
        r = entry.tokens.shape[1]
        for slot, start in enumerate(begin):                                     # row i of a slot: entry start + i
            torch.arange(start, start + r, out=entry.write[slot])
        entry.positions.copy_(entry.write)
        entry.tokens.zero_()
        entry.allowed.zero_()
        entry.allowed.scatter_(2, entry.write[:, :, None], True)                # every row sees its own entry
        for b in blocks:
            q, start, row = b.tokens.numel(), begin[b.slot], b.slot
            entry.tokens[row, :q] = b.tokens
            entry.positions[row, :q] = b.positions
            entry.positions[row, q:] = b.positions[-1:].to(entry.positions.device)
            entry.allowed[row, :q, :start].fill_(True)                               # the slot's held prefix
            entry.allowed[row, :q, start:start + q] = b.allowed

    def _run(self, e: _Bucket, cache: SlotCache) -> torch.Tensor:
        """The forward over the bucket's buffers: (S, R, V) logits."""
        lean = self.lean
        h = lean.embed(e.tokens)                                                   # (S, R, C)
        cos, sin = lean._rotary(h, e.positions)                                    # (S, R, 1, D)
        mask = torch.zeros(e.allowed.shape, dtype=h.dtype, device=h.device)
        mask = mask.masked_fill_(e.allowed.logical_not(), torch.finfo(h.dtype).min)[:, None]   # (S, 1, R, K)
        for i, m in enumerate(lean.layers):
            q, k, v = lean._attention_inputs(m, h, cos, sin)                     # (S, R, H or H_kv, D)
            keys, values = cache.layer_keys[i], cache.layer_values[i]             # (S, H_kv, capacity, D)
            keys[e.slot_of, :, e.write] = k
            values[e.slot_of, :, e.write] = v
            h = lean._mlp(m, lean._attended(m, h, q, keys, values, mask))
        return lean.lm_head(_rms_norm(h, lean.norm, lean.one_call))
