"""An EAGLE-3 draft head (Li et al. 2025) read from its published files, and the drafter around it.

EAGLE-3 is the format most target-feature heads are published in; vLLM and
SGLang load it. Its forward, per committed position t:

- `fc` fuses three of the target's hidden states at t (by default the inputs
  of layers 2, L/2 and L-3: transformers' `hidden_states[i]`), concatenated,
  into one vector g_t of the head's width H;
- the first decoder layer's attention reads cat(input_layernorm(e(x_{t+1})),
  hidden_norm(g_t)), 2H wide; its residual is g_t (or hidden_norm(g_t) where
  the head was trained with `norm_before_residual`); then a SiLU MLP, as in a
  Llama layer (a Qwen3 layer norms each head's q and k as well). Further
  layers, where a head has them, are plain decoder layers;
- `lm_head(norm(h))` scores a draft vocabulary of K tokens; draft id d is
  target id d + d2t[d]. Every other target token has draft probability 0, so
  q stays a distribution over the target's vocabulary and verification is
  exact (as for mcsd's own head over a sub-vocabulary).

Deeper in a tree the head reads its own output h (before `norm`) in place
of g. That is the feature head's contract (`mcsd.drafting.feature_draft`), so
`Eagle3Drafter` is a `FeatureDrafter`: the same cache of true-feature entries,
window, tree steps and commit; only the block it runs differs.

The two layouts it reads, each as the engine that serves it reads it
(docs/eagle3.md cites the engines' lines):
- original (SafeAILab/EAGLE, SpecForge, SGLang): a flat Llama config with
  `draft_vocab_size`, weights `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`,
  `t2d`, usually no embedding (the target's is used); SGLang's
  `eagle_config.eagle_aux_hidden_state_layer_ids` name layer outputs, so
  id i is `hidden_states[i + 1]`; a config without `norm_before_residual`
  reads false (SGLang never reads the flag, vLLM defaults it to false);
- speculators (what `vllm serve` loads): `speculators_model_type: "eagle3"`,
  the draft layer's config in `transformer_layer_config`,
  `eagle_aux_hidden_state_layer_ids` (layer inputs), `norm_before_residual`
  (true where the config omits it, as vLLM reads it), weights under
  `layers.N.*` with `embed_tokens`.
In both, the target layers are fused in ascending order whatever order the
config lists them in: vLLM and SGLang capture the states in one pass over
the target's layers and concatenate them as they come.

Limitations: the head's width must be its target's (no `target_hidden_size`
of another width); Llama and Qwen3 draft layers only; no sliding-window
draft layers; the speculators options `norm_before_fc`, `fc_norm` and
`norm_output` are refused, as are target layer ids past the last decoder
layer's input (`L`, the final state) and a layer id named twice. One
sequence at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..forward.static_cache import StaticCache
from .feature_draft import FIRST_READ_WINDOW, FeatureDrafter, default_feature_layers

LAYER_TYPES = ("llama", "qwen3")          # draft layer families read


class Eagle3FormatError(ValueError):
    """A directory that is not a readable EAGLE-3 head; the message is one line naming the cause."""


@dataclass(frozen=True)
class Eagle3Config:
    hidden: int                          # H: the head's width, which is its target's hidden size
    vocab_size: int                      # the target's vocabulary V
    draft_vocab: int                     # K: rows of the head's LM head
    layer_config: dict = field(hash=False)   # the draft layers' transformers config (model_type llama or qwen3)
    # target hidden states fused by fc, as indices into transformers' `hidden_states` (i = the input
    # of decoder layer i), ascending (fc's input blocks in the order vLLM and SGLang concatenate them);
    # () = EAGLE-3's default for the target's depth, fixed when bound to it
    aux_layers: tuple[int, ...] = ()
    norm_before_residual: bool = False   # the first layer's residual is hidden_norm(g), not g
    has_embedding: bool = False          # the files hold the token embedding (else the target's is used)
    layout: str = "speculators"          # the layout it was read from: "speculators" or "original"

    def __post_init__(self):
        ids = tuple(int(i) for i in self.aux_layers)
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"EAGLE-3 target layers {list(ids)} must be distinct and ascending (vLLM and SGLang "
                             f"concatenate them in ascending layer order)")
        object.__setattr__(self, "aux_layers", ids)

    @property
    def layers(self) -> int:
        return int(self.layer_config.get("num_hidden_layers", 1))

    # what FeatureDrafter reads from a head's config
    @property
    def target_hidden(self) -> int:
        return self.hidden

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.aux_layers

    @property
    def read_layers(self) -> tuple[int, ...]:
        return self.aux_layers

    def transformers_config(self):
        """The draft layers' config as a transformers config object."""
        from transformers import AutoConfig
        kind = self.layer_config.get("model_type", "llama")
        fields = {k: v for k, v in self.layer_config.items() if k != "model_type"}
        cfg = AutoConfig.for_model(kind, **fields)
        cfg._attn_implementation = "sdpa"
        return cfg


