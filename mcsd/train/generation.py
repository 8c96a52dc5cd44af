"""Batched sampling from the target, for training data.

A data job writes many independent responses, so it runs the target on a
batch of rows that step together: prompts of similar length are grouped
(left-padded, each row's first real token at position 0), every step feeds
one token a live row, and a row that reaches EOS leaves the batch at once.

Two things keep a step's cost in its matrix products:
- the KV cache is a buffer allocated for the batch's whole generation and
  written in place (`GrowingLayer`), where transformers' `DynamicCache`
  concatenates, i.e. copies the whole cache of every layer, at every step;
- the products run on oneDNN with weights prepacked once (`mcsd.forward.kernels`),
  where the calibration measured many-row blocks fastest, when the caller
  packs the model (`kernels.pack`) and runs this under `kernels.using("packed")`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from mcsd.forward.kv_cache import cache_keyword


class GrowingLayer(DynamicLayer):
    """A cache layer over a preallocated (B, H, capacity, D) buffer, written in place.

    `keys` / `values` are views of the filled part, so attention reads what a
    `DynamicLayer` would hold; the buffer doubles if a batch outgrows it.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self._keys = key_states.new_empty(B, H, self.capacity, D)
        self._values = value_states.new_empty(B, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.length = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.length, key_states.shape[-2]
        if n + t > self._keys.shape[-2]:
            grow = max(n + t, 2 * self._keys.shape[-2]) - self._keys.shape[-2]
            self._keys = torch.cat([self._keys, self._keys.new_empty(*self._keys.shape[:2], grow, self._keys.shape[-1])], -2)
            self._values = torch.cat(
                [self._values, self._values.new_empty(*self._values.shape[:2], grow, self._values.shape[-1])], -2)
        self._keys[:, :, n:n + t] = key_states
        self._values[:, :, n:n + t] = value_states
        self.length = n + t
        self.keys, self.values = self._keys[:, :, :self.length], self._values[:, :, :self.length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[:, :, :self.length], self._values[:, :, :self.length]


def growing_cache(n_layers: int, capacity: int) -> DynamicCache:
    """A `DynamicCache` whose layers write into preallocated buffers of `capacity` positions."""
    cache = DynamicCache()
    cache.layers = [GrowingLayer(capacity) for _ in range(n_layers)]
    return cache


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with everything outside the smallest set of mass >= top_p set to -inf.

    Args:
        logits: (b, V) float.
    Returns:
        (b, V), the same tensor when top_p >= 1.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)                 # (b, V)
    probs = sorted_logits.softmax(-1)
    # drop a token when the mass before it already reaches top_p (the first token always stays)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p                        # (b, V)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_nucleus(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                   generator: torch.Generator | None = None,
                   candidates: tuple[int, ...] = (256, 4096)) -> torch.Tensor:
    """One token a row from softmax(logits / temperature) restricted to its top-p nucleus.

    The same distribution as `multinomial(top_p_filter(logits / T, top_p).softmax(-1))`, at a
    fraction of its cost for a batch: a row's nucleus is looked for among its most likely
    tokens (`topk` of each size in `candidates` in turn, not a sort of the whole vocabulary),
    and a row whose candidates already hold `top_p` of the mass draws from them. Only the rows
    that no candidate size covers (very flat distributions) sort every token. On the target's
    user turns at temperature 1.0 and top-p 0.95, half the rows have a nucleus of at most 71
    tokens and 85% of at most 1,024: drawing for 64 such rows took 53-64 ms against 422-448 ms
    with the full sort (one thread, 2-core AVX2 EPYC), next to about 650 ms for the forward.

    Args:
        logits: (b, V) float.
        candidates: increasing sizes to try before sorting the whole row.
    Returns:
        (b,) long.
    """
    probs = (logits / temperature).float().softmax(-1)                         # (b, V)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    V = probs.shape[-1]
    token = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    rows = torch.arange(probs.shape[0], device=probs.device)                   # rows still to draw
    for k in [c for c in candidates if c < V] + [V]:
        p = probs if rows.numel() == probs.shape[0] else probs[rows]
        top, ids = p.topk(k, dim=-1) if k < V else p.sort(-1, descending=True)  # (r, k), descending
        before = top.cumsum(-1) - top                                          # mass ranked above each
        done = before[:, -1] + top[:, -1] >= top_p if k < V else torch.ones_like(rows, dtype=torch.bool)
        if bool(done.any()):
            sel = done.nonzero().squeeze(1)
            weights = top[sel].masked_fill(before[sel] >= top_p, 0.0)          # the first token always stays
            token[rows[sel]] = ids[sel].gather(-1, torch.multinomial(weights, 1, generator=generator)).squeeze(1)
        rows = rows[~done]
        if rows.numel() == 0:
            break
    return token


