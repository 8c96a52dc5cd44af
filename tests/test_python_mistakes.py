"""Python calls a new user gets wrong, or right in a way the engine did not expect: each gives a clear
error naming the argument, or works as the README promises."""

import pytest
import torch
from conftest import tiny_llama

from mcsd import TreeDecoder
from mcsd.config import ConfigError
from mcsd.drafting.feature_draft import FeatureDrafter, FeatureHead, FeatureHeadConfig
from mcsd.drafting.pair import cast_pair

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])


def fused_head(target, seed=5):
    """A random feature head reading three of the target's layers (fused by its `fuse` layer)."""
    torch.manual_seed(seed)
    cfg = FeatureHeadConfig(target_hidden=target.config.hidden_size, hidden=16, layers=1, heads=2, kv_heads=1,
                            vocab_size=target.config.vocab_size, feature_layers=(0, 1, -1))
    return FeatureHead(cfg).eval()


@pytest.mark.parametrize("earlier_decoder", [False, True])
def test_a_pair_cast_to_bfloat16_in_place_decodes_with_its_feature_head(earlier_decoder):
    """`cast_pair(target, draft, "bfloat16")` and a new decoder over the same objects (the return value
    not taken), with or without a decoder built on them before."""
    target = tiny_llama(0)
    draft = FeatureDrafter(fused_head(target), target)
    if earlier_decoder:
        TreeDecoder(target, draft, tree="2,1", policy="static", calibrate=False).generate(PROMPT, max_new_tokens=4)
    returned = cast_pair(target, draft, "bfloat16")
    assert returned[1] is draft and draft.dtype == torch.bfloat16
    dec = TreeDecoder(target, draft, tree="2,1", policy="static", calibrate=False)
    out = dec.generate(PROMPT, max_new_tokens=12)
    assert out.stats.draft_forwards > 0 and len(out.tokens) == 12


def test_lossy_roots_with_a_feature_head_on_a_one_token_prompt_is_a_clear_error():
    target = tiny_llama(0)
    dec = TreeDecoder(target, FeatureDrafter(fused_head(target), target), lossy_target_roots=2, calibrate=False)
    with pytest.raises(ConfigError, match="needs a prompt of 2 tokens or more, got 1"):
        dec.generate(torch.tensor([3]), max_new_tokens=4)
    assert len(dec.generate(torch.tensor([3, 17]), max_new_tokens=4).tokens) == 4


def test_lossy_roots_with_a_draft_model_take_a_one_token_prompt(target, random_draft):
    dec = TreeDecoder(target, random_draft, lossy_target_roots=2, calibrate=False)
    assert len(dec.generate(torch.tensor([3]), max_new_tokens=4).tokens) == 4


def test_a_tokenizer_that_is_none_is_named(target, random_draft):
    with pytest.raises(ConfigError, match="tokenizer must be a tokenizer .* got str 'x'"):
        TreeDecoder(target, random_draft, tokenizer="x", calibrate=False)


@pytest.mark.parametrize("call", ["generate", "generate_baseline"])
def test_a_streamer_that_is_no_function_is_named_before_anything_runs(target, random_draft, call):
    dec = TreeDecoder(target, random_draft, calibrate=False)
    with pytest.raises(ConfigError, match="streamer must be a function .* got int 5"):
        getattr(dec, call)(PROMPT, max_new_tokens=4, streamer=5)
    with pytest.raises(ConfigError, match="on_round must be a function"):
        dec.generate(PROMPT, max_new_tokens=4, on_round="draw")


@pytest.mark.parametrize("draft", [[], ()])
def test_an_empty_draft_list_is_refused(target, draft):
    with pytest.raises(ConfigError, match="draft is an empty .*draft=None"):
        TreeDecoder(target, draft, calibrate=False)


def test_dense_weights_list_no_q4_candidates(target, monkeypatch, tmp_path):
    from mcsd.decoding import choice
    monkeypatch.setattr(choice, "q4_possible", lambda target, gguf: True)
    gguf = tmp_path / "t.gguf"
    assert choice.q4_candidates(target, gguf, True, "dense") == ()
    assert all(choice.weights_of(n) == "q4" for n in choice.q4_candidates(target, gguf, True, "q4"))
    assert choice.q4_candidates(target, gguf, True, "auto")
