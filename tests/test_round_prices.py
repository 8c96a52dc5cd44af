"""What a drafted round costs in decoding beyond its levels: measured on the decoder's own rounds,
cached beside the profile, read by the gates; decisions read the cached figures, never the clock."""

import json
import time

import pytest
import torch
from conftest import FIXED_ROUND_PRICES
from test_feature_draft import random_head

from mcsd import TreeDecoder
from mcsd.core.tree import TreeTopology
from mcsd.costs.cost_model import Costs
from mcsd.decoding import propose as propose_module, round_prices
from mcsd.decoding.propose import Proposer
from mcsd.drafting.context import ContextDrafter
from mcsd.drafting.feature_draft import FeatureDrafter
from mcsd.drafting.policies.static import StaticPolicy

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])


def head_and_context(target):
    return [FeatureDrafter(random_head(target), target), "context"]


def lookups_kept(patch) -> list:
    """Within `patch` (a MonkeyPatch): every lookup beneath a root alone keeps its choice (None: it
    found nothing) in the list returned."""
    looked, lookup = [], ContextDrafter.choose_under_root

    def kept(self, *args, **kwargs):
        looked.append(lookup(self, *args, **kwargs))
        return looked[-1]
    patch.setattr(ContextDrafter, "choose_under_root", kept)
    return looked


def test_the_figures_reach_the_policys_and_the_context_gates_costs(target, fresh_cache):
    dec = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    for costs in (dec.policy.costs, dec.context_costs):
        assert (costs.round_ms, costs.graft_ms) == (FIXED_ROUND_PRICES["round_ms"], FIXED_ROUND_PRICES["graft_ms"])
        assert costs.lookup_ms == FIXED_ROUND_PRICES["lookup_ms"]
        assert costs.context_round_ms == FIXED_ROUND_PRICES["context_round_ms"]
    assert "measured in this run" in dec.round_prices
    # priced into the round: the policy's draft time starts with the round's own work
    dec.policy.begin_round()
    assert dec.policy._draft_ms == pytest.approx(dec.policy.costs.draft_ms(1) + FIXED_ROUND_PRICES["round_ms"])
    # a sampled generation reads the sampled figure, the next greedy one the greedy figure again
    dec.generate(PROMPT, max_new_tokens=4, temperature=0.9, seed=1)
    assert dec.policy.costs.round_ms == dec.context_costs.round_ms == FIXED_ROUND_PRICES["round_ms_sampled"]
    assert dec.context_costs.context_round_ms == FIXED_ROUND_PRICES["context_round_ms_sampled"]
    dec.generate(PROMPT, max_new_tokens=4)
    assert dec.policy.costs.round_ms == FIXED_ROUND_PRICES["round_ms"]
    # cached beside the profile: the next decoder reads them, measuring nothing
    again = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    assert "cached" in again.round_prices


def test_a_cached_figure_is_what_decides(target, fresh_cache, monkeypatch):
    """Decisions read the cached figures: a dear round shuts the draft gate, so the rounds are plain
    steps; the text is plain decoding's either way."""
    dec = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    reference = dec.generate_baseline(PROMPT, max_new_tokens=40).tokens
    cheap = dec.generate(PROMPT, max_new_tokens=40)
    path = round_prices.cache_path(dec)
    entries = json.loads(path.read_text())
    entries[round_prices.key(dec)].update(dict.fromkeys(round_prices.FIGURES, 1e6))   # the same prices
    path.write_text(json.dumps(entries))
    dear = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    assert dear.policy.costs.round_ms == 1e6
    out = dear.generate(PROMPT, max_new_tokens=40)
    assert out.tokens == cheap.tokens == reference
    assert out.stats.plain_rounds > cheap.stats.plain_rounds
    assert out.stats.plain_rounds >= out.stats.rounds - 4          # probes only


