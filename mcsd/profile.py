"""Device cost profile: how long a target verify takes against tree size, and a draft step against width.

Measured once per (target, draft, dtype, device) and cached as JSON under
`<cache>/profiles/`. Tree policies read it to weigh a node's expected gain
against what it costs to draft and verify on *this* hardware.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import kernels, kv_cache
from .cache import cache_dir, cache_writes
from .lm import CachedLM
from .tree import causal_allowed

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)
ATEN_MAX_ROWS = 16          # block sizes up to this are also timed through ATen's kernels (mcsd.kernels)
CALIBRATION_REPEATS = 5     # the quick measurement a first generation makes (a few seconds)


@dataclass
class DeviceProfile:
    """Latencies in milliseconds, median over repeated interleaved runs.

    Attributes:
        verify_ms: {tree tokens: target forward time} with a `prefix_len` cache,
            through torch's default matmul path.
        draft_ms: {tokens: draft forward time} (empty without a draft).
        verify_aten_ms, draft_aten_ms: the same through ATen's kernels instead of
            oneDNN, for small blocks, where the two differ (`mcsd.kernels`);
            empty elsewhere.
        verify_packed_ms, draft_packed_ms: the same through oneDNN on prepacked
            weights (`mcsd.kernels.pack`), every size; empty where weights cannot
            be prepacked.
        meta: model names, dtype, device, backend, thread count, torch version.
    """

    verify_ms: dict[int, float]
    draft_ms: dict[int, float] = field(default_factory=dict)
    prefix_len: int = 200
    meta: dict = field(default_factory=dict)
    verify_aten_ms: dict[int, float] = field(default_factory=dict)
    draft_aten_ms: dict[int, float] = field(default_factory=dict)
    verify_packed_ms: dict[int, float] = field(default_factory=dict)
    draft_packed_ms: dict[int, float] = field(default_factory=dict)

    def paths(self, role: str) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """(default path, ATen path, prepacked path) timings of the target ("verify") or the draft ("draft")."""
        if role == "verify":
            return self.verify_ms, self.verify_aten_ms, self.verify_packed_ms
        return self.draft_ms, self.draft_aten_ms, self.draft_packed_ms

    def kernel_table(self, role: str) -> kernels.KernelTable | None:
        """Which matmul path each block size of `role` runs fastest on; None where only one path was timed."""
        default, aten, packed = self.paths(role)
        return kernels.KernelTable(default, aten, packed) if default and (aten or packed) else None

    def best_ms(self, role: str) -> dict[int, float]:
        """{size: ms} on the fastest path per measured size (what the engine runs)."""
        default, aten, packed = self.paths(role)
        return {n: min(ms, aten.get(n, ms), packed.get(n, ms)) for n, ms in default.items()}

    def verify_cost(self, n_tokens: int) -> float:
        """Interpolated verify time for n tokens (linear between measured sizes, flat outside),
        on the faster matmul path."""
        return interpolate(self.best_ms("verify"), n_tokens)

    def draft_cost(self, n_tokens: int) -> float:
        return interpolate(self.best_ms("draft"), n_tokens) if self.draft_ms else 0.0

    def to_json(self) -> str:
        d = asdict(self)
        for name in _TABLES:
            d[name] = {str(k): v for k, v in getattr(self, name).items()}
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        d = json.loads(text)
        table = lambda name: {int(k): float(v) for k, v in d.get(name, {}).items()}   # noqa: E731
        if not table("verify_ms"):
            raise KeyError("verify_ms")
        return cls(**{name: table(name) for name in _TABLES},
                   prefix_len=int(d.get("prefix_len", 200)), meta=dict(d.get("meta", {})))


_TABLES = ("verify_ms", "draft_ms", "verify_aten_ms", "draft_aten_ms", "verify_packed_ms", "draft_packed_ms")


def interpolate(table: dict[int, float], n: float) -> float:
    """Linear between measured sizes, flat below the smallest, proportional past the largest."""
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if n <= hi:
            return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)
    return table[xs[-1]] * n / xs[-1]                 # past the largest size: proportional


# ISA flags that change what batched work costs on a CPU (native bf16 / fp16 matmuls, AMX tiles).
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "fma")


@functools.lru_cache(maxsize=None)
def machine_info(device: str = "cpu") -> dict:
    """What the costs depend on besides the models: the processor (model name and ISA flags)
    or the GPU (name, memory, driver, CUDA), and the torch version."""
    info = {"machine": platform.machine(), "torch": torch.__version__}
    try:
        cpuinfo = open("/proc/cpuinfo").read()
    except OSError:
        cpuinfo = ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    info["cpu"] = names[0] if names else (platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    info["cpu_flags"] = [f for f in _CPU_FLAGS if f in flags]
    # what torch makes of them (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA can lower both)
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["onednn_bf16"] = kernels.switchable(torch.bfloat16, "cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, driver=_nvidia_driver())
    return info


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(device: torch.device, fn) -> float:
    """Wall time of fn() in milliseconds, synchronised on CUDA."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1000


