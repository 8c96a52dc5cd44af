"""Device cost profile: how long a target verify takes against tree size, and a draft step against width.

Measured once per (target, draft, dtype, device) and cached as JSON under
`<cache>/profiles/`. Tree policies read it to weigh a node's expected gain
against what it costs to draft and verify on *this* hardware.
"""

from __future__ import annotations

import contextlib
import copy
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

from ..config import ConfigError
from ..forward import kernels, kv_cache, native, quant
from ..forward.attention import causal_allowed
from ..forward.kernels import interpolate
from ..forward.lm import CachedLM
from ..loading.cache import cache_dir, cache_writes

# tree sizes timed (3: the last the native q4 kernel keeps in registers); larger ones extrapolate proportionally
DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 16, 32)
DEFAULT_DRAFT_SIZES = (1, 2, 4, 8, 16)    # draft level widths timed
ATEN_MAX_ROWS = 16          # block sizes up to this are also timed through ATen's kernels (mcsd.forward.kernels)
CALIBRATION_REPEATS = 4     # the quick measurement a first generation makes: 2 rounds of 2 runs (see measure)


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


MEASURED_SINCE = 2          # how profiles are measured; a change names new cache files (2: head steps after a
                            # target forward on a CPU)


class _HeadTimer:
    """A target-feature drafter holding a prefix_len cache; times one step over n tree nodes
    (head forward and its LM-head scores) and drops it again.

    `before` (untimed) runs ahead of each step: on a CPU, the target's 1-token forward, so that each
    step finds the processor's caches as a round's first step does in decoding, the target's weights
    through them since the head last ran. (Timed after other head steps, the embedded head's step read
    1.0 ms; in decoding its first steps took 1.9-2.2 ms, scores included.)"""

    def __init__(self, drafter, prefix_len: int, gen: torch.Generator, before=None):
        self.drafter, self.prefix_len, self.gen, self.before = drafter, prefix_len, gen, before
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
        if self.before is not None:
            self.before()
        elapsed = _ms(d.device, lambda: d._scores(self._run(n, start=self.prefix_len)))
        kv_cache.truncate(d.cache, self.prefix_len)
        return elapsed


# ---------------------------------------------------------------------------- robust timing

SPREAD_LIMIT = 0.25         # a timing whose two best rounds differ by more than this is measured again
DROP_LIMIT = 0.15           # n+1.. rows measured this much faster than n rows: both measured again
REMEASURE_PASSES = 2        # extra rounds at most for such timings
PRUNE_FACTOR = 8.0          # blocks past the first one costing this many 1-row steps are not measured
PROBE_DISAGREEMENT = 1.5    # a fixed kernel this much slower or faster after measuring than before: busy


@dataclass
class Timings:
    """Robust per-step timings (`robust_timings`).

    Attributes:
        ms: {step: min over rounds of the round's median} in ms, then the monotone envelope.
        spread: {step: (second-best round median - best) / best}; 0 with one round.
        remeasured: steps timed in extra rounds (large spread, or inconsistent with a neighbour).
        lowered: steps the envelope lowered (a smaller block measured slower than a larger one).
    """

    ms: dict
    spread: dict
    remeasured: set
    lowered: set


def _summary(rounds: list[list[float]]) -> tuple[float, float]:
    """(min of the rounds' medians, relative gap between the best two medians)."""
    meds = sorted(statistics.median(r) for r in rounds if r)
    return meds[0], ((meds[1] - meds[0]) / meds[0] if len(meds) > 1 and meds[0] > 0 else 0.0)


