"""Exactness on CUDA: the same promises as on CPU, with the models on the GPU.

Greedy output equals Hugging Face greedy `generate` on the same device
(float32, SDPA and xformers, model and feature drafters, static and learned
policies), and sampling follows the target's distribution (chi-square against
exact enumeration done on a CPU copy of the target).
"""

import copy

import pytest
import torch
from conftest import tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = [3, 17, 42, 5, 9, 11]
BACKENDS = ["sdpa", "eager", "xformers"]


def _needs(backend, head_dim: int = 16):
    """Skip xformers cases where its kernels cannot run (not installed, or built for another torch / CUDA
    so that only its split-k operator runs, which takes no float32)."""
    if backend == "xformers":
        from mcsd.forward.attention import xformers_unavailable_reason
        if (reason := xformers_unavailable_reason("cuda", torch.float32, head_dim)) is not None:
            pytest.skip(reason.splitlines()[0])


@pytest.fixture(scope="module")
def cuda_target():
    return tiny_llama(0, hidden=64).to("cuda")


@pytest.fixture(scope="module")
def cuda_reference(cuda_target):
    prompt = torch.tensor([PROMPT], device="cuda")
    out = cuda_target.generate(prompt, max_new_tokens=60, do_sample=False,
                               attention_mask=torch.ones_like(prompt))
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["1,1,1,1", "4,2,2", "3,2,2,1"])
@pytest.mark.parametrize("draft_kind", ["same", "random"])
def test_greedy_tree_on_cuda_equals_hf_greedy(cuda_target, cuda_reference, backend, spec, draft_kind):
    from mcsd import TreeDecoder
    _needs(backend)
    draft = copy.deepcopy(cuda_target) if draft_kind == "same" else tiny_llama(1, layers=1).to("cuda")
    dec = TreeDecoder(cuda_target, draft, tree=spec, policy="static", attention=backend)
    out = dec.generate(torch.tensor(PROMPT, device="cuda"), max_new_tokens=60)
    assert out.tokens == cuda_reference
    if draft_kind == "same":
        assert out.stats.mean_accepted > 1.5


@pytest.mark.parametrize("backend", ["sdpa", "xformers"])
def test_feature_drafter_on_cuda_is_lossless(cuda_target, cuda_reference, backend):
    from mcsd import TreeDecoder
    from mcsd.drafting.feature_draft import FeatureDrafter, FeatureHead, FeatureHeadConfig
    _needs(backend)
    torch.manual_seed(5)
    cfg = FeatureHeadConfig(target_hidden=cuda_target.config.hidden_size, hidden=32, layers=1, heads=2, kv_heads=1,
                            vocab_size=cuda_target.config.vocab_size, sub_vocab=24)
    head = FeatureHead(cfg).eval()
    head.vocab_ids = torch.randperm(cfg.vocab_size)[:24].sort().values
    drafter = FeatureDrafter(head.to("cuda"), cuda_target)
    out = TreeDecoder(cuda_target, drafter, tree="4,2,2", policy="static", attention=backend).generate(
        torch.tensor(PROMPT, device="cuda"), max_new_tokens=60)
    assert out.tokens == cuda_reference
    assert out.stats.draft_forwards > 0


def test_learned_policy_on_cuda_is_lossless(cuda_target, cuda_reference):
    from mcsd import TreeDecoder
    dec = TreeDecoder(cuda_target, tiny_llama(1, layers=1).to("cuda"), tree="3,2,2,1,1", policy="learned")
    out = dec.generate(torch.tensor(PROMPT, device="cuda"), max_new_tokens=60)
    assert out.tokens == cuda_reference


@pytest.mark.parametrize("backend", ["sdpa", "xformers"])
def test_sampling_on_cuda_follows_the_target(backend):
    from conftest import assert_follows_target

    from mcsd import TreeDecoder
    from mcsd.config import SamplingConfig
    _needs(backend, head_dim=4)
    cpu_target = tiny_llama(10, vocab=8, layers=1, sharpness=6.0, hidden=16)
    gpu_target = copy.deepcopy(cpu_target).to("cuda")
    draft = tiny_llama(11, vocab=8, layers=1, sharpness=3.0, hidden=16).to("cuda")
    dec = TreeDecoder(gpu_target, draft, tree="3,2", policy="static", attention=backend)
    accepted = assert_follows_target(dec, cpu_target, SamplingConfig(0.9, top_k=6), n=1200)
    assert accepted > 0                                   # drafts were accepted, not only corrections
