"""Timing a forward robustly: a model or feature head held at a prefix, every (role, size, path) timed
in shuffled interleaved rounds, what is inconsistent measured again, and whether the machine was busy
meanwhile; `measure` turns that into a `DeviceProfile`.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass

import torch

from ..forward import kernels, kv_cache, mapped
from ..forward.attention import causal_allowed
from ..forward.lm import CachedLM
from .profile import DeviceProfile, _is_feature_drafter, _model_key, _model_name, drafter_module, machine_info

# tree sizes timed (3: the last the native q4 kernel keeps in registers); larger ones extrapolate proportionally
DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 16, 32)
DEFAULT_DRAFT_SIZES = (1, 2, 4, 8, 16)    # draft level widths timed
ATEN_MAX_ROWS = 16          # block sizes up to this are also timed through ATen's kernels (mcsd.forward.kernels)


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
        cut_short: rounds were left out at the deadline.
    """

    ms: dict
    spread: dict
    remeasured: set
    lowered: set
    cut_short: bool = False

    def merged(self, later: "Timings") -> "Timings":
        """These timings and a later phase's (other paths of some roles): each role the later phase
        timed keeps only the sizes it timed, so that every path of a role covers the same sizes."""
        sizes = {(role, n) for role, n, _ in later.ms}
        roles = {role for role, _ in sizes}
        keep = {k for k in self.ms if k[0] not in roles or (k[0], k[1]) in sizes}
        return Timings(ms={**{k: self.ms[k] for k in keep}, **later.ms},
                       spread={**{k: v for k, v in self.spread.items() if k in keep}, **later.spread},
                       remeasured=(self.remeasured & keep) | later.remeasured,
                       lowered=(self.lowered & keep) | later.lowered, cut_short=self.cut_short or later.cut_short)


def _summary(rounds: list[list[float]]) -> tuple[float, float]:
    """(min of the rounds' medians, relative gap between the best two medians)."""
    meds = sorted(statistics.median(r) for r in rounds if r)
    return meds[0], ((meds[1] - meds[0]) / meds[0] if len(meds) > 1 and meds[0] > 0 else 0.0)


def robust_timings(plan: list[tuple], latency, gen: torch.Generator, rounds: int = 3, per_round: int = 2,
                   remeasure_passes: int = REMEASURE_PASSES, deadline: float | None = None) -> Timings:
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
        deadline: a `time.perf_counter()` reading past which no further round starts (the first
            always runs); the timings are then `cut_short`.
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

    def late() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    cut = False
    for i in range(max(1, rounds)):
        if i and late():
            cut = True
            break
        one_round(plan)
    remeasured: set = set()
    for _ in range(remeasure_passes):
        suspects = _suspects({s: _summary(r) for s, r in samples.items()})
        if not suspects:
            break
        if late():
            cut = True
            break
        remeasured |= suspects
        one_round([s for s in plan if s in suspects])
    summary = {s: _summary(r) for s, r in samples.items()}
    ms, lowered = _envelope({s: v[0] for s, v in summary.items()})
    return Timings(ms=ms, spread={s: v[1] for s, v in summary.items()}, remeasured=remeasured, lowered=lowered,
                   cut_short=cut)


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
            draft_sizes=DEFAULT_DRAFT_SIZES, busy_check: BusyCheck | None = None,
            budget_s: float | None = None) -> DeviceProfile:
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
    model had them before): interleaved the same way where the model had them, else after the
    plain paths, with the plain weights' file pages given back meanwhile (one layout in memory at
    a time).

    A measurement taken while the machine was busy (`BusyCheck`) is marked
    provisional in meta["provisional"] (the reason): it serves the run that
    made it and is measured again on a later quiet start (`load_cached`).
    So is one cut short by `budget_s`: past that many seconds from the start no
    further round of timings starts. The budget does not cut the first forward,
    the warm-up pass (one forward of each planned step; it alone serves when it
    ran past the budget) or the round under way at the deadline: a measurement
    takes at most about the budget plus one warm-up pass and one round.
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
    # Copies made here for the measurement are timed after the plain paths, their plain weights' file
    # pages given back meanwhile, so that memory never holds both layouts of a model loaded in place
    # (the whole measurement would otherwise peak at twice its weights); where no copy is made (the
    # model had its copies), every path is timed interleaved, as they cost no memory to keep.

    def latency(role, n, path):
        with kernels.using(path) if both[role] or packs[role] else contextlib.nullcontext():
            return timers[role][0].latency(n)

    rounds = max(1, min(3, repeats // 2))
    deadline = None if budget_s is None else t_start + budget_s

    def timed_phase(steps) -> Timings:
        latency(*steps[0])                                                       # the very first forward
        pilot = {step: latency(*step) for step in steps}            # warms every shape up, in order of size
        steps = _prune(steps, pilot)
        if deadline is not None and time.perf_counter() > deadline:   # the warm-up pass is what there is
            ms, lowered = _envelope({step: pilot[step] for step in steps})
            return Timings(ms=ms, spread={}, remeasured=set(), lowered=lowered, cut_short=True)
        return robust_timings(steps, latency, gen, rounds=rounds, per_round=-(-repeats // rounds),
                              deadline=deadline)

    try:
        timed = timed_phase([s for s in plan if not made or s[2] != "packed"])    # every size has an onednn step
        if made:
            for module in made:
                kernels.pack(module, drop_pages=True)
            kept = {(r, n) for r, n, _ in timed.ms}                                # the sizes the plain paths kept
            timed = timed.merged(timed_phase([s for s in plan if s[2] == "packed" and (s[0], s[1]) in kept]))
    finally:
        if draft is not None and _is_feature_drafter(draft):
            draft.kernels = saved
        for module in made:
            kernels.unpack(module)
        if made:                                     # the copies' memory back before anything packs again
            gc.collect()
            mapped.trim()
    provisional = busy_check.finish()
    if provisional is None and timed.cut_short:     # the budget bounds when rounds start, not the warm-up pass
        provisional = (f"cut short: no round of timings started past the {budget_s:g} s budget "
                       f"({time.perf_counter() - t_start:.0f} s in all, the warm-up pass included)")
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