@torch.inference_mode()
def sample_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_ids: tuple[int, ...] = (2,),
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    topk: int = 0,
    store_hidden: bool = False,
) -> list[dict]:
    """Continue a batch of prompts with the target, left-padded, on a cache written in place.

    Rows that reach EOS leave the batch (and the cache) at once, so a batch
    costs what its live rows cost. temperature 0 is greedy.

    Args:
        prompts: B token lists.
        topk: also keep the target's untempered top-k at each response position (0: none).
        store_hidden: also keep the final normed hidden state at each response position.
    Returns:
        B dicts: response (R,) int32 including the EOS token when reached,
        finished (bool); with topk > 0 topk_ids (R, k) int32 and topk_probs
        (R, k) float16; with store_hidden hidden (R, H) float16.
    """
    device = next(model.parameters()).device
    if pad_id is None:                  # a tokenizer without a pad token: padding is masked out anyway
        pad_id = eos_ids[0] if eos_ids else 0
    B, P = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((B, P), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P), dtype=torch.long)
    for b, p in enumerate(prompts):
        input_ids[b, P - len(p):] = torch.tensor(p)
        attention_mask[b, P - len(p):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)                # (B, P)
    eos = torch.tensor(eos_ids, device=device)
    # the mask is preallocated too; each step reads a growing prefix of it
    full_mask = torch.ones((B, P + max_new_tokens), dtype=torch.long, device=device)
    full_mask[:, :P] = attention_mask
    cache = growing_cache(model.config.num_hidden_layers, P + max_new_tokens)
    cache_kw = cache_keyword(model.model)

    def forward(ids, positions, length):
        out = model.model(input_ids=ids, attention_mask=full_mask[:, :length], position_ids=positions,
                          use_cache=True, **{cache_kw: cache})
        hidden = out.last_hidden_state[:, -1]                                   # (b, H)
        return hidden, model.lm_head(hidden).float()                           # (b, H), (b, V)

    hidden, logits = forward(input_ids, position_ids, P)
    next_pos = position_ids[:, -1] + 1                                         # (B,)
    live = torch.arange(B, device=device)                                      # original row of each live row
    tokens, tops, hiddens = [], [], []                                         # per step: (b,) and friends
    rows_per_step = []
    for step in range(max_new_tokens):
        if temperature > 0:
            token = sample_nucleus(logits, temperature, top_p, generator)     # (b,)
        else:
            token = logits.argmax(-1)
        tokens.append(token)
        rows_per_step.append(live)
        if topk:
            p, i = logits.softmax(-1).topk(topk, dim=-1)
            tops.append((i.int(), p.half()))
        if store_hidden:
            hiddens.append(hidden.half())
        keep = (~torch.isin(token, eos)).nonzero().squeeze(1)                  # (b',)
        if keep.numel() == 0 or step == max_new_tokens - 1:
            break
        if keep.numel() < live.numel():
            cache.batch_select_indices(keep)
            full_mask = full_mask[keep]
            live, token, next_pos = live[keep], token[keep], next_pos[keep]
        hidden, logits = forward(token[:, None], next_pos[:, None], P + step + 1)
        next_pos = next_pos + 1

    # one host transfer for the whole batch, then split per row
    step_of = torch.cat([torch.full_like(r, s) for s, r in enumerate(rows_per_step)])
    row_of = torch.cat(rows_per_step)
    order = torch.argsort(row_of * (max_new_tokens + 1) + step_of)             # row-major, steps in order
    flat = torch.cat(tokens)[order].int().cpu()
    counts = torch.bincount(row_of, minlength=B).tolist()
    pieces = flat.split(counts)
    finished = [bool(torch.isin(piece[-1:], eos.cpu()).any()) for piece in pieces]
    extra = {}
    if topk:
        extra["topk_ids"] = torch.cat([t[0] for t in tops])[order].cpu().split(counts)
        extra["topk_probs"] = torch.cat([t[1] for t in tops])[order].cpu().split(counts)
    if store_hidden:
        extra["hidden"] = torch.cat(hiddens)[order].cpu().split(counts)
    return [{"response": pieces[b], "finished": finished[b], **{k: v[b] for k, v in extra.items()}}
            for b in range(B)]
