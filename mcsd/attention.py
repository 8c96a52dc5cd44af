"""Tree attention backends, plugged in through transformers' attention interface.

The engine always hands the model an additive float 4D mask (see
`tree.additive_mask`) and explicit position ids, so a backend only has to
honour an arbitrary additive bias:

- "sdpa": transformers' own torch `scaled_dot_product_attention` path. A 4D
  float mask passes through it unchanged. Works on every device.
- "xformers": `xformers.ops.memory_efficient_attention` with the mask as a
  tensor `attn_bias`, registered under the name "mcsd_xformers" with
  `AttentionInterface` (and the sdpa mask builder under the same name, so the
  model still behaves for ordinary callers such as `generate`). CUDA only.
- "gqa": for float32 blocks of 2 to `GQA_MAX_ROWS` query rows, plain matrix
  products and a softmax, with the query heads that share a key/value head
  stacked into one product (no copy of the keys and values per query head, no
  flash kernel's fixed cost per call); other blocks go to transformers' SDPA
  function as under "sdpa". Registered as "mcsd_gqa". On a 2-core AVX2 EPYC,
  one thread, 9 query / 3 key-value heads over ~300 keys, a call took
  150-540 us against 250-600 us through SDPA for 2-32 rows, about the same for
  1 row (SDPA's own grouped path) and more for 64 (noisy shared machine).
- "auto": xformers when CUDA is present and a probe call succeeds; gqa on a
  CPU; else sdpa.

The choice is applied with the model's public `set_attn_implementation`; no
modeling file is forked and no attribute is patched onto the model.
"""

from __future__ import annotations

import functools

import torch

from .config import ATTENTION_BACKENDS as BACKENDS
from .config import ConfigError

XFORMERS_NAME = "mcsd_xformers"
GQA_NAME = "mcsd_gqa"
GQA_MAX_ROWS = 32         # larger blocks go to SDPA (a flash kernel's fixed cost no longer matters there)
_GQA_DTYPES = (torch.float32, torch.float64)   # reduced precision: SDPA's kernels accumulate in float32 for us


