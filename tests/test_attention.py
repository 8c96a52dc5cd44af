"""Attention backends: selection rules on any machine; xformers against SDPA on CUDA."""

import copy

import pytest
import torch

from mcsd.attention import resolve_backend
from mcsd.config import ConfigError


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
    from mcsd.lm import CachedLM

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


def _skip_without_xformers_kernels():
    from mcsd.attention import xformers_unavailable_reason
    if (reason := xformers_unavailable_reason("cuda")) is not None:
        pytest.skip(reason.splitlines()[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_xformers_matches_sdpa_on_tree_masks(dtype):
    _skip_without_xformers_kernels()
    from conftest import tiny_llama
    from mcsd.attention import set_backend
    from mcsd.lm import CachedLM
    from mcsd.tree import TreeTopology

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
    _skip_without_xformers_kernels()
    from conftest import tiny_llama
    from mcsd import TreeDecoder

    model = tiny_llama(0, hidden=128).to("cuda")
    dec = TreeDecoder(model, model, tree="4,2,2", policy="static", attention="xformers")
    assert dec.attention == "mcsd_xformers"
    prompt = torch.tensor([3, 17, 42, 5], device="cuda")
    assert dec.generate(prompt, max_new_tokens=32).tokens == dec.generate_baseline(prompt, max_new_tokens=32).tokens
