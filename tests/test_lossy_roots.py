"""The paper's lossy multi-root variant: opt-in, greedy only, and exact in its one-root limit."""

import pytest
import torch

from mcsd import ConfigError, TreeDecoder

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])


@pytest.fixture(scope="module")
def reference(target):
    return TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=50).tokens


def test_one_root_is_plain_greedy(target, random_draft, reference):
    from test_feature_draft import random_head

    from mcsd.drafting.feature_draft import FeatureDrafter
    for draft in (target, random_draft, FeatureDrafter(random_head(target), target)):
        dec = TreeDecoder(target, draft, tree="2,1", lossy_target_roots=1, attention="sdpa")
        assert dec.generate(PROMPT, max_new_tokens=50).tokens == reference


def test_several_roots_emit_top_w_roots_and_argmax_branches(target):
    from test_equivalence import perturbed
    draft = perturbed(target, 0.3)
    rounds = []
    dec = TreeDecoder(target, draft, tree="2,1", lossy_target_roots=3, attention="sdpa")
    out = dec.generate(PROMPT, max_new_tokens=50, on_round=lambda t, a: rounds.append((t, a)))
    assert len(out.tokens) == 50 and out.stats.mean_accepted > 1.0
    # replay: each round's first emitted token is one of the target's top-3, the rest its argmax chain
    seq = PROMPT.tolist()
    for tree, acc in rounds:
        with torch.no_grad():
            logits = target(torch.tensor([seq])).logits[0, -1]
        path = tree.tokens[acc.path[1:]].tolist()
        assert path[0] in logits.topk(3).indices.tolist()
        cur = seq + [path[0]]
        for tok in path[1:]:
            with torch.no_grad():
                assert int(target(torch.tensor([cur])).logits[0, -1].argmax()) == tok
            cur.append(tok)
        seq = cur
    assert seq[len(PROMPT):] == out.tokens[:len(seq) - len(PROMPT)]


def test_lossy_roots_refuse_sampling_and_bad_specs(target):
    dec = TreeDecoder(target, target, tree="2,1", lossy_target_roots=2, attention="sdpa")
    with pytest.raises(ConfigError, match="greedy decoding only"):
        dec.generate(PROMPT, max_new_tokens=5, temperature=1.0)
    with pytest.raises(ConfigError, match="k-config tree string"):
        TreeDecoder(target, target, tree=[(0,), (1,)], lossy_target_roots=2, attention="sdpa")


@pytest.mark.parametrize("p", [0.9, 0.001], ids=["confident", "hopeless"])
def test_lossy_roots_under_the_learned_policy(p):
    """The given first level counts as certain for the learned policy; a hopeless model still drafts level 1."""
    from conftest import tiny_llama
    from test_learned_policy import _policy, constant_model
    target = tiny_llama(0)
    dec = TreeDecoder(target, tiny_llama(1), tree="2,1", policy=_policy(constant_model(p), "2,2,1"),
                      lossy_target_roots=2, attention="sdpa")
    out = dec.generate(torch.tensor([3, 17, 42, 5, 9, 11]), max_new_tokens=20)
    assert len(out.tokens) == 20 and out.stats.rounds >= 1
