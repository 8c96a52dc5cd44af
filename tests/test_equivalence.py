"""Lossless: tree output equals plain decoding (greedy, float32) and follows the target's distribution (sampling)."""


import pytest
import torch
from conftest import assert_follows_target, perturbed, tiny_llama

from mcsd import TreeDecoder
from mcsd.config import SamplingConfig

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
SPECS = ["1", "1,1,1,1", "2,2", "4,2,2", "3,2,2,1", ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (1, 0))]


@pytest.fixture(scope="module")
def drafts(target, random_draft):
    return {"same": target, "random": random_draft, "noisy": perturbed(target, 0.3)}


@pytest.fixture(scope="module")
def reference(target):
    """Plain greedy continuation by Hugging Face generate (the ground truth)."""
    out = target.generate(PROMPT[None], max_new_tokens=80, do_sample=False, attention_mask=torch.ones(1, 6))
    return out[0, PROMPT.numel():].tolist()


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("draft_name", ["same", "random", "noisy"])
def test_greedy_tree_equals_plain_greedy(target, drafts, reference, spec, draft_name):
    dec = TreeDecoder(target, drafts[draft_name], tree=spec, policy="static", attention="sdpa")
    out = dec.generate(PROMPT, max_new_tokens=80)
    assert out.tokens == reference
    assert out.finish_reason == "length"
    if draft_name == "same":
        assert out.stats.mean_accepted > 1.5            # everything drafted is accepted
    if draft_name == "random":
        assert out.stats.target_forwards >= 40          # the tree machinery ran many rounds


def test_baseline_through_the_same_loop_equals_hf(target, reference):
    out = TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=80)
    assert out.tokens == reference
    assert out.stats.mean_accepted == 1.0
    assert out.stats.target_forwards == 80


def test_noisy_draft_accepts_partially(target, drafts):
    stats = TreeDecoder(target, drafts["noisy"], tree="3,2,2,1", policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=80).stats
    assert 1.0 < stats.mean_accepted < 5.0
    assert 0.0 < stats.accept_by_depth[0] < 1.0


@pytest.mark.parametrize("policy", ["heuristic", "confidence"])
def test_other_policies_are_lossless(target, drafts, reference, policy):
    dec = TreeDecoder(target, drafts["noisy"], tree="2,2,1,1,1,1", policy=policy, attention="sdpa")
    assert dec.generate(PROMPT, max_new_tokens=80).tokens == reference


def test_eos_stops_at_the_same_token(target, drafts, reference):
    eos = reference[30]
    first = reference.index(eos)
    for name in ("same", "noisy", "random"):
        out = TreeDecoder(target, drafts[name], tree="4,2,2", policy="static", attention="sdpa").generate(
            PROMPT, max_new_tokens=80, eos_token_ids=eos)
        assert out.tokens == reference[:first + 1]
        assert out.finish_reason == "eos"
    ignored = TreeDecoder(target, drafts["same"], tree="4,2,2", policy="static", attention="sdpa").generate(
        PROMPT, max_new_tokens=80, eos_token_ids=eos, ignore_eos=True)
    assert ignored.tokens == reference


def test_stop_string_cuts_after_the_completing_token(target, drafts, tokenizer, reference):
    dec = TreeDecoder(target, drafts["noisy"], tokenizer=tokenizer, tree="4,2,2", policy="static", attention="sdpa")
    stop = tokenizer.decode(reference[20:22])
    out = dec.generate(PROMPT, max_new_tokens=80, stop_strings=[stop])
    text = tokenizer.decode(out.tokens)
    assert out.finish_reason == "stop_string"
    assert stop in text and stop not in tokenizer.decode(out.tokens[:-1])
    assert out.tokens == reference[:len(out.tokens)]


