"""Blocks padded to buckets over the whole cache (the shapes CUDA graphs replay) compute what the
engine's own forward computes unpadded: logits, hidden states, greedy output; captured graphs on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import perturbed
from test_lean_forward import PROMPT, TOL, _family, _outputs

from mcsd import TreeDecoder
from mcsd.forward import graphs
from mcsd.forward.graphs import BUCKETS, StaticBlocks, bucket_of
from mcsd.forward.lm import CachedLM


def test_buckets():
    assert [bucket_of(n) for n in (1, 2, 3, 5, 9, 16, 17, 64)] == [1, 2, 4, 8, 16, 16, 32, 64]
    assert bucket_of(65) is None and BUCKETS[-1] == 64


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_padded_blocks_compute_what_unpadded_ones_do(name):
    model = _family(name)
    padded, plain = CachedLM(model, lean=True, static_blocks=True), CachedLM(model, lean=True, static_blocks=False)
    got, n_got = _outputs(padded)
    want, n_want = _outputs(plain)
    assert isinstance(padded.blocks, StaticBlocks) and plain.blocks is None and not padded.blocks.capture
    assert n_got == n_want
    for key in want:
        a, b = (got[key], want[key]) if isinstance(got[key], tuple) else ((got[key],), (want[key],))
        for x, y in zip(a, b):
            assert x.shape == y.shape, key
            assert (x - y).abs().max() <= TOL, (name, key, (x - y).abs().max())


def test_a_long_block_runs_at_its_own_shape_and_padding_never_reaches_the_sequence():
    model = _family("llama")
    lm = CachedLM(model, lean=True, static_blocks=True)
    lm.reset()
    long = torch.arange(70) % 60 + 1                                   # past the largest bucket
    logits = lm.extend(long, last_logits=True)
    assert logits.shape[0] == 1 and lm.length == 70
    three = lm.extend(torch.tensor([5, 6, 7]))                          # bucket 4: one padding row
    assert lm.length == 73 and three.shape[0] == 3
    ref = CachedLM(model, lean=True, static_blocks=False)
    ref.reset()
    ref.extend(long)
    assert (ref.extend(torch.tensor([5, 6, 7])) - three).abs().max() <= TOL
    assert torch.isfinite(lm.cache.keys[:, :, :, :lm.cache.capacity]).all()   # padding rows stay finite


@pytest.mark.parametrize("policy", ["static", "auto"])
def test_greedy_output_on_padded_blocks_equals_generate(policy):
    model = _family("llama")
    prompt = PROMPT[:6]
    want = model.generate(prompt[None], max_new_tokens=40, do_sample=False,
                          attention_mask=torch.ones(1, prompt.numel()))[0, prompt.numel():].tolist()
    dec = TreeDecoder(model, copy.deepcopy(perturbed(model, 0.3)), tree="4,2,2", policy=policy, calibrate=False)
    for lm in (dec.target, dec.drafter.lm):
        lm.static_blocks = True                                         # read at the next reset
    out = dec.generate(prompt, max_new_tokens=40)
    assert dec.target.blocks is not None and out.tokens == want


def test_a_capture_that_fails_falls_back_to_eager_shapes_once(monkeypatch):
    model = _family("llama")
    lm = CachedLM(model, lean=True, static_blocks=True)
    lm.reset()
    lm.blocks.capture = True                                            # as on CUDA
    calls = []

    def broken(run):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "capture_graph", broken)
    ref = CachedLM(model, lean=True, static_blocks=False)
    ref.reset()
    with pytest.warns(RuntimeWarning, match="capture failed"):
        got = lm.extend(PROMPT[:6])
    got2 = lm.extend(torch.tensor([5, 6, 7]))
    want = ref.extend(PROMPT[:6])
    assert (got - want).abs().max() <= TOL and (got2 - ref.extend(torch.tensor([5, 6, 7]))).abs().max() <= TOL
    assert len(calls) == 1 and not lm.blocks.capture and "stream is capturing" in lm.blocks.failure
    lm.reset()                                                          # the next sequence: no second try
    lm.extend(PROMPT[:6])
    assert len(calls) == 1 and lm.blocks.failure is not None


@pytest.mark.gpu
def test_captured_graphs_replay_what_eager_blocks_compute():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _family("llama").cuda()
    graphed = CachedLM(model, lean=True, static_blocks=True, cuda_graphs=True)
    eager = CachedLM(model, lean=True, static_blocks=True, cuda_graphs=False)
    got, _ = _outputs(graphed)
    want, _ = _outputs(eager)
    assert graphed.blocks.capture and graphed.blocks.captures > 0 and not eager.blocks.capture
    for key in want:
        a, b = (got[key], want[key]) if isinstance(got[key], tuple) else ((got[key],), (want[key],))
        for x, y in zip(a, b):
            assert (x - y).abs().max() <= 1e-3, key
    captured = graphed.blocks.captures
    _outputs(graphed)                                                   # the same shapes again: replayed only
    assert graphed.blocks.captures == captured


@pytest.mark.gpu
def test_greedy_output_with_cuda_graphs_equals_generate():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _family("llama").cuda()
    prompt = PROMPT[:6].cuda()
    want = model.generate(prompt[None], max_new_tokens=40, do_sample=False,
                          attention_mask=torch.ones(1, prompt.numel(), device="cuda"))[0, prompt.numel():].tolist()
    dec = TreeDecoder(model, copy.deepcopy(perturbed(model, 0.3)).cuda(), tree="4,2,2", policy="static",
                      attention="sdpa", calibrate=False)
    out = dec.generate(prompt, max_new_tokens=40)
    assert dec.target.blocks is not None and dec.target.blocks.captures > 0
    assert out.tokens == want
