"""Where a target forward's time goes, and what the faster forward paths change.

Three reports, none asserted:
- the breakdown per operation class (matmul, attention, elementwise, copy,
  other ATen, Python) of a 1-token step and of verifies of 2-64 rows over a
  300-token cache (`mcsd.costs.forward_profile.breakdown`), in
  `benchmark.extra_info["breakdown"]`, with the memory floor (the weights'
  bytes over this machine's read rate, `mcsd.costs.forward_profile.memory_floor`)
  in `extra_info["memory_floor"]`;
- the same block sizes timed interleaved in one process on today's and the
  previous forward paths (`mcsd.costs.forward_profile.compare`): SDPA with a
  concatenating cache against grouped-query attention with the in-place
  cache, on each matmul path the kernel table can choose, in
  `benchmark.extra_info["compare_ms"]` (median ms per variant and size);
- a 1-token step compiled by torch.compile on transformers' static cache,
  plain and with frozen weights, against the engine's own
  (`mcsd.costs.forward_profile.compiled_step`; skipped in the smoke run).

    pytest benchmarks/test_forward_profile.py --benchmark-only --bench-threads 1 --bench-dtype float32
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from mcsd.costs.forward_profile import (
    Variant,
    breakdown,
    compare,
    compiled_step,
    format_comparison,
    format_table,
    memory_floor,
)
from mcsd.forward.kernels import packable

SIZES = (1, 2, 4, 8, 16, 32, 64)


def test_forward_breakdown(benchmark, bench):
    sizes = (1, 8) if bench.smoke else SIZES
    result = {}

    def run():
        result["rows"] = breakdown(bench.target, sizes, cache_len=300, repeats=2 if bench.smoke else 5)

    benchmark.pedantic(run, rounds=1, iterations=1)
    floor = memory_floor(bench.target, mb=64 if bench.smoke else 256)
    print("\n" + format_table(result["rows"], floor))
    benchmark.extra_info.update({
        "memory_floor": dataclasses.asdict(floor),
        "breakdown": [{"rows": r.rows, "wall_ms": r.wall_ms, "profiled_ms": r.profiled_ms, "ms": r.ms, "ops": r.ops,
                       "top": r.top} for r in result["rows"]],
        "cache_len": 300, "attention": bench.target.config._attn_implementation, "environment": bench.environment,
    })


def test_forward_paths_interleaved(benchmark, bench):
    sizes = (1, 8) if bench.smoke else SIZES
    model = bench.target
    variants = [Variant("sdpa+concatenating cache", "sdpa", in_place=False),
                Variant("gqa+in-place cache", "mcsd_gqa", in_place=True)]
    if packable(model.dtype, model.device):
        variants.append(Variant("gqa+in-place, packed", "mcsd_gqa", in_place=True, path="packed"))
    result = {}

    def run():
        result["times"] = compare(model, variants, sizes, cache_len=300, repeats=3 if bench.smoke else 10,
                                  clock="cpu" if torch.get_num_threads() == 1 else "wall")
    benchmark.pedantic(run, rounds=1, iterations=1)
    print("\n" + format_comparison(result["times"]))
    benchmark.extra_info.update({
        "compare_ms": {name: {n: statistics.median(t) for n, t in per.items()} for name, per in result["times"].items()},
        "cache_len": 300, "environment": bench.environment,
    })


@pytest.mark.parametrize("freezing", [False, True], ids=["compiled", "compiled+frozen"])
def test_compiled_step(benchmark, bench, freezing):
    """torch.compile (inductor) on transformers' static cache, against the engine's 1-token step:
    the compile's first-call cost, and each step's median, in `extra_info`."""
    if bench.smoke:
        pytest.skip("compiling the target takes about a minute on a 2-core CPU; not part of the smoke run")
    if bench.target.device.type != "cpu":
        pytest.skip("the CPU's forward paths")
    result = {}

    def run():
        result["step"] = compiled_step(bench.target, cache_len=300, capacity=512, repeats=15, freezing=freezing)
    benchmark.pedantic(run, rounds=1, iterations=1)
    step = result["step"]
    medians = {name: statistics.median(t) for name, t in step.ms.items()}
    print(f"\nfirst compiled call {step.compile_s:.1f} s; " +
          ", ".join(f"{name} {ms:.2f} ms" for name, ms in medians.items()) +
          f"; logits differ by at most {step.max_abs_diff:.2e}, same greedy token: {step.same_argmax}")
    benchmark.extra_info.update({"compiled_step": {"compile_s": step.compile_s, "median_ms": medians,
                                                   "max_abs_diff": step.max_abs_diff,
                                                   "same_argmax": step.same_argmax, "freezing": freezing},
                                 "cache_len": 300, "capacity": 512, "environment": bench.environment})
