"""PEARL (draft and target concurrently) is exact: greedy output equals plain greedy, sampling follows the target."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_follows_target, tiny_llama
from test_equivalence import perturbed

from mcsd import TreeDecoder
from mcsd.config import ConfigError, SamplingConfig
from mcsd.drafting.policies import POLICIES

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
N_NEW = 48


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(20, sharpness=30.0)
    return target, perturbed(target, 0.3)


@pytest.fixture(scope="module")
def reference(pair):
    out = pair[0].generate(PROMPT[None], max_new_tokens=N_NEW, do_sample=False, attention_mask=torch.ones(1, 6))
    return out[0, PROMPT.numel():].tolist()


@pytest.mark.parametrize("options", [{}, {"pre_verify": False}, {"post_verify": False}],
                         ids=["both", "post-only", "pre-only"])
@pytest.mark.parametrize("window", ["1", "1,1,1,1,1"])
@pytest.mark.parametrize("draft_name", ["same", "noisy", "random"])
def test_greedy_equals_plain_greedy(pair, reference, draft_name, window, options):
    target, noisy = pair
    draft = {"same": target, "noisy": noisy, "random": tiny_llama(1, layers=1)}[draft_name]
    dec = TreeDecoder(target, draft, tree=window, policy="pearl", attention="sdpa", policy_options=options)
    out = dec.generate(PROMPT, max_new_tokens=N_NEW)
    assert out.tokens == reference and out.finish_reason == "length"
    for n in (1, 2, 7):
        assert dec.generate(PROMPT, max_new_tokens=n).tokens == reference[:n]
    if draft_name == "same" and window != "1":
        assert out.stats.mean_accepted > 2.0            # most positions need no target forward of their own


def test_eos_and_stop_strings(pair, reference, tokenizer):
    target, noisy = pair
    dec = TreeDecoder(target, noisy, tokenizer=tokenizer, tree="1,1,1,1", policy="pearl", attention="sdpa")
    eos = reference[20]
    first = reference.index(eos)
    out = dec.generate(PROMPT, max_new_tokens=N_NEW, eos_token_ids=eos)
    assert out.tokens == reference[:first + 1] and out.finish_reason == "eos"
    stop = tokenizer.decode(reference[10:12])
    out = dec.generate(PROMPT, max_new_tokens=N_NEW, stop_strings=[stop])
    assert out.finish_reason == "stop_string" and out.tokens == reference[:len(out.tokens)]
    assert stop in tokenizer.decode(out.tokens) and stop not in tokenizer.decode(out.tokens[:-1])
    chunks = []
    out = dec.generate(PROMPT, max_new_tokens=N_NEW, streamer=chunks.append)
    assert [t for c in chunks for t in c] == out.tokens == reference


def test_sampling_follows_the_target():
    target = tiny_llama(10, vocab=8, layers=1, sharpness=6.0, hidden=16)
    draft = perturbed(target, 0.5, seed=3)
    dec = TreeDecoder(target, draft, tree="1,1", policy="pearl", attention="sdpa")
    accepted = assert_follows_target(dec, target, SamplingConfig(1.0), n=700)
    assert 0 < accepted < 700
    a = dec.generate(torch.tensor([1, 2, 3]), max_new_tokens=20, temperature=1.0, seed=5)
    b = dec.generate(torch.tensor([1, 2, 3]), max_new_tokens=20, temperature=1.0, seed=5)
    assert a.tokens == b.tokens                          # seeded runs repeat, whatever the threads' timing


def test_bad_settings(pair):
    from mcsd.drafting.feature_draft import FeatureDrafter, FeatureHead, FeatureHeadConfig
    target, noisy = pair
    assert "pearl" in POLICIES
    with pytest.raises(ConfigError, match="chains"):
        TreeDecoder(target, noisy, tree="2,1", policy="pearl")
    with pytest.raises(ConfigError, match="pre_verify"):
        TreeDecoder(target, noisy, policy="pearl", policy_options={"pre_verify": "yes"})
    with pytest.raises(ConfigError, match="lossy"):
        TreeDecoder(target, noisy, policy="pearl", lossy_target_roots=2)
    head = FeatureHead(FeatureHeadConfig(target_hidden=32, hidden=32, heads=4, kv_heads=2, vocab_size=64)).eval()
    with pytest.raises(ConfigError, match="standalone draft"):
        TreeDecoder(target, FeatureDrafter(head, target), policy="pearl")
