"""A device cost profile: how long a target verify takes against tree size, and a draft step against
width, on each matmul path, with what it was measured on (the machine, the models' identity).

Timing is in `mcsd.costs.timing`, the cache of profiles in `mcsd.costs.store`, the costs a policy
reads in `mcsd.costs.cost_model`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import subprocess
from dataclasses import asdict, dataclass, field

import torch

from ..forward import kernels, native, quant
from ..forward.kernels import interpolate


@dataclass
class DeviceProfile:
    """Latencies in milliseconds, median over repeated interleaved runs.

    Attributes:
        verify_ms: {tree tokens: target forward time} with a `prefix_len` cache,
            through torch's default matmul path.
        draft_ms: {tokens: draft forward time} (empty without a draft).
        verify_aten_ms, draft_aten_ms: the same through ATen's kernels instead of
            oneDNN, for small blocks, where the two differ (`mcsd.forward.kernels`);
            empty elsewhere.
        verify_packed_ms, draft_packed_ms: the same through oneDNN on prepacked
            weights (`mcsd.forward.kernels.pack`), every size; empty where weights cannot
            be prepacked.
        meta: model names, dtype, device, backend, thread count, torch version.
        layouts: {role: "plain" or "packed"}: the one weight layout a decoder holds for that
            role's model (`hold_once`), whose paths alone the costs and kernel tables then
            read; empty: every path. Not saved.
    """

    verify_ms: dict[int, float]
    draft_ms: dict[int, float] = field(default_factory=dict)
    prefix_len: int = 200
    meta: dict = field(default_factory=dict)
    verify_aten_ms: dict[int, float] = field(default_factory=dict)
    draft_aten_ms: dict[int, float] = field(default_factory=dict)
    verify_packed_ms: dict[int, float] = field(default_factory=dict)
    draft_packed_ms: dict[int, float] = field(default_factory=dict)
    layouts: dict[str, str] = field(default_factory=dict)

    def paths(self, role: str) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """(default path, ATen path, prepacked path) timings of the target ("verify") or the draft
        ("draft"); on the layout `hold_once` chose for the role, the other layout's are empty."""
        tables = (self.verify_ms, self.verify_aten_ms, self.verify_packed_ms) if role == "verify" \
            else (self.draft_ms, self.draft_aten_ms, self.draft_packed_ms)
        layout = self.layouts.get(role)
        if layout == "packed":
            return {}, {}, tables[2]
        if layout == "plain":
            return tables[0], tables[1], {}
        return tables

    def kernel_table(self, role: str) -> kernels.KernelTable | None:
        """Which matmul path each block size of `role` runs fastest on; None where only torch's
        default path serves it (one path timed, or the plain layout without ATen's)."""
        default, aten, packed = self.paths(role)
        return kernels.KernelTable(default, aten, packed) if packed or (default and aten) else None

    def best_ms(self, role: str) -> dict[int, float]:
        """{size: ms} on the fastest path per measured size (what the engine runs)."""
        default, aten, packed = self.paths(role)
        return {n: min(ms, aten.get(n, ms), packed.get(n, ms)) for n, ms in (default or packed).items()}

    def hold_once(self, rows: dict[str, tuple[int, ...]]) -> "DeviceProfile":
        """Settle each role in `rows` on one weight layout, the one whose paths run blocks of the
        given sizes faster in total (`KernelTable.one_layout`), so its model's weights are held
        once; in place, returns self."""
        for role, sizes in rows.items():
            default, aten, packed = self.paths(role)
            if default and packed:
                self.layouts[role] = kernels.KernelTable(default, aten, packed).one_layout(sizes)
        return self

    def verify_cost(self, n_tokens: int) -> float:
        """Interpolated verify time for n tokens (linear between measured sizes, flat outside),
        on the faster matmul path."""
        return interpolate(self.best_ms("verify"), n_tokens)

    def draft_cost(self, n_tokens: int) -> float:
        return interpolate(self.best_ms("draft"), n_tokens) if self.draft_ms else 0.0

    def to_json(self) -> str:
        d = asdict(self)
        del d["layouts"]                                 # a decoder's choice, not a measurement
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


