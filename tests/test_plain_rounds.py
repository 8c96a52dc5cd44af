"""A round that drafts nothing and grafts nothing is the plain loop's step: no tree is made or verified,
the text is what plain decoding writes (greedy, float32; seeded sampling the same text; the target's
distribution), and the drafters catch up when drafting resumes."""

import pytest
import torch
from conftest import assert_follows_target
from test_feature_draft import random_head

from mcsd import TreeDecoder
from mcsd.config import SamplingConfig
from mcsd.decoding import decoder as decoder_module
from mcsd.drafting.feature_draft import FeatureDrafter
from mcsd.drafting.policies.static import StaticPolicy
from mcsd.core.tree import TreeTopology

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])


class EveryOther(StaticPolicy):
    """The static tree on every `period`-th round; nothing drafted on the others (a shut gate)."""

    def __init__(self, topology, period: int = 3):
        super().__init__(topology)
        self.period, self.calls, self.steps = period, 0, []

    def reset(self) -> None:
        self.calls = 0

    def begin_round(self) -> int:
        self.calls += 1
        return self.topology.max_depth if self.calls % self.period == 0 else 0

    def observe_step(self, ms, forward_ms=None, context=None) -> None:
        self.steps.append(ms)


def decoder(target, draft, period=3, spec="2,2"):
    return TreeDecoder(target, draft, policy=EveryOther(TreeTopology.from_spec(spec), period), attention="sdpa")


def count_calls(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("drafter", ["model", "head", "head+context"])
def test_rounds_that_draft_nothing_are_plain_steps_and_the_text_is_plain_decodings(target, random_draft,
                                                                                 monkeypatch, drafter):
    draft = {"model": random_draft, "head": FeatureDrafter(random_head(target), target),
             "head+context": [FeatureDrafter(random_head(target), target), "context"]}[drafter]
    dec = decoder(target, draft)
    if drafter == "head+context":                        # context drafting sits out as a shut gate does
        monkeypatch.setattr("mcsd.drafting.policies.base.Gate.opens", lambda self: False)
        monkeypatch.setattr("mcsd.drafting.policies.base.Gate.will_open", lambda self: False)
    reference = dec.generate_baseline(PROMPT, max_new_tokens=40).tokens
    verified = count_calls(monkeypatch, decoder_module.TreeDecoder, "_verify")
    out = dec.generate(PROMPT, max_new_tokens=40)
    assert out.tokens == reference
    s = out.stats
    assert s.plain_rounds > 0 and s.rounds > s.plain_rounds
    assert len(verified) == s.rounds - s.plain_rounds               # only drafted rounds verify a tree
    assert s.target_forwards == s.rounds + 1                        # one forward a round, and the prefill
    assert len(dec.policy.steps) == s.plain_rounds                  # the policy heard of each plain step


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}])
def test_a_lookup_that_finds_nothing_is_a_plain_step(target, monkeypatch, sampling):
    """Context drafting alone, every lookup coming back empty: each round is the plain loop's step (no
    tree verified, one forward a round), the context gate hears each empty lookup's price, and the text is the
    plain loop's (greedy; and seeded sampling's, drawn as the plain step draws)."""
    from mcsd.core.tree import DraftTree
    from mcsd.drafting.context import ContextDrafter

    monkeypatch.setattr(ContextDrafter, "choose_under_root", lambda self, *args, **kwargs: None)
    lookups = count_calls(monkeypatch, ContextDrafter, "choose_under_root")
    made = count_calls(monkeypatch, DraftTree, "root_only")
    dec = TreeDecoder(target, "context", attention="sdpa", calibrate=False)     # nothing measured or cached
    reference = dec.generate_baseline(PROMPT, max_new_tokens=30, **sampling).tokens
    verified = count_calls(monkeypatch, decoder_module.TreeDecoder, "_verify")
    values = []
    from mcsd.drafting.policies.base import LookupGate
    original = LookupGate.missed
    monkeypatch.setattr(LookupGate, "missed", lambda self, cost, step_ms=None: (values.append(cost),
                                                                               original(self, cost, step_ms))[1])
    out = dec.generate(PROMPT, max_new_tokens=30, **sampling)
    assert out.tokens == reference
    assert not verified and out.stats.plain_rounds == out.stats.rounds
    assert not made                                                 # the lookup chose on the host: no tree
    assert out.stats.target_forwards == out.stats.rounds + 1
    assert lookups and len(values) == len(lookups)                  # each empty lookup priced in the gate
    if dec.context_costs is not None:
        assert all(v == dec.context_costs.lookup_ms for v in values)


