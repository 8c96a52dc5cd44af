"""The engine's native library (`q4_kernel.c`): the Q4_1 and Q8_0 products of q4 weights (on float32
activations, or on activations rounded to 8 bits with integer dot products: AMX tiles, VNNI or AVX2,
chosen from the CPU's flags, the weights "q4q8"), an RMS norm, attention over a static cache, and a whole
Llama-family decoder layer on Q4_1 weights in one call, built once per machine with the C compiler.

torch's CPU int4 kernel dequantises its weights again for every block of a few rows, so a 9-row
tree verify costs several 1-row steps. `q4_kernel.c` dequantises a block of output rows once and
reads it with every input row, and it computes each row exactly as it would alone (see the file).

The source ships with the package; the first use compiles it with `$CC` (else `cc`) into the mcsd
cache, keyed by the source, the flags and the compiler, and loads it with ctypes. Each optional path
of the 8-bit products (AVX-VNNI, AVX512-VNNI, AMX) is first test-compiled as a small snippet; one the
compiler or assembler cannot build is left out of the library (`-DMCSD_NO_<path>`), the rest still
built, and `reason()` names it. It is used only on
x86-64 Linux CPUs with AVX2 and FMA, and only where it shares torch's OpenMP runtime (a second
runtime's threads would spin against torch's on the same cores). Anything else (no compiler, another
CPU, a failed build, `MCSD_NATIVE=0`) leaves the q4 weights on torch's int4 kernel, and `reason()`
says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..config import ConfigError

SOURCE = Path(__file__).with_name("q4_kernel.c")
FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]
LIBS = ["-lm"]
VERSION = 32                           # mcsd_q4_abi() of q4_kernel.c; cost profiles are keyed by it too
_lock = threading.Lock()
_state: dict = {}                       # "lib": the loaded library or None, "reason": why not


class _Weight(ctypes.Structure):
    """mcsd_q4w: a Q4_1 weight (N, K), or a Q8_0 one (q8, its w128 on 8-bit activations), and its
    optional bias."""
    _fields_ = [("codes", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("w128", ctypes.c_void_p), ("q8", ctypes.c_int)]


class LayerWeights(ctypes.Structure):
    """mcsd_layer_t: one decoder layer's weights as `layers` reads them (see `layer_weights`)."""
    _fields_ = [("norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("eps", ctypes.c_float), ("post_eps", ctypes.c_float),
                ("qk_eps", ctypes.c_float), ("scale", ctypes.c_float), ("qkv", _Weight), ("o", _Weight),
                ("gate_up", _Weight), ("down", _Weight), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("act8", ctypes.c_int)]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


INT8_ISAS = ("avx2", "avxvnni", "avx512vnni", "amx")     # mcsd_int8_isa's numbering
# the CPU flags each needs (AMX's scaling runs on AVX-512; Linux must also grant the tile state)
_ISA_FLAGS = {"avx2": set(), "avxvnni": {"avx_vnni"}, "avx512vnni": {"avx512_vnni", "avx512vl"},
              "amx": {"amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def _isas(lib) -> dict[str, str | None]:
    """For each of INT8_ISAS, why `lib`'s 8-bit products cannot run on it here, or None where they can."""
    flags, built = _cpu_flags(), lib.mcsd_int8_isas_built()
    why = {}
    for i, name in enumerate(INT8_ISAS):
        lacks = sorted(_ISA_FLAGS[name] - flags)
        why[name] = (f"this CPU lacks {', '.join(lacks)}" if lacks
                     else "the compiler cannot build it" if not built >> i & 1
                     else "Linux did not grant the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
                     if name == "amx" and lib.mcsd_amx_grant() != 0 else None)
    return why


def int8_isas_here() -> tuple[str, ...]:
    """The instruction sets the products on 8-bit activations can run on here, the one used first:
    AMX tiles (a tile product a block of 16 rows x 16 outputs; fewer than 6 rows run on AVX512-VNNI),
    AVX512-VNNI (on 512-bit registers), AVX-VNNI, AVX2's maddubs; only those the
    CPU has, the library was built with and (AMX) Linux grants. All compute the same bits (see
    q4_kernel.c). Empty where the native library is not used."""
    if library() is None:
        return ()
    return tuple(name for name in reversed(INT8_ISAS) if _state["isas"][name] is None)


def int8_isa_absent(name: str) -> str | None:
    """Why the products on 8-bit activations cannot run on `name` here (None where they can)."""
    if library() is None:
        return f"the native kernel is not used: {reason()}"
    return _state["isas"].get(name.replace("-", ""), f"no instruction set is called {name!r}")


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {os.path.realpath(line.split()[-1]) for line in maps.splitlines()
            if any(n in line.rsplit("/", 1)[-1] for n in names)}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


# each optional path of q4_kernel.c and a snippet of the constructs it needs: where the snippet does not
# compile and assemble, the library is built with -DMCSD_NO_<path> (that path left out, the rest kept)
_PROBES = {
    "AVXVNNI": """#include <immintrin.h>
__m256i f(__m256i a, __m256i u, __m256i s) { __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(a) : "x"(u), "x"(s)); return a; }
""",
    "AVX512VNNI": """#include <immintrin.h>
#include <stdint.h>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
void f(const uint8_t *c, const int32_t *p, float *o) {
    __m512i a = _mm512_setzero_si512();
    const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)c)),
                                         _mm256_loadu_si256((const __m256i *)(c + 32)), 1);
    __asm__("vpdpbusd %2, %1, %0" : "+v"(a) : "v"(u), "v"(u));
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(a) : "v"(u), "m"(*p));
    _mm512_mask_storeu_ps(o, (__mmask16)255, _mm512_cvtepi32_ps(a));
}
""",
    "AMX": """#define _DEFAULT_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
void f(const int8_t *a, int32_t *c, float *o, const float *d) {
    __asm__ volatile("ldtilecfg %0" :: "m"(*a));
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm2" :: "r"(a), "r"((int64_t)32) : "memory");
    __asm__ volatile("tilezero %%tmm0" ::);
    __asm__ volatile("tdpbssd %%tmm4, %%tmm2, %%tmm0" ::);
    __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" :: "r"(c), "r"((int64_t)64) : "memory");
    __asm__ volatile("tilerelease" ::: "memory");
    const __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(d)), _mm256_loadu_ps(d + 8), 1);
    const __m512i w = _mm512_inserti64x4(_mm512_set1_epi8(15), _mm256_loadu_si256((const __m256i *)a), 1);
    _mm512_store_si512(c, _mm512_and_si512(_mm512_srli_epi16(w, 4), w));
    _mm512_mask_storeu_ps(o, (__mmask16)255, _mm512_fmadd_ps(v, _mm512_cvtepi32_ps(_mm512_load_si512(c)), v));
}
long g(void) { return syscall(SYS_arch_prctl, 0x1023, 18); }
""",
}


def _left_out(cc: str, folder: Path) -> list[str]:
    """The -DMCSD_NO_<path> flags for the optional paths `cc` cannot build with FLAGS."""
    out = []
    for name, snippet in _PROBES.items():
        src = folder / f"probe_{name.lower()}.c"
        src.write_text(snippet)
        try:
            proc = subprocess.run([cc, *(f for f in FLAGS if f != "-shared"), "-c", str(src), "-o",
                                   str(src.with_suffix(".o"))], capture_output=True, text=True, timeout=60,
                                  check=False)
            ok = proc.returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if not ok:
            out.append(f"-DMCSD_NO_{name}")
    return out


def _build(cc: str) -> Path:
    from ..loading.cache import cache_dir, cache_subdir, cache_writes
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    probes = "".join(_PROBES.values())
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS + LIBS).encode() + version.encode()
                         + probes.encode()).hexdigest()[:16]
    lib = cache_dir() / "native" / f"q4_kernel-{key}.so"
    if lib.is_file():                                   # built before: a read-only cache serves it
        return lib
    folder = cache_subdir("native")                     # checked writable before the build
    from ..loading.progress import stage
    with cache_writes(folder), tempfile.TemporaryDirectory(dir=folder) as tmp, \
            stage(f"compiling the q4 kernel with {Path(cc).name} (once; cached in {folder})"):
        out = Path(tmp) / lib.name
        left_out = _left_out(cc, Path(tmp))
        proc = subprocess.run([cc, *FLAGS, *left_out, str(SOURCE), "-o", str(out), *LIBS], capture_output=True,
                              text=True, timeout=300, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-400:]}")
        out.replace(lib)
    return lib


