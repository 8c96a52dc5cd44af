"""Device profile: target verify latency against the number of tree tokens, per attention backend.

On CPU this uses the real target (the session's pair); on CUDA, where no
weights can be fetched, a randomly initialised ~1B-parameter Llama stands in
(latency depends on shapes, not on weight values). The table lands in
`benchmark.extra_info["verify_ms"]` and is the cost table tree policies use.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mcsd.costs.timing import DEFAULT_SIZES, measure, stand_in
from mcsd.forward.attention import xformers_unavailable_reason

BACKENDS = ["sdpa", "xformers"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_latency_by_tree_size(benchmark, bench, backend):
    on_cuda = bench.device.startswith("cuda") or bench.device == "auto"
    if backend == "xformers" and (reason := xformers_unavailable_reason(bench.target.device)):
        pytest.skip(reason)
    model = stand_in("llama-1b", torch.bfloat16, "cuda") if on_cuda and bench.smoke is False and torch.cuda.is_available() else bench.target
    if backend != getattr(model.config, "_attn_implementation", None):
        model = copy.deepcopy(model) if model is bench.target else model
        from mcsd.forward.attention import set_backend
        set_backend(model, backend)
    repeats = 3 if bench.smoke else 20
    sizes = (1, 8) if bench.smoke else DEFAULT_SIZES
    result = {}

    def run():
        result["profile"] = measure(model, None, sizes=sizes, repeats=repeats)

    benchmark.pedantic(run, rounds=1, iterations=1)
    prof = result["profile"]
    one = prof.verify_ms[sizes[0]]
    benchmark.extra_info.update({
        "profile": True, "backend": backend, "model": prof.meta.get("target"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "verify_ms": prof.verify_ms, "relative_to_one_token": {n: v / one for n, v in prof.verify_ms.items()},
        "prefix_len": prof.prefix_len, "environment": bench.environment,
    })
