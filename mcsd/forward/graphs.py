"""Blocks of the engine's own forward in fixed shapes, captured once as CUDA graphs and replayed.

On a GPU a small model's forward is bound by the host: transformers' forward of
a SmolLM2-135M-shaped model took 31-32 ms for 1 to 64 rows on an H100, the same
forward replayed as a captured CUDA graph 3.2-3.9 ms (docs/results.md). A graph
replays fixed shapes at fixed addresses, so here:

- a block of Q rows runs padded to the smallest bucket B >= Q (`BUCKETS`);
  the padding rows (token 0, the block's last position) write their keys and
  values at the slots after the block, which the commit never keeps, and see
  only themselves, so every row stays finite and no real row sees them;
- attention always spans the cache's whole capacity, the additive mask hiding
  what lies past the block: the key length is fixed, the prefix length is in
  the mask (the "dynamically sliced" mask, sliced by values, not by shape);
  slots never written are zeroed when the buffers are made (a masked slot
  still enters the product with weight 0, and 0 times a NaN is a NaN);
- the inputs (tokens, positions, write slots, mask) are persistent buffers per
  bucket, filled in place before each replay; the outputs are copied out of the
  graph's own buffers (the next replay of that bucket writes over them, and a
  caller may still hold an earlier block's logits).

A graph is captured per (bucket, hidden-state selection) on first use and kept
while the cache keeps its buffers; when `StaticCache.reserve` grows them, every
graph is captured again (once). Blocks past the largest bucket (long prompts)
are the caller's to run at their own shape (`mcsd.forward.lm.CachedLM` does).

Without capture (the CPU, `--cuda-graphs off`), `StaticBlocks` runs the same
padded shapes eagerly: that is how the CPU tests check that padding and the
full-width mask leave the tokens unchanged.

Limitations: batch 1; the engine's own forward only (`mcsd.forward.llama`); capture
needs CUDA and a model whose forward makes no host synchronisation (the Llama
family's does not).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from .llama import LeanForward
from .static_cache import StaticCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64)     # block rows a forward is padded to


def bucket_of(rows: int) -> int | None:
    """The smallest bucket holding `rows`, or None past the largest (run at its own shape)."""
    return next((b for b in BUCKETS if b >= rows), None)


def capture_graph(run):
    """Warm `run` (a function of no arguments over persistent buffers) up twice on a side stream, then
    capture it as a CUDA graph; returns (the graph, what the captured call returned: its own buffers,
    which each replay writes over)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    torch.cuda.synchronize()
    return graph, out


class Graphed:
    """Buckets of persistent buffers, each run as a CUDA graph captured on its first use and replayed
    after, or eagerly: what `StaticBlocks`, the batched `mcsd.forward.slots.SlotBlocks` and the feature
    head's `mcsd.decoding.fixed_head.HeadBlocks` share.

    An entry is any object with a `graph` attribute (None: eager) and an `out` attribute (what the last
    run returned: the graph's own buffers once captured); a subclass fills the entry's inputs in place
    and calls `_launch`. Every entry is dropped when the cache's buffers change (`_entry`), so its
    graphs are captured again, once.

    Args:
        capture: capture and replay CUDA graphs (needs CUDA); False runs the same shapes eagerly.

    Attributes:
        built: entries made so far (one graph each where captured); captures: graphs captured so far;
            capture_s: seconds spent capturing them (warm-up included); failure: why capturing was
            given up (a warning said so once; the same shapes then run eagerly), or None.
    """

    eager_note = "running the same shapes eagerly"     # what the give-up warning says follows

    def __init__(self, capture: bool):
        self.capture = capture
        self._entries: dict = {}
        self._buffers: torch.Tensor | None = None     # the cache buffer the entries were made for
        self.built, self.captures, self.capture_s = 0, 0, 0.0
        self.failure: str | None = None

    def _entry(self, key, cache, make) -> tuple[object, bool]:
        """(the entry for `key`, made by `make()` on first use; whether it is new). Entries made over
        other buffers than `cache`'s are dropped first, and `_new_buffers` runs."""
        if self._buffers is not cache.keys:
            self._entries.clear()
            self._buffers = cache.keys
            self._new_buffers(cache)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = make()
            self.built += 1
            return entry, True
        return entry, False

    def _new_buffers(self, cache) -> None:
        """The cache's buffers are new: attention reads every entry with weight 0 past a block, and
        0 * nan is nan, so the entries never written must hold finite values (later, stale ones do)."""
        cache.zero_unwritten()

    def _launch(self, entry, fresh: bool, run):
        """`run(entry)` as the entry's graph (captured when `fresh`), or eagerly; returns `entry.out`."""
        if fresh and self.capture:
            try:
                t0 = time.perf_counter()
                entry.graph, entry.out = capture_graph(lambda: run(entry))
                self.captures += 1
                self.capture_s += time.perf_counter() - t0
            except Exception as exc:             # a forward that cannot be captured still runs, eagerly
                self._give_up("capture", exc)
        if entry.graph is not None:
            try:
                entry.graph.replay()
            except Exception as exc:             # this block again, eagerly
                self._give_up("replay", exc)
        if entry.graph is None:
            entry.out = run(entry)
        return entry.out

    def _give_up(self, what: str, exc: Exception) -> None:
        """No more graphs here (one warning says why); the same shapes run eagerly."""
        self.capture, self.failure = False, f"{what}: {type(exc).__name__}: {exc}"
        for entry in self._entries.values():
            entry.graph = None
        warnings.warn(f"mcsd: CUDA graph {what} failed ({self.failure}); {self.eager_note}",
                      RuntimeWarning, stacklevel=4)


