"""A causal LM together with its KV cache: run a block of tokens under a tree mask, commit a path.

Target and standalone draft use the same wrapper. A block is either a run of
ordinary tokens (causal among themselves) or a set of tree nodes (each sees
its ancestors); either way the model receives an explicit additive 4D mask and
explicit position ids as forward arguments. Nothing is set on the model.
"""

from __future__ import annotations

import inspect

import torch

from . import kernels, kv_cache
from .tree import additive_mask, causal_allowed


class CachedLM:
    """One sequence's view of a Hugging Face causal LM.

    Attributes:
        model: the transformers model (eval mode).
        cache: its DynamicCache; holds `length` committed positions between rounds. With
            `in_place` (the default) its layers write into buffers allocated ahead instead of
            concatenating (`mcsd.kv_cache.InPlaceLayer`).
        kernels: which CPU matmul path each block size runs on (`mcsd.kernels`;
            None leaves torch's setting alone).
    """

    def __init__(self, model: torch.nn.Module, in_place: bool = True):
        self.model = model
        self.in_place = in_place
        self.dtype = model.get_input_embeddings().weight.dtype
        self.device = model.get_input_embeddings().weight.device
        self.cache = None
        self.kernels: kernels.KernelTable | None = None
        # transformers' causal LMs can project only the last rows onto the vocabulary
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kw = kv_cache.cache_keyword(model)

    def reset(self) -> None:
        from transformers import DynamicCache
        self.cache = kv_cache.in_place_cache(self.model.config) if self.in_place \
            else DynamicCache(config=self.model.config)

    @property
    def length(self) -> int:
        return kv_cache.cache_length(self.cache)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                hidden: bool | tuple[int, ...] = False, last_logits: bool = False):
        """Append a block to the cache and return its logits.

        Args:
            tokens: (Q,) long.
            positions: (Q,) long absolute positions.
            allowed: (Q, K) bool visibility among the block's keys already in the
                cache *after the committed prefix* plus the block itself
                (K = entries after the prefix once this block is appended).
            hidden: also return hidden states: True for the last (final, normed) ones,
                or a tuple of indices into transformers' `hidden_states` (0 =
                embeddings, i = after decoder layer i, -1 = final), concatenated.
            last_logits: only the last row's logits are wanted (a prefill): models that
                support it skip the vocabulary projection of the other rows.
        Returns:
            logits (Q, V) float in the model dtype, or (1, V) with last_logits where the model
            supports it; with hidden also (Q, H) or (Q, len(hidden) * H).
        """
        prefix = self.length - (allowed.shape[1] - tokens.numel())
        mask = additive_mask(allowed.to(self.device), prefix, self.dtype)          # (1, 1, Q, prefix+K)
        keep = {"logits_to_keep": 1} if last_logits and self._keeps_logits else {}
        with kernels.running(self.kernels, tokens.numel()):
            out = self.model(input_ids=tokens.to(self.device)[None], position_ids=positions.to(self.device)[None],
                             attention_mask=mask, use_cache=True, output_hidden_states=bool(hidden),
                             **{self._cache_kw: self.cache}, **keep)
        logits = out.logits[0].to(self.device)          # a device_map may end on another GPU
        if not hidden:
            return logits
        layers = (-1,) if hidden is True else hidden
        states = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1) if len(layers) > 1 \
            else out.hidden_states[layers[0]][0]
        return logits, states.to(self.device)

    def extend(self, tokens: torch.Tensor, hidden: bool | tuple[int, ...] = False, last_logits: bool = False):
        """Feed ordinary tokens (causal) after everything in the cache; returns their logits (Q, V)
        (or (1, V), the last row's, with last_logits; see `forward`)."""
        start = self.length
        n = tokens.numel()
        pos = torch.arange(start, start + n, device=self.device)
        return self.forward(tokens, pos, causal_allowed(n, self.device), hidden=hidden, last_logits=last_logits)

    @torch.inference_mode()
    def commit(self, prefix_len: int, keep: torch.Tensor) -> None:
        """Keep `prefix_len` positions plus the block entries at offsets `keep` (ascending)."""
        kv_cache.commit(self.cache, prefix_len, keep)
