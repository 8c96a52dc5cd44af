"""The seed papers' length policies (SVIP, DISCO, SpecDec++) are lossless, and refuse bad settings.

Each policy runs on tiny random models made here: greedy output must equal
plain greedy decoding token for token (float32; a "same" draft and a
"random" draft; chains and a tree), and sampled output must follow the
target's exact distribution (chi-square against enumeration). Thresholds are
chosen so that each policy both drafts and stops in these runs; the tests
check that it did, so a policy that never cuts (or always cuts) fails.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_follows_target, tiny_llama
from mcsd import TreeDecoder
from mcsd.config import ConfigError, SamplingConfig
from mcsd.policies import POLICIES, make_policy
from mcsd.tree import TreeTopology
from test_equivalence import perturbed

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
N_NEW = 48


class Recorder:
    """Counts a policy's per-node decisions (drafted / stopped) through its `expand`."""

    def __init__(self, policy):
        self.drafted = self.stopped = 0
        inner = policy.expand

        def expand(frontier):
            n = inner(frontier)
            n = frontier.max_children if n is None else n
            self.drafted += int((n > 0).sum())
            self.stopped += int((n == 0).sum())
            return n
        policy.expand = expand


@pytest.fixture(scope="module")
def pair():
    """A target with peaked next-token distributions and a draft that agrees about half the time."""
    target = tiny_llama(20, sharpness=30.0)
    return target, perturbed(target, 0.3)


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(10, vocab=8, layers=1, sharpness=6.0, hidden=16)
    return target, perturbed(target, 0.5, seed=3)


@pytest.fixture(scope="module")
def reference(pair):
    target = pair[0]
    out = target.generate(PROMPT[None], max_new_tokens=N_NEW, do_sample=False, attention_mask=torch.ones(1, 6))
    return out[0, PROMPT.numel():].tolist()


# Per policy: options that make it both draft and stop on `pair` (greedy) and on `small_pair` (sampling).
GREEDY_OPTIONS = {"svip": {"h": 0.49}}
SAMPLING_OPTIONS = {"svip": {"h": 0.548, "min_depth": 0}}   # rounds are 1-2 levels deep here


def build(name, spec, draft, options):
    policy = make_policy(name, spec, **options)
    return policy, Recorder(policy)


@pytest.mark.parametrize("spec", ["1,1,1,1,1,1,1,1", "2,2,1,1"], ids=["chain", "tree"])
@pytest.mark.parametrize("draft_name", ["same", "random"])
@pytest.mark.parametrize("name", sorted(GREEDY_OPTIONS))
def test_greedy_equals_plain_greedy(pair, reference, name, draft_name, spec):
    target, noisy = pair
    draft = target if draft_name == "same" else noisy
    policy, rec = build(name, spec, draft, GREEDY_OPTIONS[name])
    out = TreeDecoder(target, draft, policy=policy, attention="sdpa").generate(PROMPT, max_new_tokens=N_NEW)
    assert out.tokens == reference
    assert rec.drafted > 0 and rec.stopped > 0            # the policy both drafted and cut branches
    if draft_name == "same":
        assert out.stats.mean_accepted > 1.0


@pytest.mark.parametrize("name", sorted(SAMPLING_OPTIONS))
def test_sampling_follows_the_target(small_pair, name):
    target, draft = small_pair
    policy, rec = build(name, "3,2", draft, SAMPLING_OPTIONS[name])
    dec = TreeDecoder(target, draft, policy=policy, attention="sdpa")
    accepted = assert_follows_target(dec, target, SamplingConfig(1.0), n=1200)
    assert 0 < accepted < 1200
    assert rec.drafted > 0 and rec.stopped > 0


def test_registered_by_name():
    for name in ("svip",):
        assert name in POLICIES and POLICIES[name].default_tree == "1,1,1,1,1,1,1,1"


# ---------------------------------------------------------------------------- SVIP

def test_svip_rule_on_hand_made_distributions():
    from mcsd.policies.base import Frontier
    from mcsd.tree import DraftTree
    topo = TreeTopology.from_spec("2,2")
    tree = DraftTree.root_only(topo, torch.tensor(0))
    peaked = torch.tensor([0.97, 0.01, 0.01, 0.01])              # H = 0.17 nats: sqrt(0.15 H) = 0.16
    flat = torch.full((4,), 0.25)                                # H = 1.39 nats: sqrt(0.15 H) = 0.46
    front = Frontier(1, torch.tensor([1, 2]), torch.tensor([2, 2]), torch.stack([peaked, flat]), tree)
    assert POLICIES["svip"](topo).expand(front).tolist() == [2, 0]
    assert POLICIES["svip"](topo, h=0.5).expand(front).tolist() == [2, 2]
    root = Frontier(0, torch.tensor([0]), torch.tensor([2]), flat[None], tree)
    assert POLICIES["svip"](topo).expand(root).tolist() == [2]                   # min_depth 1
    assert POLICIES["svip"](topo, min_depth=0).expand(root).tolist() == [0]


@pytest.mark.parametrize("options", [{"h": 0.0}, {"h": 1.5}, {"h": float("nan")}, {"h": "0.3"}, {"c": -1.0},
                                     {"c": 0}, {"min_depth": -1}, {"min_depth": 1.5}])
def test_svip_bad_settings(options):
    with pytest.raises(ConfigError):
        make_policy("svip", None, **options)
