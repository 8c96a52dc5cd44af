"""The feature head's blocks in the fixed-shape round (`mcsd.decoding.fixed_round`): padded to buckets
over the head's static cache, captured as CUDA graphs.

As `mcsd.forward.graphs.StaticBlocks` does for the target, but over a drafter's `fixed_block` (the
head's layers at given slots of its static cache: mcsd's feature head on the engine's own forward, or
an EAGLE-3 head on its own layer code), with the head's inputs (features and tokens) and its outputs
(predicted features and scores) in the graph. Kept with the decoder's `FixedRound`, so a decoder
captures each bucket once (again only when the head's cache grows).
"""

from __future__ import annotations

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
    out: tuple | None = None        # (pred (B, H) predicted features, scores (B, K) over the head's vocabulary)


class HeadBlocks(graphs.Graphed):
    """The feature head's blocks over its static cache, padded to buckets, captured as CUDA graphs.

    As `mcsd.forward.graphs.StaticBlocks` does for the target: a block of Q rows runs padded to the
    smallest bucket B >= Q, its padding rows writing after the block and seeing only themselves, and
    attention spans the cache's whole capacity with the additive mask hiding the rest.

    Args:
        drafter: the feature drafter (its head runs on the engine's own forward).
        capture: capture CUDA graphs (needs CUDA); False runs the same shapes eagerly.

    Attributes: those of `mcsd.forward.graphs.Graphed` (built, captures, capture_s, failure); after a
    failure this generation goes on eagerly, and under round="auto" the decoder runs the loop from its
    next one (`FixedRound.failure`).
    """

    eager_note = "the feature head's generation finishes eagerly, the next ones run the loop"

    def __init__(self, drafter: FeatureDrafter, capture: bool):
        super().__init__(capture)
        self.drafter = drafter

    def _run(self, e: _Block):
        d = self.drafter
        pred = d.fixed_block(e.feats, d.embed(e.tokens), e.positions, e.mask, e.slots)  # (B, H)
        return pred, d._scores(pred)                                                    # (B, K)

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
        dev, dtype = cache.device, cache.dtype
        e, fresh = self._entry(b, cache, lambda: _Block(
            torch.zeros(b, feats.shape[-1], dtype=dtype, device=dev), torch.zeros(b, dtype=torch.long, device=dev),
            torch.zeros(1, b, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev),
            torch.zeros(1, 1, b, cache.capacity, dtype=dtype, device=dev)))
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
        pred, scores = self._launch(e, fresh, self._run)
        cache.length = start + q
        self.drafter.forwards += 1
        return pred[:q], scores[:q]
