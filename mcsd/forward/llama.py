"""The engine's own forward for the Llama family, over a static KV cache.

Llama, Mistral, Qwen2 and Qwen3 checkpoints (SmolLM is a Llama) share one
layout: embedding, then per layer an RMS norm, q / k / v projections (Qwen2:
with biases; Qwen3: each head's q and k RMS-normed), rotary positions,
attention, an output projection and a residual, another RMS norm and a gated
MLP and a residual; a final norm and the LM head. `LeanForward` runs exactly
that on the transformers model's own modules and parameters: nothing is
copied, converted or re-laid out, and the transformers model stays the
reference it is tested against (float32 logits within 1e-4, greedy output
token-identical to `generate`).

Why: transformers' module code (decorators, mask and cache plumbing, output
records) is about a quarter of a decode step on a CPU. This forward makes
only the tensor calls the computation needs: a SmolLM2-135M step over a
300-token cache, measured in docs/design.md ("The engine's own forward").

What it keeps:
- every linear layer is called as the module it is (`layer.q_proj(x)`, not
  `F.linear` on its weight), so the paths that replace a layer's forward
  still run: prepacked oneDNN weights (`mcsd.forward.kernels`), sibling q / k / v
  products joined (`mcsd.forward.fused`), int4 weights (`mcsd.forward.quant`);
- the rotary tables come from the model's own `rotary_emb` module (default,
  linear, llama3 and yarn scaling alike), so they are transformers' numbers;
- RMS norms read each norm module's weight and epsilon when they run; in
  float32 `F.rms_norm` rounds as transformers' formula does (checked in the
  tests), in reduced precision the normalised value is rounded to the model
  dtype before the weight multiplies it, as transformers does.
- a float32 model whose layers all run on the native q4 kernel's codes runs
  every decoder layer in one call into that library (`native.layers`, see
  `LeanForward.native_layers`), which computes the same operations from the
  same weights; any other model runs them one at a time as above.

Shapes for the GPU work to come: the cache is a `StaticCache` (buffers
allocated once), positions, the additive mask and the slots a block is
written at are arguments, and nothing in the forward reads a tensor's value
on the host (no `.item()`), so a step can be captured as a CUDA graph once
the caller pads the mask to a fixed width.

Limitations: attention is torch's `scaled_dot_product_attention` with the
key / value heads grouped (`enable_gqa`) whatever attention implementation
the transformers model is set to (`mcsd.forward.lm.CachedLM` keeps transformers'
path for "eager"); one sequence (several: `mcsd.forward.slots`); a model whose sliding window can
be reached, a rope type that depends on the sequence's length (dynamic,
longrope), or any other architecture is not `supports`ed and runs on
transformers' forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import native, quant
from .static_cache import StaticCache

FAMILY = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")        # tables that depend on positions alone


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "?"


def _parts(model) -> tuple:
    """(decoder body, LM head) of a causal LM; (model, None) for a bare decoder body (a `LlamaModel`,
    as a feature head holds one)."""
    if hasattr(model, "layers") and not hasattr(model, "lm_head"):
        return model, None
    return getattr(model, "model", None), getattr(model, "lm_head", None)


def unsupported_reason(model) -> str | None:
    """None if `LeanForward` runs `model` (a causal LM, or a bare decoder body) exactly as transformers
    does, else why not, in words."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILY:
        return f"architecture {kind!r} is not one of {', '.join(FAMILY)}"
    body, head = _parts(model)
    if body is None or (head is None and body is not model) or \
            (head is not None and not isinstance(head, torch.nn.Linear)) or not all(
            hasattr(body, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} is not a causal LM with the family's modules"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "some layers use sliding-window attention"
    window = getattr(config, "sliding_window", None)
    if kind == "mistral" and window is not None and window < config.max_position_embeddings:
        return f"its sliding window ({window}) is shorter than its context ({config.max_position_embeddings})"
    if _rope_type(config) not in ROPE_TYPES:
        return f"rope type {_rope_type(config)!r} depends on the sequence length"
    for layer in body.layers:
        attn = getattr(layer, "self_attn", None)
        mlp = getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(
                isinstance(getattr(attn, n, None), torch.nn.Module) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) \
                or not all(isinstance(getattr(mlp, n, None), torch.nn.Module)
                           for n in ("gate_proj", "up_proj", "down_proj")):
            return "a decoder layer does not have the family's attention and MLP modules"
        if (getattr(attn, "q_norm", None) is None) != (kind != "qwen3"):
            return "q / k norms where the family has none (or none where it has them)"
    return None


def supports(model) -> bool:
    """`model` is a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3, SmolLM) that `LeanForward`
    runs exactly as transformers does (see `unsupported_reason`)."""
    return unsupported_reason(model) is None


def _put(kept: dict, i: int, h: torch.Tensor) -> None:
    """kept[i] = h, or h copied into the tensor kept[i] already is (a column block of a joined buffer)."""
    target = kept.get(i)
    if target is None:
        kept[i] = h
    elif target is not h:
        target.copy_(h)


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module, one_call: bool = False) -> torch.Tensor:
    """transformers' Llama RMS norm, with the norm module's own weight and epsilon; `one_call`: in
    float32 through the native library's norm (`mcsd.forward.native`: one call, not seven operations)."""
    w = norm.weight
    if x.dtype == torch.float32:
        if one_call and w.dtype == torch.float32 and not x.requires_grad and x.shape[-1] % 8 == 0:
            return native.rms_norm(x.contiguous(), w, norm.variance_epsilon)
        return F.rms_norm(x, w.shape, w, norm.variance_epsilon)
    return w * F.rms_norm(x.float(), w.shape, None, norm.variance_epsilon).to(x.dtype)


