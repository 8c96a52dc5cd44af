"""The feature head's blocks in the fixed-shape round (`mcsd.decoding.fixed_round`): padded to buckets
over the head's static cache, captured as CUDA graphs.

As `mcsd.forward.graphs.StaticBlocks` does for the target, but over a drafter's `fixed_block` (the
head's layers at given slots of its static cache: mcsd's feature head on the engine's own forward, or
an EAGLE-3 head on its own layer code), with the head's inputs (features and tokens) and its outputs
(predicted features and scores) in the graph. Kept with the decoder's `FixedRound`, so a decoder
captures each bucket once (again only when the head's cache grows).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from ..drafting.feature_draft import FeatureDrafter
from ..forward import graphs
from ..forward.attention import additive_mask, causal_allowed


@dataclass
class _Block:
    """One bucket's persistent inputs for the head, its graph (or None: eager) and that graph's outputs."""

    feats: torch.Tensor             # (B, H) features the rows read
    tokens: torch.Tensor            # (B,) long
    positions: torch.Tensor         # (1, B) long
    slots: torch.Tensor             # (B,) long
    mask: torch.Tensor              # (1, 1, B, capacity) additive
    graph: "torch.cuda.CUDAGraph | None" = None
    pred: torch.Tensor | None = None     # (B, H) predicted features
    scores: torch.Tensor | None = None   # (B, K) scores over the head's (sub-)vocabulary


class HeadBlocks:
    """The feature head's blocks over its static cache, padded to buckets, captured as CUDA graphs.

    As `mcsd.forward.graphs.StaticBlocks` does for the target: a block of Q rows runs padded to the
    smallest bucket B >= Q, its padding rows writing after the block and seeing only themselves, and
    attention spans the cache's whole capacity with the additive mask hiding the rest.

    Args:
        drafter: the feature drafter (its head runs on the engine's own forward).
        capture: capture CUDA graphs (needs CUDA); False runs the same shapes eagerly.

    Attributes:
        built: bucket buffers made so far (each a graph on CUDA, captured once); captures,
            capture_s: graphs captured and the seconds it took; failure: why graphs were given up.
    """

    def __init__(self, drafter: FeatureDrafter, capture: bool):
        self.drafter, self.capture = drafter, capture
        self._entries: dict[int, _Block] = {}
        self._buffers = None
        self.built, self.captures, self.capture_s, self.failure = 0, 0, 0.0, None

    def _run(self, e: _Block):
        d = self.drafter
        pred = d.fixed_block(e.feats, d.embed(e.tokens), e.positions, e.mask, e.slots)  # (B, H)
        return pred, d._scores(pred)                                                    # (B, K)

    def _give_up(self, what: str, exc: Exception) -> None:
        """No more graphs for the head (one line says so): this generation goes on eagerly, and under
        round="auto" the decoder runs the loop from its next one (`FixedRound.failure`)."""
        self.capture, self.failure = False, f"{what}: {type(exc).__name__}: {exc}"
        for entry in self._entries.values():
            entry.graph = None
        warnings.warn(f"mcsd: a CUDA graph of the feature head failed ({self.failure}); this generation "
                      f"finishes eagerly, the next ones run the loop", RuntimeWarning, stacklevel=3)

    def __call__(self, feats: torch.Tensor, tokens: torch.Tensor, first_position: int, start: int,
                 rows_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One block of Q rows written at cache slots start .. start+Q-1.

        Args:
            feats: (Q, H) the features the rows read; tokens: (Q,) long the tokens that followed.
            first_position: the first row's position; the rows' are consecutive, or all
                `first_position` with `rows_mask` (one tree level).
            start: the block's first slot (the cache then holds start + Q entries).
            rows_mask: (Q, start + Q) additive mask over the slots the rows may see, or None: every
                entry before the block, and the block's rows causally.
        Returns:
            (pred (Q, H), scores (Q, K)): views of the bucket's outputs, valid until its next call.
        """
        q = tokens.numel()
        b = graphs.bucket_of(q)
        cache = self.drafter.cache
        cache.length = start                        # what a reallocation must keep
        cache.reserve(start + b)
        if self._buffers is not cache.keys:                 # new buffers: every graph captured again
            self._entries.clear()
            self._buffers = cache.keys
            cache.keys[:, :, :, cache.length:].zero_()
            cache.values[:, :, :, cache.length:].zero_()
        e = self._entries.get(b)
        fresh = e is None
        if fresh:
            dev, dtype = cache.device, cache.dtype
            self.built += 1
            e = self._entries[b] = _Block(torch.zeros(b, feats.shape[-1], dtype=dtype, device=dev),
                                          torch.zeros(b, dtype=torch.long, device=dev),
                                          torch.zeros(1, b, dtype=torch.long, device=dev),
                                          torch.zeros(b, dtype=torch.long, device=dev),
                                          torch.zeros(1, 1, b, cache.capacity, dtype=dtype, device=dev))
        # the block into the bucket's buffers, in place
        e.feats.zero_()
        e.feats[:q] = feats
        e.tokens.zero_()
        e.tokens[:q] = tokens
        if rows_mask is None:
            torch.arange(first_position, first_position + b, out=e.positions[0])
            e.positions[0, q:].fill_(first_position + q - 1)
        else:
            e.positions.fill_(first_position)
        torch.arange(start, start + b, out=e.slots)
        low = torch.finfo(e.mask.dtype).min
        e.mask.fill_(low)
        if rows_mask is None:
            e.mask[0, 0, :q, :start + q] = additive_mask(causal_allowed(q, cache.device), start, cache.dtype)[0, 0]
        else:
            e.mask[0, 0, :q, :start + q] = rows_mask
        e.mask[0, 0].diagonal(start)[q:].fill_(0)          # a padding row sees itself alone
        if fresh and self.capture:
            try:
                t0 = time.perf_counter()
                e.graph, (e.pred, e.scores) = graphs.capture_graph(lambda: self._run(e))
                self.captures += 1
                self.capture_s += time.perf_counter() - t0
            except Exception as exc:                         # runs eagerly instead
                self._give_up("capture", exc)
        if e.graph is not None:
            try:
                e.graph.replay()
            except Exception as exc:                         # this block again, eagerly
                self._give_up("replay", exc)
        if e.graph is None:
            e.pred, e.scores = self._run(e)
        cache.length = start + q
        self.drafter.forwards += 1
        return e.pred[:q], e.scores[:q]
