"""The Python API's inputs: every bad prompt, sampling setting, seed, stop string or EOS id is a
ConfigError naming it (never a TypeError or a torch error from deep inside), and the good ones work."""

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from mcsd import ConfigError, TokenizerMismatchError, TreeDecoder


@pytest.fixture(scope="module")
def decoder(target, random_draft, tokenizer):
    return TreeDecoder(target, random_draft, tokenizer=tokenizer, tree="2,2")


@pytest.mark.parametrize("prompt, fragment", [
    ([1.5, 2.0], "token ids must be integers, got torch.float32"),
    (torch.tensor([1.7, 2.0]), "token ids must be integers"),
    (torch.tensor([True, False]), "token ids must be integers, got torch.bool"),
    ([None, [1]], "prompt must be a string, or token ids"),
    ([[1, 2], None], "prompt must be a string, or token ids"),
    (None, "prompt must be a string, or token ids"),
    (b"w03", "prompt must be a string, or token ids"),
    ([2**70], "prompt must be a string, or token ids"),
    ([1, 2, 999], r"token ids must lie in \[0, 64\)"),
    ([-1], r"token ids must lie in \[0, 64\)"),
    ([], "the prompt is empty"),
    ("   ", "the prompt is empty"),
    (torch.ones(2, 3, dtype=torch.long), "batched prompts are not supported"),
    (torch.ones(1, 1, 3, dtype=torch.long), "must be 1-D or"),
])
def test_bad_prompts(decoder, prompt, fragment):
    with pytest.raises(ConfigError, match=fragment):
        decoder.generate(prompt, max_new_tokens=2)


def test_a_list_of_prompts_is_several_prompts(decoder):
    """A list of strings or of id lists was an error; it is now prompts generated one after another."""
    outs = decoder.generate([[3, 4], "w03 w04"], max_new_tokens=4)
    single = decoder.generate([3, 4], max_new_tokens=4).tokens
    assert [o.tokens for o in outs] == [single, single]
    with pytest.raises(ConfigError, match=r"token ids must lie in \[0, 64\)"):
        decoder.generate([[3, 4], [999]], max_new_tokens=2)


@pytest.mark.parametrize("prompt", [[3, 4], torch.tensor([[3, 4]]), np.array([3, 4], dtype=np.int32), "w03 w04"])
def test_good_prompts_of_every_kind_agree(decoder, prompt):
    assert decoder.generate(prompt, max_new_tokens=4).tokens == decoder.generate([3, 4], max_new_tokens=4).tokens


@pytest.mark.parametrize("settings, fragment", [
    (dict(temperature="0.5"), "temperature must be a number, got '0.5'"),
    (dict(temperature=None), "temperature must be a number"),
    (dict(temperature=float("inf")), "temperature must be >= 0 and finite"),
    (dict(temperature=float("nan")), "temperature must be >= 0 and finite"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p="0.5"), "top_p must be a number"),
    (dict(top_p=None), "top_p must be a number"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=None), "top_k must be an integer, got None"),
    (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(max_new_tokens=None), "max_new_tokens must be an integer"),
    (dict(max_new_tokens="3"), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(seed=2**70), "seed must be an integer between"),
    (dict(stop_strings=[""]), "stop_strings must be non-empty strings"),
    (dict(stop_strings=[5]), "stop_strings must be non-empty strings"),
    (dict(eos_token_ids="a"), "eos_token_ids must be an integer, got 'a'"),
    (dict(eos_token_ids=1.5), "eos_token_ids must be an integer, got 1.5"),
    (dict(eos_token_ids=[-3]), "eos_token_ids must be an integer >= 0"),
])
def test_bad_generation_settings(decoder, settings, fragment):
    with pytest.raises(ConfigError, match=fragment):
        decoder.generate([3, 4], **{"max_new_tokens": 2, **settings})


def test_edge_settings_that_are_valid(decoder):
    base = decoder.generate([3, 4], max_new_tokens=4).tokens
    assert decoder.generate([3, 4], max_new_tokens=4.0, top_k=0.0).tokens == base      # whole floats count
    assert decoder.generate([3, 4], max_new_tokens=4, stop_strings=None).tokens == base
    assert decoder.generate([3, 4], max_new_tokens=4, eos_token_ids=np.int64(63)).finish_reason
    assert len(decoder.generate([3, 4], max_new_tokens=4, temperature=1.0, seed=-1).tokens) == 4
    assert len(decoder.generate([3, 4], max_new_tokens=4, temperature=1.0, seed=2**64 - 1).tokens) == 4


def test_one_stop_string_is_one_string_not_its_characters(decoder, tokenizer):
    base = decoder.generate([3, 4], max_new_tokens=6)
    stop = tokenizer.decode(base.tokens[2:4])                   # e.g. "w42 w34": spans the 3rd and 4th token
    out = decoder.generate([3, 4], max_new_tokens=6, stop_strings=stop)
    assert out.finish_reason == "stop_string" and out.tokens == base.tokens[:4]
    assert decoder.generate([3, 4], max_new_tokens=6, stop_strings=[stop]).tokens == out.tokens


def test_lossy_root_width_past_the_vocabulary(target, random_draft):
    with pytest.raises(ConfigError, match=r"between 1 and the vocabulary size \(64\)"):
        TreeDecoder(target, random_draft, tree="1", lossy_target_roots=100)


def test_draft_with_another_vocabulary_is_refused(target):
    with pytest.raises(TokenizerMismatchError, match="64 vs 80"):
        TreeDecoder(target, tiny_llama(2, vocab=80, layers=1))


def test_oversized_tree_is_refused_before_anything_is_built(target, random_draft):
    with pytest.raises(ConfigError, match="1,010,100 draft nodes; the limit is 1,024"):
        TreeDecoder(target, random_draft, tree="100,100,100")