class _Layer(NamedTuple):
    """One decoder layer's modules, looked up once per sequence (not at every forward)."""

    norm: torch.nn.Module
    q: torch.nn.Module
    k: torch.nn.Module
    v: torch.nn.Module
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    o: torch.nn.Module
    post_norm: torch.nn.Module
    gate: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module
    act: torch.nn.Module
    scaling: float


class LeanForward:
    """A Llama-family transformers causal LM run by the engine's own forward.

    Holds the model and, per decoder layer, references to its modules (looked
    up again by `refresh`, which `CachedLM.reset` calls before each sequence, so
    a module replaced in between is the one that runs); the modules' weights
    are read when they run, so a weight swapped or a layer repacked is what
    runs. Its only tensors of its own are a sign vector and a table of the rotary embedding
    (`_rotary`).

    Args:
        model: a transformers causal LM that `supports` accepts, on one device, in eval mode; or its
            bare decoder body (`states` runs it on input embeddings: a feature head's body).
    """

    def __init__(self, model: torch.nn.Module):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the engine's own forward cannot run this model: {reason}")
        self.model = model
        cfg = model.config
        self.kv_heads = cfg.num_key_value_heads
        self.heads = cfg.num_attention_heads
        self.grouped = {"enable_gqa": True} if self.heads != self.kv_heads else {}
        self._sign: torch.Tensor | None = None           # (D,) -1 on the first half, +1 on the second
        self._table: tuple | None = None                 # `_rotary_table`'s (cos, signed sin, key)
        self._plan_for: tuple | None = None              # what the plan was made from (`_looked_up`)
        self.refresh()

    def refresh(self) -> None:
        """Look the model's modules up again."""
        body, self.lm_head = _parts(self.model)
        self.body = body
        self.layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj,
                                      getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), attn.o_proj,
                                      layer.post_attention_layernorm, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
                                      mlp.act_fn, attn.scaling))
        self.head_dim = body.layers[0].self_attn.head_dim
        self.embed, self.norm, self.rotary = body.embed_tokens, body.norm, body.rotary_emb
        # a model on the native q4 kernel has its library loaded before any forward: its norms and, in
        # float32, its attention use it too (one call each, not several operations)
        self.one_call = bool(quant.attached(self.model)) and quant.kernel_name() == "native" \
            and self.head_dim % 8 == 0
        looked_up = self._looked_up() if self.one_call else ()       # without one call there is no plan
        if looked_up != self._plan_for:
            # the plan (30 layers of SmolLM2-135M: ~1.3 ms on a 2-core Xeon, once a sequence before) is
            # kept while every module, norm weight, bias and setting it reads is the one it was made from
            self._plan_for = looked_up
            self._plan_at = None                # quant.changes() when `_plan` was made (None: not made)
            self._plan: list[tuple] | None = None
            self._plan_array = None

    def _looked_up(self) -> tuple:
        """What `_make_plan` reads besides the q4 codes (`quant.changes` moves with those): each layer's
        modules, their weights as objects (the plan points into the norms'), their biases' bytes (the
        plan copies them; an edit through `.data` moves no version counter) and their settings. Some 400
        lookups, and a hash of each bias where a family has them."""
        def bias(b):
            if b is None:
                return None
            return id(b), hash(b.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())

        def part(m):
            if not isinstance(m, torch.nn.Module):
                return m
            params = m._parameters
            return id(m), id(params.get("weight")), bias(params.get("bias")), m.__dict__.get("variance_epsilon")
        return self.head_dim, self.heads, self.kv_heads, tuple(tuple(part(m) for m in layer) for layer in self.layers)

    def native_layers(self) -> list[tuple] | None:
        """Per decoder layer, its weights as the native library's whole-layer call reads them
        (`native.layer_weights`, with the tensors it points into), where every layer runs in float32
        on native Q4_1 products (q / k / v and gate / up joined, SiLU; on 8-bit activations where the
        weights are q4q8): a layer is then one call, not
        some twenty operations and module calls. None otherwise (each operation runs on its own).
        Made again after any q4 weights are attached or detached."""
        if not self.one_call:
            return None
        if self._plan_at != quant.changes():
            self._plan, self._plan_at = self._make_plan(), quant.changes()
            self._plan_array = None             # the plan's weights as one array, made on first use
        return self._plan

    def plan_array(self):
        """`native_layers`' weights as one array (`native.layer_array`), for the whole-forward calls;
        made once per plan. Call only where `native_layers()` is not None."""
        plan = self.native_layers()
        if self._plan_array is None:
            self._plan_array = native.layer_array([weights for weights, *_ in plan])
        return self._plan_array

    def _make_plan(self) -> list[tuple] | None:
        if self.embed.weight.dtype != torch.float32 or self.head_dim % 2:
            return None
        plan = []
        for m in self.layers:
            products, act8 = {}, set()
            for name, group in (("qkv", (m.q, m.k, m.v)), ("o", (m.o,)), ("gate_up", (m.gate, m.up)),
                                ("down", (m.down,))):
                parts = [quant.native_rows(layer) for layer in group]
                if any(part is None for part in parts):
                    return None
                whole = parts[0][0]
                # one weight holding the siblings' rows in order, and nothing else
                if any(p[0] is not whole for p in parts) or [p[1] for p in parts] != [0] + [p[2] for p in parts[:-1]] \
                        or parts[-1][2] != whole.out_features:
                    return None
                biases = [layer.bias for layer in group]
                if any(b is None for b in biases) and any(b is not None for b in biases):
                    return None
                bias = None if biases[0] is None else torch.cat([b.detach() for b in biases]).float().contiguous()
                q8 = isinstance(whole, quant.Q8Linear)                 # Q8_0 codes (a drafter's own)
                products[name] = (whole.codes, whole.d, None if q8 else whole.m, bias, whole.out_features,
                                  whole.in_features, whole.w128 if q8 else None)
                act8.add(whole.act8)
            norms = [m.norm, m.post_norm] + ([m.q_norm, m.k_norm] if m.q_norm is not None else [])
            if type(m.act).__name__ not in ("SiLU", "SiLUActivation") or \
                    any(n.weight.dtype != torch.float32 for n in norms) or len(act8) != 1:
                return None
            qk_eps = m.q_norm.variance_epsilon if m.q_norm is not None else 0.0
            try:
                weights = native.layer_weights(m.norm.weight, m.post_norm.weight,
                                               None if m.q_norm is None else m.q_norm.weight,
                                               None if m.k_norm is None else m.k_norm.weight,
                                               m.norm.variance_epsilon, m.post_norm.variance_epsilon, qk_eps,
                                               m.scaling, products, self.heads, self.kv_heads, self.head_dim,
                                               act8=act8.pop())
            except ValueError:                  # a weight the library cannot read as it is (not contiguous)
                return None
            # the tensors it points into stay alive with it, even if the model's are replaced meanwhile
            plan.append((weights, products, [n.weight for n in norms]))
        return plan

    def new_cache(self) -> StaticCache:
        weight = self.embed.weight
        return StaticCache(len(self.layers), self.kv_heads, self.head_dim, weight.dtype, weight.device)

    def empty_cache(self, cache) -> StaticCache:
        """A cache for a new sequence: `cache` emptied, its buffers kept, where it is a static cache in
        this model's dtype and on its device; else a new one."""
        weight = self.embed.weight
        if not isinstance(cache, StaticCache) or (cache.dtype, cache.device) != (weight.dtype, weight.device):
            cache = self.new_cache()
        cache.reset()
        return cache

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (B, Q, 1, D) for (B, Q) positions: transformers' rotation of a (B, Q, H, D)
        tensor t is t * cos + roll(t, D/2) * sin_signed (rotate_half's negation moved onto sin: exact).
        On a CPU the rows are looked up in a table the module itself made (`_rotary_table`; every rope
        type run here, `ROPE_TYPES`, computes each position on its own, so the same bits; the module's
        call took ~0.1 ms a forward in decoding); elsewhere the module runs on the positions."""
        table = self._rotary_table(x)
        if table is not None:
            flat = positions.reshape(-1)
            shape = (*positions.shape, 1, self.head_dim)
            return table[0].index_select(0, flat).view(shape), table[1].index_select(0, flat).view(shape)
        cos, sin = self.rotary(x, positions)                                   # (B, Q, D) each
        return cos[:, :, None], (sin * self._signs(sin))[:, :, None]

    def _signs(self, like: torch.Tensor) -> torch.Tensor:
        """(D,) -1 on the first half, +1 on the second, in `like`'s dtype and on its device."""
        if self._sign is None or self._sign.dtype != like.dtype or self._sign.device != like.device:
            half = self.head_dim // 2
            self._sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)]).to(like.device, like.dtype)
        return self._sign

    def _rotary_table(self, x: torch.Tensor):
        """(cos, signed sin) (L, D) each for positions 0..L-1, L twice the model's context window (the
        engine refuses prompts and lengths past the window; a position past L is an index error, never
        a wrong number), made again when the dtype or the module's frequencies change: their version
        counter, or, for a tensor made under `torch.inference_mode` (which keeps none), their values
        (a few dozen floats). None off the CPU, where the table would exceed 2^20 entries, or without
        the usual `inv_freq` buffer."""
        inv = getattr(self.rotary, "inv_freq", None)
        window = getattr(self.model.config, "max_position_embeddings", None)
        if x.device.type != "cpu" or not isinstance(inv, torch.Tensor) or not window:
            return None
        length = 1 << (2 * int(window) - 1).bit_length()
        if length * self.head_dim > 1 << 20:
            return None
        edits = tuple(inv.tolist()) if inv.is_inference() else inv._version
        key = (length, x.dtype, inv.data_ptr(), edits, getattr(self.rotary, "attention_scaling", 1.0))
        if self._table is None or self._table[2] != key:
            cos, sin = self.rotary(x[..., :1], torch.arange(length, device=x.device)[None])  # (1, L, D)
            self._table = (cos[0].contiguous(), (sin[0] * self._signs(sin)).contiguous(), key)
        return self._table

    def _in_one_call(self, plan, h, cos, sin, rows, cache, slots, wanted: set, kept: dict) -> torch.Tensor:
        """Every decoder layer in one native call (see `native_layers`, `native.layers`); the states
        after the layers in `wanted` (below the last) go into `kept`; returns h after the last."""
        cos_rows, sin_rows = cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous()   # (Q, D)
        slots = slots.to(torch.long).contiguous()
        keep = tuple(sorted(i for i in wanted if 0 < i < len(plan))) if wanted else ()
        ready = [kept.get(i) for i in keep]                # column blocks of the caller's joined buffer
        into = ready if ready and all(t is not None for t in ready) else None
        out = torch.empty_like(h)
        kept.update(zip(keep, native.layers(self.plan_array(), h, out, cos_rows, sin_rows, cache.keys, cache.values,
                                            slots, rows.shape[-1], rows, keep, into)))
        return out

    def _by_op(self, h, cos, sin, mask, rows, cache, slots):
        """Each decoder layer operation by operation on the model's own modules; yields h after each."""
        k_len = mask.shape[-1]
        for i, m in enumerate(self.layers):
            q, k, v = self._attention_inputs(m, h, cos, sin)
            keys, values = cache.layer_keys[i], cache.layer_values[i]          # (1, H_kv, capacity, D)
            keys.index_copy_(2, slots, k.transpose(1, 2))
            values.index_copy_(2, slots, v.transpose(1, 2))
            if self.one_call and q.dtype == torch.float32:                     # one call, rows on their own
                out = native.attention(q[0], keys[0], values[0], k_len, rows, m.scaling)   # (Q, H, D)
                h = h + m.o(out.view(*h.shape[:2], -1))                         # (1, Q, C)
            else:
                h = self._attended(m, h, q, keys, values, mask)
            h = self._mlp(m, h)
            yield h

    def _attended(self, m, h, q, keys, values, mask):
        """h (B, Q, C) plus layer `m`'s attention output: queries q (B, Q, H, D) over the first K entries
        of keys and values (B, H_kv, >= K, D) under the additive mask (B, 1, Q, K), by torch's SDPA."""
        k_len = mask.shape[-1]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys[:, :, :k_len], values[:, :, :k_len],
                                             attn_mask=mask, scale=m.scaling, **self.grouped)     # (B, H, Q, D)
        return h + m.o(out.transpose(1, 2).reshape(*h.shape[:2], -1))

    def _attention_inputs(self, m, h, cos, sin):
        """Layer `m`'s queries, keys and values of h (1, Q, C), normed and rotated: (1, Q, H, D),
        (1, Q, H_kv, D), (1, Q, H_kv, D)."""
        heads, half = (*h.shape[:2], -1, self.head_dim), self.head_dim // 2
        x = _rms_norm(h, m.norm, self.one_call)
        q = m.q(x).view(heads)                                                  # (1, Q, H, D)
        k = m.k(x).view(heads)                                                  # (1, Q, H_kv, D)
        v = m.v(x).view(heads)
        if m.q_norm is not None:
            q, k = _rms_norm(q, m.q_norm, self.one_call), _rms_norm(k, m.k_norm, self.one_call)
        return q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin, v

    def _mlp(self, m, h):
        """h (1, Q, C) plus layer `m`'s MLP of its post-attention norm."""
        x = _rms_norm(h, m.post_norm, self.one_call)
        return h + m.down(m.act(m.gate(x)) * m.up(x))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: StaticCache,
                 slots: torch.Tensor, hidden: tuple[int, ...] = (), last_logits: bool = False):
        """Run a block: write its keys and values at `slots`, attend over the cache's first K entries.

        Args:
            tokens: (1, Q) long.
            positions: (1, Q) long rotary positions.
            mask: (1, 1, Q, K) additive float mask in the model dtype over cache entries 0..K-1,
                the block's own included.
            cache: holds at least `max(slots) + 1` positions of room (`StaticCache.reserve`).
            slots: (Q,) long cache entries the block's keys and values go to (all < K).
            hidden: indices into transformers' `hidden_states` to return (0 = embeddings, i = after
                layer i, -1 or len(layers) = final normed), concatenated; () for none.
            last_logits: project only the last row onto the vocabulary.
        Returns:
            (logits (1, Q, V) or (1, 1, V), states (1, Q, len(hidden) * H) or None).
        """
        n_layers = len(self.layers)
        if any(not -n_layers - 1 <= i <= n_layers for i in hidden):
            raise IndexError(f"hidden state indices {list(hidden)} outside -{n_layers + 1}..{n_layers}")
        order = [i % (n_layers + 1) for i in hidden]
        wanted = set(order)
        kept: dict[int, torch.Tensor] = {}
        joined = None
        if len(order) > 1 and len(wanted) == len(order):
            # the states go straight into their column blocks of the one tensor returned
            width = self.embed.weight.shape[1]
            joined = torch.empty(*tokens.shape, len(order) * width, dtype=self.embed.weight.dtype,
                                 device=tokens.device)
            kept = {i: joined[..., j * width:(j + 1) * width] for j, i in enumerate(order)}
        h = self._final(self.embed(tokens), positions, mask, cache, slots, wanted, kept)
        logits = self.lm_head(h[:, -1:] if last_logits else h)
        if not hidden:
            return logits, None
        if joined is not None:
            return logits, joined
        states = [kept[i] for i in order]
        return logits, torch.cat(states, dim=-1) if len(states) > 1 else states[0]

    def states(self, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: StaticCache,
               slots: torch.Tensor) -> torch.Tensor:
        """A block given as (1, Q, C) input embeddings (as transformers' `inputs_embeds`), the rest as
        `__call__` takes it; returns (1, Q, C) the final normed hidden states (`last_hidden_state`)."""
        return self._final(embeds, positions, mask, cache, slots, set(), {})

    def _final(self, h, positions, mask, cache, slots, wanted: set, kept: dict) -> torch.Tensor:
        """The decoder layers and the final norm over (1, Q, C) embeddings h; the states after the
        layers in `wanted` (0 = h itself) go into `kept`, the final normed one under len(layers) (copied
        into the tensor `kept` already holds for an index, where it holds one)."""
        n_layers = len(self.layers)
        if 0 in wanted:
            _put(kept, 0, h)
        cos, sin = self._rotary(h, positions)                                  # (1, Q, 1, D)
        rows = None if not self.one_call else mask[0, 0] if mask.stride(-1) == 1 else mask[0, 0].contiguous()
        plan = self.native_layers() if not h.requires_grad else None
        if plan is not None:
            h = self._in_one_call(plan, h, cos, sin, rows, cache, slots, wanted, kept)
        else:
            for i, h in enumerate(self._by_op(h, cos, sin, mask, rows, cache, slots), 1):   # h after layer i
                if i in wanted and i < n_layers:
                    _put(kept, i, h)
        h = _rms_norm(h, self.norm, self.one_call)
        _put(kept, n_layers, h)
        return h