def robust_timings(plan: list[tuple], latency, gen: torch.Generator, rounds: int = 3, per_round: int = 2,
                   remeasure_passes: int = REMEASURE_PASSES) -> Timings:
    """Time every step of `plan` robustly against a machine whose speed drifts.

    A step is (role, rows, path). Each round times every step `per_round`
    times in one shuffled order (so a slow spell spreads over many steps, not
    one size); a step's time is the minimum over rounds of its round median
    (interference only ever adds time). Then the timings are checked: a step
    whose best two rounds disagree by more than `SPREAD_LIMIT`, or a block of
    more rows measured more than `DROP_LIMIT` faster than a smaller one of the
    same role and path, gets another round (at most `remeasure_passes`).
    Last, a monotone envelope: n rows never cost more than any larger block
    of the same role and path (n rows could run as n+1, one dropped).

    Args:
        plan: the steps.
        latency: latency(role, rows, path) -> ms, one timed forward.
        gen: shuffles the order.
    Returns:
        Timings.
    """
    samples: dict[tuple, list[list[float]]] = {step: [] for step in plan}

    def one_round(steps):
        order = [s for s in steps for _ in range(per_round)]
        for step in steps:
            samples[step].append([])
        for i in torch.randperm(len(order), generator=gen).tolist():
            samples[order[i]][-1].append(latency(*order[i]))

    for _ in range(max(1, rounds)):
        one_round(plan)
    remeasured: set = set()
    for _ in range(remeasure_passes):
        suspects = _suspects({s: _summary(r) for s, r in samples.items()})
        if not suspects:
            break
        remeasured |= suspects
        one_round([s for s in plan if s in suspects])
    summary = {s: _summary(r) for s, r in samples.items()}
    ms, lowered = _envelope({s: v[0] for s, v in summary.items()})
    return Timings(ms=ms, spread={s: v[1] for s, v in summary.items()}, remeasured=remeasured, lowered=lowered)


def _lines(steps) -> dict[tuple, list[tuple]]:
    """Steps grouped by (role, path), each group in order of rows."""
    groups: dict[tuple, list[tuple]] = {}
    for step in sorted(steps, key=lambda s: (s[0], s[2], s[1])):
        groups.setdefault((step[0], step[2]), []).append(step)
    return groups


def _suspects(summary: dict[tuple, tuple[float, float]]) -> set:
    """Steps to measure again: a large spread, or a larger block measured much faster than a smaller one."""
    bad = {s for s, (_, spread) in summary.items() if spread > SPREAD_LIMIT}
    for line in _lines(summary).values():
        for small, large in zip(line, line[1:]):
            if summary[large][0] < summary[small][0] * (1 - DROP_LIMIT):
                bad |= {small, large}
    return bad


def _envelope(ms: dict[tuple, float]) -> tuple[dict[tuple, float], set]:
    """Each step's time capped by every larger block's of its role and path (a suffix minimum)."""
    out, lowered = dict(ms), set()
    for line in _lines(ms).values():
        best = float("inf")
        for step in reversed(line):
            if out[step] > best:
                out[step], lowered = best, lowered | {step}
            best = out[step]
    return out, lowered


def _probe_ms(repeats: int = 7) -> float:
    """A fixed small kernel (a 64 x 256 by 256 x 256 float32 product), min over repeats, in ms:
    timed before and after a measurement, a disagreement says the machine's speed moved."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 256, generator=gen), torch.randn(256, 256, generator=gen)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(8):
            a @ b
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


class BusyCheck:
    """Whether the machine was busy while measuring: other processes' CPU use on this process's
    cores left fewer free cores than torch's threads (`mcsd.forward.threads`), or a fixed probe kernel
    timed before and after disagrees by `PROBE_DISAGREEMENT`."""

    def __init__(self, probe=_probe_ms):
        self.probe = probe

    def start(self) -> None:
        from ..forward import threads
        self.load, self.before = threads.snapshot(), self.probe()

    def finish(self) -> str | None:
        """None when quiet, else why the measurement is provisional."""
        from ..forward import threads
        after, load = self.probe(), threads.snapshot()
        used = torch.get_num_threads()
        busy = threads.busy_elsewhere(self.load, load, threads.allowed_cpus()) \
            if self.load is not None and load is not None else None
        if busy is not None and threads.choose_threads(len(threads.allowed_cpus()), busy).threads < used:
            return f"other processes used {busy:.1f} cores' worth while {used} threads measured"
        ratio = max(after, self.before) / max(min(after, self.before), 1e-9)
        if ratio > PROBE_DISAGREEMENT:
            return f"a fixed probe kernel took {self.before:.2f} ms before and {after:.2f} ms after"
        return None


def quiet_now(threads_used: int | None = None) -> bool:
    """No other process keeps the cores torch's threads need busy (read over `mcsd.forward.threads.MIN_WINDOW_S`)."""
    from ..forward import threads
    used = threads_used or torch.get_num_threads()
    return threads.fit_threads().threads >= used