def test_figures_hold_for_the_prices_they_were_measured_against(target, fresh_cache, monkeypatch):
    """A figure is what a round took beyond the profile's prices: cached with their fingerprint, read
    back while the profile is the same, measured again for a profile measured again (at the next
    start, or by `recalibrate` within the run), and a cache entry without a fingerprint is measured
    again."""
    measured = []

    def measure(decoder, costs):
        measured.append(dict(costs.verify))
        return dict.fromkeys(round_prices.FIGURES, 0.1 * len(measured))
    monkeypatch.setattr(round_prices, "measure", measure)
    dec = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    prices = dict(dec.policy.costs.verify)
    again = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    assert "cached" in again.round_prices and len(measured) == 1
    entry = json.loads(round_prices.cache_path(dec).read_text())[round_prices.key(dec)]
    assert entry["prices"] == round_prices.prices_key(dec.policy.costs)
    # the same profile measured again, its prices not the same: the figures beyond them are measured again
    other = Costs({n: ms * 1.5 for n, ms in prices.items()}, dec.policy.costs.draft, source="measured")
    assert round_prices.prices_key(other) != entry["prices"]
    assert round_prices.cached(dec, other) is None and round_prices.cached(dec, dec.policy.costs) is not None

    def remeasure(costs, force=False):
        costs.rebase(other)
        return True
    monkeypatch.setattr(dec.calibration, "remeasure", remeasure)
    assert dec.recalibrate(force=True)
    assert measured[-1] == other.verify and "measured in this run" in dec.round_prices
    assert dec.policy.costs.round_ms == dec.context_costs.round_ms == 0.2          # the new figures, in use
    # an entry cached without the prices it was measured against is measured again
    path = round_prices.cache_path(dec)
    entries = json.loads(path.read_text())
    del entries[round_prices.key(dec)]["prices"]
    path.write_text(json.dumps(entries))
    third = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    assert "measured in this run" in third.round_prices and len(measured) == 3


def test_nothing_is_measured_without_calibration(target, fresh_cache, monkeypatch):
    called = []
    monkeypatch.setattr(round_prices, "measure", lambda decoder, costs: called.append(1))
    dec = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa", calibrate=False)
    assert not called and dec.policy.costs.round_ms == 0.0 and dec.round_prices.startswith("not measured")


def test_a_corrupt_cache_file_is_measured_again(target, fresh_cache):
    dec = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    round_prices.cache_path(dec).write_text("{not json")
    again = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    assert "measured in this run" in again.round_prices


@pytest.mark.measures
def test_measuring_runs_drafted_rounds_and_prices_what_the_levels_leave_out(target, fresh_cache):
    """On the decoder's own rounds (every other one drafted, then none with context drafting alone): every
    figure is non-negative and finite, and the measurement leaves the decoder's costs, policy and
    context drafter as they were."""
    dec = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    costs = dec.policy.costs
    stale_flags = []
    costs.on_stale = stale_flags.append
    costs.verify = {n: ms / 1000 for n, ms in costs.verify.items()}   # any round now looks 1000x slow
    context_costs = dec.context_costs
    context_costs.context_round_ms = 9.0
    before = (costs.round_ms, costs.graft_ms, list(costs._plain), list(costs._any))
    with pytest.MonkeyPatch.context() as patch:
        looked = lookups_kept(patch)
        figures = round_prices.measure(dec, costs)
    assert set(figures) == set(round_prices.FIGURES)
    assert all(0 <= v < 1e4 for k, v in figures.items() if not k.startswith("draft_value"))
    assert figures["draft_value"] == figures["draft_value_sampled"] == 0.0      # no tokenizer: no text to answer
    assert (costs.round_ms, costs.graft_ms, costs._plain, costs._any) == before   # its rounds left no trace
    assert context_costs.context_round_ms == 9.0
    assert costs.stale is None and not stale_flags
    assert looked                               # rounds that drafted nothing looked up on the repeated prompt
    assert not {"graft", "choose_under_root", "grafted", "observe_logits"} & set(vars(dec.context))
    assert "_round" not in vars(dec)
    assert not {"begin_round", "rounds_to_draft"} & set(vars(dec.policy))   # the policy's own methods again


