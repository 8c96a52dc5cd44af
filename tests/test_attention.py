"""Attention backends: selection rules on any machine; xformers against SDPA on CUDA."""

import copy

import pytest
import torch

from mcsd.config import ConfigError
from mcsd.forward.attention import resolve_backend


def test_auto_picks_the_grouped_query_path_on_cpu():
    assert resolve_backend("auto", "cpu") == "mcsd_gqa"
    assert resolve_backend("gqa", "cpu") == "mcsd_gqa"
    assert resolve_backend("sdpa", "cpu") == "sdpa"


def test_unknown_and_impossible_backends_raise():
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'"):
        resolve_backend("flash", "cpu")
    with pytest.raises(ConfigError, match="xformers.*cannot run here.*CUDA"):
        resolve_backend("xformers", "cpu")


def test_eager_and_sdpa_agree_on_a_tree_mask(target):
    from mcsd.forward.lm import CachedLM

    eager = copy.deepcopy(target)
    eager.set_attn_implementation("eager")
    outs = []
    for model in (target, eager):
        lm = CachedLM(model)
        lm.reset()
        lm.extend(torch.tensor([3, 17, 42, 5]))
        allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        outs.append(lm.forward(torch.tensor([9, 11, 12]), torch.tensor([4, 5, 5]), allowed))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def _skip_without_xformers_kernels(dtype, head_dim):
    from mcsd.forward.attention import xformers_unavailable_reason
    if (reason := xformers_unavailable_reason("cuda", dtype, head_dim)) is not None:
        pytest.skip(reason.splitlines()[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_xformers_matches_sdpa_on_tree_masks(dtype):
    _skip_without_xformers_kernels(dtype, head_dim=32)
    from conftest import tiny_llama

    from mcsd.core.tree import TreeTopology
    from mcsd.forward.attention import set_backend
    from mcsd.forward.lm import CachedLM

    base = tiny_llama(0, hidden=128).to("cuda", dtype)
    xf = copy.deepcopy(base)
    assert set_backend(xf, "xformers") == "mcsd_xformers"
    set_backend(base, "sdpa")
    topo = TreeTopology.from_spec("4,2,2").to("cuda")
    tokens = torch.randint(0, 64, (topo.size,), device="cuda")
    logits = []
    for model in (base, xf):
        lm = CachedLM(model)
        lm.reset()
        lm.extend(torch.randint(0, 64, (37,), generator=torch.Generator().manual_seed(0)).cuda())
        logits.append(lm.forward(tokens, topo.depth + 37, topo.mask).float())
    assert torch.allclose(logits[0], logits[1], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_xformers_decoder_is_lossless_in_float32():
    _skip_without_xformers_kernels(torch.float32, head_dim=32)
    from conftest import tiny_llama

    from mcsd import TreeDecoder

    model = tiny_llama(0, hidden=128).to("cuda")
    dec = TreeDecoder(model, model, tree="4,2,2", policy="static", attention="xformers")
    assert dec.attention == "mcsd_xformers"
    prompt = torch.tensor([3, 17, 42, 5], device="cuda")
    assert dec.generate(prompt, max_new_tokens=32).tokens == dec.generate_baseline(prompt, max_new_tokens=32).tokens


def test_causal_bias_aligns_the_block_to_the_last_keys():
    from mcsd.forward.attention import _causal_bias
    bias = _causal_bias(3, 5, torch.float32, "cpu")[0, 0]
    allowed = bias == 0
    assert allowed.tolist() == [[True, True, True, False, False],
                                [True, True, True, True, False],
                                [True, True, True, True, True]]
    assert (bias[~allowed] == torch.finfo(torch.float32).min).all()


@pytest.fixture
def split_k_only(monkeypatch):
    """A CUDA machine where xformers imports but only its Triton split-k operator runs."""
    import sys
    import types

    from mcsd.forward import attention
    package = types.ModuleType("xformers")
    package.ops = types.ModuleType("xformers.ops")
    monkeypatch.setitem(sys.modules, "xformers", package)
    monkeypatch.setitem(sys.modules, "xformers.ops", package.ops)
    monkeypatch.setattr(attention, "_xformers_route",
                        lambda device: ("splitk", "NotImplementedError: No operator found"))
    monkeypatch.setattr(attention, "_register_xformers", lambda: None)
    return attention


def test_split_k_route_takes_half_precision_and_its_head_sizes(split_k_only):
    reason = split_k_only.xformers_unavailable_reason
    assert reason("cuda", torch.bfloat16, 64) is None
    assert reason("cuda", torch.float16, 128) is None
    assert "float16 and bfloat16, not float32" in reason("cuda", torch.float32, 64)
    assert "No operator found" in reason("cuda", torch.float32, 64)
    assert "not 80" in reason("cuda", torch.bfloat16, 80)
    assert split_k_only.resolve_backend("xformers", "cuda", torch.bfloat16, 64) == "mcsd_xformers"
    assert split_k_only.resolve_backend("auto", "cuda", torch.float32, 64) == "sdpa"
    with pytest.raises(ConfigError, match="cannot run here.*not float32"):
        split_k_only.resolve_backend("xformers", "cuda", torch.float32, 64)


def test_no_xformers_route_says_why(monkeypatch, split_k_only):
    monkeypatch.setattr(split_k_only, "_xformers_route", lambda device: (None, "its split-k operator failed (X)"))
    assert "split-k operator failed (X)" in split_k_only.xformers_unavailable_reason("cuda", torch.bfloat16, 64)
    assert split_k_only.resolve_backend("auto", "cuda", torch.bfloat16, 64) == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_len", [1, 9, 64])
def test_xformers_matches_sdpa_on_grouped_heads_with_and_without_a_mask(q_len):
    from mcsd.forward.attention import _xformers_attention
    _skip_without_xformers_kernels(torch.bfloat16, head_dim=64)
    gen = torch.Generator(device="cuda").manual_seed(q_len)
    k_len = 300 + q_len
    q = torch.randn(1, 9, q_len, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 3, k_len, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device="cuda").tril(k_len - q_len)
    allowed[:, k_len - q_len:] &= torch.rand(q_len, q_len, device="cuda", generator=gen) < 0.5
    allowed[:, k_len - q_len:] |= torch.eye(q_len, dtype=torch.bool, device="cuda")
    tree = torch.zeros(q_len, k_len, device="cuda", dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device="cuda").tril(k_len - q_len)
    for mask, seen in ((tree[None, None], tree[None, None]), (None, causal)):          # None: causal
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen,
                                                                enable_gqa=True).transpose(1, 2)
        got, _ = _xformers_attention(None, q, k, v, mask)
        assert got.shape == (1, q_len, 9, 64)
        assert torch.allclose(got.float(), want.float(), atol=1e-2), (q_len, mask is None)