def measure(target, draft=None, sizes=DEFAULT_SIZES, prefix_len: int = 200, repeats: int = 20,
            draft_sizes=DEFAULT_DRAFT_SIZES, busy_check: BusyCheck | None = None) -> DeviceProfile:
    """Measure verify latency per tree size (and draft latency per level width), robustly.

    `draft` is a causal LM or a target-feature drafter (`mcsd.drafting.feature_draft`).
    Every (role, size, path) is timed `repeats` times in rounds of shuffled,
    interleaved order and summarised by `robust_timings` (minimum of round
    medians, re-measuring what is inconsistent, a monotone envelope); the
    profile's meta records each timing's spread and what was re-measured.
    After a warm-up pass in order of size, sizes past the first block that
    costs `PRUNE_FACTOR` one-row steps are not measured (such blocks never pay;
    costs past the largest measured size are extrapolated proportionally).
    Where oneDNN and ATen kernels both could run the matrix products (bfloat16 or
    float16 on a CPU with native support, `mcsd.forward.kernels.switchable`), blocks
    up to `ATEN_MAX_ROWS` are also timed on ATen, and every block on prepacked
    oneDNN weights (`mcsd.forward.kernels.pack`; the copies are dropped again unless the
    model had them before), interleaved the same way.

    A measurement taken while the machine was busy (`BusyCheck`) is marked
    provisional in meta["provisional"] (the reason): it serves the run that
    made it and is measured again on a later quiet start (`load_cached`).
    """
    t_start = time.perf_counter()
    busy_check = busy_check or BusyCheck()
    busy_check.start()
    gen = torch.Generator().manual_seed(0)
    timers = {"verify": (_ModelTimer(target, prefix_len, gen), tuple(sizes))}
    if draft is not None:
        if _is_feature_drafter(draft):
            target_timer = timers["verify"][0]
            before = (lambda: target_timer.latency(1)) if target_timer.device.type == "cpu" else None
            timer = _HeadTimer(draft, prefix_len, gen, before)
        else:
            timer = _ModelTimer(draft, prefix_len, gen)
        timers["draft"] = (timer, tuple(draft_sizes))
    verify_lm = timers["verify"][0].lm
    both = {role: kernels.switchable(t.dtype, t.device) for role, (t, _) in timers.items()}
    modules = {"verify": target, "draft": drafter_module(draft) if draft is not None else None}
    packs = {role: modules[role] is not None and kernels.packable(t.dtype, t.device)
             for role, (t, _) in timers.items()}
    plan = [(role, n, path) for role, (_, ns) in timers.items() for n in sorted(ns) for path in kernels.PATHS
            if path == "onednn" or (path == "aten" and both[role] and n <= ATEN_MAX_ROWS)
            or (path == "packed" and packs[role])]
    saved = getattr(draft, "kernels", None)
    if draft is not None and _is_feature_drafter(draft):
        draft.kernels = None                                                     # timed on the path chosen here
    for module in modules.values():
        if module is not None and kernels.released(module):
            kernels.unpack(module)                   # the plain paths are timed on plain weights
    made = [m for role, m in modules.items() if packs.get(role) and not kernels.is_packed(m)]
    for module in made:
        kernels.pack(module)

    def latency(role, n, path):
        with kernels.using(path) if both[role] or packs[role] else contextlib.nullcontext():
            return timers[role][0].latency(n)

    try:
        latency(*plan[0])                                                        # the very first forward
        pilot = {step: latency(*step) for step in plan}             # warms every shape up, in order of size
        plan = _prune(plan, pilot)
        rounds = max(1, min(3, repeats // 2))
        timed = robust_timings(plan, latency, gen, rounds=rounds, per_round=-(-repeats // rounds))
    finally:
        if draft is not None and _is_feature_drafter(draft):
            draft.kernels = saved
        for module in made:
            kernels.unpack(module)
    provisional = busy_check.finish()
    spread = statistics.median(timed.spread.values()) if timed.spread else 0.0
    if provisional is None and spread > SPREAD_LIMIT:
        provisional = f"timings spread by {spread:.0%} between rounds (median)"
    meta = {"target": _model_name(target), "draft": _model_name(draft) if draft is not None else None,
            "target_key": _model_key(target),
            "dtype": str(verify_lm.dtype).replace("torch.", ""), "device": str(verify_lm.device),
            "attention": getattr(target.config, "_attn_implementation", None),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": repeats,
            "host": machine_info(str(verify_lm.device)),
            "spread": {f"{r}:{p}:{n}": round(v, 3) for (r, n, p), v in timed.spread.items()},
            "remeasured": sorted(f"{r}:{p}:{n}" for r, n, p in timed.remeasured),
            "lowered": sorted(f"{r}:{p}:{n}" for r, n, p in timed.lowered),
            "provisional": provisional, "calibration_s": round(time.perf_counter() - t_start, 2)}

    def table(role, ns, path):
        return {n: timed.ms[(role, n, path)] for n in ns if (role, n, path) in timed.ms}
    return DeviceProfile(verify_ms=table("verify", sizes, "onednn"), draft_ms=table("draft", draft_sizes, "onednn"),
                         verify_aten_ms=table("verify", sizes, "aten"), draft_aten_ms=table("draft", draft_sizes, "aten"),
                         verify_packed_ms=table("verify", sizes, "packed"),
                         draft_packed_ms=table("draft", draft_sizes, "packed"),
                         prefix_len=prefix_len, meta=meta)


def _prune(plan: list[tuple], pilot: dict[tuple, float]) -> list[tuple]:
    """The plan less each role's sizes past the first that, with the next size too, costs more than
    `PRUNE_FACTOR` times its smallest size in the pilot pass (such blocks cannot pay for
    themselves; two sizes in a row, so that one slow pilot run prunes nothing)."""
    keep = []
    for role in dict.fromkeys(s[0] for s in plan):
        best: dict[int, float] = {}
        for (r, n, _), ms in pilot.items():
            if r == role:
                best[n] = min(ms, best.get(n, ms))
        ns = sorted(best)
        dear = [best[n] > PRUNE_FACTOR * best[ns[0]] for n in ns]
        cut = next((n for n, a, b in zip(ns, dear, dear[1:]) if a and b), ns[-1])
        keep += [s for s in plan if s[0] == role and s[1] <= cut]
    return keep


def drafter_module(draft) -> torch.nn.Module | None:
    """The module whose linear layers a drafter's forwards run through (a feature drafter's head
    with its LM rows, a draft model itself), or None."""
    if _is_feature_drafter(draft):
        return draft.module
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

    from ..loading.models import parse_dtype
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


def _model_key(model, q4: bool = False, codes: bool = True) -> str:
    """What runs, never where it was loaded from: a profile holds costs, which follow the
    architecture (the configuration less its path and bookkeeping, every parameter's name and
    shape) and whether the linear layers run on 4-bit codes (attached, or `q4`: to be), not the
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
        digest.update(json.dumps(fields, sort_keys=True, default=str).encode())
    digest.update(";".join(f"{name}{tuple(p.shape)}" for name, p in module.named_parameters()).encode())
    weights = ""
    if q4 or (codes and quant.attached(module)):
        # the q4 kernel is part of what runs: torch's int4 kernel and each version of the native one
        # (`native.VERSION`) cost differently (asked only here: a dense model builds no native library)
        weights = ":q4" + (f"-native{native.VERSION}" if quant.kernel_name() == "native" else "")
    return f"{digest.hexdigest()[:16]}:{sum(p.numel() for p in module.parameters())}{weights}"


def host_key(device) -> dict:
    """The part of `machine_info` a cached profile must match: the processor and its ISA flags
    (or the GPU), and torch. A profile measured anywhere else is never used."""
    info = machine_info(str(torch.device(device)))
    return {k: info.get(k) for k in ("machine", "cpu", "cpu_flags", "cpu_capability", "onednn_bf16", "gpu", "cuda",
                                     "torch")}


def profile_path(target, draft, dtype=None, weights: str | None = None) -> Path:
    """Cache file for this machine, pair, dtype, device, attention backend and thread count;
    `weights="q4"` names the target's profile on its 4-bit codes before they are attached."""
    dev = next(target.parameters()).device
    dtype = dtype or next(target.parameters()).dtype
    # a drafter's key leaves out its own codes: it runs on them exactly when the target runs on the native
    # q4 kernel (`FeatureDrafter.follow_target_weights`), which the target's key says, before and after
    parts = [_model_key(target, q4=weights == "q4"), _model_key(draft, codes=False) if draft is not None else "-",
             str(dtype), str(dev),
             str(getattr(target.config, "_attn_implementation", None)), str(torch.get_num_threads()),
             json.dumps(host_key(dev), sort_keys=True)]
    if kernels.switchable(dtype, dev):
        parts.append("onednn-aten-packed")            # profiles timed on every matmul path
    elif kernels.packable(dtype, dev):
        parts.append("default-packed")                # timed with and without prepacked weights
    parts.append(f"measured-{MEASURED_SINCE}")         # profiles measured the way this version measures
    key = "|".join(parts)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir() / "profiles" / f"{digest}.json"


def _readable(path: Path, device) -> DeviceProfile | None:
    """The profile in `path` if it is readable and was measured on this machine."""
    try:
        prof = DeviceProfile.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None                                   # unreadable: measure again
    here, host = host_key(device), prof.meta.get("host", {})
    if {k: host.get(k) for k in here} != here:
        return None                                   # measured on another machine
    return prof


def needs_remeasure(prof: DeviceProfile) -> str | None:
    """Why a cached profile should be measured again (provisional: measured on a busy machine;
    stale: later runs' timings disagreed with it), or None."""
    return prof.meta.get("stale") or prof.meta.get("provisional")


def load_cached(target, draft=None, dtype=None, remeasure: bool = True,
                weights: str | None = None) -> DeviceProfile | None:
    """The cached profile for this setup, if there is a readable one measured on this machine.

    With `remeasure`, a profile flagged for measuring again (`needs_remeasure`)
    is passed over (None: the caller measures) when the machine is quiet now;
    on a busy machine it is still returned, since measuring again would only
    measure the noise again.
    """
    dev = next(target.parameters()).device
    prof = _readable(profile_path(target, draft, dtype, weights), dev)
    if prof is not None and remeasure and needs_remeasure(prof) and quiet_now():
        return None
    return prof


def load_target_costs(target, dtype=None) -> DeviceProfile | None:
    """A cached profile holding this target's verify costs in this setup, measured alone or with any
    drafter (its verify tables are the same either way), without measuring anything; for runs of
    the target alone (`--baseline`). A profile flagged for measuring again serves too."""
    dev = next(target.parameters()).device
    own = _readable(profile_path(target, None, dtype), dev)
    if own is not None:
        return own
    dtype = str(dtype or next(target.parameters()).dtype).replace("torch.", "")
    want = {"target_key": _model_key(target), "dtype": dtype, "device": str(dev),
            "attention": getattr(target.config, "_attn_implementation", None), "threads": torch.get_num_threads()}
    folder = cache_dir() / "profiles"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        prof = _readable(path, dev)
        if prof is not None and all(prof.meta.get(k) == v for k, v in want.items()):
            return prof
    return None


def mark_stale(target, draft, reason: str, dtype=None, ratio: float | None = None) -> bool:
    """Flag the cached profile of this setup for measuring again at the next start (`load_cached`);
    `ratio`: the rounds' measured time over the profile's that flagged it. False where there is none
    or the cache cannot be written."""
    path = profile_path(target, draft, dtype)
    prof = _readable(path, next(target.parameters()).device)
    if prof is None:
        return False
    prof.meta["stale"] = reason
    prof.meta["stale_ratio"] = ratio
    try:
        path.write_text(prof.to_json())
    except OSError:
        return False
    return True


AGREE_RATIO = 1.25           # a new measurement this close to a flagged profile's, size by size, confirms it


def agrees(old: DeviceProfile, new: DeviceProfile, bound: float = AGREE_RATIO) -> float | None:
    """The largest ratio between the two profiles' costs (fastest path, each size both measured)
    when every one is within `bound` (either way), else None."""
    worst = 1.0
    for role in ("verify", "draft"):
        a, b = old.best_ms(role), new.best_ms(role)
        if a.keys() != b.keys():
            return None
        for n in a:
            worst = max(worst, a[n] / b[n], b[n] / a[n])
    return worst if worst <= bound else None


def settle(old: DeviceProfile, new: DeviceProfile) -> DeviceProfile:
    """A flagged profile measured again: where the new figures agree with it (`agrees`), the old
    ones stay (with the flag cleared), so that the kernel paths and the trees they price, and
    with them a bfloat16 run's output, do not move with measuring noise; else the new profile."""
    if new.meta.get("provisional") or old.meta.get("provisional"):
        return new                  # a busy measurement on either side confirms nothing
    worst = agrees(old, new)
    if worst is None:
        return new
    kept = copy.deepcopy(old)
    # the rounds' ratio that flagged it is then how decoding compares with these figures on this
    # machine (the work around a forward that a profile does not time), not a change: expected from now
    kept.meta.update(stale=None, stale_ratio=None, provisional=None,
                     calibration_s=new.meta.get("calibration_s", 0.0),
                     confirmed={"flag": old.meta.get("stale"), "largest_ratio": round(worst, 3),
                                "observed": old.meta.get("stale_ratio")})
    return kept


def load_or_measure(target, draft=None, measure_if_missing: bool = True, force: bool = False,
                    quiet: bool = False, **kwargs) -> DeviceProfile | None:
    """The cached profile for this setup, measured (and cached) on first use, when `force`d, or when
    the cached one is flagged and the machine is quiet now (`load_cached`).

    A measurement prints one line on stderr (unless `quiet`), and a second when
    the machine was busy meanwhile (the profile is then provisional). A cached
    profile flagged stale that the new measurement confirms keeps its figures
    (`settle`). Keyword arguments go to `measure`; the
    default is a quick calibration (`CALIBRATION_REPEATS`).
    """
    path = profile_path(target, draft)
    prof = None if force else load_cached(target, draft)
    if prof is not None or not measure_if_missing:
        return prof
    flagged = _readable(path, next(target.parameters()).device)
    if flagged is not None and not flagged.meta.get("stale"):
        flagged = None
    if not quiet:
        dtype = str(next(target.parameters()).dtype).replace("torch.", "")
        if quant.attached(target):
            dtype = f"q4 weights, {dtype} compute"
        n = torch.get_num_threads()
        print(f"mcsd: measuring this machine's costs for {_model_name(target)} ({dtype}, {n} thread"
              f"{'s' if n > 1 else ''}; cached in {path.parent})...", file=sys.stderr, flush=True)
    unwritable = None                                 # a cache that cannot be written: the costs serve this run
    try:
        with cache_writes(path.parent):
            path.parent.mkdir(parents=True, exist_ok=True)
    except ConfigError as exc:
        unwritable = str(exc)
    kwargs.setdefault("repeats", CALIBRATION_REPEATS)
    prof = measure(target, draft, **kwargs)
    if flagged is not None:
        prof = settle(flagged, prof)
        if prof.meta.get("confirmed") and not quiet:
            print(f"mcsd: measured again within {prof.meta['confirmed']['largest_ratio'] - 1:.0%} of the cached "
                  f"costs, which stay", file=sys.stderr, flush=True)
    if prof.meta.get("provisional") and not quiet:
        print(f"mcsd: the machine was busy while measuring ({prof.meta['provisional']}): these costs serve "
              f"until a quieter start measures again", file=sys.stderr, flush=True)
    if unwritable is None:
        try:
            with cache_writes(path.parent):
                path.write_text(prof.to_json())
        except ConfigError as exc:
            unwritable = str(exc)
    if unwritable is not None and not quiet:
        print(f"mcsd: {unwritable.split(';')[0]}; these costs serve this run only", file=sys.stderr, flush=True)
    return prof


# ---------------------------------------------------------------------------- costs the policies use

STALE_RATIO = 1.3            # plain steps this much slower or faster than the profile, persistently: stale
STALE_ROUNDS = 8             # ... over this many plain (1-row) steps in a row (the median of them)
STALE_RATIO_ANY = 1.6        # rounds of any size, a looser bound (per-round work the profile leaves out)
STALE_ROUNDS_ANY = 24


class Costs:
    """Round costs in milliseconds: verify(n tree tokens) and one draft level of width w,
    from a measured profile, optionally corrected online by what rounds actually take.

    The correction (`online`) is a multiplicative factor per power-of-two size
    bucket, an exponentially weighted mean (weight `adapt`) of measured /
    predicted time; a bucket not yet seen uses the mean over all buckets. So a
    busy or throttled machine, a longer context or another prompt length
    moves the costs within a few rounds, while the measured shape (how verify
    grows with tree size) still orders sizes that have not been tried. It
    makes the costs, and so the trees a policy grows, depend on this run's
    timings; the learned policy leaves it off unless asked (`online_costs`).

    Whether or not it corrects, every observed verify round is checked against
    the profile: when the median of the last `STALE_ROUNDS` plain (1-row)
    steps is off by `STALE_RATIO` or more either way (or of the last
    `STALE_ROUNDS_ANY` rounds of any size by `STALE_RATIO_ANY`), the profile is
    stale: `stale` says why, and `on_stale(reason)` is called once (the decoder
    flags the cached profile for measuring again at the next start).
    """

    def __init__(self, verify: dict[int, float], draft: dict[int, float], source: str = "default",
                 adapt: float = 0.15, online: bool = False):
        self.verify, self.draft, self.source, self.adapt = dict(verify), dict(draft), source, adapt
        self.online = online
        self.stale: str | None = None
        self.on_stale = None
        self.expected_ratio = 1.0                   # measured / profile that rounds are checked against
        self.stale_ratio: float | None = None       # measured / profile when flagged stale
        self._plain: list[float] = []               # measured / profile, last plain steps
        self._any: list[float] = []                 # the same, last rounds of any size
        self.reset_corrections()

    def rebase(self, other: "Costs") -> None:
        """Take `other`'s measured costs and source (a profile measured again), keeping this one's
        settings and hook; corrections and the staleness check start over."""
        self.verify, self.draft, self.source = dict(other.verify), dict(other.draft), other.source
        self.expected_ratio, self.stale_ratio = other.expected_ratio, None
        self.stale, self._plain, self._any = None, [], []
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
        costs = cls(verify=profile.best_ms("verify"), draft=profile.best_ms("draft") or cls.default().draft,
                    source=source)
        observed = (profile.meta.get("confirmed") or {}).get("observed")
        if observed:                # a flag that measuring again did not confirm: that ratio is expected
            costs.expected_ratio = float(observed)
        return costs

    def _corr(self, kind: str, n: float) -> float:
        if not self.online:
            return 1.0
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

    def observe(self, kind: str, n: int | None, predicted_ms: float, measured_ms: float,
                forward_ms: float | None = None) -> None:
        """Fold one measured round into the correction (when `online`) and the staleness check:
        "verify" with n tree tokens, or "draft" with n None (a round's draft levels of several
        widths, corrected as a whole; predicted_ms is their uncorrected sum). `forward_ms`, the
        verify's target forward alone, is what the staleness check compares with the profile (which
        times forwards) where given: the sampling work around a sampled round's forward is not a
        change of machine."""
        if predicted_ms <= 0 or measured_ms <= 0:
            return
        ratio, a = measured_ms / predicted_ms, self.adapt
        if kind == "verify" and self.source != "default":
            self._check_stale(n, forward_ms / predicted_ms if forward_ms else ratio)
        if not self.online:
            return
        if n is not None:
            bucket, b = self._factor[kind], int(n).bit_length()
            bucket[b] = (1 - a) * bucket.get(b, self._overall[kind]) + a * ratio
        self._overall[kind] = (1 - a) * self._overall[kind] + a * ratio

    def _check_stale(self, n: int | None, ratio: float) -> None:
        checks = [(self._any, STALE_ROUNDS_ANY, STALE_RATIO_ANY, "rounds")]
        if n == 1:
            checks.append((self._plain, STALE_ROUNDS, STALE_RATIO, "plain steps"))
        for window, size, bound, what in checks:
            window.append(ratio)
            del window[:-size]
            if self.stale is None and len(window) == size:
                mid = statistics.median(window)
                # off both the profile's own figures and the ratio measuring again confirmed: a machine
                # whose speed drifts between runs (a VM's) then moves between the two without measuring
                if all(not 1 / bound < mid / r < bound for r in {1.0, self.expected_ratio}):
                    self.stale_ratio = mid
                    way = 'faster' if mid < self.expected_ratio else 'slower'
                    self.stale = (f"the last {size} {what} took {mid:.2f}x the profile's time (measured {way}"
                                  + (f" than the {self.expected_ratio:.2f}x expected)" if self.expected_ratio != 1
                                     else ")"))
                    if self.on_stale is not None:
                        self.on_stale(self.stale)