def test_streaming_delivers_the_same_tokens(target, drafts, reference):
    dec = TreeDecoder(target, drafts["noisy"], tree="4,2,2", policy="static", attention="sdpa")
    chunks = []
    out = dec.generate(PROMPT, max_new_tokens=80, streamer=chunks.append)
    assert [t for c in chunks for t in c] == out.tokens == reference
    assert len(chunks) == out.stats.rounds + 1          # the prefill's token, then one chunk a round
    gen = dec.stream(PROMPT, max_new_tokens=80)
    assert [t for c in gen for t in c] == reference


def test_string_prompt_and_tokenizer(target, drafts, tokenizer, reference):
    dec = TreeDecoder(target, drafts["noisy"], tokenizer=tokenizer, tree="2,2", policy="static", attention="sdpa")
    text_prompt = " ".join(f"w{i:02d}" for i in PROMPT.tolist())
    out = dec.generate(text_prompt, max_new_tokens=80)
    assert out.tokens == reference
    assert out.text == tokenizer.decode(reference, skip_special_tokens=True)


def test_short_generations_and_trees_deeper_than_the_budget(target, drafts, reference):
    dec = TreeDecoder(target, drafts["same"], tree="1,1,1,1,1,1,1,1", policy="static", attention="sdpa")
    for n in (1, 2, 3, 9):
        assert dec.generate(PROMPT, max_new_tokens=n).tokens == reference[:n]


# ---------------------------------------------------------------------------- sampling

V_SMALL = 8


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(10, vocab=V_SMALL, layers=1, sharpness=6.0, hidden=16)
    return target, perturbed(target, 0.5, seed=3)


@pytest.mark.parametrize("sampling, policy", [
    (SamplingConfig(1.0), "static"),
    (SamplingConfig(0.7, top_k=5), "static"),
    (SamplingConfig(1.3, top_p=0.8), "static"),
    (SamplingConfig(1.0, top_k=2), "static"),       # q has 2 tokens for 3 children: the third is dropped
    (SamplingConfig(1.0), "confidence"),
    (SamplingConfig(0.8, top_p=0.9), "heuristic"),
], ids=["t1", "t0.7-k5", "t1.3-p0.8", "t1-k2", "t1-confidence", "t0.8-p0.9-heuristic"])
def test_sampling_follows_the_target_distribution(small_pair, sampling, policy):
    """Chi-square goodness of fit of 1,500 seeded runs against exact enumeration (reject at p < 0.001)."""
    target, draft = small_pair
    dec = TreeDecoder(target, draft, tree="3,2", policy=policy, attention="sdpa")
    accepted = assert_follows_target(dec, target, sampling, n=1500)
    assert 0 < accepted < 1500                      # the draft is sometimes accepted, sometimes not


def test_seeded_sampling_is_reproducible(small_pair):
    target, draft = small_pair
    dec = TreeDecoder(target, draft, tree="3,2", policy="static", attention="sdpa")
    a = dec.generate(torch.tensor([1, 2, 3]), max_new_tokens=20, temperature=1.0, seed=123)
    b = dec.generate(torch.tensor([1, 2, 3]), max_new_tokens=20, temperature=1.0, seed=123)
    assert a.tokens == b.tokens


def test_prefill_projects_only_the_last_row(target):
    """The prefill asks the model for the last row's logits alone, with context drafting too
    (it recycles the last prompt token's predictions only); output unchanged."""
    rows = []
    # uncalibrated: a profile measured here (none cached yet when this test runs alone) would feed
    # forwards of its own through the hook
    plain = TreeDecoder(target, None, attention="sdpa", calibrate=False)
    tree = TreeDecoder(target, [target, "context"], tree="2,1", policy="static", attention="sdpa", calibrate=False)
    # the LM head: both forwards (the engine's own and transformers') call it with the rows they project
    hook = target.lm_head.register_forward_hook(lambda m, args, out: rows.append(out.shape[1]))
    try:
        ref = plain.generate_baseline(PROMPT, max_new_tokens=12)
        assert rows[0] == 1
        rows.clear()
        out = tree.generate(PROMPT, max_new_tokens=12)
        assert rows[0] == 1 and out.tokens == ref.tokens
    finally:
        hook.remove()
