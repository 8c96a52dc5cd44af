"""Sibling projections as one product (mcsd.forward.fused): the same outputs as separate products, one product
per input, nothing kept past its use or shared between threads, and stale weights never read."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import tiny_llama

from mcsd import TreeDecoder
from mcsd.forward import fused, kernels
from mcsd.forward.lm import CachedLM

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
needs_fp32_packing = pytest.mark.skipif(not kernels.packable(torch.float32, "cpu"), reason="no oneDNN on this CPU")


class Counting:
    """A joined product that records each input it computes for: x -> [x, 2x, 3x] along the last dim."""

    def __init__(self):
        self.inputs = []
        self.product = fused.Product([2, 2, 2], self)

    def __call__(self, x):
        self.inputs.append(x)
        return torch.cat([x, 2 * x, 3 * x], dim=-1)


def test_one_product_per_input_and_nothing_kept_after_the_last_sibling():
    joined, x = Counting(), torch.ones(1, 2)
    parts = [joined.product.part(x, i) for i in range(3)]
    assert len(joined.inputs) == 1
    assert [p.tolist() for p in parts] == [[[1.0, 1.0]], [[2.0, 2.0]], [[3.0, 3.0]]]
    assert not joined.product.holds(x)                      # every sibling served: input and product let go
    joined.product.part(torch.ones(1, 2), 0)                # another tensor, equal values: computed again
    assert len(joined.inputs) == 2


def test_an_input_changed_in_place_is_computed_again():
    joined, x = Counting(), torch.ones(1, 2)
    assert joined.product.part(x, 0).tolist() == [[1.0, 1.0]]
    x.mul_(5)
    assert joined.product.part(x, 1).tolist() == [[10.0, 10.0]]
    assert len(joined.inputs) == 2


def test_threads_keep_their_own_products():
    joined = Counting()
    first, second = torch.ones(1, 2), torch.full((1, 2), 7.0)
    joined.product.part(first, 0)
    seen = []
    other = threading.Thread(target=lambda: seen.append(joined.product.part(second, 1)))
    other.start(), other.join()
    assert seen[0].tolist() == [[14.0, 14.0]]
    assert joined.product.part(first, 1).tolist() == [[2.0, 2.0]]   # this thread's product, not the other's
    assert len(joined.inputs) == 2


def test_only_plain_linear_siblings_of_one_width_are_grouped():
    model = tiny_llama(0)
    groups = fused.sibling_groups(model)
    assert len(groups) == len(model.model.layers)
    assert all([id(layer) for layer in g] == [id(layer) for layer in (a.q_proj, a.k_proj, a.v_proj)]
               for g, a in zip(groups, (layer.self_attn for layer in model.model.layers)))
    model.model.layers[0].self_attn.k_proj = torch.nn.Linear(8, 16)    # another input width
    assert len(fused.sibling_groups(model)) == len(model.model.layers) - 1


@needs_fp32_packing
def test_joined_prepacked_projections_give_the_separate_products():
    model = tiny_llama(0)
    ids = torch.tensor([[3, 17, 42, 5, 9, 11, 23, 4]])
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    outputs = {}
    for join in (False, True):
        kernels.unpack(model)
        kernels.pack(model, join=join)
        assert kernels.joined(model) == (3 * len(model.model.layers) if join else 0)
        with pytest.MonkeyPatch.context() as mp, torch.inference_mode(), kernels.using("packed"):
            mp.setattr(kernels.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(join) or real(*a),
                       raising=False)
            outputs[join] = model(ids).logits
    layers = len(model.model.layers)
    assert calls.count(False) == 7 * layers + 1 and calls.count(True) == 5 * layers + 1   # + the LM head
    assert torch.allclose(outputs[True], outputs[False], atol=1e-5, rtol=1e-5)


@needs_fp32_packing
def test_a_replaced_sibling_weight_is_never_read_from_the_joined_copy():
    model = tiny_llama(0)
    kernels.pack(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 3, attn.q_proj.in_features)
    with torch.no_grad():
        attn.k_proj.weight = torch.nn.Parameter(2 * attn.k_proj.weight)
        with kernels.using("packed"):
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert torch.allclose(k, torch.nn.functional.linear(x, attn.k_proj.weight), atol=1e-5)
    assert torch.allclose(q, torch.nn.functional.linear(x, attn.q_proj.weight), atol=1e-5)
    assert not kernels.is_packed(attn.q_proj) and kernels.is_packed(attn.o_proj)
    assert kernels.pack(model) == 3                          # the group is made again, once, from the new weights
    assert kernels.is_packed(attn.q_proj) and kernels.joined(model) == 3 * len(model.model.layers)


@needs_fp32_packing
@pytest.mark.parametrize("tree", ["2,2,1", "3,1"])
def test_decoding_on_joined_projections_is_lossless(tree):
    model, draft = tiny_llama(0), tiny_llama(1, layers=1)
    reference = TreeDecoder(model, None, calibrate=False).generate_baseline(PROMPT, max_new_tokens=40).tokens
    dec = TreeDecoder(model, draft, tree=tree, policy="static", calibrate=False)
    dec.target.kernels = dec.drafter.kernels = kernels.KernelTable({1: 10.0, 64: 10.0}, {}, {1: 5.0, 64: 5.0})
    kernels.pack(model), kernels.pack(draft)
    assert kernels.joined(model) and kernels.joined(draft)
    assert dec.generate(PROMPT, max_new_tokens=40).tokens == reference
    assert dec.generate_baseline(PROMPT, max_new_tokens=40).tokens == reference


@needs_fp32_packing
def test_a_cached_forward_keeps_nothing_after_it_returns():
    model = tiny_llama(0)
    kernels.pack(model)
    lm = CachedLM(model)
    lm.kernels = kernels.KernelTable({1: 10.0}, {}, {1: 5.0})
    lm.reset()
    lm.extend(PROMPT)
    products = {id(layer.__dict__["_mcsd_packed"].product): layer.__dict__["_mcsd_packed"].product
                for layer in model.modules() if getattr(layer.__dict__.get("_mcsd_packed"), "product", None)}
    assert products and all(getattr(p._kept, "x", None) is None for p in products.values())


@needs_fp32_packing
def test_siblings_with_biases_join_with_their_biases():
    torch.manual_seed(0)
    block = torch.nn.Module()
    block.q_proj, block.k_proj, block.v_proj = (torch.nn.Linear(16, n, bias=True) for n in (16, 8, 8))
    x = torch.randn(2, 3, 16)
    separate = [block.q_proj(x), block.k_proj(x), block.v_proj(x)]
    assert kernels.pack(block) == 3 and kernels.joined(block) == 3
    with torch.no_grad(), kernels.using("packed"):
        joined = [block.q_proj(x), block.k_proj(x), block.v_proj(x)]
    for a, b in zip(joined, separate):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