def test_the_plain_loop_makes_no_tree(target, monkeypatch):
    from mcsd.core.tree import DraftTree
    dec = TreeDecoder(target, None, attention="sdpa")
    made = count_calls(monkeypatch, DraftTree, "root_only")
    verified = count_calls(monkeypatch, decoder_module.TreeDecoder, "_verify")
    out = dec.generate_baseline(PROMPT, max_new_tokens=12)
    assert len(out.tokens) == 12 and out.stats.plain_rounds == out.stats.rounds == 11
    assert not made and not verified


@pytest.mark.parametrize("method", ["gumbel", "rejection"])
def test_plain_steps_keep_a_seeds_text(target, random_draft, method):
    """Seeded sampling: a round's draw is the target's own noise at that position, so the text does not
    depend on which rounds drafted (with the position noise); under rejection sampling, the
    drafted and plain rounds alike follow the target's distribution."""
    dec = decoder(target, random_draft, period=2)
    if method == "gumbel":
        a = dec.generate(PROMPT, max_new_tokens=30, temperature=0.9, seed=11)
        b = dec.generate_baseline(PROMPT, max_new_tokens=30, temperature=0.9, seed=11)
        assert a.tokens == b.tokens and a.stats.plain_rounds > 0
    else:
        sampling = SamplingConfig(0.9, top_k=6, method="rejection")
        dec.generate = _with_method(dec.generate, "rejection")
        assert_follows_target(dec, target, sampling, n=1200)


def _with_method(generate, method):
    def run(*args, **kwargs):
        return generate(*args, sampling_method=method, **kwargs)
    return run


def test_return_logprobs_on_plain_steps_match_the_plain_loop(target, random_draft):
    dec = decoder(target, random_draft)
    a = dec.generate(PROMPT, max_new_tokens=16, return_logprobs=True)
    b = dec.generate_baseline(PROMPT, max_new_tokens=16, return_logprobs=True)
    assert a.tokens == b.tokens
    assert torch.allclose(torch.as_tensor(a.logprobs), torch.as_tensor(b.logprobs), atol=1e-5)