class _ModelTimer:
    """A causal LM holding a prefix_len cache; times a block of n fresh tokens and drops it again."""

    def __init__(self, model, prefix_len: int, gen: torch.Generator):
        self.lm, self.prefix_len, self.gen = CachedLM(model), prefix_len, gen
        self.dtype, self.device = self.lm.dtype, self.lm.device
        self.vocab = model.get_input_embeddings().weight.shape[0]
        self.lm.reset()
        self.lm.extend(torch.randint(0, self.vocab, (prefix_len,), generator=gen).to(self.lm.device))

    @torch.inference_mode()
    def latency(self, n: int) -> float:
        lm = self.lm
        tokens = torch.randint(0, self.vocab, (n,), generator=self.gen).to(lm.device)
        pos = torch.arange(self.prefix_len, self.prefix_len + n, device=lm.device)
        elapsed = _ms(lm.device, lambda: lm.forward(tokens, pos, causal_allowed(n, lm.device)))
        lm.commit(self.prefix_len, torch.zeros(0, dtype=torch.long, device=lm.device))   # back to the prefix
        return elapsed


class _HeadTimer:
    """A target-feature drafter holding a prefix_len cache; times one step over n tree nodes
    (head forward and its LM-head scores) and drops it again."""

    def __init__(self, drafter, prefix_len: int, gen: torch.Generator):
        self.drafter, self.prefix_len, self.gen = drafter, prefix_len, gen
        self.dtype, self.device = drafter.dtype, drafter.device
        self.vocab = drafter.embed.weight.shape[0]
        drafter.reset()
        self._run(prefix_len, start=0)

    @torch.inference_mode()
    def _run(self, n: int, start: int) -> torch.Tensor:
        d = self.drafter
        feats = torch.randn(n, d.head.cfg.target_hidden, generator=self.gen).to(d.device, d.dtype)   # (n, H)
        tokens = torch.randint(0, self.vocab, (n,), generator=self.gen).to(d.device)
        return d._run(feats, tokens, torch.arange(start, start + n, device=d.device), causal_allowed(n, d.device))

    @torch.inference_mode()
    def latency(self, n: int) -> float:
        d = self.drafter
        elapsed = _ms(d.device, lambda: d.head.scores(self._run(n, start=self.prefix_len)))
        kv_cache.truncate(d.cache, self.prefix_len)
        return elapsed