class Eagle3Head(nn.Module):
    """EAGLE-3's draft head: fc, the decoder layers (the first one 2H wide), norm, LM head, d2t.

    Parameter names are the speculators layout's (`layers.0.self_attn.q_proj.weight`, ...), so its
    state dict is the file's. The layers are transformers' own decoder-layer modules (q / k / v of
    the first widened to 2H, a `hidden_norm` added); `block` runs them, over a transformers cache
    (`forward`, as training and the reference tests do) or the engine's static cache (`step`).
    """

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

        self.cfg = cfg
        tcfg = cfg.transformers_config()
        kind = tcfg.model_type
        if kind not in LAYER_TYPES:
            raise Eagle3FormatError(f"draft layers of type {kind!r} are not read (only {', '.join(LAYER_TYPES)})")
        layer_cls, norm_cls = (LlamaDecoderLayer, LlamaRMSNorm) if kind == "llama" else (Qwen3DecoderLayer, Qwen3RMSNorm)
        H = cfg.hidden
        if tcfg.hidden_size != H:
            raise Eagle3FormatError(f"draft layer width {tcfg.hidden_size} is not the head's {H}")
        self.head_dim = tcfg.head_dim
        self.heads, self.kv_heads = tcfg.num_attention_heads, tcfg.num_key_value_heads
        self.fc = nn.Linear(len(cfg.aux_layers or (0, 0, 0)) * H, H, bias=False)
        self.layers = nn.ModuleList(layer_cls(tcfg, i) for i in range(cfg.layers))
        first = self.layers[0]
        bias = bool(getattr(tcfg, "attention_bias", False))
        attn = first.self_attn
        attn.q_proj = nn.Linear(2 * H, self.heads * self.head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * H, self.kv_heads * self.head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * H, self.kv_heads * self.head_dim, bias=bias)
        first.hidden_norm = norm_cls(H, eps=tcfg.rms_norm_eps)
        self.norm = norm_cls(H, eps=tcfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if cfg.has_embedding else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.rotary = LlamaRotaryEmbedding(tcfg)        # tables from the layer's rope settings (any scaling)
        self.grouped = {"enable_gqa": True} if self.heads != self.kv_heads else {}

    # ------------------------------------------------------------ vocabulary (FeatureDrafter's interface)

    @property
    def vocab_ids(self) -> torch.Tensor:
        """(K,) the target id of each draft id: d + d2t[d]."""
        return torch.arange(self.cfg.draft_vocab, device=self.d2t.device) + self.d2t

    @property
    def lm_rows(self) -> torch.Tensor:
        return self.lm_head.weight

    def attach_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        """Nothing to borrow: an EAGLE-3 head has an LM head of its own."""

    def fused(self, target_states: torch.Tensor) -> torch.Tensor:
        """(..., n*H) the target's chosen hidden states, concatenated -> (..., H) g."""
        return self.fc(target_states)

    def sub_scores(self, predicted: torch.Tensor) -> torch.Tensor:
        """(..., H) the head's outputs -> (..., K) logits over the draft vocabulary."""
        return self.lm_head(self.norm(predicted))

    def full_scores(self, sub: torch.Tensor) -> torch.Tensor:
        """(..., K) draft-vocabulary logits -> (..., V), -inf at every other target token."""
        if self._identity():
            return sub
        full = sub.new_full(sub.shape[:-1] + (self.cfg.vocab_size,), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, sub)

    def scores(self, predicted: torch.Tensor) -> torch.Tensor:
        return self.full_scores(self.sub_scores(predicted))

    def _identity(self) -> bool:
        """Draft id d is target id d (the whole vocabulary, d2t all 0): read from d2t once per version of
        it, not at every call (a host read, which a captured CUDA graph cannot hold)."""
        key = (self.d2t.data_ptr(), self.d2t._version)
        if getattr(self, "_identity_for", None) != key:
            self._identity_for = key
            self._is_identity = self.cfg.draft_vocab == self.cfg.vocab_size and not bool(self.d2t.any())
        return self._is_identity

    # ------------------------------------------------------------------------------ the forward

    def block(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The decoder layers over one block.

        Args:
            hidden: (B, Q, H) g (fc's output) at committed entries, or a parent's output deeper in a tree.
            embeds: (B, Q, H) embeddings of the entries' tokens.
            positions: (B, Q) long rotary positions.
            attend: attend(i, q, k, v) -> (B, heads, Q, D): layer i's attention of the block's queries over
                the cache with the block's keys and values (B, kv_heads, Q, D) added.
        Returns:
            (B, Q, H) the last layer's output before `norm` (what the next step reads).
        """
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        cos, sin = self.rotary(hidden, positions)                                # (B, Q, D) each
        B, Q, _ = hidden.shape
        h = hidden
        for i, layer in enumerate(self.layers):
            if i == 0:
                g = layer.hidden_norm(h)
                x = torch.cat([layer.input_layernorm(embeds), g], dim=-1)        # (B, Q, 2H)
                residual = g if self.cfg.norm_before_residual else h
            else:
                x, residual = layer.input_layernorm(h), h
            attn = layer.self_attn
            q = attn.q_proj(x).view(B, Q, -1, self.head_dim)                     # (B, Q, heads, D)
            k = attn.k_proj(x).view(B, Q, -1, self.head_dim)                     # (B, Q, kv_heads, D)
            v = attn.v_proj(x).view(B, Q, -1, self.head_dim)
            if getattr(attn, "q_norm", None) is not None:                        # Qwen3: per-head q / k norms
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            out = attend(i, q, k, v.transpose(1, 2))                              # (B, heads, Q, D)
            h = residual + attn.o_proj(out.transpose(1, 2).reshape(B, Q, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def _sdpa(self, q, keys, values, mask):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.head_dim ** -0.5,
                                              **self.grouped)

    def forward(self, features, token_embeds, position_ids, attention_mask=None, past_key_values=None):
        """FeatureHead's training signature, over a transformers cache.

        Args:
            features: (B, T, H) g or the head's own outputs.
            token_embeds: (B, T, H).
            position_ids: (B, T).
            attention_mask: additive (B, 1, T, K) over the cache after this block, or None: causal.
            past_key_values: a transformers `DynamicCache` (None: a fresh one, dropped after).
        Returns:
            (B, T, H) outputs before `norm`.
        """
        from transformers import DynamicCache
        cache = DynamicCache() if past_key_values is None else past_key_values
        T = features.shape[1]

        def attend(i, q, k, v):
            keys, values = cache.update(k, v, i)
            mask = attention_mask
            if mask is None:                     # causal over a prefix of keys.shape[2] - T
                allowed = torch.ones(T, keys.shape[2], dtype=torch.bool, device=q.device).tril(keys.shape[2] - T)
                mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
                    ~allowed, torch.finfo(q.dtype).min)
            return self._sdpa(q, keys, values, mask)

        return self.block(features, token_embeds, position_ids, attend)

    def new_cache(self, device, dtype) -> StaticCache:
        return StaticCache(len(self.layers), self.kv_heads, self.head_dim, dtype, device)

    def step(self, features, embeds, positions, mask, cache: StaticCache, slots) -> torch.Tensor:
        """A block over the engine's static cache: (1, Q, H) features and embeddings, (1, Q) positions,
        (1, 1, Q, K) additive mask over cache entries 0..K-1 (the block's own at `slots` included).
        Writes the block's keys and values at `slots`; the caller advances `cache.length`."""
        k_len = mask.shape[-1]

        def attend(i, q, k, v):
            keys, values = cache.layer_keys[i], cache.layer_values[i]            # (1, kv_heads, capacity, D)
            keys.index_copy_(2, slots, k)
            values.index_copy_(2, slots, v)
            return self._sdpa(q, keys[:, :, :k_len], values[:, :, :k_len], mask)

        return self.block(features, embeds, positions, attend)


class Eagle3Drafter(FeatureDrafter):
    """A `FeatureDrafter` over an `Eagle3Head`: the target's `aux_layers` states are fused by fc; a
    head holding its own embedding embeds with it (else with the target's); its blocks run on the
    head's own layer code (`Eagle3Head.step`) over a static cache."""

    def __init__(self, head: Eagle3Head, target: nn.Module, name: str = "eagle3", window: int | None = FIRST_READ_WINDOW,
                 directory: str | Path | None = None):
        n_layers = getattr(target.config, "num_hidden_layers", None)
        if not head.cfg.aux_layers and n_layers:
            raise ValueError("bind an EAGLE-3 head to its target's layers first (`bind_layers`)")
        bad = [i for i in head.cfg.aux_layers if n_layers is not None and not 0 <= i < n_layers]
        if bad:
            from ..config import ConfigError
            raise ConfigError(f"EAGLE-3 head reads target layers {list(head.cfg.aux_layers)} (layer inputs), but "
                              f"the target has {n_layers} layers (ids 0..{n_layers - 1})")
        super().__init__(head, target, name=name, window=window, directory=directory)
        if head.embed_tokens is not None:
            self.embed = head.embed_tokens
        head._identity()                         # read d2t now, not in a round

    def _empty_cache(self):
        cache = self.cache
        if not isinstance(cache, StaticCache) or (cache.dtype, cache.device) != (self.dtype, self.device):
            cache = self.head.new_cache(self.device, self.dtype)
        cache.reset()
        return cache

    @property
    def static_blocks(self) -> bool:
        """Always: the head's own layer code steps over a static cache (so the fixed-shape round runs it)."""
        return True

    def fixed_block(self, feats, embeds, positions, mask, slots):
        """`FeatureDrafter.fixed_block` on the head's own layer code (`Eagle3Head.step`)."""
        return self.head.step(feats[None], embeds[None], positions, mask, self.cache, slots)[0]

    @property
    def module(self) -> nn.Module:
        return self.head


def bind_layers(cfg: Eagle3Config, target_layers: int) -> Eagle3Config:
    """`cfg` with EAGLE-3's default target layers for a target of `target_layers` layers where it names none."""
    from dataclasses import replace
    if cfg.aux_layers:
        return cfg
    return replace(cfg, aux_layers=default_feature_layers(target_layers))


# ---------------------------------------------------------------------------------------- reading

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
IGNORED = ("verifier_lm_head.", "verifier_norm.", "t2d")    # training-only or derivable entries


def read_config(directory: str | Path) -> dict | None:
    try:
        cfg = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def eagle3_layout(directory: str | Path) -> str | None:
    """"speculators" or "original" where `directory` holds an EAGLE-3 head's config, else None."""
    cfg = read_config(directory)
    if cfg is None:
        return None
    if cfg.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "speculators_model_type" not in cfg and "draft_vocab_size" in cfg and \
            any("eagle3" in str(a).lower() for a in cfg.get("architectures") or ["eagle3"]):
        return "original"
    return None


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    files = [directory / "model.safetensors"]
    index = directory / "model.safetensors.index.json"
    try:
        if not files[0].is_file() and index.is_file():
            files = [directory / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        if files[0].is_file() or index.is_file():
            state = {}
            for f in files:
                state.update(load_file(str(f)))
            return state
        if (directory / "pytorch_model.bin").is_file():        # tensors only: no code runs on load
            return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except (OSError, ValueError, KeyError, SafetensorError, RuntimeError) as exc:
        raise Eagle3FormatError(f"{directory}: EAGLE-3 head weights are unreadable "
                                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    raise Eagle3FormatError(f"{directory}: no EAGLE-3 head weights ({' or '.join(WEIGHT_FILES)})")


def _refuse_options(where: str, cfg: dict) -> None:
    for option in ("norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(option):
            raise Eagle3FormatError(f"{where}: EAGLE-3 option {option} is not supported")
    eagle = cfg.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise Eagle3FormatError(f"{where}: a head without auxiliary hidden states (use_aux_hidden_state false) "
                                f"is not EAGLE-3's")


def read_eagle3(directory: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """An EAGLE-3 head's config and weights (renamed to the speculators layout), either layout.

    Raises:
        Eagle3FormatError (one line) for a missing, truncated or malformed file.
    """
    directory = Path(directory)
    layout = eagle3_layout(directory)
    if layout is None:
        raise Eagle3FormatError(f"{directory}: no EAGLE-3 config.json (speculators_model_type eagle3, or a "
                                f"draft_vocab_size)")
    raw = read_config(directory)
    _refuse_options(str(directory), raw)
    try:
        if layout == "speculators":
            layer = dict(raw["transformer_layer_config"])
            ids = [int(i) for i in raw.get("eagle_aux_hidden_state_layer_ids") or ()]
            norm_before_residual = bool(raw.get("norm_before_residual", True))      # vLLM's default
            draft_vocab = int(raw.get("draft_vocab_size", layer["vocab_size"]))
        else:
            layer = {k: v for k, v in raw.items() if k not in ("architectures", "draft_vocab_size", "eagle_config",
                                                               "target_hidden_size", "auto_map")}
            layer.setdefault("model_type", "llama")
            # SGLang's ids name layer outputs: output of layer i = input of layer i + 1
            ids = [int(i) + 1 for i in (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()]
            norm_before_residual = bool(raw.get("norm_before_residual", False))     # SGLang's and vLLM's
            draft_vocab = int(raw["draft_vocab_size"])
        hidden, vocab = int(layer["hidden_size"]), int(layer["vocab_size"])
        layer["num_hidden_layers"] = int(layer.get("num_hidden_layers", 1))
        layer["vocab_size"] = vocab
    except (KeyError, TypeError, ValueError) as exc:
        raise Eagle3FormatError(f"{directory}/config.json: EAGLE-3 config is malformed ({type(exc).__name__}: "
                                f"{exc})") from None
    other = raw.get("target_hidden_size")
    if other not in (None, hidden):
        raise Eagle3FormatError(f"{directory}: EAGLE-3 heads of width {hidden} over a target of width {other} "
                                f"are not supported")
    if len(ids) not in (0, 3) and layout == "original":
        raise Eagle3FormatError(f"{directory}: EAGLE-3 fuses three target layers, not {list(ids)}")
    if len(set(ids)) != len(ids):
        raise Eagle3FormatError(f"{directory}: EAGLE-3 head names target layer ids {list(ids)} with repeats "
                                f"(vLLM and SGLang capture each layer once)")
    ids = sorted(ids)                     # the engines concatenate the captured states in layer order
    state = _weights(directory)
    state = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v
             for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if "d2t" not in state and "t2d" in state and draft_vocab != vocab:        # d2t from the kept target ids
        kept = state["t2d"].bool().nonzero().flatten()
        if kept.numel() == draft_vocab:
            state["d2t"] = kept - torch.arange(draft_vocab)
    cfg = Eagle3Config(hidden=hidden, vocab_size=vocab, draft_vocab=draft_vocab, layer_config=layer,
                       aux_layers=tuple(ids), norm_before_residual=norm_before_residual,
                       has_embedding="embed_tokens.weight" in state, layout=layout)
    return cfg, state


def load_eagle3_head(directory: str | Path, target_layers: int | None = None, dtype=None) -> Eagle3Head:
    """Read an EAGLE-3 head (either layout) into an `Eagle3Head` in eval mode.

    Args:
        directory: the head's folder.
        target_layers: the target's decoder layer count, for EAGLE-3's default layers where the files
            name none (None: leave them unset).
        dtype: convert the head's floating weights to this.
    Raises:
        Eagle3FormatError (one line) for a missing, truncated or malformed head.
    """
    cfg, state = read_eagle3(directory)
    if target_layers is not None:
        cfg = bind_layers(cfg, target_layers)
    try:
        head = Eagle3Head(cfg)
    except Exception as exc:           # transformers' config checks raise several kinds; all mean the same here
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        msg = lines[-1] if lines else type(exc).__name__
        raise Eagle3FormatError(f"{directory}: EAGLE-3 draft layer config is not usable ({msg})") from None
    if cfg.draft_vocab != cfg.vocab_size and "d2t" not in state:
        raise Eagle3FormatError(f"{directory}: EAGLE-3 head has a draft vocabulary of {cfg.draft_vocab} of "
                                f"{cfg.vocab_size} tokens but no d2t (or t2d) mapping")
    state = {k: v for k, v in state.items() if not k.startswith(IGNORED)}
    if "d2t" not in state:
        state["d2t"] = torch.zeros(cfg.draft_vocab, dtype=torch.long)
    own = head.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise Eagle3FormatError(f"{directory}: EAGLE-3 head weights do not match its config (missing "
                                f"{missing[:3]}, unexpected {unexpected[:3]})")
    wrong = [f"{k} {tuple(state[k].shape)} (config: {tuple(v.shape)})" for k, v in own.items()
             if tuple(state[k].shape) != tuple(v.shape)]
    if wrong:
        raise Eagle3FormatError(f"{directory}: EAGLE-3 head weights do not match its config: {wrong[0]}")
    head.load_state_dict({k: v.to(own[k].dtype) if own[k].is_floating_point() else v.long()
                          for k, v in state.items()})
    ids = head.vocab_ids
    if cfg.draft_vocab and (ids.min() < 0 or ids.max() >= cfg.vocab_size or ids.unique().numel() != ids.numel()):
        raise Eagle3FormatError(f"{directory}: EAGLE-3 head's d2t maps draft ids outside the target's "
                                f"{cfg.vocab_size} tokens, or two onto one")
    head.eval().requires_grad_(False)
    return head.to(dtype) if dtype is not None else head