class LongShut(EveryOther):
    """`EveryOther` that says how long it will draft nothing: the proposer leaves a plain step's
    target features out when the next drafted round is further than the resume window."""

    def rounds_to_draft(self) -> int:
        return (self.period - self.calls % self.period) % self.period

    def sit_out(self, rounds: int) -> None:
        self.calls += rounds


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}])
def test_steps_far_from_a_drafted_round_take_no_features_and_the_head_starts_over(target, monkeypatch, sampling):
    """With drafted rounds 24 rounds apart, the steps further than `RESUME_WINDOW` from the next one
    ask the target for no hidden states; the head starts over from the steps' features before it
    drafts (its window of them), and the text is plain decoding's (greedy, and a seed's)."""
    from mcsd.decoding import propose as propose_module
    head = FeatureDrafter(random_head(target), target)
    dec = TreeDecoder(target, head, policy=LongShut(TreeTopology.from_spec("2,2"), 24), attention="sdpa")
    asked = []
    extend = type(dec.target).extend

    def recorded(self, tokens, hidden=False, last_logits=False):
        if tokens.numel() == 1:
            asked.append(bool(hidden))
        return extend(self, tokens, hidden=hidden, last_logits=last_logits)

    monkeypatch.setattr(type(dec.target), "extend", recorded)
    skipped = []
    skip = FeatureDrafter.skip_target
    monkeypatch.setattr(FeatureDrafter, "skip_target", lambda self, n=1: skipped.append(n) or skip(self, n))
    reference = dec.generate_baseline(PROMPT, max_new_tokens=60, **sampling).tokens
    asked.clear()
    out = dec.generate(PROMPT, max_new_tokens=60, **sampling)
    assert out.tokens == reference
    window = propose_module.RESUME_WINDOW
    # every step without features is skipped by the head, a quiet run's at once when it ends (a run still
    # going when the generation ends is not told)
    assert 0 < sum(skipped) <= asked.count(False) and asked.count(True) >= window
    assert out.stats.rounds > out.stats.plain_rounds >= 2 * window                # it drafted after skipping


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}])
def test_a_quiet_run_asks_no_proposer_and_changes_no_decision(target, monkeypatch, sampling):
    """Rounds every gate is sure to sit out, far from the head's next round, run as a quiet run: the
    policy, the context gate and the head are not asked in them and hear of them when it ends, and
    every round's tree, the text and the gates' states are what asking each round gives."""
    from mcsd.decoding.propose import Proposer

    def run(quiet: bool):
        head = FeatureDrafter(random_head(target), target)
        dec = TreeDecoder(target, [head, "context"], policy=LongShut(TreeTopology.from_spec("2,2"), 24),
                          attention="sdpa")
        with pytest.MonkeyPatch.context() as patch:
            if not quiet:
                patch.setattr(Proposer, "_quiet_rounds", lambda self: 0)
            asked = count_calls(patch, LongShut, "begin_round")
            sizes = []
            out = dec.generate(PROMPT, max_new_tokens=60, on_round=lambda tree, acc: sizes.append(tree.size),
                               **sampling)
        return out.tokens, sizes, len(asked), dec.policy.calls
    tokens, sizes, asked, calls = run(quiet=True)
    assert (tokens, sizes) == run(quiet=False)[:2]
    assert asked < len(sizes) and calls <= len(sizes) and max(sizes) > 1     # it drafted, and sat quiet


def test_a_head_with_no_features_since_it_skipped_says_so(target):
    head = FeatureDrafter(random_head(target), target)
    head.reset()
    hidden = torch.randn(PROMPT.numel(), len(head.feature_layers) * target.config.hidden_size)
    head.observe_target(hidden)
    head.skip_target(1)
    with pytest.raises(RuntimeError, match="no target features"):
        head.begin_round(torch.cat([PROMPT, torch.tensor([7])]))


class LeavesLevelOne(StaticPolicy):
    """Every round asks for the static tree; every other one drafts nothing beneath the root after its
    first draft forward (as the learned policy does where the first level cannot pay)."""

    def __init__(self, topology):
        super().__init__(topology)
        self.calls, self.observed = 0, []

    def reset(self) -> None:
        self.calls = 0

    def begin_round(self) -> int:
        self.calls += 1
        return self.topology.max_depth

    def expand(self, frontier):
        if frontier.depth == 0 and self.calls % 2:
            return torch.zeros_like(frontier.max_children)
        return None

    def observe(self, n_accepted, tree, shared=0) -> None:
        self.observed.append((n_accepted, tree.size))


