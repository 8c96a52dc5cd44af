"""Context drafting: n-gram and suffix lookup, recycled target predictions, the datastore, the
merged trie, and exactness (greedy token-identical in fp32, sampling by chi-square)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_follows_target, tiny_llama

from mcsd import TreeDecoder
from mcsd.config import ConfigError, SamplingConfig
from mcsd.core.sampling import sample_without_replacement
from mcsd.core.tree import DraftTree, TreeTopology, ancestor_mask
from mcsd.core.verify import accept_sampling
from mcsd.costs.cost_model import Costs
from mcsd.drafting.context import ContextConfig, ContextDrafter, ContextStore, NGramIndex, parse_drafter_spec

# ---------------------------------------------------------------------------- lookup

def test_longest_match_first_most_recent_first():
    idx = NGramIndex(1, 4)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    idx.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7])
    got = idx.continuations(idx.tokens[-4:], max_matches=4, max_len=3)
    # "5 6 7" (n=3) occurred at 0..2 -> 8 1 6; then n=2 "6 7" also at 5..6 -> 9 2 5 (after the n=3 match)
    assert got[0] == ([8, 1, 6], 3)
    assert ([9, 2, 5], 2) in got
    assert all(n >= 2 for _, n in got)                   # enough long matches: no unigram noise


def test_match_of_the_query_itself_is_excluded_and_incremental_extend_indexes_new_tokens():
    idx = NGramIndex(1, 3)
    idx.extend([1, 2, 3])
    assert idx.continuations([1, 2, 3], 4, 4) == []     # only occurrence is the query itself
    idx.extend([4, 1, 2, 3])
    assert idx.continuations(idx.tokens[-3:], 4, 4)[0] == ([4, 1, 2, 3], 3)


@pytest.mark.parametrize("min_n,max_n", [(1, 6), (2, 4), (3, 3)])
def test_a_prompt_indexed_at_once_matches_one_indexed_token_by_token(min_n, max_n):
    """A prompt or a document (`BULK_EXTEND` tokens or more) is indexed n by n: the same n-grams at
    the same end positions, in the same order, as indexing it a token at a time, documents kept apart,
    and lookups after it alike."""
    gen = torch.Generator().manual_seed(min_n * 10 + max_n)
    docs = [torch.randint(0, 5, (n,), generator=gen).tolist() for n in (40, 2, 17, 90)]
    at_once, one_by_one = NGramIndex(min_n, max_n), NGramIndex(min_n, max_n)
    for doc in docs:
        at_once.extend(doc)
        for t in doc:
            one_by_one.extend([t])
        at_once.end_document()
        one_by_one.end_document()
    tail = torch.randint(0, 5, (20,), generator=gen).tolist()
    at_once.extend(tail)
    for t in tail:
        one_by_one.extend([t])
    assert at_once.tokens == one_by_one.tokens
    for n in range(max_n + 1):
        assert list(at_once.ends[n].items()) == list(one_by_one.ends[n].items())
    assert at_once.continuations(tail, 8, 5) == one_by_one.continuations(tail, 8, 5)


def test_a_full_length_match_is_measured_back_to_where_the_copy_began():
    idx = NGramIndex(1, 3)
    idx.extend([1, 2, 3, 4, 5, 9, 7, 2, 3, 4, 5])
    got = dict((tuple(c), n) for c, n in idx.continuations(idx.tokens, 4, 2))
    assert got[(9, 7)] == 4                  # "2 3 4 5" matched, not just the 3 tokens looked up


def test_store_documents_do_not_leak_into_each_other(tmp_path):
    store = ContextStore([[1, 2, 3, 4], [9, 1, 2, 8, 7]], vocab_size=16)
    path = tmp_path / "s.safetensors"
    store.save(path)
    idx, ends = ContextStore.load(path, 16).index(1, 3)
    got = idx.continuations([1, 2], 8, 6, limit=len(idx), doc_ends=ends)
    conts = sorted(c for c, _ in got)
    assert conts == [[3, 4], [8, 7]]                     # neither runs past its document's end


def test_store_errors_are_specific(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ContextStore.load(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00not a safetensors file")
    with pytest.raises(ConfigError, match="cannot read context store"):
        ContextStore.load(junk)
    good = tmp_path / "good.safetensors"
    ContextStore([[1, 2, 3]], vocab_size=100).save(good)
    with pytest.raises(ConfigError, match="vocabulary of 100 tokens; this target has 64"):
        ContextStore.load(good, vocab_size=64)
    from safetensors.torch import save_file
    other = tmp_path / "other.safetensors"
    save_file({"tokens": torch.zeros(3, dtype=torch.int32)}, str(other), metadata={"format": "something-else"})
    with pytest.raises(ConfigError, match="not an mcsd context store"):
        ContextStore.load(other)
    bad = tmp_path / "bad.safetensors"
    save_file({"tokens": torch.tensor([1, 2, 99], dtype=torch.int32), "offsets": torch.tensor([0, 3])}, str(bad),
              metadata={"format": "mcsd-context-store", "version": "1", "vocab_size": "16"})
    with pytest.raises(ConfigError, match="corrupt: token ids"):
        ContextStore.load(bad)
    save_file({"tokens": torch.tensor([1, 2, 3], dtype=torch.int32), "offsets": torch.tensor([0, 5])}, str(bad),
              metadata={"format": "mcsd-context-store", "version": "1", "vocab_size": "16"})
    with pytest.raises(ConfigError, match="corrupt: document offsets"):
        ContextStore.load(bad)


@pytest.mark.parametrize("options, message", [
    (dict(sources=("ngram", "crystal-ball")), "unknown context source"),
    (dict(sources=()), "unknown context source"),
    (dict(min_ngram=4, max_ngram=2), "min_ngram <= max_ngram"),
    (dict(max_nodes=0), "max_nodes must be >= 1"),
    (dict(recycle_widths=(2, 0)), "recycle_widths must be positive"),
    (dict(min_score=1.5), "min_score"),
])
def test_bad_context_settings(options, message):
    with pytest.raises(ConfigError, match=message):
        ContextConfig(**options)


def test_drafter_specs():
    assert parse_drafter_spec("feature+context") == ("feature", True)
    assert parse_drafter_spec("context") == (None, True)
    assert parse_drafter_spec("model") == ("model", False)
    for bad in ("", "context+context", "feature+model", "oracle"):
        with pytest.raises(ConfigError, match="unknown drafter"):
            parse_drafter_spec(bad)


# ---------------------------------------------------------------------------- the merged tree

def test_graft_extends_the_sliced_mask_exactly():
    topo = TreeTopology.from_spec("2,1")
    tree = DraftTree.root_only(topo, torch.tensor(7))
    tree.append_level(torch.tensor([3, 4]), torch.tensor([0, 0]), torch.zeros(2), topo.child_table[0, :2])
    # grafted: 9 under the root, 5 under 9, 6 under model node 1
    grafted = tree.graft(torch.tensor([9, 5, 6]), torch.tensor([0, 3, 1]), torch.zeros(3))
    assert grafted.tokens.tolist() == [7, 3, 4, 9, 5, 6]
    assert grafted.depth.tolist() == [0, 1, 1, 1, 2, 2]
    assert torch.equal(grafted.mask(), ancestor_mask(grafted.parents, grafted.depth))
    assert torch.equal(grafted.mask(torch.tensor([4]), torch.tensor([0, 3, 4])), torch.tensor([[True, True, True]]))
    with pytest.raises(ValueError, match="parent to come before"):
        tree.graft(torch.tensor([1]), torch.tensor([5]), torch.zeros(1))


def test_a_small_grafted_trees_host_mask_is_the_general_one(monkeypatch):
    """A grafted tree of a few dozen nodes builds its mask from ancestor bits on the host; it equals the
    mask extended level by level from the topology's, on random trees and grafts."""
    import mcsd.core.tree as tree_module
    g = torch.Generator().manual_seed(3)
    topo = TreeTopology.from_spec("3,2,2")
    for trial in range(20):
        tree = DraftTree.root_only(topo, torch.tensor(1))
        if trial % 2:
            tree.append_level(torch.tensor([3, 4, 5]), torch.tensor([0, 0, 0]), torch.zeros(3), topo.child_table[0, :3])
        m = int(torch.randint(1, 40, (1,), generator=g))
        parents = [int(torch.randint(0, tree.size + i, (1,), generator=g)) for i in range(m)]
        tokens = torch.randint(0, 50, (m,), generator=g)
        host = tree.graft(tokens, torch.tensor(parents), torch.zeros(m))
        monkeypatch.setattr(tree_module, "_HOST_MASK_NODES", 0)
        general = tree.graft(tokens, torch.tensor(parents), torch.zeros(m))
        monkeypatch.undo()
        assert host.size <= tree_module._HOST_MASK_NODES
        assert torch.equal(host.mask(), general.mask())
        assert torch.equal(host.mask(), ancestor_mask(host.parents, host.depth))