@pytest.mark.measures
def test_a_lookup_that_finds_nothing_is_priced_with_the_recycling_before_it(target, fresh_cache, monkeypatch):
    """A probe of a shut context gate costs decoding its lookup and the target's top-k recycled on the
    step before it (a shut gate's steps skip it): `lookup_ms` holds both, so a recycling that takes 3 ms
    makes a miss cost at least that, whatever the lookups themselves took."""
    monkeypatch.setattr(round_prices, "PASSES", 1)
    dec = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    recycle = ContextDrafter.observe_logits

    def slow(self, *args, **kwargs):
        time.sleep(0.003)
        return recycle(self, *args, **kwargs)
    monkeypatch.setattr(ContextDrafter, "observe_logits", slow)
    looked = lookups_kept(monkeypatch)
    figures = round_prices.measure(dec, dec.policy.costs)
    assert None in looked                        # some lookups found nothing
    assert figures["lookup_ms"] >= 3.0
    assert "observe_logits" not in vars(dec.context)


def _round(ms, size=1, graft_ms=0.0, priced=None):
    return {"ms": ms, "size": size, "graft_ms": graft_ms, "priced": priced}


def test_a_round_is_priced_against_the_steps_beside_it_in_the_profiles_ms():
    """On a machine whose plain steps run 1.5x the profile's (15 ms against 10), a drafted round that
    took its priced levels, its extra rows and 0.8 profile ms more (all 1.5x), plus its graft's own
    0.3 ms, and made the step after it 0.6 ms slower, is worth 0.8 + 0.6 / 1.5 beyond (the next, timed
    against that slower step, 0.8 - 1.2 / 1.5); the first round (the prompt's catch-up), rounds not
    between two plain steps and, priced as drafted, rounds that only grafted are left out."""
    costs = Costs({1: 10.0, 3: 11.0}, {1: 1.0})
    drafted = 15.0 + 1.5 * (2.0 + 1.0 + 0.8) + 0.3              # priced 2.0, extra rows 11 - 10
    timed = [_round(99.0, 3, priced=2.0), _round(15.0), _round(drafted, 3, 0.3, 2.0), _round(15.6),
             _round(drafted, 3, 0.3, 2.0), _round(15.0), _round(40.0, 3, 0.3, 2.0), _round(40.0, 3, 0.3, 2.0),
             _round(15.0), _round(15.0 + 1.5 * (1.0 + 0.4) + 0.2, 3, 0.2), _round(15.0), _round(15.0, 1, 0.1)]
    assert round_prices.beyond(timed, costs, True) == pytest.approx([0.8 + 0.6 / 1.5, 0.8 - 1.2 / 1.5])
    # a generation that drafts nothing: each grafting round beyond its rows, priced or not
    grafting = [_round(99.0, 3, 0.2), _round(15.0), _round(15.0 + 1.5 * (1.0 + 0.4) + 0.2, 3, 0.2), _round(15.0),
                _round(15.0, 1, 0.1), _round(15.0)]
    assert round_prices.beyond(grafting, costs, False) == pytest.approx([0.4])
    assert round_prices.beyond([_round(15.0, 3)] * 4, costs, False) == []     # no plain step to price against


def test_the_quietest_pass_gives_the_figure():
    assert round_prices.quietest([[1.0, 2.0, 3.0], [0.5, 0.6, 10.0], []]) == 0.6
    assert round_prices.quietest([[], []]) is None