def measure(target, draft=None, sizes=DEFAULT_SIZES, prefix_len: int = 200, repeats: int = 20,
            draft_sizes=(1, 2, 4, 8, 16, 32)) -> DeviceProfile:
    """Measure verify latency per tree size (and draft latency per level width), interleaved.

    `draft` is a causal LM or a target-feature drafter (`mcsd.feature_draft`).
    Sizes are visited in a shuffled order each repeat so that drift (thermal,
    other load) spreads evenly; the median of `repeats` runs is kept. Where
    oneDNN and ATen kernels both could run the matrix products (bfloat16 or
    float16 on a CPU with native support, `mcsd.kernels.switchable`), blocks
    up to `ATEN_MAX_ROWS` are also timed on ATen, and every block on prepacked
    oneDNN weights (`mcsd.kernels.pack`; the copies are dropped again unless the
    model had them before), interleaved the same way.
    """
    gen = torch.Generator().manual_seed(0)
    timers = {"verify": (_ModelTimer(target, prefix_len, gen), sizes)}
    if draft is not None:
        timer = (_HeadTimer if _is_feature_drafter(draft) else _ModelTimer)(draft, prefix_len, gen)
        timers["draft"] = (timer, draft_sizes)
    verify_lm = timers["verify"][0].lm
    both = {role: kernels.switchable(t.dtype, t.device) for role, (t, _) in timers.items()}
    modules = {"verify": target, "draft": drafter_module(draft) if draft is not None else None}
    packs = {role: modules[role] is not None and kernels.packable(t.dtype, t.device)
             for role, (t, _) in timers.items()}
    plan = [(role, n, path) for role, (_, ns) in timers.items() for n in ns for path in kernels.PATHS
            if path == "onednn" or (path == "aten" and both[role] and n <= ATEN_MAX_ROWS)
            or (path == "packed" and packs[role])]
    saved = getattr(draft, "kernels", None)
    if draft is not None and _is_feature_drafter(draft):
        draft.kernels = None                                                     # timed on the path chosen here
    made = [m for role, m in modules.items() if packs.get(role) and not kernels.is_packed(m)]
    for module in made:
        kernels.pack(module)

    def latency(role, n, path):
        with kernels.using(path) if both[role] or packs[role] else contextlib.nullcontext():
            return timers[role][0].latency(n)

    try:
        for step in plan:
            latency(*step)                                                       # warm-up
        samples: dict[tuple[str, int, str], list[float]] = {}
        for _ in range(repeats):
            for i in torch.randperm(len(plan), generator=gen).tolist():
                samples.setdefault(plan[i], []).append(latency(*plan[i]))
    finally:
        if draft is not None and _is_feature_drafter(draft):
            draft.kernels = saved
        for module in made:
            kernels.unpack(module)
    med = {k: statistics.median(v) for k, v in samples.items()}
    meta = {"target": _model_name(target), "draft": _model_name(draft) if draft is not None else None,
            "dtype": str(verify_lm.dtype).replace("torch.", ""), "device": str(verify_lm.device),
            "attention": getattr(target.config, "_attn_implementation", None),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": repeats,
            "host": machine_info(str(verify_lm.device))}

    def table(role, ns, path):
        return {n: med[(role, n, path)] for n in ns if (role, n, path) in med}
    return DeviceProfile(verify_ms=table("verify", sizes, "onednn"), draft_ms=table("draft", draft_sizes, "onednn"),
                         verify_aten_ms=table("verify", sizes, "aten"), draft_aten_ms=table("draft", draft_sizes, "aten"),
                         verify_packed_ms=table("verify", sizes, "packed"),
                         draft_packed_ms=table("draft", draft_sizes, "packed"),
                         prefix_len=prefix_len, meta=meta)


def drafter_module(draft) -> torch.nn.Module | None:
    """The module whose linear layers a drafter's forwards run through (a feature drafter's head,
    a draft model itself), or None."""
    if _is_feature_drafter(draft):
        return draft.head
    return draft if isinstance(draft, torch.nn.Module) else getattr(draft, "model", None)


