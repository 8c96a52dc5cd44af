"""Faster forward paths: grouped-query attention for few rows, the in-place KV cache, the forward profile.

Each must leave float32 results where they were: equal logits within float32
rounding, token-identical greedy output.
"""

import copy
import types

import pytest
import torch
from conftest import tiny_llama

from mcsd import TreeDecoder
from mcsd.forward import kv_cache
from mcsd.forward.attention import _gqa_attention, set_backend
from mcsd.forward.lm import CachedLM, forward_path

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])


def _tree_mask(q_len, k_len, dtype):
    """(1, 1, Q, K) additive mask: a cache of K - Q positions, then a random tree (each node sees a
    random subset of the earlier nodes and itself)."""
    g = torch.Generator().manual_seed(q_len)
    allowed = torch.ones(q_len, k_len, dtype=torch.bool)
    tree = torch.rand(q_len, q_len, generator=g) < 0.5
    allowed[:, k_len - q_len:] = torch.tril(tree, -1) | torch.eye(q_len, dtype=torch.bool)
    return torch.zeros(q_len, k_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@pytest.mark.parametrize("q_len", [1, 2, 5, 32, 35, 64])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_equals_sdpa(q_len, groups, dtype):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    h_kv, k_len, d = 2, 40 + q_len, 16
    module = types.SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, q_len, h_kv * groups, d, generator=g).transpose(1, 2).to(dtype)  # as the model hands it over
    store = torch.randn(2, 1, h_kv, k_len + 9, d, generator=g).to(dtype)
    key, value = store[0, :, :, :k_len], store[1, :, :, :k_len]                      # views, as the in-place cache gives
    mask = _tree_mask(q_len, k_len, dtype)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=d ** -0.5)
    got, _ = _gqa_attention(module, query, key, value, mask, scaling=d ** -0.5)
    assert got.shape == want.shape == (1, q_len, h_kv * groups, d) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


def test_gqa_attention_masks_what_it_must():
    """A key the mask hides must not change the output (a wrong mask alignment would leak it)."""
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    query, key, value = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    mask = _tree_mask(3, 10, torch.float32)
    hidden = (mask[0, 0, 1] < 0).nonzero()[0, 0]                   # a key row 1 does not see
    out, _ = _gqa_attention(module, query, key, value, mask)
    value2 = value.clone()
    value2[:, :, hidden] += 100.0
    out2, _ = _gqa_attention(module, query, key, value2, mask)
    assert torch.equal(out[:, 1], out2[:, 1])
    assert not torch.allclose(out, out2)                            # ... while rows that see it do change


def _lm_logits(model, in_place, steps):
    lm = CachedLM(model, in_place=in_place, lean=False)          # transformers' forward and its cache
    lm.reset()
    outs = [lm.extend(PROMPT)]
    for tokens, pos, allowed, keep in steps(lm):
        outs.append(lm.forward(tokens, pos, allowed))
        lm.commit(lm.length - tokens.numel(), keep)
    outs.append(lm.extend(torch.tensor([20, 21])))
    return outs, lm


def _tree_steps(rounds):
    def steps(lm):
        for r in range(rounds):
            base = lm.length
            tokens = torch.tensor([9 + r % 7, 11, 12, 13])
            allowed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
            yield tokens, torch.tensor([base, base + 1, base + 1, base + 2]), allowed, torch.tensor([0, 1, 3])
    return steps


@pytest.mark.parametrize("rounds", [3, 120])           # 120 rounds outgrow the first buffer (reallocation)
def test_in_place_cache_gives_the_logits_of_the_concatenating_one(target, rounds):
    want, plain = _lm_logits(target, False, _tree_steps(rounds))
    got, lm = _lm_logits(target, True, _tree_steps(rounds))
    assert lm.length == plain.length == PROMPT.numel() + 3 * rounds + 2
    assert all(isinstance(layer, kv_cache.InPlaceLayer) for layer in lm.cache.layers)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)