def test_the_context_gate_hears_a_graft_at_its_rounds_price():
    """A graft beneath a root alone is worth its accepted nodes less its rows, its lookup and the round
    of the root and its graft (`context_round_ms`); beneath a drafted tree, whose round is made anyway,
    no such round is charged; a lookup that found nothing is a miss at its own price (`lookup_ms`)."""
    costs = Costs({1: 10.0, 2: 10.5, 64: 41.5}, {1: 1.0})
    costs.graft_ms, costs.lookup_ms, costs.context_round_ms = 0.2, 0.03, 1.5
    proposer = Proposer(StaticPolicy(TreeTopology.from_spec("")), None, ContextDrafter(), 0, costs)
    heard, missed = [], []
    proposer.context_gate.observe = lambda value, step_ms=None: heard.append(value)
    proposer.context_gate.missed = lambda cost, step_ms=None: missed.append(cost)
    proposer._value_context(1, 1, 3)                    # the root alone and two grafted nodes, one accepted
    proposer._value_context(1, 3, 5)                    # the same beneath a drafted tree of three
    proposer._value_context(0, 1, 1)                    # nothing found beneath the root alone
    proposer._value_context(0, 3, 3)                    # ... or beneath a drafted tree
    assert heard == pytest.approx([10.0 - 1.0 - 0.2 - 1.5, 10.0 - 1.0 - 0.2])
    assert missed == [0.03, 0.03]


