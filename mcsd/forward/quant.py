"""Q4 weights: a GGUF Q4_1 target's linear layers run on their 4-bit codes.

The embedded target ships as a Q4_1 GGUF: every linear weight is stored as
blocks of 32 along the input dimension, each block a 4-bit code q in 0..15,
a scale d and an offset m (both float16), the weight being d * q + m; the token
embedding, tied to the LM head, is Q8_0 (d * q, q an int8). Loading dequantises
that into dense float32 (or bfloat16) weights, so a 1-token step reads 540 MB
(270 MB) of weights where the file holds 76 MB. On a CPU a step of a few rows
is bound by that traffic, not by arithmetic.

`attach` reads the codes back from the GGUF and gives each linear layer a copy
in the layout of the one q4 kernel this process runs (`kernel_name`), for every
layer and every block size:

- "native": mcsd's own kernel (`mcsd.forward.native`, `q4_kernel.c`), on x86-64 CPUs
  with AVX2 and FMA where a C compiler builds it. It multiplies by the very
  float32 weights a GGUF loader computes, sums each row in float32 in an order
  that does not depend on the rows beside it, and dequantises a block of
  output rows once for all rows of a verify. It also runs the LM head on its
  Q8_0 codes. Activations stay in the model's dtype (bfloat16 or float32).
- "torch": torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`: packed
  codes, and per block a scale d and a zero point m + 8 d rounded to bfloat16,
  since it computes (q - 8) * scale + zero), bfloat16 activations. Its cost
  grows with every few rows (it dequantises again for each), and the LM head
  stays dense. A prompt is many rows: a forward that starts a sequence (an
  empty cache) with at least `PREFILL_ROWS` rows therefore reads the dense
  weights where oneDNN runs bfloat16 natively (the engine's prefill and
  `model.generate`'s alike, so decoding stays exact with respect to plain q4
  decoding of the same prompt). Measured on a 2-core Xeon with AMX,
  SmolLM2-135M, 2 threads, a forward of 8 / 16 / 32 / 128 rows over an empty
  cache took 39 / 58 / 75 / 224 ms on q4 weights and 52 / 55 / 66 / 104 ms on
  the dense ones through oneDNN.

Q4 weights on 8-bit activations ("q4q8", `attach(..., act8=True)`, native kernel, float32 compute):
the Q4_1 layers and the Q8_0 head multiply the same codes by each input row quantised to 8 bits per
block of 32 (llama.cpp's Q8_1 / Q8_0), with integer dot products (AMX tiles or VNNI where the CPU has
them, AVX2 otherwise, the same bits on each; `native.q4q8_mm`). That rounding of the activations makes a slightly different target,
as bfloat16 compute does: greedy output under q4q8 is exact with respect to plain q4q8 decoding,
since a row is quantised and summed on its own at every block size.

Before it keeps a layer, `attach` checks that the codes dequantise to the very
weights the model holds (float32: bit for bit; bfloat16: after the same
rounding), so a wrong or mismatched file is refused. Greedy output under q4 is
exact with respect to q4 decoding (the engine runs every block size on one
kernel), not to dense bfloat16 or float32 decoding.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ModelLoadError
from . import fused, kernels, kv_cache, native

GROUP = 32                              # weights per Q4_1 block (along the input dimension)
_BLOCK_BYTES = 20                       # float16 d, float16 m, 16 bytes of 4-bit codes
_ATTR = "_mcsd_q4"
_JOINED = "_mcsd_q4_joined"       # (fused.Product, index) where siblings share one product
_ROWS = "_mcsd_q4_rows"           # (start, stop): the layer's rows in its (maybe joined) Q4Linear
Codes = tuple            # (q (N, K) uint8 in 0..15, d (N, K / 32) float16, m (N, K / 32) float16)
                         # or for a Q8_0 head: (q (N, K) int8, d (N, K / 32) float16, None)
HEAD = "lm_head"         # the name the LM head's Q8_0 codes go by (the tied token embedding, or `output`)
_Q8_BLOCK_BYTES = 34     # float16 d, 32 int8 codes
PREFILL_ROWS = 32        # a forward over an empty cache with this many rows reads the dense weights
_HOOKS = "_mcsd_q4_prefill_hooks"
NATIVE_SIBLINGS = fused.SIBLINGS + (("gate_proj", "up_proj"),)   # layers the native kernel runs as one product
_changes = [0]           # attach / detach calls so far: a plan made of the attached codes is stale once it moves


class _Forwards(threading.local):
    """Per thread, whether each q4 forward now running (innermost last) reads the dense weights."""

    def __init__(self):
        self.stack: list[bool] = []

    @property
    def dense(self) -> bool:
        return bool(self.stack) and self.stack[-1]


_local = _Forwards()
# GGUF tensor names of a llama-family block -> transformers module path inside decoder layer i
_LLAMA_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class Q4Error(ModelLoadError):
    """Q4 weights cannot be used for this model (file, weights, dtype, device or torch)."""


@functools.cache
def _torch_kernel_runs() -> bool:
    """torch's CPU int4 kernel runs here (probed once: `kernel_name` is asked at every layer and reset)."""
    try:
        q = torch.zeros(16, 64, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.zeros(64 // GROUP, 16, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 64, dtype=torch.bfloat16), packed, GROUP, sz)
        return True
    except (AttributeError, RuntimeError):
        return False


def kernel_name() -> str | None:
    """The q4 kernel this process runs: "native" (`mcsd.forward.native`, built from q4_kernel.c), else "torch"
    (torch's CPU int4 kernel), else None. One kernel for every layer and block size, so that a verify
    computes each row as a step does."""
    if native.library() is not None:
        return "native"
    return "torch" if _torch_kernel_runs() else None


def kernel_available() -> bool:
    """Some q4 kernel runs here."""
    return kernel_name() is not None


ON_CODES = ("q4", "q4q8")     # the weights options that run on a GGUF's codes (q4q8: on 8-bit activations)


def dtypes(weights: str = "q4") -> tuple[str, ...]:
    """The dtypes `weights` ("q4" or "q4q8") can compute in here: q4 on the native kernel float32 or
    bfloat16, on torch's int4 kernel bfloat16 only; q4q8 float32 on the native kernel (its activations
    are rounded to 8 bits whatever the dtype, and bfloat16 attention and norms only cost more), none
    elsewhere."""
    if weights == "q4q8":
        return ("float32",) if kernel_name() == "native" else ()
    return ("float32", "bfloat16") if kernel_name() == "native" else ("bfloat16",)


def compute_dtype() -> str:
    """The dtype q4 weights compute in where nothing was measured (`--dtype auto` weighs every compute
    dtype of `dtypes()` by its calibrated costs, `mcsd.decoding.choice`): float32 with the native kernel,
    bfloat16 with torch's int4 kernel (the only one it takes). On every CPU measured, float32
    activations ran the native kernel's q4 products faster than bfloat16 ones, which are widened to
    float32 inside the kernel while bfloat16 attention and norms cost more (`--stats` lists each
    candidate's rate from this machine's calibrated costs)."""
    return "float32" if kernel_name() == "native" else "bfloat16"


def describe_kernel() -> str:
    """The q4 kernel in words, for `--stats`."""
    name = kernel_name()
    if name == "native":
        return "mcsd's native kernel"
    why = native.reason()
    return f"torch's int4 kernel (the native one is not used: {why})" if name else "none"


def split_q4_1(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's blocks as codes, scales and offsets.

    Args:
        raw: (N, K / 32 * 20) uint8, one row per output feature, as a GGUF holds it.
    Returns:
        q (N, K) uint8 in 0..15, d (N, K / 32) float16, m (N, K / 32) float16.
    """
    n, row_bytes = raw.shape
    if row_bytes % _BLOCK_BYTES:
        raise ValueError(f"a Q4_1 row has a multiple of {_BLOCK_BYTES} bytes, not {row_bytes}")
    blocks = np.ascontiguousarray(raw).reshape(n, row_bytes // _BLOCK_BYTES, _BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]                      # (N, K/32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]                                                      # (N, K/32, 16)
    # element j of a block sits in the low nibble of byte j, element j + 16 in its high nibble
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)          # (N, K)
    return torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d.copy()), torch.from_numpy(m.copy())


def split_q8_0(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's blocks as codes and scales: q (N, K) int8, d (N, K / 32) float16."""
    n, row_bytes = raw.shape
    if row_bytes % _Q8_BLOCK_BYTES:
        raise ValueError(f"a Q8_0 row has a multiple of {_Q8_BLOCK_BYTES} bytes, not {row_bytes}")
    blocks = np.ascontiguousarray(raw).reshape(n, row_bytes // _Q8_BLOCK_BYTES, _Q8_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)
    return torch.from_numpy(q), torch.from_numpy(d.copy())


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The float32 weight d * q + m (Q4_1) or d * q (Q8_0, m None), (N, K), as a GGUF loader computes it."""
    n, k = q.shape
    w = q.view(n, k // GROUP, GROUP).float() * d.float()[..., None]
    if m is not None:
        w = w + m.float()[..., None]
    return w.view(n, k)


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of q / k projections (GGUF row i of
    the result is transformers' row i)."""
    half = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, half, 2).transpose(1, 2).reshape(n_rows)


class Q4Linear:
    """A linear layer's weight in the layout of the q4 kernel this process runs (`kernel_name()`):
    mcsd's native kernel (codes as the GGUF stores them, float32 scale / offset) or torch's int4 kernel
    (codes packed, bfloat16 scale / zero). `act8` (native only): its products on 8-bit activations, the
    codes, scales and offsets then in that product's 8-row interleaved layout (`interleave_q4`)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, act8: bool = False):
        n, k = q.shape
        self.out_features, self.in_features = n, k
        self.native = kernel_name() == "native"
        self.act8 = act8
        if act8 and not self.native:
            raise Q4Error(f"products on 8-bit activations run on mcsd's native kernel only ({native.reason()})")
        if act8:
            self.codes, self.d, self.m = interleave_q4(q, d, m)
            self.dtypes = (torch.float32,)
            return
        if self.native:
            blocks = q.to(torch.uint8).view(n, k // GROUP, GROUP)
            self.codes = (blocks[..., :GROUP // 2] | (blocks[..., GROUP // 2:] << 4)).contiguous().view(n, k // 2)
            self.d, self.m = d.float().contiguous(), m.float().contiguous()
            self.dtypes = (torch.float32, torch.bfloat16)
            return
        self.dtypes = (torch.bfloat16,)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        d32, m32 = d.float(), m.float()
        # the kernel computes (q - 8) * scale + zero, so zero = m + 8 d (exact in float32)
        self.scale_zero = torch.stack([d32, m32 + 8 * d32], dim=-1).transpose(0, 1).contiguous() \
            .to(torch.bfloat16)                                                 # (K/32, N, 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.native:
            x32 = rows.float().contiguous()
            out = native.q4q8_mm(x32, self.codes, self.d, self.m, self.out_features) if self.act8 else \
                native.q4_mm(x32, self.codes, self.d, self.m)
            out = out if x.dtype == torch.float32 else out.to(x.dtype)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, GROUP, self.scale_zero)
        return out.view(*x.shape[:-1], self.out_features)

    def dense(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start..stop-1 of the weight, dequantised as a GGUF loader does (native layout only)."""
        if not self.native:
            raise RuntimeError("torch's int4 layout is not read back; its layers keep their dense weights")
        if self.act8:
            q, d, m = deinterleave_q4(self.codes, self.d, self.m, self.out_features)
            return dequantize(q[start:stop], d[start:stop], m[start:stop]).to(dtype)
        blocks = self.codes[start:stop].view(stop - start, self.in_features // GROUP, GROUP // 2)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).view(stop - start, self.in_features)
        return dequantize(q, self.d[start:stop], self.m[start:stop]).to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as this kernel reads it."""
        parts = (self.codes, self.d, self.m) if self.native else (self.packed, self.scale_zero)
        return sum(t.nbytes for t in parts)

    def __deepcopy__(self, memo):
        # torch's layout: a copied model has dense weights of its own and runs on them until attached.
        # The native layout is the only copy of the weights (`attach` lets the dense ones go): a copy
        # shares it, read-only
        return self if self.native else None


class _SharedProduct(fused.Product):
    """A joined q4 product that a copied model shares (its codes are the weights' only copy)."""

    def __deepcopy__(self, memo):
        return self


class Q8Linear:
    """A Q8_0 weight (the LM head) on the native kernel: int8 codes and float32 scales; `act8`: its
    products on 8-bit activations (`native.q8q8_mm`), in that product's layout (`interleave_q8`)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, act8: bool = False):
        self.out_features, self.in_features = q.shape
        self.act8 = act8
        self.w128 = None
        if act8:
            self.codes, self.d, self.w128 = interleave_q8(q, d)
        else:
            self.codes, self.d = q.to(torch.int8).contiguous(), d.float().contiguous()
        self.dtypes = (torch.float32,) if act8 else (torch.float32, torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = native.q8q8_mm(rows, self.codes, self.d, self.w128, self.out_features) if self.act8 else \
            native.q8_mm(rows, self.codes, self.d)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.d.nbytes + (self.w128.nbytes if self.w128 is not None else 0)

    def __deepcopy__(self, memo):
        return self         # shared with a copied model, read-only, as the native Q4_1 layers' codes are


def _by_groups_of_8(t: torch.Tensor) -> torch.Tensor:
    """(N, ...) padded with zero rows to a multiple of 8, as (⌈N/8⌉, 8, ...)."""
    pad = -t.shape[0] % 8
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, 8, *t.shape[1:])


def _interleave_per_block(t: torch.Tensor) -> torch.Tensor:
    """A value per row and block of 32, t (N, K / 32), in the interleaved layout: (⌈N/8⌉, K / 32, 8)."""
    return _by_groups_of_8(t).transpose(1, 2).contiguous()


def interleave_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """Q4_1 codes q (N, K) in 0..15, d and m (N, K / 32) in the layout of the products on 8-bit
    activations (q4_kernel.c): the rows in groups of 8 (zero rows padding the last), codes (groups,
    K / 32, 4, 32) uint8, byte 4j + t of vector p holding row j's code at k = 4p + t (low nibble) and
    4(p + 4) + t (high nibble) of the block; d and m (groups, K / 32, 8) float32."""
    n, k = q.shape
    g = k // GROUP
    quads = _by_groups_of_8(q.to(torch.uint8)).view(-1, 8, g, 8, 4).permute(0, 2, 3, 1, 4)   # (o, g, quad, j, t)
    quads = quads.reshape(-1, g, 8, 32)
    codes = (quads[:, :, :4] | (quads[:, :, 4:] << 4)).contiguous()
    return codes, _interleave_per_block(d.float()), _interleave_per_block(m.float())


def deinterleave_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n: int):
    """`interleave_q4` undone: q (n, K) uint8, d and m (n, K / 32) float32."""
    groups, g = codes.shape[:2]
    quads = torch.cat([codes & 15, codes >> 4], dim=2).view(groups, g, 8, 8, 4).permute(0, 3, 1, 2, 4)
    q = quads.reshape(groups * 8, g * GROUP)[:n]
    return q, d.transpose(1, 2).reshape(groups * 8, g)[:n], m.transpose(1, 2).reshape(groups * 8, g)[:n]


def interleave_q8(q: torch.Tensor, d: torch.Tensor):
    """Q8_0 codes q (N, K) int8 and d (N, K / 32) in the layout of the products on 8-bit activations:
    codes (groups, K / 32, 8, 32) int8, byte 4j + t of vector p being row j's code at k = 4p + t of the
    block; d (groups, K / 32, 8) float32; w128 likewise int32, 128 x each block's sum of codes."""
    n, k = q.shape
    g = k // GROUP
    rows = _by_groups_of_8(q.to(torch.int8))                                                 # (o, 8, K)
    codes = rows.view(-1, 8, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, g, 8, 32).contiguous()
    w128 = (rows.view(-1, 8, g, GROUP).sum(-1, dtype=torch.int32) * 128).transpose(1, 2).contiguous()
    return codes, _interleave_per_block(d.float()), w128


def _q4_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    q4 = layer.__dict__.get(_ATTR)
    if q4 is not None and x.dtype in q4.dtypes and not x.requires_grad and not _local.dense:
        joined = layer.__dict__.get(_JOINED)
        # siblings share one product; each adds its own bias as it is now (edited in place or replaced)
        out = joined[0].part(x, joined[1]) if joined is not None else q4(x)
        return out if layer.bias is None else out + layer.bias
    weight = layer.weight
    if weight.is_meta:          # let go by `attach`: another dtype, or autograd, reads it dequantised
        weight = q4.dense(*layer.__dict__[_ROWS], x.dtype)
    return F.linear(x, weight, layer.bias)


def read_codes(gguf_path: str | Path, num_heads: int, num_kv_heads: int) -> dict[str, Codes]:
    """The Q4_1 linear weights of a llama-family GGUF, by transformers module path.

    q / k projections come back in transformers' row order (llama.cpp permutes
    their rows for its rotary layout). A Q8_0 LM head (`output`, else the tied token
    embedding) comes back as `HEAD`. Tensors of other types are left out.
    Parsing a GGUF's metadata (its vocabulary) takes seconds; `codes` caches this and says so once.
    """
    try:
        import gguf
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:
        raise Q4Error(f"could not read {gguf_path} as a GGUF file: {exc.__class__.__name__}: {exc}") from exc
    out = {}
    heads = {t.name: t for t in reader.tensors if t.name in ("output.weight", "token_embd.weight")}
    head = heads.get("output.weight", heads.get("token_embd.weight"))
    if head is not None and head.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        q, d = split_q8_0(np.asarray(head.data))
        out[HEAD] = (q, d, None)
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LLAMA_NAMES or parts[3] != "weight" \
                or t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        q, d, m = split_q4_1(np.asarray(t.data))
        if parts[2] in ("attn_q", "attn_k"):
            order = _unpermute_rows(q.shape[0], num_heads if parts[2] == "attn_q" else num_kv_heads)
            q, d, m = q[order], d[order], m[order]
        out[f"model.layers.{parts[1]}.{_LLAMA_NAMES[parts[2]]}"] = (q, d, m)
    return out





def _cache_file(gguf_path: Path) -> Path:
    """Where the codes of `gguf_path` are cached; nothing is made or written (a complete read-only
    cache serves them as it is)."""
    from ..loading.cache import cache_dir
    st = gguf_path.stat()
    # "h8": the file also holds a Q8_0 head's codes (`HEAD`), when the GGUF has one
    return cache_dir() / "q4" / f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}-h8.safetensors"


def _keep(flat: dict, cached: Path) -> None:
    """Write the codes to the cache (whole or not at all); a cache that cannot be written is said in
    one line, and the codes serve this run only."""
    from safetensors.torch import save_file

    from ..config import ConfigError
    from ..loading.cache import cache_subdir, cache_writes, shared_modes
    from ..loading.progress import say
    try:
        folder = cache_subdir(cached.parent.name)
        with cache_writes(folder):
            tmp = cached.with_suffix(".tmp")
            save_file(flat, str(tmp))
            shared_modes(tmp)                           # safetensors writes 0600; nothing in it is secret
            tmp.replace(cached)
    except ConfigError as exc:
        say(f"{str(exc).split(';')[0]}; the 4-bit codes serve this run only")


def codes(gguf_path: str | Path, num_heads: int, num_kv_heads: int) -> tuple[dict[str, Codes], bool]:
    """`read_codes`, kept in the mcsd cache (safetensors, keyed by the file's name, size and
    modification time). Returns (codes, whether they came from the cache)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise Q4Error(f"GGUF file not found: {gguf_path}")
    cached = _cache_file(gguf_path)
    if cached.is_file():
        try:
            flat = load_file(str(cached))
            layers = {name.rsplit(".", 1)[0] for name in flat} - {HEAD}
            got = {name: (flat[f"{name}.q"], flat[f"{name}.d"], flat[f"{name}.m"]) for name in layers}
            # the cache holds two 4-bit codes a byte
            out = {name: (torch.stack([q & 15, q >> 4], -1).view(q.shape[0], -1), d, m)
                   for name, (q, d, m) in got.items()}
            if f"{HEAD}.q8" in flat:
                out[HEAD] = (flat[f"{HEAD}.q8"], flat[f"{HEAD}.d"], None)
            return out, True
        except (SafetensorError, OSError, KeyError, RuntimeError):
            pass                                                   # unreadable: rebuilt below
    from ..loading.progress import stage
    with stage(f"reading the 4-bit codes of {gguf_path.name} for q4 weights (once; cached in {cached.parent})"):
        out = read_codes(gguf_path, num_heads, num_kv_heads)
    flat = {}
    for name, (q, d, m) in out.items():
        if m is None:                                              # the Q8_0 head
            flat[f"{name}.q8"], flat[f"{name}.d"] = q.contiguous(), d.contiguous()
            continue
        flat[f"{name}.q"] = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        flat[f"{name}.d"], flat[f"{name}.m"] = d.contiguous(), m.contiguous()
    if flat:
        _keep(flat, cached)
    return out, False


CHECK_ROWS = 16          # rows per layer compared with the model's weights when the codes come from the cache


def attach(model: torch.nn.Module, gguf_path: str | Path, join: bool = True, act8: bool = False) -> int:
    """Run `model`'s linear layers on the Q4_1 codes of the GGUF it was loaded from.

    Every weight is compared with the codes' dequantisation when they are read
    from the GGUF; with codes from the cache, `CHECK_ROWS` rows of each layer
    (enough to tell another model's weights apart).

    Args:
        model: a transformers llama-family causal LM on the CPU, in a dtype of the kernel (`dtypes()`).
        gguf_path: the GGUF file its weights came from.
        join: sibling layers that read one input (q / k / v; on the native kernel the MLP's gate
            and up too) run as one product (`mcsd.forward.fused`).
        act8: the products on 8-bit activations (the weights "q4q8"; native kernel, float32).
    Returns:
        the number of layers attached. On the native kernel the Q4_1 layers' dense weights are
        let go (`_let_go`): the codes are then the only copy, for every block size.
    Raises:
        Q4Error: no kernel, wrong dtype or device, an unreadable file, an architecture
            whose tensors are not named as llama's, or weights that are not the file's.
    """
    _changes[0] += 1
    weight = model.get_input_embeddings().weight
    if weight.device.type != "cpu":
        raise Q4Error(f"q4 weights run on the CPU; the model is on {weight.device}")
    kernel = kernel_name()
    if kernel is None:
        raise Q4Error(f"no q4 kernel runs here: the native one is not used ({native.reason()}) and torch "
                      f"{torch.__version__} has no usable CPU int4 kernel (aten::_weight_int4pack_mm_for_cpu)")
    if act8 and kernel != "native":
        raise Q4Error(f"q4 weights on 8-bit activations run on mcsd's native kernel only; it is not used here "
                      f"({native.reason()})")
    allowed = dtypes("q4q8" if act8 else "q4")
    if str(weight.dtype).removeprefix("torch.") not in allowed:
        raise Q4Error(f"q4 weights{' on 8-bit activations' if act8 else ''} compute in {' or '.join(allowed)} "
                      f"here; the model is {str(weight.dtype).removeprefix('torch.')}")
    cfg = model.config
    found, from_cache = codes(gguf_path, cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
                              or cfg.num_attention_heads)
    if not any(m is not None for _, _, m in found.values()):             # a Q8_0 head alone is not q4
        raise Q4Error(f"{gguf_path} holds no Q4_1 linear weights of a llama-family model")
    if kernel != "native":
        found = {name: c for name, c in found.items() if name != HEAD}      # torch has no Q8_0 kernel
    layers = dict(model.named_modules())
    checked = {}                                      # id(layer) -> (layer, its codes)
    for path, (q, d, m) in found.items():
        layer = layers.get(path)
        if not isinstance(layer, torch.nn.Linear):
            raise Q4Error(f"{gguf_path}: the model has no linear layer {path} for the file's tensor")
        if tuple(q.shape) != tuple(layer.weight.shape):
            raise Q4Error(f"{gguf_path}: the weight for {path} is {tuple(q.shape)}, the model's "
                          f"{tuple(layer.weight.shape)}")
        rows = torch.linspace(0, q.shape[0] - 1, CHECK_ROWS).long() if from_cache else slice(None)
        if not torch.equal(dequantize(q[rows], d[rows], None if m is None else m[rows]).to(layer.weight.dtype),
                           layer.weight.detach()[rows]):
            raise Q4Error(f"{gguf_path}: the weight for {path} does not dequantise to the model's; "
                          f"the model was not loaded from this file")
        checked[id(layer)] = (layer, (q, d, m))
    # all or nothing: every layer was checked before any is attached (`kernels.pack` leaves these alone)
    # the native kernel joins the MLP's gate and up too (1-3% off a 1-row step of SmolLM2-135M on a
    # 2-core AVX2 EPYC, a 9-row one unchanged); torch's int4 kernel gained nothing from it (`mcsd.forward.fused`)
    siblings = NATIVE_SIBLINGS if kernel == "native" else fused.SIBLINGS
    groups = [g for g in fused.sibling_groups(model, siblings) if all(id(layer) in checked for layer in g)] \
        if join else []
    joined = {id(layer) for group in groups for layer in group}
    for group in groups:
        _join(group, [checked[id(layer)][1] for layer in group], act8)
    for key, (layer, (q, d, m)) in checked.items():
        if key not in joined:                         # joined ones: `_join`
            _put(layer, Q4Linear(q, d, m, act8) if m is not None else Q8Linear(q, d, act8))
        if kernel == "native" and m is not None:
            _let_go(layer)
    _install_prefill(model)
    return len(checked)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight (N, K), K a multiple of 32, as Q8_0 blocks, quantised by the `gguf` package as
    llama.cpp quantises them (d = max |w| / 127 per block of 32, stored in float16): codes (N, K) int8
    and float32 scales (N, K / 32). A Q8_0 weight's dequantisation comes back as its own codes."""
    import gguf
    q, d = split_q8_0(gguf.quants.quantize(weight.detach().float().cpu().numpy(), gguf.GGMLQuantizationType.Q8_0))
    return q, d.float()


def attach_q8(module: torch.nn.Module, act8: bool = False) -> int:
    """Run a drafter's float32 linear layers on Q8_0 codes of their own weights, on the native kernel;
    `act8`: their products on 8-bit activations (`native.q8q8_mm`), as a target on "q4q8" runs its own.

    A draft only proposes, so its rounding never reaches the output; a quarter of the bytes is most
    of a draft step's time on a CPU (a one-layer feature head reads ~35 MB of float32 weights a
    step). The float32 weights stay (the module is still trained and saved from them, and other
    dtypes and autograd run on them). Layers that already run on another path, or whose inputs are
    not a multiple of 32 wide, are left alone.

    Returns:
        the number of layers attached (0 where the native kernel is not in use).
    """
    if kernel_name() != "native":
        return 0
    _changes[0] += 1

    def codable(layer) -> bool:
        w = layer.weight
        return "forward" not in layer.__dict__ and _ATTR not in layer.__dict__ and not w.is_meta \
            and w.dtype == torch.float32 and w.device.type == "cpu" and w.shape[1] % GROUP == 0
    n = 0
    # siblings that read one input share one product (q / k / v, gate / up), as a target's do, so that
    # a decoder layer of the drafter runs as one native call (`LeanForward.native_layers`); Q8_0 codes
    # are per row, so the joined codes are each layer's own
    for group in fused.sibling_groups(module, NATIVE_SIBLINGS):
        if all(codable(layer) for layer in group):
            _share(group, Q8Linear(*quantize_q8_0(torch.cat([layer.weight for layer in group])), act8))
            n += len(group)
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and codable(layer):
            _put(layer, Q8Linear(*quantize_q8_0(layer.weight), act8))
            n += 1
    return n


def _put(layer: torch.nn.Linear, weight) -> None:
    """A linear layer's forward on `weight` (a Q4Linear or Q8Linear of its own, all of its rows)."""
    layer.__dict__[_ATTR] = weight
    layer.__dict__[_ROWS] = (0, weight.out_features)
    layer.__dict__["forward"] = types.MethodType(_q4_forward, layer)


def _let_go(layer: torch.nn.Linear) -> None:
    """Drop a layer's dense weight: the native kernel reads its codes at every block size, prompts
    included, so the weights are held once. A meta tensor keeps the weight's shape and dtype in its
    place (for code that reads them); `detach` dequantises it back."""
    w = layer.weight
    layer.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)


def starts_dense(rows: int, cached: int) -> bool:
    """A forward of `rows` rows after `cached` cached positions reads a q4 model's dense weights: it
    starts a sequence with at least `PREFILL_ROWS` rows, on a CPU where oneDNN runs bfloat16."""
    return cached == 0 and rows >= PREFILL_ROWS and kernels.switchable(torch.bfloat16, "cpu") \
        and kernel_name() == "torch"


def _before_forward(model, args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    rows = ids.shape[-1] if ids is not None else embeds.shape[-2] if embeds is not None else 0
    cached = kv_cache.cache_length(kwargs.get("cache", kwargs.get("past_key_values")))
    _local.stack.append(starts_dense(rows, cached))             # a forward inside another keeps its own


@contextlib.contextmanager
def forward_rows(model: torch.nn.Module, rows: int, cached: int):
    """What `model`'s q4 hooks do around a call of the model, around a forward that runs its layers
    without calling it (the engine's own forward, `mcsd.forward.llama`): a forward of `rows` rows after
    `cached` cached positions reads the dense weights where `starts_dense` says so. Nothing for a
    model without q4 weights."""
    if _HOOKS not in model.__dict__:
        yield
        return
    _local.stack.append(starts_dense(rows, cached))
    try:
        yield
    finally:
        _local.stack.pop()


def _after_forward(model, args, kwargs, output):
    if _local.stack:
        _local.stack.pop()


def _install_prefill(model: torch.nn.Module) -> None:
    if _HOOKS not in model.__dict__:
        model.__dict__[_HOOKS] = (model.register_forward_pre_hook(_before_forward, with_kwargs=True),
                                  model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True))


def _join(group: list[torch.nn.Linear], group_codes: list[Codes], act8: bool = False) -> None:
    """Sibling layers on one int4 product: their codes concatenated along the output dimension."""
    q, d, m = (torch.cat(parts) for parts in zip(*group_codes))
    whole = Q4Linear(q, d, m, act8)
    _share(group, whole, shared=whole.native)


def _share(group: list[torch.nn.Linear], whole, shared: bool = True) -> None:
    """Sibling layers on one coded weight `whole` (their rows one after another), each adding its own
    bias to its slice of the product (`_q4_forward`); `shared`: a copied model shares it (the codes are
    the weights' only copy, or read-only codes of their own)."""
    product = (_SharedProduct if shared else fused.Product)([layer.out_features for layer in group], whole)
    start = 0
    for i, layer in enumerate(group):
        layer.__dict__[_ATTR] = whole                  # the marker `attached` counts; the product reads it
        layer.__dict__[_JOINED] = (product, i)
        layer.__dict__[_ROWS] = (start, start + layer.out_features)
        layer.__dict__["forward"] = types.MethodType(_q4_forward, layer)
        start += layer.out_features


def detach(model: torch.nn.Module) -> None:
    """Back to the dense weights everywhere (dequantised again where `attach` let them go)."""
    _changes[0] += 1
    for hook in model.__dict__.pop(_HOOKS, ()):
        hook.remove()
    for layer in model.modules():
        if _ATTR in layer.__dict__:
            if layer.weight.is_meta:                     # let go by `attach`: dequantised back
                q4 = layer.__dict__[_ATTR]
                layer.weight = torch.nn.Parameter(q4.dense(*layer.__dict__[_ROWS], layer.weight.dtype),
                                                  requires_grad=False)
            del layer.__dict__[_ATTR]
            layer.__dict__.pop(_JOINED, None)
            layer.__dict__.pop(_ROWS, None)
            layer.__dict__.pop("forward", None)


def read_bytes(layer: torch.nn.Module) -> tuple[int, int] | None:
    """(identity, bytes) of the coded weight a layer's forward reads (Q4_1 codes, scales and zero
    points, or Q8_0 codes and scales), or None where none is attached; joined siblings share one
    identity."""
    q4 = layer.__dict__.get(_ATTR)
    if q4 is None:
        return None
    return id(q4), q4.nbytes


def code_bits(layer: torch.nn.Module) -> int | None:
    """4 or 8: the width of the codes a layer's forward reads (`attach`, `attach_q8`); None for none."""
    codes = layer.__dict__.get(_ATTR)
    return None if codes is None else 8 if isinstance(codes, Q8Linear) else 4


def on_8bit_activations(model: torch.nn.Module) -> bool:
    """`model`'s coded layers multiply 8-bit activations (the weights "q4q8", `attach(..., act8=True)`)."""
    return any(getattr(layer.__dict__.get(_ATTR), "act8", False) for layer in model.modules())


def weights_name(model: torch.nn.Module) -> str:
    """What `model`'s linear layers run on: "q4q8", "q4" or "dense"."""
    return ("q4q8" if on_8bit_activations(model) else "q4") if attached(model) else "dense"


def changes() -> int:
    """A count that moves whenever any model's q4 weights are attached or detached."""
    return _changes[0]


def native_rows(layer: torch.nn.Module) -> tuple[Q4Linear | Q8Linear, int, int] | None:
    """(the native Q4_1 or Q8_0 weight a layer's forward reads, the layer's first and end row in it)
    where it reads one (joined siblings share it), else None."""
    codes = layer.__dict__.get(_ATTR)
    if not isinstance(codes, Q8Linear) and not (isinstance(codes, Q4Linear) and codes.native):
        return None
    return (codes, *layer.__dict__[_ROWS])


def row_invariant(layer: torch.nn.Module, dtype: torch.dtype) -> bool:
    """A forward of `layer` on `dtype` rows now computes each row on its own, in a fixed order (mcsd's
    native Q4_1 or Q8_0 product): a row's result is the same whatever rows run beside it."""
    rows = native_rows(layer)
    return rows is not None and dtype in rows[0].dtypes and not _local.dense


def attached(model: torch.nn.Module) -> int:
    """How many of `model`'s layers run on q4 weights."""
    return sum(1 for layer in model.modules() if layer.__dict__.get(_ATTR) is not None)


def joined(model: torch.nn.Module) -> int:
    """How many of `model`'s q4 layers share one int4 product with their siblings (`mcsd.forward.fused`)."""
    return sum(1 for layer in model.modules() if layer.__dict__.get(_JOINED) is not None)