def test_in_place_layer_writes_into_its_buffer_and_adopts_foreign_tensors():
    layer = kv_cache.InPlaceLayer()
    first = torch.arange(5.0).view(1, 1, 5, 1)
    keys, _ = layer.update(first, -first)
    buf = layer._key_buf
    assert buf.shape[-2] == 5 + kv_cache.HEADROOM
    keys, values = layer.update(torch.full((1, 1, 2, 1), 7.0), torch.full((1, 1, 2, 1), -7.0))
    assert layer._key_buf is buf and keys.data_ptr() == buf.data_ptr()          # no new allocation
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 7, 7]
    # something replaces the views with a tensor of its own: it is adopted, not overwritten
    layer.keys, layer.values = layer.keys[:, :, [0, 2]].clone(), layer.values[:, :, [0, 2]].clone()
    keys, values = layer.update(torch.full((1, 1, 1, 1), 9.0), torch.full((1, 1, 1, 1), -9.0))
    assert keys[0, 0, :, 0].tolist() == [0, 2, 9] and values[0, 0, :, 0].tolist() == [0, -2, -9]
    kv_cache.truncate(types.SimpleNamespace(layers=[layer]), 1)
    keys, _ = layer.update(torch.full((1, 1, 1, 1), 5.0), torch.full((1, 1, 1, 1), -5.0))
    assert keys[0, 0, :, 0].tolist() == [0, 5]


@pytest.fixture(scope="module")
def reference(target):
    out = target.generate(PROMPT[None], max_new_tokens=60, do_sample=False, attention_mask=torch.ones(1, 6))
    return out[0, PROMPT.numel():].tolist()


@pytest.mark.parametrize("attention", ["gqa", "auto"])
@pytest.mark.parametrize("tree,policy", [("4,2,2", "static"), ("1,1,1,1", "static"), ("6,3,2", "heuristic")])
@pytest.mark.parametrize("draft_name", ["same", "random"])
def test_greedy_output_on_the_fast_paths_equals_plain_greedy(target, random_draft, reference, attention, tree,
                                                              policy, draft_name):
    model = copy.deepcopy(target)                          # the backend is switched on the model itself
    draft = copy.deepcopy(model if draft_name == "same" else random_draft)
    dec = TreeDecoder(model, draft, tree=tree, policy=policy, attention=attention)
    assert model.config._attn_implementation == "mcsd_gqa"
    with forward_path(False):                              # the backend serves transformers' forward
        out = dec.generate(PROMPT, max_new_tokens=60)
    assert out.tokens == reference
    assert isinstance(dec.target.cache.layers[0], kv_cache.InPlaceLayer)


def test_gqa_backend_keeps_plain_generate_working(target):
    """transformers' own callers (generate, no explicit mask) still get causal attention."""
    model = copy.deepcopy(target)
    set_backend(model, "gqa")
    a = model.generate(PROMPT[None], max_new_tokens=10, do_sample=False, attention_mask=torch.ones(1, 6))
    b = target.generate(PROMPT[None], max_new_tokens=10, do_sample=False, attention_mask=torch.ones(1, 6))
    assert a.tolist() == b.tolist()


def test_forward_profile_splits_a_forward_into_classes():
    from mcsd.costs.forward_profile import CLASSES, Variant, breakdown, compare, format_comparison, format_table
    model = tiny_llama(0, layers=2)
    results = breakdown(model, sizes=(1, 3), cache_len=20, repeats=2)
    assert [r.rows for r in results] == [1, 3]
    for r in results:
        assert set(r.ms) == set(CLASSES)
        assert r.ms["matmul"] > 0 and r.ms["attention"] > 0 and r.ops > 50
        assert sum(r.ms.values()) == pytest.approx(max(r.profiled_ms, sum(r.ms[c] for c in CLASSES[:-1])))
    assert "rows" in format_table(results)
    model.set_attn_implementation("sdpa")
    times = compare(model, [Variant("a"), Variant("b", "mcsd_gqa", in_place=False)], sizes=(1, 2), cache_len=10,
                    repeats=2, clock="cpu")
    assert set(times) == {"a", "b"} and all(len(t[n]) == 2 for t in times.values() for n in (1, 2))
    assert model.config._attn_implementation == "sdpa"              # restored
    assert "b" in format_comparison(times)
    with pytest.raises(ValueError, match="clock"):
        compare(model, [Variant("a")], clock="gpu")


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")   # inductor's own
def test_a_compiled_static_step_computes_the_engines_logits():
    """The torch.compile candidate the benchmark times: its step gives the eager step's logits (float32)."""
    from mcsd.costs.forward_profile import compiled_step
    model = tiny_llama(0, layers=1)
    step = compiled_step(model, cache_len=12, capacity=32, repeats=2)
    assert step.same_argmax and step.max_abs_diff < 1e-4 and step.compile_s > 0
    assert set(step.ms) == {"engine", "static eager", "static compiled"} and all(len(t) == 2 for t in step.ms.values())


