"""What the default runs on this machine: the weights (dense or the 4-bit codes of a GGUF-born target)
and the dtype they compute in, whichever pair the calibrated costs say runs the method fastest.

Each candidate is priced by `expected_rate` over its cost profile (`mcsd.costs.profile`),
measured once per machine on a converted copy of the pair and cached: dense float32, dense
bfloat16 where the CPU runs it natively (or bfloat16 and float16 on CUDA), and the target's
Q4_1 codes (`mcsd.forward.quant`) with each compute dtype the q4 kernel takes here ("q4/float32",
"q4/bfloat16" where bfloat16 is native), and on the native kernel the same codes on 8-bit
activations ("q4q8/float32": integer products, llama.cpp's arithmetic), where the target comes
from a GGUF file and a q4 kernel runs. No pair is ruled out by a rule of thumb: on a 2-core Xeon
with AVX512-BF16, q4 codes with float32 compute ran 1.5x the q4-with-bfloat16 pair that a fixed
rule had chosen. Every candidate is exact in its own terms: float32 token for token with plain
float32 decoding, the others with plain decoding in their own arithmetic (see README's
"Exactness").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from ..costs.cost_model import Costs
from ..costs.profile import host_key
from ..costs.store import load_cached, load_or_measure, load_target_costs, needs_remeasure

# Acceptance barely depends on the dtype; the comparison turns on the costs. Measured for the
# preset's feature head, a static chain at greedy decoding's roots on 96 held-out prompts:
# 0.48 / 0.57 / 0.62 at depths 1-3 after its fourth Magpie run, 0.52 / 0.63 / 0.68 after the
# fifth, 0.53 / 0.63 / 0.67 after the sixth, 0.54 / 0.64 / 0.68 after the seventh; in real
# bfloat16 decoding on 48 of those prompts 0.56 / 0.64 / 0.71 after the seventh, 0.57 / 0.67 /
# 0.70 after the eighth and 0.57 / 0.66 / 0.71 after the ninth (the shipped head; docs/training.md).
ASSUMED_ACCEPTANCE = 0.55
Q4 = "q4"                       # the weights that run the target's linear layers on its 4-bit codes
Q4Q8 = "q4q8"                   # the same codes on 8-bit activations (integer products)


def q4_candidate(dtype: str, weights: str = Q4) -> str:
    """The candidate name of `weights` ("q4" or "q4q8") computing in `dtype` ("q4/float32")."""
    return f"{weights}/{dtype}"


def weights_of(name: str) -> str:
    """The weights a candidate runs on: "q4", "q4q8" or "dense"."""
    weights = name.partition("/")[0]
    return weights if weights in (Q4, Q4Q8) else "dense"


def is_q4(name: str) -> bool:
    """The candidate runs the target on its 4-bit codes (q4 or q4q8)."""
    return weights_of(name) != "dense"


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
    dtype: str                  # the dtype the pair computes in
    reason: str
    rates: dict                 # candidate -> expected tokens/s of the method on this machine
    calibration_s: float = 0.0  # time spent measuring for the choice in this run
    provisional: bool = False   # some profile it rests on was measured on a busy machine
    weights: str = "dense"      # "dense", "q4" (the target's linear layers on its GGUF's 4-bit codes), "q4q8"
                                # (those codes on 8-bit activations)
    measured: bool = True       # False: no calibrated costs, the fixed rule of an uncalibrated run chose


def q4_possible(target, gguf: Path | None) -> bool:
    """The q4 candidate can run: a GGUF the target came from, the CPU, and a q4 kernel."""
    from ..forward import quant
    return gguf is not None and next(target.parameters()).device.type == "cpu" and quant.kernel_available()


def choose_dtype(target, draft, candidates=None, drafting: bool = True, calibrate: bool | None = None,
                 quiet: bool = False, free_draft: bool = False, borrow: bool = False,
                 gguf: Path | None = None, weights: str = "auto") -> DtypeChoice:
    """The weights and dtype with which this pair runs fastest here, from each candidate's calibrated cost.

    `target` (and `draft`) must be in float32, dense; a candidate other than
    float32 is measured on a converted copy (only when its profile is not
    cached, or when `calibrate` is True). `free_draft`: proposals come from
    context (nothing to draft, only verify). Candidates default to float32 and
    bfloat16 on a CPU with native bf16 (float32 alone on other CPUs), bfloat16
    and float16 on CUDA, and besides, where `gguf` (the Q4_1 file the target
    came from) is given and `q4_possible`, q4 weights with every compute dtype
    the q4 kernel takes here (bfloat16 only where it is native) and q4q8 in
    float32 on the native kernel; `weights="q4"` or `"q4q8"` weighs that one's
    alone. With `calibrate=False` and a profile missing, a fixed rule decides
    instead (`measured` False): for dense weights bfloat16 on CUDA and on CPUs
    with native bf16 (AVX512-BF16 or AMX, as oneDNN uses it), float32 on other
    CPUs; for q4 weights `quant.compute_dtype()`; q4q8 float32.
    `borrow` (with no draft): the target's costs may come from a cached profile
    of it with any drafter (`load_target_costs`). A cached profile flagged for
    measuring again is measured again when the machine is quiet (`calibrate`
    None). The models are not converted here (see `apply_choice`).
    """
    device = next(target.parameters()).device
    native = device.type == "cuda" or host_key(device)["onednn_bf16"]          # what torch runs bf16 products with
    if candidates is None:
        candidates = q4_candidates(target, gguf, native, weights)
        if weights not in (Q4, Q4Q8):
            # on a CPU without native bf16, oneDNN emulates its products: never faster enough to
            # give up float32's exactness for, so not worth the calibration time
            candidates = (("bfloat16", "float16") if device.type == "cuda" else
                          ("float32", "bfloat16") if native else ("float32",)) + candidates

    def cached(name):
        dtype = _dtype(name)
        prof = load_cached(target, draft, dtype, remeasure=calibrate is None,
                           weights=weights_of(name) if is_q4(name) else None)
        if prof is None and draft is None and borrow and not is_q4(name):
            prof = load_target_costs(target, dtype)         # the target's costs from a pair's profile
        return prof
    profiles = {name: None if calibrate else cached(name) for name in candidates}
    if calibrate is False and any(p is None for p in profiles.values()):
        return _uncalibrated(device, native, weights)
    rates, depths, spent, provisional = {}, {}, 0.0, False
    for name, prof in profiles.items():
        if prof is None:
            t, d = _candidate_copy(target, draft, name, gguf)
            prof = load_or_measure(t, d, force=bool(calibrate), quiet=quiet)
            spent += prof.meta.get("calibration_s", 0.0)
            del t, d
        provisional = provisional or bool(needs_remeasure(prof))
        rates[name], depths[name] = expected_rate(Costs.from_profile(prof), drafting and (draft is not None or free_draft),
                                                  free_draft=free_draft and draft is None)
    best = max(rates, key=rates.get)
    others = ", ".join(f"{_label(n)} {r:.1f}" for n, r in rates.items() if n != best) or \
        "bfloat16 not measured: no native bfloat16 on this CPU"
    what = f"chains of {depths[best]}" if depths[best] else "plain steps"
    reason = (f"{_label(best)}: {rates[best]:.1f} expected tokens/s with {what} on this machine "
              f"(measured costs; {others}; {ASSUMED_ACCEPTANCE:.0%} acceptance per drafted token assumed)")
    return DtypeChoice(str(_dtype(best)).removeprefix("torch."), reason, rates, spent, provisional,
                       weights_of(best))


def q4_candidates(target, gguf: Path | None, native_bf16: bool, weights: str = "auto") -> tuple[str, ...]:
    """The pairs on the target's codes this machine can run: q4 weights with each compute dtype the
    kernel takes here, bfloat16 beside float32 only where the CPU runs it natively (emulated, it is
    never the faster one), and q4q8 (8-bit activations) in float32 where the native kernel runs;
    `weights` "q4" or "q4q8": that one's alone; "dense": none. Which of them is fastest is left to the measured
    costs: the integer products pay off with rows (a verify) more than in a one-row step."""
    from ..forward import quant
    if not q4_possible(target, gguf):
        return ()
    out = []
    for kind in (Q4, Q4Q8):
        if weights in (kind, "auto"):
            takes = quant.dtypes(kind)
            out += [q4_candidate(d, kind) for d in takes if d == "float32" or native_bf16 or len(takes) == 1]
    return tuple(out)


def _uncalibrated(device, native: bool, weights: str) -> DtypeChoice:
    """The fixed rule's choice where a candidate has no cached costs and measuring is not allowed."""
    from ..forward import quant
    where = "GPU" if device.type == "cuda" else "CPU"
    if weights == Q4Q8:
        return DtypeChoice("float32", "q4 weights on 8-bit activations (float32): not calibrated; the only "
                                      "compute dtype they take", {}, weights=Q4Q8, measured=False)
    if weights == Q4:
        best = quant.compute_dtype()
        return DtypeChoice(best, f"q4 weights ({best}): not calibrated; the fixed rule for q4 weights "
                                 f"({quant.describe_kernel()})", {}, weights=Q4, measured=False)
    best = "bfloat16" if native else "float32"
    return DtypeChoice(best, f"{best}: not calibrated; the fixed rule for dense weights "
                             f"({'native' if native else 'no native'} bfloat16 on this {where})", {}, measured=False)