def test_a_graft_makes_the_trie_nodes_its_choice_reaches_only(monkeypatch):
    """A match's continuation becomes trie nodes only as the graft's best-first choice reaches its
    parent: a graft that its costs stop after a few nodes makes about those, not every match's
    `max_len` tokens."""
    import mcsd.drafting.context as context_module
    made = [0]
    init = context_module._Node.__init__

    def counted(self, token):
        made[0] += 1
        init(self, token)

    monkeypatch.setattr(context_module._Node, "__init__", counted)
    g = torch.Generator().manual_seed(8)
    base = torch.randint(2, 60, (30,), generator=g)
    seq = torch.cat([base, base, base, base[:10]])                 # every suffix matches, 16 tokens on
    ctx = ContextDrafter(sources=("ngram",), min_score=0.0, max_len=16)
    ctx.bind(64, "cpu")
    ctx.reset(seq)

    class Dear:                                                    # a node's verify: a fifth of the round
        def marginal_verify_ms(self, n):
            return 1.0

    graft = ctx.graft(DraftTree.root_only(TreeTopology.from_spec(""), seq[-1]), seq, 1.0, 5.0, costs=Dear())
    grafted = graft.tree.size - 1
    assert 1 <= grafted < 8 and graft.tree.tokens[1:].tolist() == base[10:10 + grafted].tolist()
    assert made[0] <= grafted + 3              # the root, the chosen, the next in line: not 16 a match