def _load():
    if os.environ.get("MCSD_NATIVE", "1") == "0":
        return None, "MCSD_NATIVE=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"built for x86-64 Linux only ({platform.system()} {platform.machine()})"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (set CC, or install gcc)"
    before = _openmp_runtimes()
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError, ConfigError) as exc:
        # a compiler error, an unwritable cache, a library that will not load
        return None, f"the native kernel could not be built: {exc}"
    if len(_openmp_runtimes()) > max(1, len(before)):
        return None, "the native kernel would start an OpenMP runtime beside torch's"
    lib.mcsd_q4_abi.restype = ctypes.c_int
    if lib.mcsd_q4_abi() != VERSION:
        return None, "the native kernel in the cache is of another version"
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mcsd_q4_mm.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]
    lib.mcsd_q4_mm.restype = ctypes.c_int
    lib.mcsd_q8_mm.argtypes = [p, i64, i64, p, p, i64, p, ctypes.c_int]
    lib.mcsd_q8_mm.restype = ctypes.c_int
    lib.mcsd_q4q8_mm.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]
    lib.mcsd_q4q8_mm.restype = ctypes.c_int
    lib.mcsd_q8q8_mm.argtypes = [p, i64, i64, p, p, p, i64, p, ctypes.c_int]
    lib.mcsd_q8q8_mm.restype = ctypes.c_int
    lib.mcsd_int8_isa.argtypes = [ctypes.c_int]
    lib.mcsd_int8_isa.restype = ctypes.c_int
    lib.mcsd_int8_isas_built.restype = ctypes.c_int
    lib.mcsd_amx_grant.restype = ctypes.c_int
    _state["isas"] = why = _isas(lib)
    lib.mcsd_int8_isa(max(i for i, name in enumerate(INT8_ISAS) if why[name] is None))
    # a set this CPU has that the library cannot run on, and why
    left = "".join(f"; not on {name}: {note}" for name, note in why.items() if note and "lacks" not in note)
    lib.mcsd_rms_norm.argtypes = [p, i64, i64, p, ctypes.c_float, p]
    lib.mcsd_rms_norm.restype = None
    lib.mcsd_attention.argtypes = [p, p, p, i64, i64, p, i64, i64, i64, i64, i64, ctypes.c_float, p, ctypes.c_int]
    lib.mcsd_attention.restype = ctypes.c_int
    lib.mcsd_attention_lanes.argtypes = [ctypes.c_int]
    lib.mcsd_attention_lanes.restype = ctypes.c_int
    lib.mcsd_layers.argtypes = [p, i64, p, p, i64, p, p, p, p, i64, i64, p, i64, p, i64, p, i64, p, i64,
                                ctypes.c_int]
    lib.mcsd_layers.restype = ctypes.c_int
    lib.mcsd_layers_slots.argtypes = [p, i64, p, p, i64, p, p, p, p, i64, i64, i64, i64, p, p, p, p, p, i64, p, i64,
                                      p, i64, ctypes.c_int]
    lib.mcsd_layers_slots.restype = ctypes.c_int
    lib.mcsd_top_p.argtypes = [p, i64, i64, ctypes.c_float, p, ctypes.c_int]
    lib.mcsd_top_p.restype = ctypes.c_int
    lib.mcsd_draw.argtypes = [p, i64, i64, ctypes.c_float, ctypes.c_float, p, p, ctypes.c_int]
    lib.mcsd_draw.restype = ctypes.c_int
    lib.mcsd_gumbel.argtypes = [p, i64, p, i64, i64, p]
    lib.mcsd_gumbel.restype = None
    lib.mcsd_keys.argtypes = [p, i64, i64, p, p, p]
    lib.mcsd_keys.restype = None
    lib.mcsd_topk.argtypes = [p, i64, i64, ctypes.c_int, p, ctypes.c_int]
    lib.mcsd_topk.restype = None
    return lib, "built from mcsd/forward/q4_kernel.c with " + Path(cc).name + left