@dataclass
class _Entry:
    """One bucket's persistent inputs, its graph (or None: eager) and what it returned (logits, states)."""

    tokens: torch.Tensor             # (1, B) long
    positions: torch.Tensor          # (1, B) long
    slots: torch.Tensor              # (B,) long
    mask: torch.Tensor               # (1, 1, B, capacity) additive, model dtype
    graph: "torch.cuda.CUDAGraph | None" = None
    out: tuple | None = None


class StaticBlocks(Graphed):
    """Run `LeanForward` blocks padded to buckets over the whole cache, captured as CUDA graphs.

    Args:
        lean: the engine's own forward of the model.
        capture: capture and replay CUDA graphs (needs the model on CUDA); False runs the padded
            shapes eagerly.

    Attributes: those of `Graphed` (built, captures, capture_s, failure).
    """

    def __init__(self, lean: LeanForward, capture: bool):
        super().__init__(capture)
        self.lean = lean

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: StaticCache,
                 start: int, hidden: tuple[int, ...] = (), last_logits: bool = False):
        """One block of at most `BUCKETS[-1]` rows after `start` cache entries.

        Args:
            tokens, positions: (Q,) long.
            mask: (1, 1, Q, start + Q) additive mask over the entries before and in the block.
            cache: the sequence's cache (room is reserved here).
            start: entries held before the block; the block's rows go to start .. start+Q-1.
            hidden: hidden-state indices to return (see `LeanForward`).
            last_logits: only the last row's logits are wanted.
        Returns:
            (logits (Q, V), or (1, V) with last_logits; states (Q, len(hidden) * H) or None).
        """
        q = tokens.numel()
        b = bucket_of(q)
        if b is None:
            raise ValueError(f"a block of {q} rows is past the largest bucket ({BUCKETS[-1]}); run it unpadded")
        cache.reserve(start + b)
        entry, fresh = self._entry((b, tuple(hidden)), cache, lambda: self._new_entry(b, cache))
        self._fill(entry, tokens, positions, mask, start)
        all_logits, all_states = self._launch(
            entry, fresh, lambda e: self.lean(e.tokens, e.positions, e.mask, cache, e.slots, hidden))
        logits = all_logits[0, q - 1:q] if last_logits else all_logits[0, :q]
        states = None if all_states is None else all_states[0, :q]
        if entry.graph is not None:             # the graph's buffers: the next replay writes over them
            logits, states = logits.clone(), None if states is None else states.clone()
        return logits, states

    def _new_entry(self, b: int, cache: StaticCache) -> _Entry:
        dev = cache.device
        return _Entry(tokens=torch.zeros(1, b, dtype=torch.long, device=dev),
                      positions=torch.zeros(1, b, dtype=torch.long, device=dev),
                      slots=torch.zeros(b, dtype=torch.long, device=dev),
                      mask=torch.zeros(1, 1, b, cache.capacity, dtype=cache.dtype, device=dev))

    @staticmethod
    def _fill(entry: _Entry, tokens, positions, mask, start: int) -> None:
        """The block into the entry's buffers, in place (the addresses a graph reads stay)."""
        q, b = tokens.numel(), entry.tokens.shape[1]
        entry.tokens.zero_()
        entry.tokens[0, :q] = tokens
        entry.positions[0, :q] = positions
        entry.positions[0, q:] = positions[-1]
        torch.arange(start, start + b, out=entry.slots)
        entry.mask.fill_(torch.finfo(entry.mask.dtype).min)
        entry.mask[0, 0, :q, :start + q] = mask[0, 0]
        # a padding row sees itself alone (a fill: `mask[rows, slots] = 0` uploads the 0 and syncs on CUDA)
        entry.mask[0, 0].diagonal(start)[q:b].fill_(0)
