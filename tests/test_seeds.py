"""A seed gives one text: from the same decoder called again, a fresh decoder, another process,
any drafter and policy, and plain decoding; a request's trees never depend on the requests before it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_follows_target, perturbed, tiny_llama

from mcsd import TreeDecoder
from mcsd.config import ConfigError, SamplingConfig
from mcsd.core.sampling import PositionNoise, noise_uniform, processed_scores
from mcsd.drafting.context import ContextDrafter
from mcsd.forward import native

PROMPT = torch.tensor([5, 9, 2, 7, 5, 9, 2])
SETTINGS = dict(max_new_tokens=30, temperature=0.7, top_p=0.9, seed=123, ignore_eos=True)


@pytest.fixture(scope="module")
def sharp():
    """A target with peaked distributions and a draft close to it, so drafts are often accepted."""
    target = tiny_llama(4, sharpness=4.0)
    return target, perturbed(target, 0.2, seed=5)


def _decoders(target, draft):
    return {
        "model": lambda: TreeDecoder(target, draft, tree="3,2,1", policy="static", attention="sdpa", calibrate=False),
        "context": lambda: TreeDecoder(target, ContextDrafter(), attention="sdpa", calibrate=False),
        "model+context": lambda: TreeDecoder(target, [draft, ContextDrafter()], tree="2,2,1", policy="static",
                                             attention="sdpa", calibrate=False),
        "learned+context": lambda: TreeDecoder(target, [draft, ContextDrafter()], policy="learned",
                                               attention="sdpa", calibrate=False),
    }


@pytest.mark.parametrize("which", ["model", "context", "model+context", "learned+context"])
def test_a_seed_repeats_within_a_process_and_equals_plain_sampling(sharp, which):
    target, draft = sharp
    make = _decoders(target, draft)[which]
    dec = make()
    texts = [dec.generate(PROMPT, **SETTINGS).tokens for _ in range(3)]
    dec.generate(torch.tensor([3, 1, 4, 1, 5]), **{**SETTINGS, "seed": 7})      # another request between
    texts.append(dec.generate(PROMPT, **SETTINGS).tokens)
    texts.append(make().generate(PROMPT, **SETTINGS).tokens)                     # a fresh decoder
    plain = dec.generate_baseline(PROMPT, **SETTINGS).tokens                     # the target alone
    assert all(t == plain for t in texts), texts
    other = dec.generate(PROMPT, **{**SETTINGS, "seed": 124}).tokens
    assert other != plain                                                        # the seed does decide


def test_a_seed_repeats_in_another_process(sharp):
    target, draft = sharp
    here = _decoders(target, draft)["model+context"]().generate(PROMPT, **SETTINGS).tokens
    script = (
        "import json, sys, torch\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from conftest import perturbed, tiny_llama\n"
        "from mcsd import TreeDecoder\n"
        "from mcsd.drafting.context import ContextDrafter\n"
        "t = tiny_llama(4, sharpness=4.0)\n"
        "d = TreeDecoder(t, [perturbed(t, 0.2, seed=5), ContextDrafter()], tree='2,2,1', policy='static',"
        " attention='sdpa', calibrate=False)\n"
        f"print(json.dumps(d.generate(torch.tensor({PROMPT.tolist()}), **{SETTINGS!r}).tokens))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True,
                         text=True, env=env, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_a_request_after_others_drafts_the_same_trees_as_a_fresh_decoder(sharp):
    """Context rates, recycled predictions and the learned policy's gate start afresh per request, so
    the trees, and under bfloat16 their rounding, are those of a fresh decoder (greedy, bfloat16)."""
    target, draft = sharp
    t16, d16 = (m.to(torch.bfloat16) for m in (target, draft))
    try:
        def run(dec):
            trees = []
            out = dec.generate(PROMPT, max_new_tokens=40, ignore_eos=True,
                               on_round=lambda tree, acc: trees.append(tree.tokens.tolist()))
            return out.tokens, trees

        make = _decoders(t16, d16)["learned+context"]
        used = make()
        for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [9, 8, 7, 6], PROMPT.tolist()[::-1]):
            used.generate(torch.tensor(prompt), max_new_tokens=40, ignore_eos=True)
        assert run(used) == run(make())
    finally:
        for m in (target, draft):
            m.to(torch.float32)


@pytest.mark.parametrize("method", ["gumbel", "rejection"])
@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_p=0.9)], ids=["t1", "t0.8-p0.9"])
def test_both_methods_follow_the_target_distribution(method, sampling):
    """Chi-square of the first two tokens over many seeds against exact enumeration, per method."""
    target = tiny_llama(10, vocab=8, layers=1, sharpness=6.0, hidden=16)
    dec = TreeDecoder(target, [perturbed(target, 0.5, seed=3), ContextDrafter()], tree="3,2", policy="static",
                      attention="sdpa", calibrate=False)
    original = dec.generate

    def generate(prompt, **kw):
        return original(prompt, sampling_method=method, **kw)

    dec.generate = generate
    accepted = assert_follows_target(dec, target, sampling, n=1200)
    assert 0 < accepted < 1200


def test_position_noise_depends_on_seed_and_position_alone():
    a, b = PositionNoise(11, 50, "cpu"), PositionNoise(11, 50, "cpu")
    first = a.gumbel(torch.tensor([7, 3, 7]))
    assert torch.equal(first[0], first[2])
    assert torch.equal(b.gumbel(torch.tensor([3])), first[1:2])                # another order, the same noise
    assert not torch.equal(PositionNoise(12, 50, "cpu").gumbel(torch.tensor([7])), first[:1])
    assert not torch.equal(first[0], first[1])
    probs = torch.zeros(2, 50)
    probs[:, [4, 9]] = 0.5
    assert set(a.draw(probs, torch.tensor([7, 3])).tolist()) <= {4, 9}        # never outside the support


def _splitmix_uniform(key: int, token: int) -> float:
    """The noise's uniform for one token, in Python integers (the definition both implementations follow)."""
    mask = (1 << 64) - 1
    z = (key + (token + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (2 * (z >> 41) + 1) / 2 ** 24


def test_position_noise_is_a_hash_of_the_position_and_the_token():
    noise = PositionNoise(2 ** 63 - 5, 3000, "cpu")
    positions, ids = torch.tensor([0, 41, 10 ** 6]), torch.tensor([0, 1, 7, 2999])
    keys = noise.position_keys(positions)
    u = noise_uniform(keys, ids)
    for r, key in enumerate(keys.tolist()):
        for c, token in enumerate(ids.tolist()):
            assert float(u[r, c]) == _splitmix_uniform(key, token)            # int64 arithmetic wraps as uint64's
    dense = noise.gumbel(positions)
    assert torch.equal(noise.gumbel(positions, ids), dense[:, ids])           # a token's noise, asked alone
    filtered = torch.full((3, 3000), float("-inf"))
    filtered[:, ids] = torch.tensor([0.5, -1.0, 2.0, 0.0])
    assert torch.equal(noise.keys(filtered, positions), filtered + dense)   # noise for the kept entries only
    sub = torch.tensor([7, 0, 2999, 5, 1200])                                # a sub-vocabulary's ids, filtered
    scores = torch.full((3, 5), float("-inf"))
    scores[:, 1:3] = torch.tensor([0.25, -2.0])
    assert torch.equal(noise.keys(scores, positions, sub), scores + dense[:, sub])
    scores[:, :] = 1.5                                                       # nothing filtered: the whole rows
    assert torch.equal(noise.keys(scores, positions, sub), scores + dense[:, sub])
    assert torch.allclose(dense[:, ids], -torch.log(-torch.log(u)), atol=1e-6, rtol=0)
    many = PositionNoise(3, 200_000, "cpu").gumbel(torch.tensor([5]))[0].double()
    assert abs(many.mean() - 0.5772) < 0.01 and abs(many.var() - 1.6449) < 0.03   # standard Gumbel


@pytest.mark.skipif(native.library() is None, reason="the native library is not built here")
@pytest.mark.parametrize("temperature,top_p", [(0.3, 0.5), (0.7, 0.95), (1.2, 0.95), (1.0, 1.0)])
def test_the_native_draw_is_the_processed_scores_draw(temperature, top_p):
    """The native draw (noise for the kept tokens only) picks what the whole processed row and its noise pick."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5000, generator=gen) * 3
    logits[:, :30] += 6
    logits[1, 100:4000] = float("-inf")                                     # a processor dropped most tokens
    logits[2] = 0.0                                                          # every token tied
    cfg = SamplingConfig(temperature=temperature, top_p=top_p)
    for seed in range(25):
        noise, positions = PositionNoise(seed, 5000, "cpu"), torch.arange(6) + 10 * seed
        drawn = noise.draw_logits(logits, cfg, positions)
        assert torch.equal(drawn, noise.draw_scores(processed_scores(logits, cfg), positions))
        for r, p in enumerate(positions.tolist()):                          # one row, its key a host int
            assert noise.draw_at(logits[r:r + 1], cfg, p).tolist() == [drawn[r].item()]


@pytest.mark.parametrize("top_k", [0, 50])                                   # native, and not (top-k)
def test_drawing_chosen_rows_at_host_positions_is_drawing_them_together(top_k):
    """`draw_rows` (a verify level's accepted nodes): the rows' draws as `draw_logits` makes them,
    whether each row is drawn on its own (native) or all in one draw."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 3000, generator=gen) * 3
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, top_k=top_k)
    noise, rows, positions = PositionNoise(5, 3000, "cpu"), [6, 1, 3], [40, 41, 43]
    drawn = noise.draw_logits(logits[rows], cfg, torch.tensor(positions))
    assert noise.draw_rows(logits, cfg, rows, positions) == drawn.tolist()
    assert noise.draw_rows(logits, cfg, [], []) == []


@pytest.mark.skipif(native.library() is None, reason="the native library is not built here")
def test_the_native_draw_is_the_same_from_threads_that_come_and_go():
    """Each thread draws with scratch rows of its own, freed when it ends: draws from short-lived threads,
    on rows of other widths first, are the main thread's."""
    import threading
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 3000, generator=gen) * 3
    keys = torch.tensor([11, 12, 13, 14])
    want = native.draw(logits, 0.8, 0.9, keys)
    got = []

    def work():
        native.draw(torch.randn(2, 500, generator=torch.Generator().manual_seed(3)), 1.0, 0.5, keys[:2])
        got.append(native.draw(logits, 0.8, 0.9, keys))

    for _ in range(3):
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(got) == 12 and all(torch.equal(g, want) for g in got)


@pytest.mark.skipif(native.library() is None, reason="the native library is not built here")
def test_noise_and_draws_without_the_native_library_are_the_same(monkeypatch):
    """Where the native library is not in use (another CPU, a GPU), torch makes the same noise from the
    same hash and the whole-row draw picks the same tokens."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 3000, generator=gen) * 3
    logits[:, :20] += 5
    cfg = SamplingConfig(temperature=0.8, top_p=0.9)
    positions, ids = torch.tensor([3, 4, 4, 9, 100]), torch.tensor([0, 5, 2999])
    noise = PositionNoise(42, 3000, "cpu")
    with_native = (noise.gumbel(positions), noise.gumbel(positions, ids), noise.draw_logits(logits, cfg, positions))
    monkeypatch.setenv("MCSD_NATIVE", "0")
    native.reset()
    monkeypatch.setattr(native, "_state", {})            # forgotten again when the test ends
    assert native.library() is None
    without = (noise.gumbel(positions), noise.gumbel(positions, ids), noise.draw_logits(logits, cfg, positions))
    assert torch.allclose(with_native[0], without[0], atol=1e-5, rtol=0)
    assert torch.allclose(with_native[1], without[1], atol=1e-5, rtol=0)
    assert torch.equal(with_native[2], without[2])


def test_an_unknown_sampling_method_is_refused(sharp):
    target, draft = sharp
    dec = _decoders(target, draft)["model"]()
    with pytest.raises(ConfigError, match="sampling method"):
        dec.generate(PROMPT, max_new_tokens=4, temperature=1.0, sampling_method="coin")