# Shapes a profile can stand in for where the weights cannot go (Llama architecture, random weights):
# latency depends on shapes and dtype, not on weight values.
STAND_INS = {
    # the embedded preset's target, SmolLM2-135M-Instruct
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    # a ~1.1B Llama (TinyLlama-1.1B shapes)
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                     num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096),
}


def stand_in(name: str, dtype=torch.bfloat16, device="cpu"):
    """A randomly initialised LlamaForCausalLM with the shapes of `STAND_INS[name]`, in eval mode,
    built directly on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from .models import parse_dtype
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**STAND_INS[name]))
    model.config._name_or_path = f"stand-in:{name}"
    return model.to(parse_dtype(dtype)).eval().requires_grad_(False)


def _is_feature_drafter(draft) -> bool:
    return getattr(draft, "uses_target_hidden", False) and hasattr(draft, "head")


def _model_name(model) -> str:
    if _is_feature_drafter(model):
        return f"feature-head:{model.name}"
    return str(getattr(model.config, "_name_or_path", "") or model.config.model_type)


def _model_key(model) -> str:
    # the name, plus the shape of what runs: models saved without a name path all read "llama"
    module = model.head if _is_feature_drafter(model) else model
    return f"{_model_name(model)}:{sum(p.numel() for p in module.parameters())}"


def host_key(device) -> dict:
    """The part of `machine_info` a cached profile must match: the processor and its ISA flags
    (or the GPU), and torch. A profile measured anywhere else is never used."""
    info = machine_info(str(torch.device(device)))
    return {k: info.get(k) for k in ("machine", "cpu", "cpu_flags", "cpu_capability", "onednn_bf16", "gpu", "cuda",
                                     "torch")}


def profile_path(target, draft, dtype=None) -> Path:
    """Cache file for this machine, pair, dtype, device, attention backend and thread count."""
    dev = next(target.parameters()).device
    dtype = dtype or next(target.parameters()).dtype
    parts = [_model_key(target), _model_key(draft) if draft is not None else "-", str(dtype), str(dev),
             str(getattr(target.config, "_attn_implementation", None)), str(torch.get_num_threads()),
             json.dumps(host_key(dev), sort_keys=True)]
    if kernels.switchable(dtype, dev):
        parts.append("onednn-aten-packed")            # profiles timed on every matmul path
    elif kernels.packable(dtype, dev):
        parts.append("default-packed")                # timed with and without prepacked weights
    key = "|".join(parts)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir() / "profiles" / f"{digest}.json"


def load_cached(target, draft=None, dtype=None) -> DeviceProfile | None:
    """The cached profile for this setup, if there is a readable one measured on this machine."""
    path = profile_path(target, draft, dtype)
    if not path.is_file():
        return None
    try:
        prof = DeviceProfile.from_json(path.read_text())
    except (ValueError, KeyError, TypeError):
        return None                                   # unreadable: measure again
    here, host = host_key(next(target.parameters()).device), prof.meta.get("host", {})
    if {k: host.get(k) for k in here} != here:
        return None                                   # measured on another machine
    return prof


def load_or_measure(target, draft=None, measure_if_missing: bool = True, force: bool = False,
                    quiet: bool = False, **kwargs) -> DeviceProfile | None:
    """The cached profile for this setup, measured (and cached) on first use or when `force`d.

    A measurement prints one line on stderr (unless `quiet`). Keyword
    arguments go to `measure`; the default is a quick calibration (5 repeats).
    """
    path = profile_path(target, draft)
    prof = None if force else load_cached(target, draft)
    if prof is not None or not measure_if_missing:
        return prof
    if not quiet:
        dtype = str(next(target.parameters()).dtype).replace("torch.", "")
        print(f"mcsd: measuring this machine's costs for {_model_name(target)} ({dtype}; once, cached in "
              f"{path.parent})...", file=sys.stderr, flush=True)
    with cache_writes(path.parent):                   # a cache that cannot be written fails before measuring
        path.parent.mkdir(parents=True, exist_ok=True)
    kwargs.setdefault("repeats", CALIBRATION_REPEATS)
    prof = measure(target, draft, **kwargs)
    with cache_writes(path.parent):
        path.write_text(prof.to_json())
    return prof


# ---------------------------------------------------------------------------- costs the policies use

class Costs:
    """Round costs in milliseconds: verify(n tree tokens) and one draft level of width w,
    from a measured profile, corrected online by what rounds actually take.

    The correction is a multiplicative factor per power-of-two size bucket,
    an exponentially weighted mean (weight `adapt`) of measured / predicted
    time; a bucket not yet seen uses the mean over all buckets. So a busy or
    throttled machine, a longer context or another prompt length moves the
    costs within a few rounds, while the measured shape (how verify grows
    with tree size) still orders sizes that have not been tried.
    """

    def __init__(self, verify: dict[int, float], draft: dict[int, float], source: str = "default",
                 adapt: float = 0.15):
        self.verify, self.draft, self.source, self.adapt = dict(verify), dict(draft), source, adapt
        self.reset_corrections()

    def reset_corrections(self) -> None:
        self._factor = {"verify": {}, "draft": {}}
        self._overall = {"verify": 1.0, "draft": 1.0}

    @classmethod
    def default(cls) -> "Costs":
        # Shape measured for a 135M target on a 2-core CPU in bfloat16, in units of a 1-token verify;
        # only ratios matter to the policy. Used only when nothing can be measured.
        return cls(verify={1: 1.0, 8: 1.09, 16: 1.33, 32: 1.61, 64: 2.3}, draft={1: 0.1, 8: 0.13, 32: 0.2})

    @classmethod
    def from_profile(cls, profile: DeviceProfile, source: str = "measured") -> "Costs":
        """Costs on the faster matmul path per size, which is the one the engine runs."""
        return cls(verify=profile.best_ms("verify"), draft=profile.best_ms("draft") or cls.default().draft,
                   source=source)

    def _corr(self, kind: str, n: float) -> float:
        return self._factor[kind].get(int(n).bit_length(), self._overall[kind])

    def base_verify_ms(self, n: int) -> float:
        return interpolate(self.verify, n)

    def base_draft_ms(self, width: int) -> float:
        return interpolate(self.draft, width)

    def verify_ms(self, n: int) -> float:
        return self.base_verify_ms(n) * self._corr("verify", n)

    def marginal_verify_ms(self, n: int) -> float:
        """The verify time one more node adds to an n-node tree: the measured shape's slope.
        Online corrections scale whole rounds, and much of what they absorb is per round (a
        longer context, hidden states, acceptance) rather than per node; scaling the slope
        with them priced context nodes at 1.3-1.4x what they cost (see README)."""
        return self.base_verify_ms(n + 1) - self.base_verify_ms(n)

    def draft_ms(self, width: int) -> float:
        return self.base_draft_ms(width) * self._corr("draft", width)

    def observe(self, kind: str, n: int | None, predicted_ms: float, measured_ms: float) -> None:
        """Fold one measured round into the correction: "verify" with n tree tokens, or "draft"
        with n None (a round's draft levels of several widths, corrected as a whole; predicted_ms
        is their uncorrected sum)."""
        if predicted_ms <= 0 or measured_ms <= 0:
            return
        ratio, a = measured_ms / predicted_ms, self.adapt
        if n is not None:
            bucket, b = self._factor[kind], int(n).bit_length()
            bucket[b] = (1 - a) * bucket.get(b, self._overall[kind]) + a * ratio
        self._overall[kind] = (1 - a) * self._overall[kind] + a * ratio


# ---------------------------------------------------------------------------- the dtype that wins

# What one drafted token is assumed to be accepted with when dtypes are compared (per depth).
# Acceptance barely depends on the dtype; the comparison turns on the costs.
ASSUMED_ACCEPTANCE = 0.6


def expected_rate(costs: Costs, drafting: bool, max_depth: int = 8,
                  acceptance: float = ASSUMED_ACCEPTANCE, free_draft: bool = False) -> tuple[float, int]:
    """(tokens per second, chain depth) of the best chain under these costs; depth 0 is plain decoding.
    `free_draft`: the proposals cost nothing to draft (context drafting), only to verify."""
    best = (1000.0 / costs.verify_ms(1), 0)
    if not drafting:
        return best
    for k in range(1, max_depth + 1):
        tokens = sum(acceptance ** i for i in range(k + 1))
        rate = 1000.0 * tokens / ((0.0 if free_draft else k * costs.draft_ms(1)) + costs.verify_ms(k + 1))
        best = max(best, (rate, k))
    return best


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    reason: str
    rates: dict                 # dtype -> expected tokens/s of the method on this machine


def choose_dtype(target, draft, candidates=None, drafting: bool = True, calibrate: bool | None = None,
                 quiet: bool = False, free_draft: bool = False) -> DtypeChoice:
    """The dtype in which this pair runs fastest here, from the calibrated cost of each candidate.

    `target` (and `draft`) must be in float32; a candidate other than float32
    is measured on a converted copy (only when its profile is not cached, or
    when `calibrate` is True). `free_draft`: proposals come from context
    (nothing to draft, only verify). Candidates default to float32 and bfloat16 on a
    CPU, bfloat16 and float16 on CUDA. With `calibrate=False` and a profile
    missing, a fixed rule decides instead: bfloat16 on CUDA and on CPUs with
    native bf16 (AVX512-BF16 or AMX, as oneDNN uses it), float32 on other CPUs. The models are not
    converted here (see `mcsd.models.cast_pair`).
    """
    device = next(target.parameters()).device
    if candidates is None:
        candidates = ("bfloat16", "float16") if device.type == "cuda" else ("float32", "bfloat16")
    profiles = {name: None if calibrate else load_cached(target, draft, getattr(torch, name)) for name in candidates}
    if calibrate is False and any(p is None for p in profiles.values()):
        native = device.type == "cuda" or host_key(device)["onednn_bf16"]      # what torch runs bf16 products with
        best = "bfloat16" if native else "float32"
        return DtypeChoice(best, f"{best}: not calibrated; {'native' if native else 'no native'} bfloat16 "
                                 f"on this {'GPU' if device.type == 'cuda' else 'CPU'}", {})
    rates, depths = {}, {}
    for name, prof in profiles.items():
        if prof is None:
            dtype = getattr(torch, name)
            t, d = (target, draft) if dtype == next(target.parameters()).dtype else _cast_copy(target, draft, dtype)
            prof = load_or_measure(t, d, force=True, quiet=quiet)
            del t, d
        rates[name], depths[name] = expected_rate(Costs.from_profile(prof), drafting and (draft is not None or free_draft),
                                                  free_draft=free_draft and draft is None)
    best = max(rates, key=rates.get)
    others = ", ".join(f"{n} {r:.1f}" for n, r in rates.items() if n != best)
    what = f"chains of {depths[best]}" if depths[best] else "plain steps"
    reason = (f"{best}: {rates[best]:.1f} expected tokens/s with {what} on this machine "
              f"(measured costs; {others}; {ASSUMED_ACCEPTANCE:.0%} acceptance per drafted token assumed)")
    return DtypeChoice(best, reason, rates)


def _cast_copy(target, draft, dtype):
    """A converted copy of the pair, for measuring a dtype without touching the originals."""
    import copy

    from .feature_draft import FeatureDrafter
    from .models import cast_pair
    t = copy.deepcopy(target)
    if isinstance(draft, FeatureDrafter):
        d = FeatureDrafter(copy.deepcopy(draft.head), t, name=draft.name)
    else:
        d = copy.deepcopy(draft)
    return cast_pair(t, d, dtype)
