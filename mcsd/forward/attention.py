"""Tree attention backends, plugged in through transformers' attention interface.

The engine always hands the model an additive float 4D mask (see
`additive_mask` below) and explicit position ids, so a backend only has to
honour an arbitrary additive bias:

- "sdpa": transformers' own torch `scaled_dot_product_attention` path. A 4D
  float mask passes through it unchanged. Works on every device.
- "xformers": `xformers.ops.memory_efficient_attention` with the mask as a
  tensor `attn_bias`, registered under the name "mcsd_xformers" with
  `AttentionInterface` (and the sdpa mask builder under the same name, so the
  model still behaves for ordinary callers such as `generate`). CUDA only.
  Where xformers' compiled operators do not load (a wheel built for another
  torch or CUDA), its dispatcher finds no operator, but its Triton split-k
  kernel still runs: the backend then calls that operator class directly,
  for float16 and bfloat16 and the head sizes it takes. On an H200 (torch
  2.11, CUDA 13, xformers 0.0.35) it matched SDPA within 0.002 for 1-64 tree
  rows over ~300 keys, 9 query / 3 key-value heads, and replays inside a
  CUDA graph. Its float32 arithmetic is not float32's (errors of 1e-3), so
  float32 models are refused there rather than given inexact logits.
- "gqa": torch's `scaled_dot_product_attention` called directly with the
  additive mask and `enable_gqa`, so the key/value heads are read once by
  the query heads that share them. transformers' SDPA path, handed a mask,
  first repeats the keys and values per query head (a copy of the whole
  cache at every layer and forward; for a single row it regroups the query
  instead). Registered as "mcsd_gqa". On a 2-core Intel Xeon with AMX, one
  thread, 9 query / 3 key-value heads over ~300 keys: 26 / 86 / 287 us a call
  for 1 / 9 / 64 bfloat16 rows against 38 / 123 / 403 us through
  transformers' path, the same output bit for bit; in float32 39 / 106 / 602
  against 43 / 208 / 702 us. (It replaced a hand-written grouped product for
  2-32 float32 rows, which took 52 / 104 / 290 us there for 2 / 9 / 32 rows
  against 44 / 103 / 284 us for this call.)
- "auto": xformers when CUDA is present and a probe call succeeds; gqa on a
  CPU; else sdpa.

The choice is applied with the model's public `set_attn_implementation`; no
modeling file is forked and no attribute is patched onto the model.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..config import ATTENTION_BACKENDS as BACKENDS
from ..config import ConfigError

# ----------------------------------------------------------------------------
# masks: what the engine hands every backend

def additive_mask(allowed: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Turn a tree visibility mask into the additive 4D mask a transformers model takes.

    Args:
        allowed: (Q, K) bool, which in-tree keys each query may see.
        prefix_len: number of committed tokens in the KV cache before the tree;
            every query sees all of them.
        dtype: the model's compute dtype (masked entries get its most negative value).
    Returns:
        (1, 1, Q, prefix_len + K) float, 0 where visible and dtype-min elsewhere.
        A bool mask is *not* used: eager attention would treat it as additive.
    """
    q, k = allowed.shape
    out = torch.zeros(1, 1, q, prefix_len + k, dtype=dtype, device=allowed.device)
    out[0, 0, :, prefix_len:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return out


def causal_allowed(n: int, device=None) -> torch.Tensor:
    """(n, n) bool lower-triangular visibility for a run of ordinary prefix tokens."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


XFORMERS_NAME = "mcsd_xformers"
GQA_NAME = "mcsd_gqa"


@functools.lru_cache(maxsize=None)
def _sdpa_takes_gqa() -> bool:
    # torch >= 2.5 broadcasts key/value heads inside SDPA (`enable_gqa`)
    q = torch.zeros(1, 2, 1, 4)
    kv = torch.zeros(1, 1, 1, 4)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def _gqa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function: SDPA over the cache as it is, query heads grouped.

    Falls back to transformers' SDPA function without a float mask shared by
    all heads, with dropout, with options SDPA does not take (softcap, sinks,
    position bias), or on a torch without `enable_gqa`.

    Args:
        query: (B, H, Q, D); key, value: (B, H_kv, K, D), H a multiple of H_kv.
        attention_mask: (B or 1, 1, Q, K) additive float mask.
    Returns:
        ((B, Q, H, D) attention output, None).
    """
    h, h_kv, k_len = query.shape[1], key.shape[1], key.shape[2]
    if (attention_mask is None or attention_mask.dtype == torch.bool or dropout or h % h_kv
            or attention_mask.shape[1] != 1 or attention_mask.shape[-1] != k_len
            or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
            or kwargs.get("position_bias") is not None or (h != h_kv and not _sdpa_takes_gqa())):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    grouped = {"enable_gqa": True} if h != h_kv else {}
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask.to(query.dtype),
                                         scale=scaling, **grouped)                 # (B, H, Q, D)
    return out.transpose(1, 2).contiguous(), None                                  # (B, Q, H, D)


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
    h_kv, k_len = key.shape[1], key.shape[2]
    q = query.transpose(1, 2)                                                  # (B, Q, H, D)
    k = key.transpose(1, 2)                                                    # (B, K, H_kv, D)
    v = value.transpose(1, 2)
    if h_kv != h:  # grouped-query attention: xformers takes (B, M, G, H/G, D)
        g = h_kv
        q = q.reshape(b, q_len, g, h // g, d)
        k = k.unsqueeze(3).expand(b, k.shape[1], g, h // g, d)
        v = v.unsqueeze(3).expand(b, v.shape[1], g, h // g, d)
    if _xformers_route(str(query.device))[0] == "splitk":
        if dropout:
            raise ValueError("xformers' split-k operator, the only one that runs here, has no dropout")
        from xformers.ops import fmha
        from xformers.ops.fmha import triton_splitk
        if attention_mask is None and q_len > 1:                               # causal, aligned bottom-right
            attention_mask = _causal_bias(q_len, k_len, query.dtype, query.device)
        bias = None if attention_mask is None else _aligned_bias(attention_mask.to(query.dtype), b, h, h_kv)
        out, _ = triton_splitk.FwOp.apply(fmha.Inputs(q, k, v, attn_bias=bias, scale=scaling),
                                          needs_gradient=False)
        return out.reshape(b, q_len, h, d), None
    if attention_mask is None:
        bias = xops.LowerTriangularFromBottomRightMask() if q_len > 1 else None
    else:
        bias = _aligned_bias(attention_mask.to(query.dtype), b, h, h_kv)
    out = xops.memory_efficient_attention(q, k, v, attn_bias=bias, p=dropout, scale=scaling)
    return out.reshape(b, q_len, h, d), None


def _causal_bias(q_len: int, k_len: int, dtype, device) -> torch.Tensor:
    """(1, 1, Q, K) additive mask: query row i sees keys up to k_len - q_len + i."""
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


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
    return {GQA_NAME: "torch SDPA over the cache as it is, query heads grouped (no key/value copies)",
            XFORMERS_NAME: "xformers attention", "sdpa": "torch SDPA",
            "eager": "transformers' eager attention"}.get(implementation, implementation)


SPLITK_DTYPES = (torch.float16, torch.bfloat16)
SPLITK_HEAD_DIMS = (16, 32, 64, 128, 256, 512)


@functools.lru_cache(maxsize=None)
def _xformers_route(device: str) -> tuple[str | None, str]:
    """How xformers runs on a CUDA `device`: ("dispatch", "") when its dispatcher finds an operator,
    ("splitk", why not the dispatcher) when only its Triton split-k operator runs, else (None, why)."""
    import xformers.ops as xops
    x = torch.zeros(1, 8, 1, 64, device=device, dtype=torch.float16)
    try:
        xops.memory_efficient_attention(x, x, x)
        return "dispatch", ""
    except Exception as exc:
        dispatch = f"{exc.__class__.__name__}: {str(exc).splitlines()[0]}"
    try:
        from xformers.ops import fmha
        from xformers.ops.fmha import triton_splitk
        q = torch.randn(1, 3, 1, 64, device=device, dtype=torch.bfloat16)
        kv = torch.randn(1, 16, 1, 64, device=device, dtype=torch.bfloat16)
        bias = _aligned_bias(torch.zeros(1, 1, 3, 16, device=device, dtype=torch.bfloat16), 1, 1, 1)
        out, _ = triton_splitk.FwOp.apply(fmha.Inputs(q, kv, kv, attn_bias=bias), needs_gradient=False)
        want = F.scaled_dot_product_attention(q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2))
        if not torch.allclose(out.float(), want.transpose(1, 2).float(), atol=2e-2):
            return None, f"its dispatcher found no operator ({dispatch}) and its Triton split-k operator disagreed with SDPA"
    except Exception as exc:
        return None, (f"its dispatcher found no operator ({dispatch}) and its Triton split-k operator failed "
                      f"({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    return "splitk", dispatch


def xformers_unavailable_reason(device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str | None:
    """None if the xformers backend can run on `device` (for a model of `dtype` with attention heads
    of `head_dim`, where given), else a sentence saying why not."""
    if torch.device(device).type != "cuda":
        return f"xformers kernels run only on CUDA devices, not on {torch.device(device).type!r}"
    try:
        import xformers.ops  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build raising at import
        return f"xformers is not importable ({exc.__class__.__name__}: {exc}); install mcsd[gpu]"
    try:
        route, why = _xformers_route(str(torch.device(device)))
    except Exception as exc:
        return f"xformers failed a probe call on {device} ({exc.__class__.__name__}: {exc})"
    if route is None:
        return f"xformers cannot attend on {device}: {why}"
    if route == "splitk":
        takes = None
        if dtype is not None and dtype not in SPLITK_DTYPES:
            takes = f"float16 and bfloat16, not {str(dtype).removeprefix('torch.')}"
        elif head_dim is not None and head_dim not in SPLITK_HEAD_DIMS:
            takes = f"heads of {', '.join(map(str, SPLITK_HEAD_DIMS))} dimensions, not {head_dim}"
        if takes:
            return f"only xformers' Triton split-k operator runs on {device} (its dispatcher: {why}), and it takes {takes}"
    return None


def resolve_backend(name: str, device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """Map "auto" | "sdpa" | "gqa" | "xformers" | "eager" to a transformers implementation name, for a
    model on `device` of `dtype` with attention heads of `head_dim` (where given).

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
    reason = xformers_unavailable_reason(device, dtype, head_dim)
    if reason is None:
        _register_xformers()
        return XFORMERS_NAME
    if name == "xformers":
        raise ConfigError(f"attention='xformers' cannot run here: {reason}")
    return "sdpa"


def set_backend(model: torch.nn.Module, name: str) -> str:
    """Switch `model` to the resolved backend through its public API; returns the name used."""
    weight = next(model.parameters())
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None)
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    impl = resolve_backend(name, weight.device, weight.dtype, head_dim)
    if getattr(model.config, "_attn_implementation", None) != impl:
        model.set_attn_implementation(impl)
    return impl
