"""Where a target forward's time goes: matrix products, attention, elementwise work, Python.

A forward of a few rows over a long cache is mostly not arithmetic: on a CPU
the matrix products of a 135M model run near the memory roofline, while the
attention kernel's fixed cost per call, thousands of small ATen operations
(norms, rotary, views, cache copies) and the Python of the modeling code
around them add as much again. `breakdown` runs one block size under
`torch.profiler` and sorts the self CPU time of every ATen operation into
classes:

- matmul: linear layers' products (`aten::linear` / `mm` / `addmm`, oneDNN's
  prepacked `mkldnn::_linear_pointwise`) and everything they call;
- attention: `scaled_dot_product_attention`, batched products and softmax
  (mcsd's grouped-query attention), and everything they call;
- elementwise: arithmetic on activations (norms, rotary, SwiGLU, residuals, mask);
- copy: concatenation, dtype casts and copies (cache appends, commits);
- other: every other ATen operation (views, indexing, allocation);
- python: the profiled forward's wall time minus all ATen self time (the
  modeling code, cache bookkeeping, dispatch).

`memory_floor` says how near that roofline a forward is: the bytes of
weights every forward reads whatever its rows (the dense or 4-bit linear
weights and the norms; the input embedding only by the row) over the rate
this machine reads memory at (a sum over a tensor far past its caches).
No forward of a few rows can beat it on this machine without reading fewer
bytes.

Limitations: the profiler adds a few microseconds to every operation, part
of it inside the operations' self time and part outside, so a profiled
forward is slower than an unprofiled one (`wall_ms` is the unprofiled
median, `profiled_ms` the profiled mean) and the shares are of the latter.
Figures are only as steady as the machine is quiet.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..forward import kernels
from ..forward.attention import causal_allowed
from ..forward.lm import CachedLM

CLASSES = ("matmul", "attention", "elementwise", "copy", "other", "python")
ATTENTION_SCOPE = "mcsd::attention"         # record_function name of mcsd's own attention paths

_MATMUL_ROOTS = {"aten::linear", "aten::matmul", "aten::mm", "aten::addmm",
                 "mkldnn::_linear_pointwise", "aten::mkldnn_linear", "aten::_weight_int4pack_mm_for_cpu"}
# Batched products and softmax occur only in attention in a Llama-style forward (linear layers fold
# their batch into one `mm`); mcsd's grouped-query attention is made of them.
_ATTENTION_ROOTS = {"aten::scaled_dot_product_attention", ATTENTION_SCOPE, "aten::bmm", "aten::baddbmm",
                    "aten::softmax", "aten::_softmax"}
_ELEMENTWISE = {"aten::mul", "aten::add", "aten::sub", "aten::div", "aten::neg", "aten::rsqrt", "aten::pow",
                "aten::mean", "aten::silu", "aten::sigmoid", "aten::exp",
                "aten::mul_", "aten::add_", "aten::div_", "aten::masked_fill", "aten::where", "aten::embedding",
                "aten::cos", "aten::sin", "aten::sqrt", "aten::var", "aten::sum"}
_COPY = {"aten::cat", "aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous",
         "aten::index_copy_", "aten::index_select", "aten::index", "aten::index_put_", "aten::_index_put_impl_"}


@dataclass
class Breakdown:
    """Milliseconds per forward of `rows` block rows over a `cache_len` cache.

    Attributes:
        rows: block rows (query tokens) of the forward.
        cache_len: committed positions before the block.
        wall_ms: median wall time of an unprofiled forward.
        profiled_ms: mean wall time of a profiled forward.
        ms: {class: ms} over `CLASSES` (self CPU time per class; "python" = profiled_ms - ATen).
        ops: ATen operations per forward (count of profiled events, all nesting levels).
        top: the ten operations with the most self time, [(name, ms per forward, calls per forward)].
    """

    rows: int
    cache_len: int
    wall_ms: float
    profiled_ms: float
    ms: dict[str, float]
    ops: int
    top: list = field(default_factory=list)


@dataclass(frozen=True)
class MemoryFloor:
    """The least time a forward can take here for reading its weights once.

    Attributes:
        weight_mb: MB (1e6 bytes) of weights one forward reads (`weight_bytes`).
        read_gb_s: GB/s this machine read memory at with torch's threads (`read_bandwidth`).
        ms: weight_mb / read_gb_s, in ms.
    """

    weight_mb: float
    read_gb_s: float
    ms: float


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one forward of `model` reads, whatever its rows.

    Every linear layer's weight in the form its forward reads (the 4-bit codes, scales and zero
    points where `mcsd.forward.quant` attached them, else the dense weight: prepacking changes its layout,
    not its size), every other parameter (norms), each tensor once (a tied LM head is the
    embedding); the input embedding itself is left out unless the LM head reads it, since a
    forward gathers only its rows.
    """
    from ..forward import quant

    embedding = model.get_input_embeddings()
    unread = {id(p) for p in embedding.parameters()} if embedding is not None else set()   # gathered by the row
    reads: dict = {}                                    # one entry per tensor (or joined q4 product) read
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            q4 = quant.read_bytes(layer)
            if q4 is not None:
                reads[("q4", q4[0])] = q4[1]
                unread.add(id(layer.weight))            # it runs on its codes, not its dense weight
            else:
                unread.discard(id(layer.weight))        # a tied LM head reads the whole embedding
    for p in model.parameters():
        if id(p) not in unread:                        # a weight let go for its prepacked copy: that size
            reads[("meta", id(p)) if p.is_meta else p.data_ptr()] = p.nbytes
    return sum(reads.values())