class _Letters:
    """A stand-in tokenizer (no chat template): each letter of a text one id, within the tiny vocabulary."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = torch.tensor([[3 + ord(c) % (self.vocab - 3) for c in text]])
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


def test_a_probes_worth_is_measured_on_the_fixed_text(target, fresh_cache):
    """`worth` answers the fixed text greedy and sampled, every `WORTH_SPACING`-th round a probe keeping the
    first-level test; the decoder's costs, figures, round, policy and context drafter are left as they
    were; without a tokenizer nothing is measured."""
    dec = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    dec.tokenizer = _Letters(target.config.vocab_size)
    tested = []
    first_level = dec.policy._first_level_pays
    costs = [dec.policy.costs, dec.context_costs]
    before = [(c.round_ms, c.graft_ms, c.lookup_ms, c.context_round_ms, list(c._plain)) for c in costs]
    figures_before = dict(dec.round_figures)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dec.policy, "_first_level_pays", lambda path, counts: tested.append(1) or first_level(path, counts))
        values = round_prices.worth(dec, dict(FIXED_ROUND_PRICES), costs[0], costs)
    assert set(values) == {"draft_value", "draft_value_sampled"} and all(abs(v) < 1e4 for v in values.values())
    assert tested
    assert [(c.round_ms, c.graft_ms, c.lookup_ms, c.context_round_ms, list(c._plain)) for c in costs] == before
    assert dec.round_figures == figures_before and "_round" not in vars(dec)
    assert not {"begin_round", "rounds_to_draft", "sit_out", "_first_level_pays", "observe"} & set(vars(dec.policy))
    assert not {"graft", "choose_under_root", "grafted"} & set(vars(dec.context))
    dec.tokenizer = None
    assert round_prices.worth(dec, dict(FIXED_ROUND_PRICES), costs[0], costs) == \
        {"draft_value": 0.0, "draft_value_sampled": 0.0}


def _probe(ms, accepted=0, shared=0, size=1, drafted=1, graft_ms=0.0):
    return {"ms": ms, "accepted": accepted, "shared": shared, "size": size, "drafted": drafted, "graft_ms": graft_ms}


def test_a_probe_is_worth_what_the_drafter_added_to_its_round():
    """On a machine whose plain steps run 1.5x the profile's (15 ms against 10; a lookup's 0.5 ms left
    out): a probe that took 9 ms more than the step before it (its graft's 1 ms aside), made the next
    1.5 ms slower, had 2 drafted tokens accepted, one of them proposed by context drafting too, and
    grafted a node (rows 3 of 4, priced 1) is worth 10 - 10.5 / 1.5 + 1 = 4 profile ms; the next, left
    after its first level (3 ms more than that slower step, nothing accepted, the step after it 15
    again), -1; a probe beside a round that grafted is not timed; the figure is their mean."""
    costs = Costs({1: 10.0, 3: 11.0, 4: 12.0}, {1: 1.0})
    rounds = [_probe(15.5, graft_ms=0.5), _probe(25.0, 2, 1, size=4, drafted=3, graft_ms=1.0), _probe(16.5),
              _probe(19.5), _probe(15.0), _probe(30.0, 3, size=3, drafted=3), _probe(20.0, size=2, drafted=1),
              _probe(15.0, 1, size=2, drafted=2), _probe(15.0)]
    assert round_prices._probes_worth(rounds, costs) == pytest.approx((4.0 - 1.0) / 2)
    assert round_prices._probes_worth([_probe(15.0, size=2)] * 3, costs) == 0.0


def test_probes_spaced_as_a_shut_gate_spaces_them():
    """Every `every`-th round drafts and the rounds between say how far the next one is, so the steps
    further than `RESUME_WINDOW` from it leave the head's features out (it starts over from the
    window's, as after a shut gate's wait); a quiet run's rounds count; outside, the policy's own
    methods are back."""
    class Policy:
        def begin_round(self):
            return 3
    policy = Policy()
    with round_prices._drafting_every_other(policy, every=5):
        asked = [(policy.begin_round(), policy.rounds_to_draft()) for _ in range(5)]
        policy.sit_out(3)                                   # a quiet run's three rounds
        asked += [(policy.begin_round(), policy.rounds_to_draft()) for _ in range(2)]
    assert asked == [(0, 3), (0, 2), (0, 1), (0, 0), (3, 4), (0, 0), (3, 4)]
    assert not {"begin_round", "rounds_to_draft", "sit_out"} & set(vars(policy))
    assert round_prices.WORTH_SPACING > propose_module.RESUME_WINDOW


def test_spaced_probes_are_each_weighed_against_their_neighbours():
    """With a probe every 3rd round, each is weighed against the rounds before and after it alone: a
    probe that took 6 ms more than the step before it (steps 15 ms against a 10 ms profile) and had one
    drafted token accepted is worth 10 - 6 / 1.5 = 6 profile ms; the steps around are not probes."""
    costs = Costs({1: 10.0, 2: 11.0}, {1: 1.0})
    rounds = [_probe(15.0), _probe(15.0), _probe(21.0, 1, size=2, drafted=2), _probe(15.0), _probe(15.0),
              _probe(15.0)]
    assert round_prices._probes_worth(rounds, costs, every=3) == pytest.approx(6.0)
    assert round_prices._probes_worth(rounds + [_probe(15.0)], costs, every=3) == pytest.approx(3.0)   # and a probe
    # left after its first level at no cost: worth 0


def test_a_machine_where_drafted_rounds_lose_starts_each_text_with_the_draft_gate_shut(target, fresh_cache,
                                                                                     monkeypatch):
    """A cached worth below 0 reaches the policy as its prior (greedy or sampled, as decoded): each
    generation's gate starts shut for the wait a probe that lost that much would sit out, so the
    generation's first rounds draft nothing (context drafting goes on), and the text is plain decoding's;
    at 0 it starts open."""
    lose = {**FIXED_ROUND_PRICES, "draft_value": -3.0, "draft_value_sampled": -5.0}
    monkeypatch.setattr(round_prices, "measure", lambda decoder, costs: dict(lose))
    dec = TreeDecoder(target, head_and_context(target), policy="learned", attention="sdpa")
    reference = dec.generate_baseline(PROMPT, max_new_tokens=24).tokens
    out = dec.generate(PROMPT, max_new_tokens=24)
    assert dec.policy.prior == -3.0 and out.tokens == reference
    assert out.stats.draft_forwards == 0                              # the wait outlasts 24 tokens
    step = dec.policy.costs.verify_ms(1)
    dec.policy.reset()
    assert dec.policy.rounds_to_draft() == dec.policy.gate.gap >= 3.0 / (dec.policy.probe_budget * step) - 1
    assert dec.policy.begin_round() == 0
    dec.generate(PROMPT, max_new_tokens=4, temperature=0.8, seed=3)
    assert dec.policy.prior == -5.0
    dec.policy.prior = 0.0
    dec.policy.reset()
    assert dec.policy.rounds_to_draft() == 0 and dec.policy.begin_round() > 0