def test_bench_report_renders_the_forward_profile(tmp_path):
    import json
    import runpy
    from pathlib import Path
    from types import SimpleNamespace
    # the script's own namespace, as `python tools/bench_report.py` would build it (not imported as a module)
    bench_report = SimpleNamespace(**runpy.run_path(str(Path(__file__).resolve().parents[1] / "tools" / "bench_report.py")))
    info = {"breakdown": [{"rows": 1, "wall_ms": 20.0, "profiled_ms": 25.0, "ops": 6000,
                           "ms": {"matmul": 9.0, "attention": 5.0, "python": 4.0}}],
            "compare_ms": {"before": {"1": 24.0}, "after": {"1": 20.5}}, "cache_len": 300, "attention": "sdpa"}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"benchmarks": [{"extra_info": info}]}))
    rows, env = bench_report.load(path)
    text = bench_report.markdown(rows, env)
    assert "| 1 | 20.0 | 9.0 | 5.0 | 4.0 | 6000 |" in text
    assert "| rows | before | after |" in text and "| 1 | 24.0 | 20.5 |" in text


def test_a_packed_model_deep_copies_and_the_copy_runs_on_its_own_weights():
    """Prepacked copies (oneDNN's opaque tensors) are not copied: the copy computes from its plain
    weights, and packing it again works."""
    from mcsd.forward import kernels
    model = tiny_llama(3)
    if not kernels.packable(torch.float32, "cpu"):
        pytest.skip("oneDNN cannot prepack here")
    kernels.pack(model)
    clone = copy.deepcopy(model)
    assert kernels.is_packed(model) and not kernels.is_packed(clone)
    with torch.no_grad():
        clone.lm_head.weight.mul_(2.0)                     # the copy's own weights are what it computes with
        ids = PROMPT[None]
        with kernels.using("packed"):
            a, b = model(ids).logits, clone(ids).logits
        assert not torch.allclose(a, b)
        kernels.pack(clone)
        with kernels.using("packed"):
            assert torch.allclose(clone(ids).logits, b, atol=1e-5)


def test_hidden_states_are_asked_for_with_a_plain_flag():
    """`output_hidden_states` goes to the model as True/False: some transformers releases read
    only `is True`, and a tuple of layer indices there silently returned no hidden states."""
    model = tiny_llama(0).eval()
    seen = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs.get("output_hidden_states")),
                                    with_kwargs=True)
    lm = CachedLM(model)
    logits, states = lm.extend(PROMPT, hidden=(1, -1))
    assert seen == [True]
    assert states.shape == (PROMPT.numel(), 2 * model.config.hidden_size)
    lm.extend(torch.tensor([7]))
    assert seen == [True, False]


def _dense_bytes(model, skip_input_embedding: bool) -> int:
    embed = model.get_input_embeddings().weight
    params = {p.data_ptr(): p for p in model.parameters()}              # a tied LM head once
    return sum(p.nbytes for ptr, p in params.items() if not (skip_input_embedding and p is embed))


@pytest.mark.parametrize("tied", [False, True])
def test_memory_floor_counts_each_weight_a_forward_reads_once(tied):
    from mcsd.costs.forward_profile import format_table, memory_floor, weight_bytes
    from mcsd.forward import kernels
    model = tiny_llama(0, layers=2)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    # untied: the input embedding is only gathered by the row; tied: it is the LM head, read whole
    expected = _dense_bytes(model, skip_input_embedding=not tied)
    assert weight_bytes(model) == expected
    if kernels.packable(model.dtype, model.device):
        kernels.pack(model)                                            # joined q / k / v: the same bytes
        assert weight_bytes(model) == expected
        kernels.unpack(model)
    floor = memory_floor(model, mb=8, repeats=2)
    assert floor.weight_mb == pytest.approx(expected / 1e6)
    assert 0.1 < floor.read_gb_s < 10_000
    assert floor.ms == pytest.approx(floor.weight_mb / floor.read_gb_s)
    from mcsd.costs.forward_profile import Breakdown
    row = Breakdown(rows=1, cache_len=10, wall_ms=3 * floor.ms, profiled_ms=1.0, ms=dict.fromkeys(
        ("matmul", "attention", "elementwise", "copy", "other", "python"), 0.1), ops=10)
    text = format_table([row], floor)
    assert text.startswith("memory floor: ") and text.splitlines()[-1].split()[-1] == "3.00"