def read_bandwidth(mb: int = 256, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """GB/s (1e9 bytes) `device`'s memory is read at (on a CPU with torch's current threads): the
    fastest of `repeats` sums over `mb` MB of bfloat16 (after one untimed sum), far past any cache."""
    if mb < 1 or repeats < 1:
        raise ValueError("mb and repeats must be positive")
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.ones(mb * 1_000_000 // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9


def resident_bytes(*modules) -> dict[str, int]:
    """Bytes the weights of `modules` hold in memory, each tensor once, by form: "dense" (every
    parameter), "int4" (the Q4_1 codes, scales and zero points `mcsd.forward.quant` attached), "int8" (Q8_0
    codes and scales: a GGUF's LM head, a feature head beside a q4 target) and "prepacked" (oneDNN's
    reordered copies `mcsd.forward.kernels` made). What `--stats` reports."""
    from ..forward import quant
    dense, int4, int8, packed = {}, {}, {}, {}
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            if not p.is_meta:                            # a q4 weight let go (`mcsd.forward.quant`) holds nothing
                dense[p.data_ptr()] = p.nbytes
        for layer in module.modules():
            codes = quant.read_bytes(layer)
            if codes is not None:
                (int8 if quant.code_bits(layer) == 8 else int4)[codes[0]] = codes[1]
            copy = layer.__dict__.get("_mcsd_packed")
            if copy is not None:
                packed[id(copy)] = copy.weight.numel() * copy.weight.element_size()
    return {"dense": sum(dense.values()), "int4": sum(int4.values()), "int8": sum(int8.values()),
            "prepacked": sum(packed.values())}


def memory_floor(model: torch.nn.Module, mb: int = 256, repeats: int = 5) -> MemoryFloor:
    """`model`'s weight bytes over the measured read rate of the memory its weights are in: the
    floor of any forward."""
    nbytes = weight_bytes(model)
    gb_s = read_bandwidth(mb, repeats, next(model.parameters()).device)
    return MemoryFloor(weight_mb=nbytes / 1e6, read_gb_s=gb_s, ms=nbytes / (gb_s * 1e9) * 1e3)


def _classify(evt) -> str:
    """The class of one profiled event: its outermost recognised ancestor (or itself) decides,
    else its own name."""
    chain = []
    node = evt
    while node is not None:
        chain.append(node.name)
        node = node.cpu_parent
    for name in reversed(chain):                    # outermost first: a linear layer's inner bmm stays matmul
        if name in _ATTENTION_ROOTS:
            return "attention"
        if name in _MATMUL_ROOTS:
            return "matmul"
    if evt.name in _ELEMENTWISE:
        return "elementwise"
    if evt.name in _COPY:
        return "copy"
    return "other"


def _is_annotation(evt) -> bool:
    # record_function scopes (and the profiler's own) hold Python time, not ATen work
    return bool(getattr(evt, "is_user_annotation", False)) or evt.name.startswith(("mcsd::", "ProfilerStep"))


class _Runner:
    """A CachedLM with `cache_len` committed positions; runs one block and drops it again."""

    def __init__(self, model, cache_len: int, seed: int = 0, in_place: bool = True, lean: bool | None = None):
        self.lm = CachedLM(model, in_place=in_place, lean=lean)
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = model.get_input_embeddings().weight.shape[0]
        self.cache_len = cache_len
        self.lm.reset()
        self.lm.extend(torch.randint(0, self.vocab, (cache_len,), generator=self.gen), last_logits=True)

    @torch.inference_mode()
    def step(self, rows: int) -> None:
        lm = self.lm
        tokens = torch.randint(0, self.vocab, (rows,), generator=self.gen)
        pos = torch.arange(self.cache_len, self.cache_len + rows)
        lm.forward(tokens, pos, causal_allowed(rows, lm.device))
        lm.commit(self.cache_len, torch.zeros(0, dtype=torch.long))              # back to the prefix


def breakdown(model, sizes=(1, 2, 4, 8, 16, 32, 64), cache_len: int = 300, repeats: int = 5,
              path: str | None = None, join: bool = True, lean: bool | None = None) -> list[Breakdown]:
    """Profile target forwards of each block size and split their time by operation class.

    Args:
        model: a transformers causal LM (eval mode) on the CPU.
        sizes: block sizes (query rows) to profile; 1 is a decode step, more a verify.
        cache_len: committed positions in the cache before each block.
        repeats: unprofiled timings per size (median kept), and profiled forwards per size
            (self times averaged); sizes are interleaved round by round.
        path: matmul path to run on ("aten", "onednn", "packed"; see `mcsd.forward.kernels`), or None
            for torch's own choice. "packed" prepacks the model's linear weights for the
            duration (dropped again unless they were there before).
        join: on prepacked weights, q / k / v run as one product (`mcsd.forward.fused`), as the engine runs them.
        lean: the engine's own forward (True), transformers' (False), or the one `CachedLM` chooses (None).
    Returns:
        one `Breakdown` per size, in the order given.
    """
    from torch.profiler import ProfilerActivity, profile

    runner = _Runner(model, cache_len, lean=lean)
    made_packed = path == "packed" and not kernels.is_packed(model)
    if made_packed:
        kernels.pack(model, join=join)
    scope = kernels.using(path) if path is not None else contextlib.nullcontext()
    walls: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        with scope:
            for n in sizes:                                                      # warm-up
                runner.step(n)
            for _ in range(repeats):
                for n in sizes:
                    t0 = time.perf_counter()
                    runner.step(n)
                    walls[n].append((time.perf_counter() - t0) * 1000)
            results = []
            for n in sizes:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t0 = time.perf_counter()
                    for _ in range(repeats):
                        runner.step(n)
                    profiled = (time.perf_counter() - t0) * 1000 / repeats
                results.append(_summarise(prof, n, cache_len, statistics.median(walls[n]), profiled, repeats))
    finally:
        if made_packed:
            kernels.unpack(model)
    return results


def _summarise(prof, rows: int, cache_len: int, wall_ms: float, profiled_ms: float, repeats: int) -> Breakdown:
    ms = dict.fromkeys(CLASSES, 0.0)
    per_op: dict[str, list[float]] = {}
    ops = 0
    for evt in prof.events():
        if _is_annotation(evt):
            continue
        ops += 1
        self_ms = evt.self_cpu_time_total / 1000 / repeats
        ms[_classify(evt)] += self_ms
        entry = per_op.setdefault(evt.name, [0.0, 0])
        entry[0] += self_ms
        entry[1] += 1
    aten = sum(ms.values())
    ms["python"] = max(0.0, profiled_ms - aten)
    top = sorted(((name, round(t, 3), round(c / repeats, 1)) for name, (t, c) in per_op.items()),
                 key=lambda r: -r[1])[:10]
    return Breakdown(rows=rows, cache_len=cache_len, wall_ms=wall_ms, profiled_ms=profiled_ms, ms=ms, ops=round(ops / repeats), top=top)


def format_table(results: list[Breakdown], floor: MemoryFloor | None = None) -> str:
    """A text table: one line per block size: wall times, ms per class (share of the profiled
    forward), ATen operations; with `floor`, a first line stating it and each wall time's
    multiple of it."""
    head = f"{'rows':>5} {'wall ms':>8} {'profiled':>8} " + " ".join(f"{c:>11}" for c in CLASSES) + f" {'ATen ops':>9}"
    if floor is not None:
        head += f" {'x floor':>8}"
    lines = [head, "-" * len(head)]
    if floor is not None:
        lines.insert(0, f"memory floor: {floor.weight_mb:.1f} MB of weights a forward at {floor.read_gb_s:.1f} GB/s "
                        f"read here = {floor.ms:.2f} ms")
    for r in results:
        cells = " ".join(f"{r.ms[c]:>6.2f} {100 * r.ms[c] / r.profiled_ms:>3.0f}%" for c in CLASSES)
        line = f"{r.rows:>5} {r.wall_ms:>8.2f} {r.profiled_ms:>8.2f} {cells} {r.ops:>9}"
        if floor is not None:
            line += f" {r.wall_ms / floor.ms:>8.2f}"
        lines.append(line)
    return "\n".join(lines)


def to_json(results: list[Breakdown], meta: dict | None = None) -> str:
    return json.dumps({"meta": meta or {}, "breakdown": [asdict(r) for r in results]}, indent=1)


@dataclass(frozen=True)
class Variant:
    """One way of running the forward, for `compare`.

    Attributes:
        name: what the report calls it.
        attention: transformers attention implementation ("sdpa", or a name `mcsd.forward.attention`
            registers, e.g. "mcsd_gqa").
        in_place: the KV cache writes into preallocated buffers (else concatenates).
        path: matmul path (`mcsd.forward.kernels.using`), or None for torch's own choice.
        lean: runs on the engine's own forward (`mcsd.forward.llama`; `attention` and `in_place` then do
            not apply), else on transformers' forward.
    """

    name: str
    attention: str = "sdpa"
    in_place: bool = True
    path: str | None = None
    lean: bool = False


def compare(model, variants: list[Variant], sizes=(1, 2, 4, 8, 16, 32, 64), cache_len: int = 300,
            repeats: int = 10, seed: int = 0, clock: str = "wall") -> dict[str, dict[int, list[float]]]:
    """Time forwards of each block size under each variant, interleaved in one process.

    Every round visits all (variant, size) pairs in a fresh random order, so a
    busy machine's drift falls on all of them alike; each variant keeps its own
    cache of `cache_len` positions. The model's attention implementation is
    switched between forwards (and restored at the end); weights are prepacked
    for the duration if some variant runs on the "packed" path. `clock` "cpu"
    counts the calling thread's CPU time (user and system) instead of wall
    time: on a shared machine it leaves out the time other processes hold
    the core, which only makes sense with one torch thread.

    Returns:
        {variant name: {rows: [ms per forward, one per round]}}.
    """
    from ..forward.attention import register

    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', not {clock!r}")
    now = time.perf_counter if clock == "wall" else time.thread_time
    before = model.config._attn_implementation
    made_packed = any(v.path == "packed" for v in variants) and not kernels.is_packed(model)
    if made_packed:
        kernels.pack(model)
    try:
        runners = {}
        for v in variants:
            register(v.attention)
            model.set_attn_implementation(v.attention)
            runners[v.name] = _Runner(model, cache_len, seed=seed, in_place=v.in_place, lean=v.lean)
        plan = [(v, n) for v in variants for n in sizes]
        gen = torch.Generator().manual_seed(seed)
        times: dict[str, dict[int, list[float]]] = {v.name: {n: [] for n in sizes} for v in variants}
        for r in range(repeats + 1):                                             # round 0 warms up
            for i in torch.randperm(len(plan), generator=gen).tolist():
                v, n = plan[i]
                if model.config._attn_implementation != v.attention:
                    model.set_attn_implementation(v.attention)
                with kernels.using(v.path) if v.path else contextlib.nullcontext():
                    t0 = now()
                    runners[v.name].step(n)
                    elapsed = (now() - t0) * 1000
                if r:
                    times[v.name][n].append(elapsed)
    finally:
        model.set_attn_implementation(before)
        if made_packed:
            kernels.unpack(model)
    return times


def format_comparison(times: dict[str, dict[int, list[float]]]) -> str:
    """A text table: per block size, each variant's minimum and median ms and its median's
    ratio to the first variant's."""
    names = list(times)
    sizes = list(next(iter(times.values())))
    head = f"{'rows':>5} " + " ".join(f"{name:>26}" for name in names)
    lines = [head, f"{'':>5} " + " ".join(f"{'min / median ms (x first)':>26}" for _ in names)]
    for n in sizes:
        base = statistics.median(times[names[0]][n])
        cells = []
        for name in names:
            t = times[name][n]
            cells.append(f"{min(t):>8.2f} / {statistics.median(t):>8.2f} ({statistics.median(t) / base:4.2f})")
        lines.append(f"{n:>5} " + " ".join(f"{c:>26}" for c in cells))
    return "\n".join(lines)


@dataclass
class CompiledStep:
    """A 1-token step compiled by torch.compile (inductor) on a static KV cache, against the engine's own.

    Attributes:
        compile_s: the compiled step's first call (tracing, code generation, C++ compile; a warm
            on-disk inductor cache shortens it).
        ms: {variant: [ms per step, one per round]}: "engine" (CachedLM, the path the decoder runs
            today), "static eager" (transformers' StaticCache, not compiled), "static compiled".
        max_abs_diff: largest logit difference between the compiled and the eager static step.
        same_argmax: whether the two agree on the greedy token.
    """

    compile_s: float
    ms: dict[str, list[float]]
    max_abs_diff: float
    same_argmax: bool


def compiled_step(model, cache_len: int = 300, capacity: int = 512, repeats: int = 10, freezing: bool = False,
                  seed: int = 0) -> CompiledStep:
    """Time a 1-token step three ways, interleaved round by round (see `CompiledStep`).

    The static cache holds `capacity` slots and every step attends over all of
    them (the slots past the sequence masked), which is what lets one compiled
    graph serve every cache length; `freezing` folds the weights into the
    graph as constants (inductor's `freezing`, which also prepacks them).
    """
    from transformers import StaticCache

    from ..forward.kv_cache import cache_keyword

    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    engine = _Runner(model, cache_len, seed=seed)
    cache_kw = cache_keyword(model)
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    dtype = model.get_input_embeddings().weight.dtype
    slots = torch.arange(capacity)

    def static_forward(fn, tokens, start):
        n = tokens.numel()
        rows = torch.arange(start, start + n)
        mask = torch.where(slots[None, :] <= rows[:, None], 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
        logits = fn(input_ids=tokens[None], position_ids=rows[None], cache_position=rows, attention_mask=mask,
                    use_cache=True, **{cache_kw: cache}).logits[0]
        for layer in cache.layers:                                             # back to the prefix
            layer.cumulative_length.fill_(start)
        return logits

    import torch._inductor.config as inductor_config
    with torch.inference_mode(), inductor_config.patch(freezing=freezing):
        static_forward(model.forward, torch.randint(0, vocab, (cache_len,), generator=gen), 0)
        for layer in cache.layers:
            layer.cumulative_length.fill_(cache_len)
        torch._dynamo.reset()                       # an earlier compile of the same forward must not serve
        compiled = torch.compile(model.forward, dynamic=False, fullgraph=True)
        probe = torch.randint(0, vocab, (1,), generator=gen)
        eager = static_forward(model.forward, probe, cache_len)
        t0 = time.perf_counter()
        fast = static_forward(compiled, probe, cache_len)
        compile_s = time.perf_counter() - t0
        steps = {"engine": lambda: engine.step(1),
                 "static eager": lambda: static_forward(model.forward, torch.randint(0, vocab, (1,), generator=gen),
                                                        cache_len),
                 "static compiled": lambda: static_forward(compiled, torch.randint(0, vocab, (1,), generator=gen),
                                                           cache_len)}
        ms: dict[str, list[float]] = {name: [] for name in steps}
        names = list(steps)
        for r in range(repeats + 1):                                           # round 0 warms up
            for i in torch.randperm(len(names), generator=gen).tolist():
                t0 = time.perf_counter()
                steps[names[i]]()
                if r:
                    ms[names[i]].append((time.perf_counter() - t0) * 1000)
    return CompiledStep(compile_s=compile_s, ms=ms, max_abs_diff=float((fast - eager).abs().max()),
                        same_argmax=bool(fast.argmax() == eager.argmax()))