def library():
    """The loaded native library, or None (then `reason()` says why). Built on first call."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["reason"] = _load()
        return _state["lib"]


def reason() -> str:
    """Why the native kernel is or is not in use."""
    library()
    return _state["reason"]


def reset() -> None:
    """Forget the loaded state (tests: to look again after changing MCSD_NATIVE)."""
    with _lock:
        _state.clear()


def _lib():
    lib = _state.get("lib") or library()          # no lock once loaded: a forward makes ~150 calls
    if lib is None:
        raise RuntimeError(f"the native q4 kernel is not available: {reason()}")
    return lib


def q4_mm(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 times the Q4_1 weight (codes (N, K / 2) uint8, d and m (N, K / 32) float32),
    transposed: (M, N) float32. Every tensor contiguous on the CPU; the caller checks shapes."""
    rows, k = x.shape
    out = torch.empty(rows, codes.shape[0], dtype=torch.float32)
    if _lib().mcsd_q4_mm(x.data_ptr(), rows, k, codes.data_ptr(), d.data_ptr(), m.data_ptr(), codes.shape[0],
                         out.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError("the native q4 kernel could not allocate its dequantisation buffer")
    return out


def q8_mm(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 times the Q8_0 weight (codes (N, K) int8, d (N, K / 32) float32), transposed."""
    rows, k = x.shape
    out = torch.empty(rows, codes.shape[0], dtype=torch.float32)
    if _lib().mcsd_q8_mm(x.data_ptr(), rows, k, codes.data_ptr(), d.data_ptr(), codes.shape[0], out.data_ptr(),
                         torch.get_num_threads()) != 0:
        raise MemoryError("the native q4 kernel could not allocate its dequantisation buffer")
    return out


def int8_isa(name: str | None = None) -> str:
    """The instruction set the products on 8-bit activations run on ("amx", "avx512vnni", "avxvnni" or
    "avx2"), the best of `int8_isas_here()` when the library loads; `name` sets it (tests: every set
    here computes the same bits; "avx512-vnni" spelt with a hyphen too). Raises ValueError for a set
    that cannot run here."""
    lib = _lib()
    if name is not None:
        key = name.replace("-", "")
        if key not in int8_isas_here():
            raise ValueError(f"the 8-bit products cannot run on {name!r} here; they can on {int8_isas_here()}")
        lib.mcsd_int8_isa(INT8_ISAS.index(key))
    return INT8_ISAS[lib.mcsd_int8_isa(-1)]


def _on_8bit_activations(product, x: torch.Tensor, weight: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
    """x (M, K) float32 times an 8-row interleaved weight of `n` rows through `product` (the library's
    q4q8 or q8q8 call, taking the weight's three tensors): (M, n) float32."""
    rows, k = x.shape
    out = torch.empty(rows, n, dtype=torch.float32)
    if product(x.data_ptr(), rows, k, *(t.data_ptr() for t in weight), n, out.data_ptr(),
               torch.get_num_threads()) != 0:
        raise MemoryError("the native q4 kernel could not allocate the quantised activations")
    return out


def q4q8_mm(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n: int) -> torch.Tensor:
    """x (M, K) float32, each row quantised to 8 bits per block of 32 (llama.cpp's Q8_1), times the
    Q4_1 weight of `n` rows in the 8-row interleaved layout (`quant.interleave_q4`: codes (⌈n/8⌉, K / 32,
    4, 32) uint8, d and m (⌈n/8⌉, K / 32, 8) float32) with integer dot products (see q4_kernel.c), transposed:
    (M, n) float32."""
    return _on_8bit_activations(_lib().mcsd_q4q8_mm, x, (codes, d, m), n)


def q8q8_mm(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, w128: torch.Tensor, n: int) -> torch.Tensor:
    """x (M, K) float32, each row quantised to 8 bits per block of 32 (llama.cpp's Q8_0), times the Q8_0
    weight of `n` rows in the 8-row interleaved layout (`quant.interleave_q8`: codes (⌈n/8⌉, K / 32, 8,
    32) int8, d (⌈n/8⌉, K / 32, 8) float32, w128 likewise int32) with integer dot products, transposed."""
    return _on_8bit_activations(_lib().mcsd_q8q8_mm, x, (codes, d, w128), n)


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """float32 `scores` (..., V) on the CPU -> (...) long, `scores.argmax(-1)`'s indices (the first of equal
    maxima; the first NaN where a row has one): `topk_indices` with k = 1."""
    v = scores.shape[-1]
    if v == 0:
        raise ValueError("argmax of an empty row")
    return topk_indices(scores.reshape(-1, v), 1).view(scores.shape[:-1])


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """float32 `scores` (R, V) on the CPU -> (R, k) long, the indices of each row's k largest, largest
    first (ties to the lower index, NaN above every number; -1 where a row has fewer than k entries;
    k <= 64), in one call per block of rows (see `mcsd_topk`)."""
    x = scores.contiguous()
    if x.dim() != 2 or not 1 <= k <= 64:
        raise ValueError(f"topk_indices takes (R, V) scores and 1 <= k <= 64, got {tuple(x.shape)} and k={k}")
    out = torch.empty(x.shape[0], k, dtype=torch.long)
    _lib().mcsd_topk(x.data_ptr(), x.shape[0], x.shape[1], k, out.data_ptr(), torch.get_num_threads())
    return out


def top_p(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """Nucleus filtering of float32 `scores` (..., V) on the CPU: -inf where a token is dropped (the
    probability of the tokens ranked above it, by score then by lower index, already reaches `mass`),
    in one call per block of rows instead of torch's sort or partial sorts (see `mcsd_top_p`)."""
    x = scores.contiguous()
    out = torch.empty_like(x)
    v = x.shape[-1]
    if _lib().mcsd_top_p(x.data_ptr(), x.numel() // v, v, mass, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("the native top-p filter could not allocate its scratch rows")
    return out


def draw(logits: torch.Tensor, temperature: float, mass: float, keys: torch.Tensor | int) -> torch.Tensor:
    """Gumbel-max draws from raw float32 `logits` (R, V) on the CPU, each row scaled as sampling scales
    it ((x - max) / temperature, the values of `mcsd.core.sampling.processed_scores` before its
    filters) and nucleus-filtered with `mass` (none at 1), row r under position key `keys[r]` ((R,)
    int64, the bits of a uint64; for one row, its key as a host int: no tensor made for it, which
    right after a forward costs tens of microseconds): (R,) long, the kept token with the largest
    score + noise (see `mcsd_draw`)."""
    x = logits.contiguous()
    if isinstance(keys, int):
        key = ctypes.c_uint64(keys & 0xFFFFFFFFFFFFFFFF)             # held here until the call returns
        key_ptr = ctypes.addressof(key)
    else:
        key = keys.contiguous()
        key_ptr = key.data_ptr()
    out = torch.empty(x.shape[0], dtype=torch.long)
    if _lib().mcsd_draw(x.data_ptr(), x.shape[0], x.shape[1], temperature, mass, key_ptr, out.data_ptr(),
                        torch.get_num_threads()):
        raise MemoryError("the native draw could not allocate its scratch rows")
    return out


def gumbel(keys: torch.Tensor, ids: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """Standard Gumbel noise for (R,) int64 position keys on the CPU: for the tokens ids (K,) at every
    key, (R, K) float32; with `pairs`, for (R,) ids, token r at key r, (R,) (see `mcsd_gumbel`)."""
    k, i = keys.contiguous(), ids.contiguous()
    cols = 1 if pairs else i.numel()
    out = torch.empty(k.numel(), cols, dtype=torch.float32)
    _lib().mcsd_gumbel(k.data_ptr(), k.numel(), i.data_ptr(), cols, 1 if pairs else 0, out.data_ptr())
    return out.view(-1) if pairs else out


def keys(scores: torch.Tensor, ids: torch.Tensor | None, position_keys: torch.Tensor) -> torch.Tensor:
    """Gumbel keys of float32 `scores` (R, K) on the CPU, row r under position key `position_keys[r]`
    ((R,) int64): scores + noise where a score is finite, -inf elsewhere, the noise of token `ids[c]`
    ((K,) int64; None: token c) as `gumbel` makes it, for the finite entries only (see `mcsd_keys`)."""
    x, k = scores.contiguous(), position_keys.contiguous()
    i = ids.long().contiguous() if ids is not None else None
    out = torch.empty_like(x)
    _lib().mcsd_keys(x.data_ptr(), x.shape[0], x.shape[1], i.data_ptr() if i is not None else None, k.data_ptr(),
                     out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMS norm of float32 `x` (..., K), K a multiple of 8, with float32 `weight` (K,):
    one call instead of torch's seven operations. Every tensor contiguous on the CPU."""
    out = torch.empty_like(x)
    k = x.shape[-1]
    _lib().mcsd_rms_norm(x.data_ptr(), x.numel() // k, k, weight.data_ptr(), eps, out.data_ptr())
    return out


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Attention of float32 queries q (Q, H, D) over the first `length` positions of a static cache's
    key / value buffers (H_kv, capacity, D), heads grouped, with an additive mask (Q, length) whose last
    dimension is contiguous: (Q, H, D). What torch's SDPA computes, in one call; each row on its own."""
    rows, heads, dim = q.shape
    kv_heads, capacity, _ = keys.shape
    out = torch.empty_like(q)
    if _lib().mcsd_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), capacity, length, mask.data_ptr(),
                             mask.stride(0), rows, heads, kv_heads, dim, scale, out.data_ptr(),
                             torch.get_num_threads()) != 0:
        raise MemoryError("the native attention could not allocate its scratch rows")
    return out


def attention_lanes(from_vectors: int | None = None) -> int:
    """From how many query vectors per key / value head (a block's rows times the heads sharing it) the
    native attention puts sixteen of them in the lanes of one AVX-512 vector (`attention_lanes` in
    q4_kernel.c) rather than computing one (row, head) at a time: the same bits either way, only the
    time differs. `from_vectors` sets it (tests); returns the one in use, 0 where that path is not here
    (no AVX-512, or a build without it)."""
    if from_vectors is not None and from_vectors < 1:
        raise ValueError(f"from_vectors must be positive, got {from_vectors}")
    return _lib().mcsd_attention_lanes(from_vectors or 0)


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype not in (torch.float32, torch.uint8, torch.int8, torch.int32) or not t.is_contiguous() \
            or t.device.type != "cpu":
        raise ValueError(f"the native layer reads contiguous float32 / uint8 / int8 / int32 CPU tensors, not "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t.data_ptr()


def layer_weights(norm, post_norm, q_norm, k_norm, eps: float, post_eps: float, qk_eps: float, scale: float,
                  products: dict, heads: int, kv_heads: int, head_dim: int, act8: bool = False) -> LayerWeights:
    """A decoder layer's weights for `layers`: float32 norm weights (q_norm / k_norm None where the model
    has none) and four products, `products[name] = (codes, d, m, bias or None, rows, columns, w128)` for
    "qkv" (rows q, k, v), "o", "gate_up" (rows gate, up) and "down": Q4_1 codes, or Q8_0 ones where m
    is None (w128: their block sums on 8-bit activations, else None); `act8`: the products on 8-bit
    activations (`q4q8_mm` / `q8q8_mm`, the codes in their layout).
    The result points into the tensors: the caller keeps them alive as long as it."""
    weights = {}
    for name in ("qkv", "o", "gate_up", "down"):
        codes, d, m, bias, n, k, w128 = products[name]
        weights[name] = _Weight(_ptr(codes), _ptr(d), _ptr(m), _ptr(bias), n, k, _ptr(w128), int(m is None))
    return LayerWeights(_ptr(norm), _ptr(post_norm), _ptr(q_norm), _ptr(k_norm), eps, post_eps, qk_eps, scale,
                        **weights, heads=heads, kv_heads=kv_heads, head_dim=head_dim, act8=int(act8))


def layer_array(weights: list[LayerWeights]):
    """The layers' weights as one array for `layers` (copies of the structures, which point into the
    same tensors: the caller keeps those alive as long as it)."""
    return (LayerWeights * len(weights))(*weights)


def layers(array, h: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor, slots: torch.Tensor, length: int, mask: torch.Tensor,
           keep: tuple[int, ...] = (), into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every decoder layer in one call (`mcsd_layers` in q4_kernel.c): `array` from `layer_array`, one
    entry a layer in order; float32 rows h (..., Q, C) in, `out` of its shape written (it may be h); the
    cache's whole key and value buffers (layers, 1, H_kv, capacity, D), each layer's keys and values
    written at `slots` (Q,) int64 and attended over their first `length` entries under the additive mask
    (Q, length) (last dimension contiguous); cos and sin (Q, D), sin signed as `mcsd.forward.llama`
    makes it. The rows after each layer in `keep` (1-based, each below the number of layers) are
    written into `into`'s tensors (of h's shape, rows `into[0].stride(-2)` floats apart, each row
    contiguous: column blocks of one joined buffer, say), or into new ones; returns those. Every
    tensor contiguous on the CPU but where said; the caller checks shapes."""
    rows = h.numel() // h.shape[-1]
    if into is None:
        into = list(torch.empty(len(keep), *h.shape).unbind(0)) if keep else []
    index = (ctypes.c_int64 * len(keep))(*keep) if keep else None
    targets = (ctypes.c_void_p * len(keep))(*[t.data_ptr() for t in into]) if keep else None
    if _lib().mcsd_layers(ctypes.addressof(array), len(array), h.data_ptr(), out.data_ptr(), rows, cos.data_ptr(),
                          sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.shape[3],
                          slots.data_ptr(), length, mask.data_ptr(), mask.stride(0), index, len(keep), targets,
                          into[0].stride(-2) if keep else 0, torch.get_num_threads()) != 0:
        raise MemoryError("the native layer could not allocate its buffers")
    return into


def layers_slots(array, h: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor, first: torch.Tensor, cache: torch.Tensor,
                 slots: torch.Tensor, lens: torch.Tensor, mask: torch.Tensor) -> None:
    """`layers` over the rows of several sequences at once (`mcsd_layers_slots`): float32 rows h (R, C),
    sequence i's rows first[i] .. first[i+1]-1 (first (S+1,) int64); the cache's whole key and value
    buffers (layers, B, H_kv, capacity, D), sequence i's the slice `cache[i]` ((S,) int64), its rows
    written there at `slots` (R,) int64 and attending over its first lens[i] entries (lens (S,) int64)
    under the rows of the additive mask (R, >= max lens) (last dimension contiguous). The products run
    once over all R rows; a row's result is what `layers` gives it in its own sequence's block, bit for
    bit."""
    if _lib().mcsd_layers_slots(ctypes.addressof(array), len(array), h.data_ptr(), out.data_ptr(),
                                h.numel() // h.shape[-1], cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
                                values.data_ptr(), keys.stride(0), keys.shape[3], keys.stride(1), lens.numel(),
                                first.data_ptr(), cache.data_ptr(), slots.data_ptr(), lens.data_ptr(),
                                mask.data_ptr(), mask.stride(0), None, 0, None, 0, torch.get_num_threads()) != 0:
        raise MemoryError("the native layer could not allocate its buffers")
