"""A causal LM together with its KV cache: run a block of tokens under a tree mask, commit a path.

Target and standalone draft use the same wrapper. A block is either a run of
ordinary tokens (causal among themselves) or a set of tree nodes (each sees
its ancestors); either way the model receives an explicit additive 4D mask and
explicit position ids as forward arguments. Nothing is set on the model.

Two forwards: for a Llama-family model on one device (`mcsd.forward.llama.supports`)
the engine's own (`mcsd.forward.llama.LeanForward`, over a `StaticCache`), which
makes only the tensor calls the computation needs; for every other model,
and where asked, transformers' forward over its DynamicCache. They give the
same logits (float32: within 1e-4; greedy output token-identical), so the
choice is one of speed. The attention backend chosen in `mcsd.forward.attention`
applies to transformers' path; the engine's own forward always attends with
torch SDPA over the cache with grouped key / value heads, except that a
model set to "eager" attention (the reference) stays on transformers' path.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time

import torch

from . import graphs, kernels, kv_cache, llama, quant
from .attention import additive_mask, causal_allowed

_chosen = threading.local()             # .lean: what CachedLMs that choose for themselves choose (None: auto)


@contextlib.contextmanager
def forward_path(lean: bool | None):
    """Inside the block (on this thread), every CachedLM made with `lean=None` runs, from its next
    `reset`, on the engine's own forward where it can (True, the same as None) or on transformers'
    forward (False); for tests that want transformers' path inside code that makes its own
    CachedLMs (TreeDecoder)."""
    before = getattr(_chosen, "lean", None)
    _chosen.lean = lean
    try:
        yield
    finally:
        _chosen.lean = before


class CachedLM:
    """One sequence's view of a Hugging Face causal LM.

    Args:
        model: the transformers model (eval mode).
        in_place: transformers' path keeps its cache's entries in buffers allocated ahead.
        lean: run on the engine's own forward (True; a ValueError where it cannot), on
            transformers' (False), or choose at every `reset` (None, the default): the engine's
            own where `mcsd.forward.llama.supports` the model, its weights sit on one device, its
            attention is not "eager" and no `forward_path(False)` block is active.
        static_blocks: on the engine's own forward, run every block padded to a bucket over the
            cache's whole capacity (`mcsd.forward.graphs`): True, False, or None (the default) for on
            where the model sits on CUDA.
        cuda_graphs: with static blocks on CUDA, capture each bucket's forward as a CUDA graph
            once and replay it (default); False runs the same shapes eagerly, for debugging.

    Attributes:
        model: the transformers model (eval mode).
        cache: the engine's own forward's `StaticCache`, or transformers' DynamicCache; holds
            `length` committed positions between rounds. With `in_place` (the default) a
            DynamicCache's layers write into buffers allocated ahead instead of concatenating
            (`mcsd.forward.kv_cache.InPlaceLayer`).
        kernels: which CPU matmul path each block size runs on (`mcsd.forward.kernels`;
            None leaves torch's setting alone).
        forward_ms: how long the last `forward` took, in ms, on a CPU; None elsewhere or before one.
        forward_context: the cache positions that forward read (its block's included), or None.
    """

    def __init__(self, model: torch.nn.Module, in_place: bool = True, lean: bool | None = None,
                 static_blocks: bool | None = None, cuda_graphs: bool = True):
        self.model = model
        self.in_place = in_place
        self.lean = lean
        self.static_blocks, self.cuda_graphs = static_blocks, cuda_graphs
        self.blocks: graphs.StaticBlocks | None = None  # the engine's own forward in bucketed shapes
        self.dtype = model.get_input_embeddings().weight.dtype
        self.device = model.get_input_embeddings().weight.device
        self.cache = None
        self.kernels: kernels.KernelTable | None = None
        self.forward_ms: float | None = None
        self.forward_context: int | None = None
        # transformers' causal LMs can project only the last rows onto the vocabulary
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kw = kv_cache.cache_keyword(model)
        self._own: llama.LeanForward | None = None      # the engine's own forward, once made
        self._running: llama.LeanForward | None = None  # ... when it runs the forwards since the last reset
        if lean:
            self._lean_reason()                         # raises where it cannot run

    def _lean_reason(self) -> str | None:
        """Why the engine's own forward would not run the model now (None: it would)."""
        if self.lean is False or (self.lean is None and getattr(_chosen, "lean", None) is False):
            return "transformers' forward was asked for"
        reason = llama.unsupported_reason(self.model)
        if reason is None and len({str(d) for d in (getattr(self.model, "hf_device_map", None) or {}).values()}) > 1:
            reason = "its weights are spread over several devices"
        head = kernels.weight_device(self.model.lm_head) if reason is None else None
        if head is not None and head != self.device:
            reason = "its LM head sits on another device than its embedding"
        if reason is None and getattr(self.model.config, "_attn_implementation", None) == "eager" \
                and self.lean is None:
            reason = "its attention is transformers' eager reference"
        if reason is not None and self.lean:
            raise ValueError(f"the engine's own forward cannot run this model: {reason}")
        return reason

    @property
    def path(self) -> str:
        """Which forward runs the blocks since the last reset: "lean" (the engine's own) or "transformers"."""
        return "lean" if self._running is not None else "transformers"

    def reset(self) -> None:
        if self._lean_reason() is None:
            self._running = self._own_forward()
            weight = self._own.embed.weight
            padded = self.static_blocks if self.static_blocks is not None else weight.device.type == "cuda"
            capture = padded and self.cuda_graphs and weight.device.type == "cuda"
            if not padded:
                self.blocks = None
            elif self.blocks is None or self.blocks.lean is not self._own or \
                    (self.blocks.capture != capture and self.blocks.failure is None):   # a failed capture stays off
                self.blocks = graphs.StaticBlocks(self._own, capture)
            self.cache = self._own.empty_cache(self.cache)
            return
        from transformers import DynamicCache
        self._running = None
        self.cache = kv_cache.in_place_cache(self.model.config) if self.in_place \
            else DynamicCache(config=self.model.config)

    def lean_forward(self) -> llama.LeanForward:
        """The engine's own forward of this model (made once; its modules looked up again), for a
        forward of several sequences at once (`mcsd.forward.slots`); a ValueError where it cannot run
        the model now (see `_lean_reason`)."""
        reason = self._lean_reason()
        if reason is not None:
            raise ValueError(f"the engine's own forward cannot run this model: {reason}")
        return self._own_forward()

    def _own_forward(self) -> llama.LeanForward:
        """The engine's own forward, made on first use, else its modules looked up again."""
        if self._own is None:
            self._own = llama.LeanForward(self.model)
        else:
            self._own.refresh()
        return self._own

    @property
    def length(self) -> int:
        return kv_cache.cache_length(self.cache)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                hidden: bool | tuple[int, ...] = False, last_logits: bool = False):
        """Append a block to the cache and return its logits; `forward_ms` keeps how long it took
        (on a CPU, where the result is ready on return; None elsewhere).

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
        t0 = time.perf_counter()
        out = self._forward(tokens, positions, allowed, hidden, last_logits)
        self.forward_ms = (time.perf_counter() - t0) * 1000 if self.device.type == "cpu" else None
        self.forward_context = self.length
        return out

    def _forward(self, tokens, positions, allowed, hidden, last_logits):
        prefix = self.length - (allowed.shape[1] - tokens.numel())
        mask = additive_mask(allowed.to(self.device), prefix, self.dtype)          # (1, 1, Q, prefix+K)
        if self._running is not None:
            return self._lean_forward(tokens, positions, mask, hidden, last_logits)
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

    def _lean_forward(self, tokens, positions, mask, hidden, last_logits):
        n, start = tokens.numel(), self.cache.length
        layers = () if not hidden else (-1,) if hidden is True else tuple(hidden)
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        with kernels.running(self.kernels, n), quant.forward_rows(self.model, n, start):
            if self.blocks is not None and graphs.bucket_of(n) is not None:   # bucketed (CUDA graphs there)
                logits, states = self.blocks(tokens, positions, mask, self.cache, start, layers, last_logits)
            else:                                       # its own shape (a long prompt, or no buckets)
                slots = self.cache.next_slots(n)
                logits, states = self._running(tokens[None], positions[None], mask, self.cache, slots, layers,
                                               last_logits)
                logits, states = logits[0], None if states is None else states[0]
        self.cache.length = start + n
        return logits if not hidden else (logits, states)

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

    def truncate(self, length: int) -> None:
        """Drop every cached position from `length` on."""
        kv_cache.truncate(self.cache, length)