def test_candidates_merge_into_existing_nodes_without_duplicate_siblings():
    ctx = ContextDrafter(sources=("ngram",), min_score=0.0)
    ctx.bind(16, "cpu")
    seq = torch.tensor([1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    ctx.reset(seq)
    topo = TreeTopology.from_spec("2")
    tree = DraftTree.root_only(topo, torch.tensor(2))
    tree.append_level(torch.tensor([3, 9]), torch.tensor([0, 0]), torch.zeros(2), topo.child_table[0, :2])
    graft = ctx.graft(tree, seq, expected_tokens=1.0, round_ms=1.0, costs=None)
    t = graft.tree
    for parent in range(t.size):
        kids = t.tokens[t.parents == parent].tolist()
        assert len(kids) == len(set(kids))               # no duplicate siblings anywhere
    # "3" under the root was the model's; the context continued beneath it (4 / 5), not beside it
    assert t.tokens[(t.parents == 1)].tolist() and set(t.tokens[t.parents == 1].tolist()) <= {4, 5}
    assert graft.deterministic.tolist() == [False] * 3 + [True] * (t.size - 3)
    assert 1 in graft.proposed                            # the model node the context also proposed


def test_costs_bound_the_graft():
    ctx = ContextDrafter(sources=("ngram",), min_score=0.0)
    ctx.bind(16, "cpu")
    seq = torch.tensor([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    ctx.reset(seq)
    tree = DraftTree.root_only(TreeTopology.from_spec(""), torch.tensor(3))
    free = ctx.graft(tree, seq, 1.0, 10.0, costs=None).tree.size
    cheap = Costs({1: 10.0, 64: 10.0}, {1: 1.0})
    dear = Costs({1: 10.0, 2: 100.0, 64: 1000.0}, {1: 1.0})
    assert ctx.graft(tree, seq, 1.0, 10.0, costs=cheap).tree.size == free > 1
    assert ctx.graft(tree, seq, 1.0, 10.0, costs=dear).tree.size == 1


def test_a_root_alones_graft_pays_for_the_tree_it_makes():
    """Beneath a root alone, grafting anything turns a plain step into a tree round: with that round's
    own work (`Costs.context_round_ms`) charged, a graft whose nodes each pay their rows but not the
    tree is not chosen, and one that pays for both is chosen whole, as without it."""
    ctx = ContextDrafter(sources=("ngram",), min_score=0.0)
    ctx.bind(16, "cpu")
    seq = torch.tensor([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    ctx.reset(seq)
    costs = Costs({1: 10.0, 2: 10.5, 64: 41.5}, {1: 1.0})        # a row 0.5 ms on a 10 ms step
    free = ctx.choose_under_root(seq, 10.0, costs)
    assert free is not None and len(free[0]) >= 1
    costs.context_round_ms = 10.0 * free[4]                        # the tree's work: what its tokens bring
    assert ctx.choose_under_root(seq, 10.0, costs) is None
    costs.context_round_ms = 0.1
    kept = ctx.choose_under_root(seq, 10.0, costs)
    assert kept is not None and kept[0][:1] == free[0][:1]
    assert ctx.choose_under_root(seq, 10.0, None) is not None      # no costs: nothing priced


def test_a_node_is_priced_at_the_measured_slope_not_at_corrected_whole_rounds():
    """Online corrections that inflate whole rounds (per-round overheads) do not inflate what one
    more context node costs: its marginal verify time is the profile's slope."""
    ctx = ContextDrafter(sources=("ngram",), min_score=0.0)
    ctx.bind(16, "cpu")
    seq = torch.tensor([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    ctx.reset(seq)
    tree = DraftTree.root_only(TreeTopology.from_spec(""), torch.tensor(3))
    shape = {1: 20.0, 2: 24.0, 4: 32.0, 64: 272.0}                   # 4 ms per node
    plain = Costs(shape, {1: 1.0})
    corrected = Costs(shape, {1: 1.0}, online=True)                 # corrections are opt-in
    for n, factor in ((1, 1.2), (2, 1.6), (4, 2.0), (8, 2.4)):       # rounds measured slower, more so for bigger trees
        for _ in range(30):
            corrected.observe("verify", n, corrected.base_verify_ms(n), factor * corrected.base_verify_ms(n))
    assert corrected.verify_ms(4) - corrected.verify_ms(3) > 2 * (plain.verify_ms(4) - plain.verify_ms(3))
    assert corrected.marginal_verify_ms(3) == plain.marginal_verify_ms(3) == pytest.approx(4.0)
    sizes = [ctx.graft(tree, seq, 1.0, 20.0, costs=c).tree.size for c in (plain, corrected)]
    assert sizes[0] == sizes[1] > 1


@pytest.mark.parametrize("max_nodes", [1, 2, 3, 5, 48])
def test_lookups_stopped_at_the_grafts_reach_graft_and_learn_what_full_lookups_do(monkeypatch, max_nodes):
    """Candidates deeper than a round's budget (past the drafted nodes) can be neither grafted nor a drafted
    node's evidence: the lookups stop there, and the grafts, their proposers and what the rates learn
    are the same as with every continuation followed to `max_len`."""
    import mcsd.drafting.context as context_module
    g = torch.Generator().manual_seed(5)
    base = torch.randint(2, 9, (40,), generator=g)
    seq = torch.cat([base, base[:25], base[3:30], base[:12]])           # repeats of several lengths
    topo = TreeTopology.from_spec("2,1")
    drafted = DraftTree.root_only(topo, seq[-1])
    drafted.append_level(base[12:14].clone(), torch.tensor([0, 0]), torch.zeros(2), topo.child_table[0, :2])
    drafted.append_level(base[13:14].clone(), torch.tensor([1]), torch.zeros(1), topo.child_table[1, :1])

    def run(full: bool):
        if full:
            monkeypatch.setattr(context_module, "graft_reach", lambda n, d: 10 ** 6)
        else:
            monkeypatch.undo()
        ctx = ContextDrafter(min_score=0.0, max_nodes=48)
        ctx.bind(16, "cpu")
        ctx.reset(seq)
        out = []
        for tree in (DraftTree.root_only(topo, seq[-1]), drafted):
            graft = ctx.graft(tree, seq, 1.0, 5.0, costs=None, max_nodes=max_nodes)
            ctx.observe(graft, torch.tensor([0, 1, graft.tree.size - 1][:2]))
            out.append((graft.tree.tokens.tolist(), graft.tree.parents.tolist(), graft.tree.logp.tolist(),
                        graft.proposed))
        return out, dict(ctx.rates)

    full, capped = run(True), run(False)
    assert capped == full and len(full[0][1][0]) > 3           # the drafted round grafted beneath its nodes


def test_a_long_match_is_not_diluted_by_short_ones():
    """Siblings are ranked by their longest match: a copy in progress keeps its full estimate even
    when many short matches continue differently, and the runner-ups are priced lower."""
    ctx = ContextDrafter(sources=("ngram",), min_score=0.0, max_len=1)
    ctx.bind(32, "cpu")
    seq = torch.tensor([15, 20, 15, 21, 15, 22, 10, 11, 12, 13, 14, 15, 7, 5, 10, 11, 12, 13, 14, 15])
    ctx.reset(seq)
    tree = DraftTree.root_only(TreeTopology.from_spec(""), torch.tensor(15))
    graft = ctx.graft(tree, seq, 1.0, 1.0, costs=None)
    t, est = graft.tree, graft.tree.logp.exp()
    kids = {int(tok): float(p) for tok, p, par in zip(t.tokens, est, t.parents) if par == 0}
    assert max(kids, key=kids.get) == 7                  # what followed the 6-token match
    assert kids[7] == pytest.approx(ctx._rate(("ngram", 6, 1, 0)))
    assert set(kids) == {7, 20, 21, 22}                  # three unigram matches disagree with it
    assert all(p < kids[7] for tok, p in kids.items() if tok != 7)
    assert [k[3] for k in graft.proposed[int((t.tokens == 7).nonzero())]] == [0]


def test_the_root_alone_is_expected_to_emit_one_token():
    """Context-only rounds price grafted nodes against the root's single token; with a drafted tree
    and no estimate of the policy's own, 1 + what drafted trees got accepted lately (not the round
    totals, which count context acceptances and would make every context node look dearer)."""
    from mcsd.decoding.propose import expected_tokens
    from mcsd.drafting.policies import make_policy
    policy = make_policy("static", "2,1")
    assert expected_tokens(policy, [4, 4, 4], 1) == 1.0
    assert expected_tokens(policy, [1, 0, 2], 3) == 2.0
    assert expected_tokens(policy, [], 3) == 1.0


def test_expected_tokens_of_a_drafted_tree_leave_out_context_acceptances(pair, monkeypatch):
    """In a combined run, the fallback estimate reads the drafted part's acceptances only, one per round
    before it."""
    from mcsd.decoding import propose
    target, draft = pair
    seen, rounds = [], []
    real = propose.expected_tokens
    dec = TreeDecoder(target, [draft, "context"], tree="1,1", policy="static", attention="sdpa", calibrate=False)
    monkeypatch.setattr(propose, "expected_tokens", lambda policy, accepts, size:
                        seen.append((list(accepts), len(rounds))) or real(policy, accepts, size))
    out = dec.generate(REPEATING, max_new_tokens=40, ignore_eos=True,
                       on_round=lambda tree, acc: rounds.append(int(acc.n_accepted)))
    assert max(out.stats.accepted_per_round) > 2           # context branches got more accepted than the chain can
    assert seen and all(0 <= a <= 2 for a in seen[-1][0])  # a 1,1 chain accepts at most its 2 drafted nodes
    assert all(len(accepts) == before for accepts, before in seen)


# ---------------------------------------------------------------------------- exactness, the rule itself

def _tv(counts, probs):
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


@pytest.mark.parametrize("context_tokens", [[4, 0], [2, 5, 1], [5]], ids=["two", "three", "one"])
def test_mixed_drawn_and_deterministic_siblings_follow_p(context_tokens):
    """Drawn children (without replacement from q) then context children (point masses), with the
    duplicates of drawn ones merged away as the trie does: the first token follows p exactly."""
    torch.manual_seed(0)
    vocab, trials, width = 6, 20000, 2
    p = torch.softmax(torch.randn(vocab) * 1.5, 0)
    q = torch.softmax(torch.randn(vocab) * 1.5, 0)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    drafts, _ = sample_without_replacement(q.expand(trials, vocab), width, gen)
    for i in range(trials):
        drawn = drafts[i].tolist()
        extra = [t for t in context_tokens if t not in drawn]
        tokens = torch.tensor([0] + drawn + extra)
        n = tokens.numel()
        parents = torch.tensor([-1] + [0] * (n - 1))
        det = torch.tensor([False] * (1 + width) + [True] * len(extra))
        p_rows = torch.cat([p[None], torch.full((n - 1, vocab), 1.0 / vocab)])
        q_rows = torch.cat([q[None], torch.zeros(n - 1, vocab)])
        acc = accept_sampling(tokens, parents, p_rows, q_rows, gen, deterministic=det)
        first = tokens[acc.path[1]] if acc.n_accepted else acc.next_token
        counts[int(first)] += 1
    noise = float(torch.sqrt(p * (1 - p) / (2 * math.pi * trials)).sum())
    assert _tv(counts, p) < 4 * noise


def test_a_deterministic_child_alone_is_accepted_with_probability_p():
    p = torch.tensor([0.2, 0.5, 0.3])
    gen = torch.Generator().manual_seed(0)
    tokens, parents, det = torch.tensor([0, 1]), torch.tensor([-1, 0]), torch.tensor([False, True])
    hits, emitted = 0, torch.zeros(3)
    for _ in range(6000):
        acc = accept_sampling(tokens, parents, torch.stack([p, p]), torch.zeros(2, 3), gen, deterministic=det)
        hits += acc.n_accepted
        if not acc.n_accepted:
            emitted[int(acc.next_token)] += 1
    assert abs(hits / 6000 - 0.5) < 0.03
    assert emitted[1] == 0                                   # a rejected proposal never comes back as the residual


# ---------------------------------------------------------------------------- exactness, end to end

@pytest.fixture(scope="module")
def pair():
    return tiny_llama(0), tiny_llama(1)


def _reference(target, prompt, n):
    ids = prompt[None]
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, prompt.numel():].tolist()


REPEATING = torch.tensor([5, 9, 13, 2, 7, 30, 5, 9, 13, 2, 7, 31, 5, 9, 13])


@pytest.mark.parametrize("which", ["context", "same+context", "random+context", "learned+context",
                                   "ngram-only", "recycle-only"])
def test_greedy_with_context_equals_plain_greedy(pair, which):
    target, random_draft = pair
    ref = _reference(target, REPEATING, 40)
    ctx = ContextDrafter(sources=("ngram",) if which == "ngram-only" else ("recycle",) if which == "recycle-only"
                         else ("ngram", "recycle"))
    draft = {"context": ctx, "ngram-only": ctx, "recycle-only": ctx, "same+context": [target, ctx],
             "random+context": [random_draft, ctx], "learned+context": [random_draft, ctx]}[which]
    policy = "learned" if which == "learned+context" else "auto" if "+" not in which else "static"
    dec = TreeDecoder(target, draft, tree="2,2,1", policy=policy, attention="sdpa", calibrate=False)
    for _ in range(2):                                    # the second run starts with learned rates and recycled rows
        out = dec.generate(REPEATING, max_new_tokens=40, ignore_eos=True)
        assert out.tokens == ref
    assert out.stats.context_nodes > 0


def test_context_nodes_are_accepted_on_repetitive_text(pair):
    target, _ = pair
    ref = _reference(target, REPEATING, 30)
    prompt = torch.cat([REPEATING, torch.tensor(ref), REPEATING])   # the target's own continuation, in context
    dec = TreeDecoder(target, "context", attention="sdpa", calibrate=False)
    out = dec.generate(prompt, max_new_tokens=30, ignore_eos=True)
    assert out.stats.context_accepted > 10
    assert out.stats.mean_accepted > 1.5


def test_store_source_is_exact_and_used(pair, tmp_path):
    target, _ = pair
    ref = _reference(target, REPEATING, 30)
    path = tmp_path / "outputs.safetensors"
    ContextStore([REPEATING.tolist() + ref], vocab_size=64).save(path)
    ctx = ContextDrafter(sources=("ngram",), store=path)
    dec = TreeDecoder(target, ctx, attention="sdpa", calibrate=False)
    out = dec.generate(REPEATING, max_new_tokens=30, ignore_eos=True)
    assert out.tokens == ref
    assert any(key[0] == "store" for key in ctx.rates)
    assert out.stats.mean_accepted > 2.0                  # the earlier output, found in the store


def test_context_with_a_feature_drafter_is_exact(pair):
    from mcsd.drafting.feature_draft import FeatureDrafter, FeatureHead, FeatureHeadConfig
    target, _ = pair
    torch.manual_seed(3)
    head = FeatureHead(FeatureHeadConfig(target_hidden=32, vocab_size=64, heads=4, kv_heads=2)).eval()
    drafter = FeatureDrafter(head, target)
    ref = _reference(target, REPEATING, 30)
    dec = TreeDecoder(target, [drafter, "context"], tree="2,2", policy="static", attention="sdpa", calibrate=False)
    assert dec.generate(REPEATING, max_new_tokens=30, ignore_eos=True).tokens == ref


V_SMALL = 8


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(10, vocab=V_SMALL, layers=1, sharpness=6.0, hidden=16)
    return target, tiny_llama(11, vocab=V_SMALL, layers=1, sharpness=3.0, hidden=16)


@pytest.mark.parametrize("sampling, with_model", [
    (SamplingConfig(1.0), False),
    (SamplingConfig(1.0), True),
    (SamplingConfig(0.8, top_k=4), True),
], ids=["context-t1", "model+context-t1", "model+context-t0.8-k4"])
def test_sampling_with_context_follows_the_target_distribution(small_pair, sampling, with_model):
    """Chi-square of 1,500 seeded runs' first two tokens against exact enumeration. The prompt
    repeats, so n-gram and recycled proposals appear in the first rounds."""
    target, draft = small_pair
    ctx = ContextDrafter(min_score=0.0)
    dec = TreeDecoder(target, [draft, ctx] if with_model else ctx, tree="2,1", policy="static",
                      attention="sdpa", calibrate=False)
    dec.context_costs = None                              # price nothing: graft every candidate
    original, grafted = dec.generate, []

    def generate(prompt, **kw):
        out = original(prompt, **kw)
        grafted.append(out.stats.context_nodes)
        return out

    dec.generate = generate
    assert_follows_target(dec, target, sampling, n=1500, prompt=(1, 2, 3, 1, 2, 3, 1, 2))
    assert sum(n > 0 for n in grafted) > 500               # most generations verified context nodes


# ---------------------------------------------------------------------------- bad input

def test_bad_combinations_are_refused(pair):
    target, draft = pair
    with pytest.raises(ConfigError, match="at most one context drafter"):
        TreeDecoder(target, ["context", ContextDrafter()], calibrate=False)
    with pytest.raises(ConfigError, match="at most one model drafter"):
        TreeDecoder(target, [draft, draft, "context"], calibrate=False)
    with pytest.raises(ConfigError, match="lossy_target_roots"):
        TreeDecoder(target, [draft, "context"], lossy_target_roots=2, calibrate=False)
    with pytest.raises(ConfigError, match="takes no policy"):
        TreeDecoder(target, "context", policy="heuristic", calibrate=False)
    with pytest.raises(ConfigError, match="needs a store file"):
        ContextDrafter(sources=("ngram", "store"))
    ctx = ContextDrafter(store=ContextStore([[1, 2]], vocab_size=100))
    with pytest.raises(ConfigError, match="vocabulary of 100"):
        TreeDecoder(target, ctx, calibrate=False)


# ---------------------------------------------------------------------------- the command line

def test_cli_context_drafters_match_the_baseline(model_dirs, tmp_path, capsys):
    import json

    from mcsd.cli import main
    target = ["--target", str(model_dirs / "target"), "--dtype", "float32", "--no-calibrate"]
    common = ["--prompt", "w03 w17 w42 w05 w03 w17 w42", "--max-new-tokens", "20", "--json"]
    assert main(target + ["--baseline"] + common) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(target + ["--drafter", "context"] + common) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["tokens"] == base["tokens"]
    assert alone["settings"]["drafter"] == "context" and alone["settings"]["tree"] is None
    store = tmp_path / "store.safetensors"
    ContextStore([base["tokens"]], vocab_size=64).save(store)
    assert main(target + ["--draft", str(model_dirs / "draft"), "--drafter", "model+context",
                          "--context-store", str(store)] + common) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["tokens"] == base["tokens"] and both["settings"]["drafter"] == "model+context"
    assert both["stats"]["context_nodes"] > 0
    assert both["settings"]["context"]["sources"] == ["ngram", "recycle", "store"]
    assert any(k.startswith("store/") for k in both["settings"]["context"]["rates"])


@pytest.mark.parametrize("extra, fragment", [
    (["--drafter", "context", "--draft", "DRAFT"], "uses no draft model"),
    (["--draft", "DRAFT", "--drafter", "model", "--context-store", "STORE"], "--context-store needs a context drafter"),
    (["--drafter", "context", "--context-store", "nope.safetensors"], "no such file"),
    (["--draft", "DRAFT", "--drafter", "model+context", "--lossy-target-roots", "2"], "exact-only"),
    (["--drafter", "oracle"], "invalid choice"),
])
def test_cli_context_mistakes_are_one_line(model_dirs, tmp_path, capsys, extra, fragment):
    from mcsd.cli import main
    store = tmp_path / "s.safetensors"
    ContextStore([[1, 2]], vocab_size=64).save(store)
    extra = [str(model_dirs / "draft") if a == "DRAFT" else str(store) if a == "STORE" else a for a in extra]
    code = main(["--target", str(model_dirs / "target"), "--prompt", "w03"] + extra)
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_build_context_store_tool(model_dirs, tmp_path, capsys):
    import json

    from mcsd.train import context_store as build_context_store

    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text(json.dumps({"tokens": [3, 4, 5]}) + "\n\n" + json.dumps({"text": "w07 w08"}) + "\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("w09 w10 w11")
    store = tmp_path / "store.safetensors"
    target = str(model_dirs / "target")
    assert build_context_store.main([str(outputs), str(notes), "--target", target, "--out", str(store)]) == 0
    assert ContextStore.load(store, 64).documents == [[3, 4, 5], [7, 8], [9, 10, 11]]
    more = tmp_path / "more.safetensors"
    assert build_context_store.main([str(notes), "--target", target, "--append", str(store), "--out", str(more)]) == 0
    assert len(ContextStore.load(more, 64).documents) == 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 999]}\n')
    with pytest.raises(SystemExit, match="outside this tokenizer's vocabulary"):
        build_context_store.main([str(bad), "--target", target, "--out", str(tmp_path / "x.safetensors")])
    bad.write_text('{"words": 1}\n')
    with pytest.raises(SystemExit, match="expected a 'tokens' or 'text' field"):
        build_context_store.main([str(bad), "--target", target, "--out", str(tmp_path / "x.safetensors")])


def test_context_drafting_sits_out_while_it_loses_and_is_tried_again():
    """The context gate: rounds whose grafted nodes are rejected make its value negative, then it
    skips rounds, probing every `CONTEXT_PROBE_EVERY` + 1 (no doubling: only a budget lengthens the
    wait, below); a probe whose node is accepted opens it again."""
    from mcsd.decoding import propose
    from mcsd.drafting.policies import make_policy
    costs = Costs({1: 10.0, 8: 20.0}, {1: 1.0})
    proposer = propose.Proposer(make_policy("static", "1"), None, ContextDrafter(), context_costs=costs)
    assert proposer.context_gate.budget == propose.CONTEXT_BUDGET
    proposer.context_gate.budget = None                                # the probes' own gap alone

    def round_with(grafted: int, accepted: int):
        """One grafting round's outcome: `grafted` context nodes beneath the root, `accepted` of them taken."""
        proposer._value_context(accepted, 1, 1 + grafted)

    schedule = []
    for _ in range(40):
        grafts = proposer.context_gate.opens()
        schedule.append(grafts)
        if grafts:
            round_with(grafted=3, accepted=0)
    assert schedule[0] and proposer.context_value < 0
    gaps = [len(run) for run in "".join("x" if g else "." for g in schedule).split("x")[1:-1]]
    assert len(gaps) >= 5 and set(gaps) == {propose.CONTEXT_PROBE_EVERY}
    while not proposer.context_gate.opens():
        pass
    round_with(grafted=1, accepted=1)                                   # a probe that pays opens the gate
    assert proposer.context_value > 0 and all(proposer.context_gate.opens() for _ in range(5))
    round_with(grafted=3, accepted=0)                                   # one loss is weighed, not decisive
    assert proposer.context_value > 0 and proposer.context_gate.opens()
    proposer.reset()
    assert proposer.context_value == 0 and proposer.context_gate.opens()


def test_lookups_that_find_nothing_move_the_rate_not_what_grafts_are_worth():
    """Between the bursts of a repeated span, lookups that find nothing (a fraction of a step each) leave
    open a gate whose grafts gain: its value is the share of lookups that found a graft times what a
    graft was worth, less the other lookups' price. On text that never repeats, misses alone shut it,
    and then its lookups cost at most the budget's share of the rounds."""
    from mcsd.decoding import propose
    from mcsd.drafting.policies import make_policy
    costs = Costs({1: 10.0, 8: 20.0}, {1: 1.0})
    costs.lookup_ms = 0.05                                              # half a percent of a step
    proposer = propose.Proposer(make_policy("static", "1"), None, ContextDrafter(), context_costs=costs)
    gate = proposer.context_gate
    proposer._value_context(1, 1, 2)                                    # a graft that paid
    paid = gate.graft_value
    assert paid > 0
    for _ in range(20):
        assert gate.opens()
        proposer._value_context(0, 1, 1)                                # nothing found
    assert gate.graft_value == paid and gate.opens()
    assert gate.value == pytest.approx(gate.found * paid - (1 - gate.found) * costs.lookup_ms)
    proposer.reset()                                                    # a text that never repeats
    looked = []
    for _ in range(400):
        looked.append(gate.opens())
        if looked[-1]:
            proposer._value_context(0, 1, 1)
    assert gate.value < 0 and gate.graft_value == 0
    late = looked[-200:]
    assert sum(late) * costs.lookup_ms <= propose.CONTEXT_BUDGET * costs.verify_ms(1) * len(late) + costs.lookup_ms


def test_losing_lookups_cost_at_most_the_context_budget():
    """With its budget, a context gate whose value fell to -L ms waits at least L / (budget x a plain step)
    rounds (up to its longest wait), not the doubling's 3."""
    from mcsd.decoding import propose
    from mcsd.drafting.policies import make_policy
    costs = Costs({1: 10.0, 8: 20.0}, {1: 1.0})
    proposer = propose.Proposer(make_policy("static", "1"), None, ContextDrafter(), context_costs=costs)
    assert proposer.context_gate.opens()
    proposer._value_context(0, 1, 4)                                    # 3 nodes grafted, none taken
    loss = -proposer.context_value
    assert loss == pytest.approx(propose.CONTEXT_MEMORY * (costs.verify_ms(4) - costs.verify_ms(1)))
    waited = 0
    while not proposer.context_gate.opens():
        waited += 1
    assert waited == min(math.ceil(loss / (propose.CONTEXT_BUDGET * costs.verify_ms(1))), propose.CONTEXT_MAX_GAP)
    assert waited > propose.CONTEXT_PROBE_EVERY


# ---------------------------------------------------------------------------- the target's noise, known ahead

def test_a_candidate_given_its_noise_wins_as_often_as_its_probability_on_average():
    """`given_noise(p, g)` is the chance a token of probability p wins the Gumbel-max draw when its own
    noise is g: checked against draws over a whole distribution, and averaging to p over g."""
    from mcsd.drafting.context import given_noise
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    gumbel = -torch.log(-torch.log(torch.rand(200_000, 5, generator=gen)))
    wins = (probs.log() + gumbel).argmax(-1) == 0
    g = gumbel[:, 0]
    for lo, hi in ((-1.0, -0.5), (0.0, 0.5), (1.0, 1.5), (2.5, 3.0)):
        band = (g >= lo) & (g < hi)
        predicted = torch.tensor([given_noise(0.3, float(x)) for x in g[band][:4000]]).mean()
        assert float(wins[band].float().mean()) == pytest.approx(float(predicted), abs=0.02)
    assert sum(given_noise(0.3, float(x)) for x in g[:20_000]) / 20_000 == pytest.approx(0.3, abs=0.01)
    assert given_noise(1.0, -5.0) == 1.0


def test_the_host_noise_is_the_draws_noise():
    from mcsd.core.sampling import PositionNoise
    noise = PositionNoise(123, 1000, "cpu")
    positions, ids = torch.tensor([0, 7, 300]), torch.tensor([0, 5, 999])
    table = noise.gumbel(positions, ids)
    for i, p in enumerate(positions.tolist()):
        for j, t in enumerate(ids.tolist()):
            assert noise.host_gumbel(p, t) == pytest.approx(float(table[i, j]), abs=1e-5)


class _Noise:
    """A stand-in for `PositionNoise` whose every token has noise `g`, recording what it was asked."""

    def __init__(self, g: float):
        self.g, self.asked = g, []

    def host_gumbel(self, position: int, token: int) -> float:
        self.asked.append((position, token))
        return self.g


def test_a_candidates_estimate_reads_the_noise_it_will_be_drawn_with():
    """Sampled, a context candidate that its noise says will win is grafted, one that it says will lose
    is not, and the noise is read at the position the candidate is drawn at (the committed length for
    the root's children, one more a level deeper)."""
    ctx = ContextDrafter(sources=("ngram",), recycle_widths=(), min_score=0.05)
    ctx.bind(16, "cpu")
    seq = torch.tensor([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    ctx.reset(seq)
    costs = Costs({1: 10.0, 2: 11.0, 64: 73.0}, {1: 1.0})          # a row a tenth of a step
    plain = ctx.choose_under_root(seq, 10.0, costs)
    assert plain is not None and plain[0][0] == 4
    high, low = _Noise(4.0), _Noise(-2.0)
    favoured = ctx.choose_under_root(seq, 10.0, costs, noise=high)
    assert favoured is not None and favoured[0][:len(plain[0])] == plain[0] and favoured[4] > plain[4]
    assert ctx.choose_under_root(seq, 10.0, costs, noise=low) is None
    assert high.asked[0] == (seq.numel(), 4) and (seq.numel() + 1, 5) in high.asked


def test_sampled_context_drafting_reads_the_noise_and_keeps_the_seeds_text(pair, monkeypatch):
    """Sampled with a seed, context drafting that chooses its candidates by the target's noise emits the
    plain loop's text for that seed."""
    from mcsd.core.sampling import PositionNoise
    target, _ = pair
    asked = []
    original = PositionNoise.host_gumbel
    monkeypatch.setattr(PositionNoise, "host_gumbel", lambda self, p, t: (asked.append(p), original(self, p, t))[1])
    ref = _reference(target, REPEATING, 30)
    prompt = torch.cat([REPEATING, torch.tensor(ref), REPEATING])
    dec = TreeDecoder(target, "context", attention="sdpa", calibrate=False)
    for seed in range(3):
        plain = dec.generate_baseline(prompt, max_new_tokens=30, temperature=0.8, seed=seed, ignore_eos=True)
        out = dec.generate(prompt, max_new_tokens=30, temperature=0.8, seed=seed, ignore_eos=True)
        assert out.tokens == plain.tokens
    assert asked and out.stats.context_nodes > 0                   # the choice read the noise, and grafted
