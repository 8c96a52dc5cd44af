"""Device cost profile: how long a target verify takes against tree size, and a draft step against width.

Measured once per (target, draft, dtype, device) and cached as JSON under
`<cache>/profiles/`. Tree policies read it to weigh a node's expected gain
against what it costs to draft and verify on *this* hardware.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import kv_cache
from .cache import cache_dir, cache_subdir, cache_writes
from .lm import CachedLM
from .tree import causal_allowed

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class DeviceProfile:
    """Latencies in milliseconds, median over repeated interleaved runs.

    Attributes:
        verify_ms: {tree tokens: target forward time} with a `prefix_len` cache.
        draft_ms: {tokens: draft forward time} (empty without a draft).
        meta: model names, dtype, device, backend, thread count, torch version.
    """

    verify_ms: dict[int, float]
    draft_ms: dict[int, float] = field(default_factory=dict)
    prefix_len: int = 200
    meta: dict = field(default_factory=dict)

    def verify_cost(self, n_tokens: int) -> float:
        """Interpolated verify time for n tokens (linear between measured sizes, flat outside)."""
        return interpolate(self.verify_ms, n_tokens)

    def draft_cost(self, n_tokens: int) -> float:
        return interpolate(self.draft_ms, n_tokens) if self.draft_ms else 0.0

    def to_json(self) -> str:
        d = asdict(self)
        d["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        d["draft_ms"] = {str(k): v for k, v in self.draft_ms.items()}
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        d = json.loads(text)
        return cls(verify_ms={int(k): float(v) for k, v in d["verify_ms"].items()},
                   draft_ms={int(k): float(v) for k, v in d.get("draft_ms", {}).items()},
                   prefix_len=int(d.get("prefix_len", 200)), meta=dict(d.get("meta", {})))


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
    other load) spreads evenly; the median of `repeats` runs is kept.
    """
    gen = torch.Generator().manual_seed(0)
    timers = {"verify": (_ModelTimer(target, prefix_len, gen), sizes)}
    if draft is not None:
        timer = (_HeadTimer if _is_feature_drafter(draft) else _ModelTimer)(draft, prefix_len, gen)
        timers["draft"] = (timer, draft_sizes)
    plan = [(role, n) for role, (_, ns) in timers.items() for n in ns]
    for role, n in plan:
        timers[role][0].latency(n)                                               # warm-up
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for i in torch.randperm(len(plan), generator=gen).tolist():
            role, n = plan[i]
            samples.setdefault((role, n), []).append(timers[role][0].latency(n))
    med = {k: statistics.median(v) for k, v in samples.items()}
    verify_lm = timers["verify"][0].lm
    meta = {"target": _model_name(target), "draft": _model_name(draft) if draft is not None else None,
            "dtype": str(verify_lm.dtype).replace("torch.", ""), "device": str(verify_lm.device),
            "attention": getattr(target.config, "_attn_implementation", None),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": repeats,
            "host": machine_info(str(verify_lm.device))}
    return DeviceProfile(verify_ms={n: med[("verify", n)] for n in sizes},
                         draft_ms={n: med[("draft", n)] for n in draft_sizes} if draft is not None else {},
                         prefix_len=prefix_len, meta=meta)


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
        model = LlamaForCausalLM(LlamaConfig(**STAND_INS[name], dtype=parse_dtype(dtype)))
    model.config._name_or_path = f"stand-in:{name}"
    return model.to(parse_dtype(dtype)).eval().requires_grad_(False)


def _is_feature_drafter(draft) -> bool:
    return getattr(draft, "uses_target_hidden", False) and hasattr(draft, "head")


def _model_name(model) -> str:
    if _is_feature_drafter(model):
        return f"feature-head:{model.name}"
    return str(getattr(model.config, "_name_or_path", "") or model.config.model_type)


def profile_path(target, draft, device=None) -> Path:
    """Cache file for this pair, dtype, device and thread count."""
    dev = device or next(target.parameters()).device
    key = "|".join([_model_name(target), _model_name(draft) if draft is not None else "-",
                    str(next(target.parameters()).dtype), str(dev), str(torch.get_num_threads())])
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir() / "profiles" / f"{digest}.json"


def load_or_measure(target, draft=None, measure_if_missing: bool = True, **kwargs) -> DeviceProfile | None:
    """The cached profile for this setup, measured (and cached) on first use."""
    path = profile_path(target, draft)
    if path.is_file():
        try:
            return DeviceProfile.from_json(path.read_text())
        except (ValueError, KeyError):
            pass                                      # unreadable: measure again
    if not measure_if_missing:
        return None
    cache_subdir("profiles")                       # a cache that cannot be written fails before measuring
    prof = measure(target, draft, **kwargs)
    with cache_writes(path.parent):
        path.write_text(prof.to_json())
    return prof