def _dtype(name: str) -> torch.dtype:
    """The dtype candidate `name` computes in ("q4" alone: the fixed rule's, `quant.compute_dtype()`;
    "q4q8" alone: float32)."""
    from ..forward import quant
    if is_q4(name):
        given = name.partition("/")[2]
        return getattr(torch, given or ("float32" if weights_of(name) == Q4Q8 else quant.compute_dtype()))
    return getattr(torch, name)


def _label(name: str) -> str:
    if not is_q4(name):
        return name
    on = " on 8-bit activations" if weights_of(name) == Q4Q8 else ""
    return f"q4 weights{on} ({str(_dtype(name)).removeprefix('torch.')})"


def apply_choice(target, draft, choice: DtypeChoice, gguf: Path | None = None):
    """The pair converted to `choice`: cast to its dtype, and the target's linear layers on the GGUF's
    codes for q4 (on 8-bit activations for q4q8). Returns (target, draft)."""
    return _convert(target, draft, getattr(torch, choice.dtype), choice.weights, gguf)


def _convert(target, draft, dtype: torch.dtype, weights: str, gguf: Path | None):
    from ..drafting.pair import cast_pair
    from ..forward import quant
    target, draft = cast_pair(target, draft, dtype)
    if weights in (Q4, Q4Q8):
        quant.attach(target, gguf, act8=weights == Q4Q8)
        if hasattr(draft, "follow_target_weights"):         # a feature head follows its target onto codes
            draft.follow_target_weights()
    return target, draft


def _candidate_copy(target, draft, name: str, gguf: Path | None):
    """The pair as candidate `name` runs it, a copy where it must be converted (the originals untouched)."""
    dtype = _dtype(name)
    if dtype == next(target.parameters()).dtype and not is_q4(name):
        return target, draft
    from ..drafting.feature_draft import FeatureDrafter
    t = copy.deepcopy(target)
    d = draft.bound_to(t, copy.deepcopy(draft.head)) if isinstance(draft, FeatureDrafter) \
        else copy.deepcopy(draft)
    return _convert(t, d, dtype, weights_of(name), gguf)