MEASURED_SINCE = 3          # how profiles are measured; a change names new cache files (2: head steps after a
                            # target forward on a CPU; 3: a head beside a "q4q8" target on 8-bit activations too)


def drafter_module(draft) -> torch.nn.Module | None:
    """The module whose linear layers a drafter's forwards run through (a feature drafter's head
    with its LM rows, a draft model itself), or None."""
    if _is_feature_drafter(draft):
        return draft.module
    return draft if isinstance(draft, torch.nn.Module) else getattr(draft, "model", None)


def _is_feature_drafter(draft) -> bool:
    return getattr(draft, "uses_target_hidden", False) and hasattr(draft, "head")


def _model_name(model) -> str:
    if _is_feature_drafter(model):
        return f"feature-head:{model.name}"
    return str(getattr(model.config, "_name_or_path", "") or model.config.model_type)


# What an EAGLE-3 head's decoder layer costs, from its config: the rest of that config is how the file was
# written (the speculators layout spells out a full Llama config, the original layout a few fields)
_LAYER_GEOMETRY = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                   "num_hidden_layers", "hidden_act")


def _model_key(model, weights: str | None = None, codes: bool = True) -> str:
    """What runs, never where it was loaded from: a profile holds costs, which follow the
    architecture (the configuration less its path and bookkeeping, every parameter's name and
    shape) and whether the linear layers run on 4-bit codes, and on which activations (attached,
    or `weights` "q4" / "q4q8": to be), not the
    weights' values. So a cache copied elsewhere (or mounted read-only at another path) still
    finds its profiles, and two checkpoints of one architecture share theirs."""
    module = model.module if _is_feature_drafter(model) else model          # a head: with its LM rows
    digest = hashlib.sha1()
    head = getattr(model, "head", None)
    for cfg in (getattr(module, "config", None), getattr(head, "cfg", None)):
        fields = cfg.to_dict() if hasattr(cfg, "to_dict") else asdict(cfg) if cfg is not None else {}
        fields = {k: v for k, v in fields.items()
                  if not k.startswith("_") and k not in ("transformers_version", "name_or_path", "dtype",
                                                          "torch_dtype")}
        if isinstance(fields.get("layer_config"), dict):     # an EAGLE-3 head: one key in either layout
            layer = fields.pop("layer_config")
            fields = {k: v for k, v in fields.items() if k not in ("layout", "has_embedding")}
            fields["layer"] = {k: layer.get(k) for k in _LAYER_GEOMETRY}
        digest.update(json.dumps(fields, sort_keys=True, default=str).encode())
    digest.update(";".join(f"{name}{tuple(p.shape)}" for name, p in module.named_parameters()).encode())
    if weights not in quant.ON_CODES and codes and quant.attached(module):
        weights = quant.weights_name(module)
    suffix = ""
    if weights in quant.ON_CODES:
        # the q4 kernel is part of what runs: torch's int4 kernel and each version of the native one
        # (`native.VERSION`) cost differently (asked only here: a dense model builds no native library),
        # and so do float32 and 8-bit activations ("q4q8")
        suffix = f":{weights}" + (f"-native{native.VERSION}" if quant.kernel_name() == "native" else "")
    return f"{digest.hexdigest()[:16]}:{sum(p.numel() for p in module.parameters())}{suffix}"


def host_key(device) -> dict:
    """The part of `machine_info` a cached profile must match: the processor and its ISA flags
    (or the GPU), and torch. A profile measured anywhere else is never used."""
    info = machine_info(str(torch.device(device)))
    return {k: info.get(k) for k in ("machine", "cpu", "cpu_flags", "cpu_capability", "onednn_bf16", "gpu", "cuda",
                                     "torch")}