def _gqa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function for few query rows over a long cache.

    The query heads that share a key/value head (grouped-query attention) are
    stacked along the rows, so each key/value head is read by one matrix
    product, and the scale and additive mask join the first product
    (`baddbmm`). Falls back to transformers' SDPA function for one row (its own
    grouped path is as fast there), more than `GQA_MAX_ROWS` rows, dtypes other
    than float32 / float64, without a float mask, with dropout or with options
    it does not take (softcap, sinks, position bias).

    Args:
        query: (B, H, Q, D); key, value: (B, H_kv, K, D), H a multiple of H_kv.
        attention_mask: (B or 1, 1, Q, K) additive float mask.
    Returns:
        ((B, Q, H, D) attention output, None).
    """
    b, h, q_len, d = query.shape
    h_kv, k_len = key.shape[1], key.shape[2]
    if (not 1 < q_len <= GQA_MAX_ROWS or query.dtype not in _GQA_DTYPES or attention_mask is None or attention_mask.dtype == torch.bool or dropout
            or h % h_kv or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
            or attention_mask.shape[1] != 1 or attention_mask.shape[-1] != k_len
            or kwargs.get("position_bias") is not None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    g = h // h_kv
    scale = d ** -0.5 if scaling is None else scaling
    q = query.reshape(b * h_kv, g * q_len, d)                                  # (B*H_kv, G*Q, D)
    k = key.reshape(b * h_kv, k_len, d)                                        # (B*H_kv, K, D)
    v = value.reshape(b * h_kv, k_len, d)
    mask = attention_mask[:, 0].to(query.dtype)                               # (B or 1, Q, K)
    if g > 1 and q_len > 1:                                                    # one mask row per stacked head row
        mask = mask[:, None].expand(mask.shape[0], g, q_len, k_len).reshape(mask.shape[0], g * q_len, k_len)
    if mask.shape[0] != b * h_kv:
        mask = mask.repeat_interleave(h_kv, dim=0) if mask.shape[0] > 1 else mask
    scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)           # (B*H_kv, G*Q, K)
    probs = scores.softmax(-1)
    out = torch.bmm(probs, v)                                                  # (B*H_kv, G*Q, D)
    return out.view(b, h, q_len, d).transpose(1, 2).contiguous(), None        # (B, Q, H, D)


def _xformers_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function backed by xformers.

    Args:
        query: (B, H, Q, D); key, value: (B, H_kv, K, D).
        attention_mask: (B or 1, 1, Q, K) additive float mask, or None (causal).
    Returns:
        ((B, Q, H, D) attention output, None).
    """
    import xformers.ops as xops

    b, h, q_len, d = query.shape
    h_kv = key.shape[1]
    q = query.transpose(1, 2)                                                  # (B, Q, H, D)
    k = key.transpose(1, 2)                                                    # (B, K, H_kv, D)
    v = value.transpose(1, 2)
    if h_kv != h:  # grouped-query attention: xformers takes (B, M, G, H/G, D)
        g = h_kv
        q = q.reshape(b, q_len, g, h // g, d)
        k = k.unsqueeze(3).expand(b, k.shape[1], g, h // g, d)
        v = v.unsqueeze(3).expand(b, v.shape[1], g, h // g, d)
    if attention_mask is None:
        bias = xops.LowerTriangularFromBottomRightMask() if q_len > 1 else None
    else:
        bias = _aligned_bias(attention_mask.to(query.dtype), b, h, h_kv)
    out = xops.memory_efficient_attention(q, k, v, attn_bias=bias, p=dropout, scale=scaling)
    return out.reshape(b, q_len, h, d), None


def _aligned_bias(mask: torch.Tensor, b: int, h: int, h_kv: int) -> torch.Tensor:
    # xformers wants the bias's last dimension padded to a multiple of 8 in memory;
    # allocate padded storage and hand it a view of the real width.
    q_len, k_len = mask.shape[-2:]
    padded = (k_len + 7) // 8 * 8
    store = torch.empty(b, h, q_len, padded, dtype=mask.dtype, device=mask.device)
    view = store[..., :k_len]
    view.copy_(mask.expand(b, h, q_len, k_len))
    if h_kv != h:
        view = view.reshape(b, h_kv, h // h_kv, q_len, k_len)
    return view


@functools.lru_cache(maxsize=None)
def _register_gqa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GQA_NAME, _gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_NAME, sdpa_mask)


@functools.lru_cache(maxsize=None)
def _register_xformers() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(XFORMERS_NAME, _xformers_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(XFORMERS_NAME, sdpa_mask)


def register(implementation: str) -> None:
    """Make sure a transformers attention implementation named by mcsd is registered ("mcsd_gqa",
    "mcsd_xformers"); transformers' own names need nothing."""
    if implementation == GQA_NAME:
        _register_gqa()
    elif implementation == XFORMERS_NAME:
        _register_xformers()


def describe(implementation: str) -> str:
    """What a resolved implementation name runs, in words (for `--stats`)."""
    return {GQA_NAME: f"grouped-query products for 2-{GQA_MAX_ROWS} float32 rows, SDPA otherwise",
            XFORMERS_NAME: "xformers memory-efficient attention", "sdpa": "torch SDPA",
            "eager": "transformers' eager attention"}.get(implementation, implementation)


def xformers_unavailable_reason(device) -> str | None:
    """None if the xformers backend can run on `device`, else a sentence saying why not."""
    if torch.device(device).type != "cuda":
        return f"xformers kernels run only on CUDA devices, not on {torch.device(device).type!r}"
    try:
        import xformers.ops as xops
    except Exception as exc:  # ImportError, or a broken build raising at import
        return f"xformers is not importable ({exc.__class__.__name__}: {exc}); install mcsd[gpu]"
    try:
        x = torch.zeros(1, 8, 1, 64, device=device, dtype=torch.float16)
        xops.memory_efficient_attention(x, x, x)
    except Exception as exc:
        return f"xformers failed a probe call on {device} ({exc.__class__.__name__}: {exc})"
    return None


def resolve_backend(name: str, device) -> str:
    """Map "auto" | "sdpa" | "gqa" | "xformers" | "eager" to a transformers implementation name.

    Raises:
        ConfigError: unknown name, or xformers requested where it cannot run.
    """
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name in ("sdpa", "eager"):
        return name
    if name == "gqa" or (name == "auto" and torch.device(device).type == "cpu"):
        _register_gqa()
        return GQA_NAME
    reason = xformers_unavailable_reason(device)
    if reason is None:
        _register_xformers()
        return XFORMERS_NAME
    if name == "xformers":
        raise ConfigError(f"attention='xformers' cannot run here: {reason}")
    return "sdpa"


def set_backend(model: torch.nn.Module, name: str) -> str:
    """Switch `model` to the resolved backend through its public API; returns the name used."""
    device = next(model.parameters()).device
    impl = resolve_backend(name, device)
    if getattr(model.config, "_attn_implementation", None) != impl:
        model.set_attn_implementation(impl)
    return impl