@pytest.mark.parametrize("drafter", ["model", "head", "head+empty context"])
def test_a_round_left_after_its_first_draft_forward_is_a_plain_step(target, random_draft, monkeypatch, drafter):
    """A round whose policy drafts nothing beneath the root after the drafter's first forward verifies no
    tree (nor where context drafting looked and found nothing): it is the plain loop's step, the policy
    hears of the round (nothing accepted, the root alone), the drafter keeps up, and the text is plain
    decoding's."""
    draft = random_draft if drafter == "model" else FeatureDrafter(random_head(target), target)
    if drafter == "head+empty context":
        from mcsd.drafting.context import ContextDrafter, Graft
        monkeypatch.setattr(ContextDrafter, "graft", lambda self, drafted, *args, **kwargs:
                            Graft(drafted, torch.zeros(drafted.size, dtype=torch.bool), {}))
        draft = [draft, "context"]
    dec = TreeDecoder(target, draft, policy=LeavesLevelOne(TreeTopology.from_spec("2,2")), attention="sdpa")
    reference = dec.generate_baseline(PROMPT, max_new_tokens=30).tokens
    verified = count_calls(monkeypatch, decoder_module.TreeDecoder, "_verify")
    out = dec.generate(PROMPT, max_new_tokens=30)
    s = out.stats
    assert out.tokens == reference
    assert s.plain_rounds > 0 and len(verified) == s.rounds - s.plain_rounds > 0
    assert s.target_forwards == s.rounds + 1
    left = dec.policy.observed.count((0, 1))            # all but a last round with one token to go
    assert 0 < left and s.plain_rounds - 1 <= left <= s.plain_rounds


class Unannounced(EveryOther):
    """Drafts every round from the `period`-th on while having said each round before it that it would
    draft nothing for the resume window's rounds (as a gate reset from outside, `forget`, makes a
    learned policy do): the steps before skip the features (and, asked every round, it runs none of
    them as a quiet run)."""

    def begin_round(self) -> int:
        self.calls += 1
        return self.topology.max_depth if self.calls >= self.period else 0

    def rounds_to_draft(self) -> int:
        from mcsd.decoding.propose import RESUME_WINDOW
        return RESUME_WINDOW if self.calls < self.period else 0


def test_a_round_drafted_sooner_than_announced_takes_the_features_first(target):
    """A policy that drafts after steps that skipped the target's features does not reach the drafter
    without them: that round is a plain step that takes them, the next one drafts, and the text is
    plain decoding's."""
    head = FeatureDrafter(random_head(target), target)
    dec = TreeDecoder(target, head, policy=Unannounced(TreeTopology.from_spec("2,2"), 12), attention="sdpa")
    reference = dec.generate_baseline(PROMPT, max_new_tokens=40).tokens
    out = dec.generate(PROMPT, max_new_tokens=40)
    assert out.tokens == reference
    assert out.stats.rounds > out.stats.plain_rounds > 0                # some rounds drafted all the same


@pytest.mark.parametrize("policy,prompt_features", [(Unannounced, False), (LongShut, True)])
def test_the_prompts_features_are_taken_only_where_the_policy_may_draft_soon(target, monkeypatch, policy,
                                                                             prompt_features):
    """The prompt's forward asks the target for its hidden states as a step does (`step_hidden`): not
    where the policy will draft nothing for longer than the resume window from the start (a gate shut
    for good takes no features at all; the head starts over from the steps' when it drafts), and
    where it may draft at once; the text is plain decoding's either way."""
    head = FeatureDrafter(random_head(target), target)
    dec = TreeDecoder(target, head, policy=policy(TreeTopology.from_spec("2,2"), 12), attention="sdpa")
    asked = []
    extend = type(dec.target).extend

    def recorded(self, tokens, hidden=False, last_logits=False):
        if tokens.numel() > 1:
            asked.append(bool(hidden))
        return extend(self, tokens, hidden=hidden, last_logits=last_logits)

    monkeypatch.setattr(type(dec.target), "extend", recorded)
    reference = dec.generate_baseline(PROMPT, max_new_tokens=40).tokens
    asked.clear()
    out = dec.generate(PROMPT, max_new_tokens=40)
    assert asked == [prompt_features]
    assert out.tokens == reference and out.stats.rounds > out.stats.plain_rounds > 0
