"""The tree round in fixed shapes (`mcsd.decoding.fixed_round`): the same path as the loop's acceptance,
greedy output equal to `generate`, sampled output following the target, and at most one host read a
round (counted on the CPU at the dispatcher, `host_reads`; on CUDA by torch's sync debug mode)."""

import host_reads
import pytest
import torch
from conftest import FIXED_DRAFT_MS, FIXED_VERIFY_MS, assert_follows_target, pooled_chi_square_p, tiny_llama
from test_feature_draft import random_head, random_v2_head
from host_reads import counting_host_reads, cuda_operators
from test_learned_policy import constant_model, q_threshold_model

from mcsd import TreeDecoder
from mcsd.config import ConfigError, SamplingConfig
from mcsd.core.sampling import PositionNoise
from mcsd.core.static_tree import StaticTree, accept_paths, emitted_tokens, level_children
from mcsd.core.tree import TreeTopology
from mcsd.core.verify import accept_greedy
from mcsd.costs.cost_model import Costs
from mcsd.decoding import fixed_round
from mcsd.drafting.context import ContextDrafter
from mcsd.drafting.feature_draft import FeatureDrafter
from mcsd.drafting.policies.acceptance import FORMAT, FORMAT_VERSION, AcceptanceModel
from mcsd.drafting.policies.learned import LearnedPolicy, choose_best_first
from mcsd.forward.static_cache import StaticCache

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])


@pytest.fixture(autouse=True)
def torch_operators():
    """The CPU runs the torch operators CUDA runs (mcsd's native paths off), and the dispatcher-level
    counter (`host_reads`) sees what they read."""
    with cuda_operators():
        yield


def reads_per_round(decoder, prompt, **options) -> tuple[list[list[str]], list[int]]:
    """The host reads of each round of one generation (the set-up and prefill not counted), and its tokens."""
    _, rounds, tokens = host_reads.reads_per_round(decoder, prompt, **options)
    return rounds, tokens


def fixed_decoder(target, head, spec="4,2,2", **kw):
    return TreeDecoder(target, FeatureDrafter(head, target), tree=spec, policy="static", attention="sdpa",
                       calibrate=False, round="fixed", **kw)


@pytest.fixture(scope="module")
def hf_greedy(target):
    """`generate`'s own greedy tokens after PROMPT."""
    with torch.no_grad():
        out = target.generate(PROMPT[None], attention_mask=torch.ones(1, PROMPT.numel(), dtype=torch.long),
                              max_new_tokens=60, do_sample=False, pad_token_id=0)
    return out[0, PROMPT.numel():].tolist()


# ---------------------------------------------------------------------------- the tensor helpers

@pytest.mark.parametrize("spec", ["1", "1,1,1", "4,2,2", "3,2,2,1", [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]])
def test_accept_paths_is_the_loops_greedy_acceptance(spec):
    """On random tokens and draws (made to match often), the same path, count and next token."""
    topo = TreeTopology.from_spec(spec)
    tree = StaticTree.of(topo)
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        tokens = torch.randint(0, 4, (topo.size,), generator=g)
        draws = torch.randint(0, 4, (topo.size,), generator=g)
        limit = None if trial % 3 else int(torch.randint(0, topo.max_depth + 1, (1,), generator=g))
        kept = topo.depth <= (topo.max_depth if limit is None else limit)
        ids = kept.nonzero().squeeze(1)
        acc = accept_greedy(tokens[ids], topo.parents[ids], topo.depth[ids], topo.mask[ids][:, ids], draws[ids])
        n, path, next_token = accept_paths(tree, tokens, draws, depth_limit=limit)
        assert int(n) == acc.n_accepted
        assert torch.equal(ids[acc.path], path[:int(n) + 1])
        assert int(next_token) == int(acc.next_token)
        assert (path[int(n) + 1:] == path[int(n)]).all()


def test_invalid_candidates_are_never_accepted():
    tree = StaticTree.of(TreeTopology.from_spec("2,1"))          # root, a, b, a0, b0
    tokens, draws = torch.tensor([9, 1, 2, 3, 4]), torch.tensor([1, 3, 0, 7, 7])
    n, path, _ = accept_paths(tree, tokens, draws)
    assert int(n) == 2 and path.tolist() == [0, 1, 3]
    n, path, next_token = accept_paths(tree, tokens, draws, valid=torch.tensor([True, True, True, False, True]))
    assert int(n) == 1 and path.tolist() == [0, 1, 1] and int(next_token) == 3
    assert emitted_tokens(tokens, path, n, next_token).tolist() == [1, 1, 3, 3]


def test_level_children_take_each_parents_ranks():
    keys = torch.tensor([[0.1, 0.5, 0.3, float("-inf")], [0.9, float("-inf"), float("-inf"), float("-inf")]])
    tokens, valid = level_children(keys, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1]), 2)
    assert tokens[:3].tolist() == [1, 2, 0] and valid.tolist() == [True, True, True, False]
    ids = torch.tensor([10, 11, 12, 13])
    assert level_children(keys, torch.tensor([0]), torch.tensor([1]), 2, ids)[0].tolist() == [12]


def test_device_keys_are_the_position_keys():
    noise = PositionNoise(123456789, 64, "cpu")
    positions = torch.tensor([0, 1, 7, 300, 10**6])
    assert torch.equal(noise.device_keys(positions), noise.position_keys(positions))
    for p in positions.tolist():                        # one position's key from a host int, as the step draws
        assert torch.equal(noise.key_at(p, "cpu"), noise.position_keys(torch.tensor([p])))


def test_commit_rows_keeps_what_commit_keeps():
    a, b = (StaticCache(2, 1, 4, torch.float32, "cpu") for _ in range(2))
    for cache in (a, b):
        cache.reserve(20)
        torch.manual_seed(0)
        cache.keys.copy_(torch.randn_like(cache.keys))
        cache.values.copy_(torch.randn_like(cache.values))
        cache.length = 12
    a.commit(5, torch.tensor([0, 2, 5]))
    b.commit_rows(5, torch.tensor([0, 2, 5, 5]), 3)
    assert a.length == b.length == 8
    assert torch.equal(a.keys[:, :, :, :8], b.keys[:, :, :, :8])
    assert torch.equal(a.values[:, :, :, :8], b.values[:, :, :, :8])


def test_the_counter_sees_reads_inside_operators():
    """Every way a value reaches the host is seen at the dispatcher, however it is spelt (the Python-level
    count of `item`, `tolist` and the like missed 0-dim tensor indices and uploaded scalars: 7 synchronisations
    a round on CUDA where it counted 1); pure tensor work reads nothing."""
    x, mask = torch.arange(6), torch.tensor([True, False] * 3)
    with torch.inference_mode():
        best = x.argmax()
    reads = {
        "item": [lambda: x[best], lambda: x[:best], lambda: int(best), lambda: x.max().item(),
                 lambda: bool(x.any()), lambda: x.any() and None],
        "boolean index": [lambda: x[mask], lambda: x.clone().__setitem__(mask, x[:3])],
        "nonzero": [lambda: x.nonzero(), lambda: torch.where(mask)],
        "masked_select": [lambda: x.masked_select(mask)],
        "equal": [lambda: torch.equal(x, x)],
        "upload": [lambda: torch.tensor([1, 2]), lambda: x.clone().__setitem__(x[:2], 0), lambda: x[[0, 1]]],
        "tolist": [lambda: x.tolist()],
        "cpu": [lambda: x.cpu()],
        "unique": [lambda: x.unique()],
    }
    for name, ways in reads.items():
        for way in ways:
            for inference in (False, True):
                with torch.inference_mode(inference), counting_host_reads() as seen:
                    way()
                assert name in seen, (name, seen)
    with counting_host_reads() as seen:
        y = x.clone()
        y[2:].fill_(0)
        y.index_select(0, best.reshape(1))
        torch.where(mask, x, 0).argmax().reshape(1) + 1
        y.diagonal() if y.dim() == 2 else y.topk(2)
    assert seen == []


def test_accept_paths_reads_nothing():
    tree = StaticTree.of(TreeTopology.from_spec("4,2,2"))
    g = torch.Generator().manual_seed(1)
    tokens, draws = torch.randint(0, 3, (tree.size,), generator=g), torch.randint(0, 3, (tree.size,), generator=g)
    for inference in (False, True):
        with torch.inference_mode(inference), counting_host_reads() as seen:
            n, path, next_token = accept_paths(tree, tokens, draws, torch.ones(tree.size, dtype=torch.bool), 2)
            emitted_tokens(tokens, path, n, next_token)
        assert seen == []


# ---------------------------------------------------------------------------- the round

@pytest.mark.parametrize("spec", ["1,1,1", "4,2,2", "3,2,2,1"])
@pytest.mark.parametrize("sub_vocab", [0, 24])
def test_greedy_fixed_round_equals_generate(target, hf_greedy, spec, sub_vocab):
    """float32 greedy output token-identical to `generate`, and the same acceptances as the loop's."""
    out = fixed_decoder(target, random_head(target, sub_vocab), spec).generate(PROMPT, max_new_tokens=60)
    assert out.tokens == hf_greedy
    loop = TreeDecoder(target, FeatureDrafter(random_head(target, sub_vocab), target), tree=spec, policy="static",
                       attention="sdpa", calibrate=False, round="loop").generate(PROMPT, max_new_tokens=60)
    assert out.stats.accepted_per_round == loop.stats.accepted_per_round
    assert out.stats.draft_forwards > 0


def test_v2_head_and_a_short_window(target, hf_greedy):
    head = random_v2_head(target, (1, -1), sub_vocab=24)
    dec = TreeDecoder(target, FeatureDrafter(head, target, window=3), tree="3,2,1", policy="static",
                      attention="sdpa", calibrate=False, round="fixed")
    assert dec.generate(PROMPT, max_new_tokens=60).tokens == hf_greedy


@pytest.mark.parametrize("options", [dict(temperature=0.8, seed=3), dict(temperature=0.8, top_p=0.9, seed=4),
                                     dict(temperature=1.0, top_k=5, seed=5)])
def test_sampled_text_is_the_loops_for_a_seed(target, options):
    """A sampled token is the target's own seeded draw at its position: the loop's text, and here (the
    same static trees) its acceptances too."""
    fixed = fixed_decoder(target, random_head(target, 24)).generate(PROMPT, max_new_tokens=40, **options)
    loop = TreeDecoder(target, FeatureDrafter(random_head(target, 24), target), tree="4,2,2", policy="static",
                       attention="sdpa", calibrate=False, round="loop").generate(PROMPT, max_new_tokens=40, **options)
    assert fixed.tokens == loop.tokens
    assert fixed.stats.accepted_per_round == loop.stats.accepted_per_round


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.7, top_k=5), SamplingConfig(1.3, top_p=0.8)],
                         ids=["t1", "t0.7-k5", "t1.3-p0.8"])
def test_sampling_follows_the_target_distribution(sampling):
    """Chi-square goodness of fit of 1,200 seeded runs' first two tokens against exact enumeration."""
    small = tiny_llama(10, vocab=8, layers=1, sharpness=6.0, hidden=16)
    dec = fixed_decoder(small, random_head(small, sub_vocab=5, seed=2), "3,2")
    assert_follows_target(dec, small, sampling, n=1200)


@pytest.mark.parametrize("options", [{}, dict(temperature=0.8, seed=3), dict(temperature=0.9, top_p=0.9, seed=1)],
                         ids=["greedy", "t0.8", "t0.9-p0.9"])
def test_at_most_one_host_read_a_round(target, hf_greedy, options):
    """Every round reads one tensor on the host (the emitted tokens), and nothing else."""
    dec = fixed_decoder(target, random_head(target, 24))
    rounds, tokens = reads_per_round(dec, PROMPT, max_new_tokens=60, **options)
    assert len(rounds) > 10
    assert all(len(seen) <= 1 for seen in rounds), [seen for seen in rounds if len(seen) > 1][:3]
    assert sum(map(len, rounds)) >= len(rounds) - 1           # the count is read (the last call: the output)
    if not options:
        assert tokens == hf_greedy


def test_the_loop_reads_more_and_the_counter_sees_it(target):
    """The counter is not blind: the loop's rounds read the host several times each."""
    dec = TreeDecoder(target, FeatureDrafter(random_head(target), target), tree="4,2,2", policy="static",
                      attention="sdpa", calibrate=False, round="loop")
    rounds, _ = reads_per_round(dec, PROMPT, max_new_tokens=20)
    assert max(map(len, rounds)) > 1


# ---------------------------------------------------------------------------- the learned policy

# a logistic model over several features, so that trees are pruned, stop early and are gated
MIXED = AcceptanceModel({"format": FORMAT, "version": FORMAT_VERSION, "kind": "logistic",
                         "features": ["q_rank", "top1", "depth", "recent_accept", "path_logp"],
                         "mean": [0.1, 0.2, 2.0, 0.3, -3.0], "scale": [0.1, 0.1, 1.0, 0.2, 2.0],
                         "coef": [1.5, 0.5, -0.4, 1.0, 0.6], "intercept": 0.5})
MODELS = {"mixed": MIXED, "q-threshold": q_threshold_model(0.05), "constant": constant_model(0.5)}


def learned(spec="4,2,2", model="mixed"):
    """The learned policy on the test profile's fixed costs (`conftest.fixed_measure`'s)."""
    costs = Costs({n: FIXED_VERIFY_MS(n) for n in (1, 8, 16, 32, 64)}, {w: FIXED_DRAFT_MS(w) for w in (1, 8, 32)})
    return LearnedPolicy(TreeTopology.from_spec(spec), model=MODELS[model], costs=costs)


def learned_decoder(target, head, round, spec="4,2,2", model="mixed"):
    return TreeDecoder(target, FeatureDrafter(head, target), policy=learned(spec, model), attention="sdpa",
                       calibrate=False, round=round)


@pytest.fixture
def fixed_rounds(monkeypatch):
    """The `FixedRound` of each generation, as `fixed_round.choose` makes it."""
    made = []

    def choose(*args, **kwargs):
        made.append(fixed_round.choose.__wrapped__(*args, **kwargs))
        return made[-1]
    choose.__wrapped__ = fixed_round.choose
    monkeypatch.setattr(fixed_round, "choose", choose)
    return made


def test_best_first_choice_on_the_device_is_the_policys():
    """`choose_best_first` (tensors) takes the same children as `LearnedPolicy._choose` (host floats),
    ties and zeros included."""
    policy = learned()
    table = torch.tensor([policy.costs.verify_ms(n) for n in range(40)], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for trial in range(500):
        f, k = (int(torch.randint(1, 6, (1,), generator=g)) for _ in range(2))
        path = torch.rand(f, k, generator=g) ** 3
        path[torch.rand(f, k, generator=g) < 0.3] = 0
        if trial % 5 == 0:
            path[:] = path[0, 0]                                  # all tied
        n_now = int(torch.randint(1, 20, (1,), generator=g))
        policy._path_pred = torch.rand(n_now, generator=g).tolist()
        policy._draft_ms = 2.2 + float(torch.rand(1, generator=g))
        time_ms = torch.tensor(policy._draft_ms, dtype=torch.float64) + table[n_now]
        tokens = torch.tensor(sum(policy._path_pred), dtype=torch.float64)
        on_device = choose_best_first(path, tokens, time_ms, torch.tensor(n_now), table)
        assert on_device.tolist() == policy._choose(path.tolist(), n_now)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("spec, sub_vocab", [("4,2,2", 0), ("3,2,2,1,1", 24)])
@pytest.mark.parametrize("options", [{}, dict(temperature=0.8, seed=3)], ids=["greedy", "t0.8"])
def test_learned_decisions_are_the_loops(target, hf_greedy, fixed_rounds, model, spec, sub_vocab, options):
    """Round by round, the fixed round keeps the nodes the loop's learned policy grows (the gate's
    plain rounds included), on the test profile's fixed costs; the output is the loop's, and greedy
    `generate`'s."""
    trees = []
    loop = learned_decoder(target, random_head(target, sub_vocab), "loop", spec, model)
    loop.policy.leave_unpaying = False          # the loop's own test after the first level (a host decision)
    loop = loop.generate(
        PROMPT, max_new_tokens=60, on_round=lambda tree, acc: trees.append(sorted(tree.topo_ids.tolist())),
        **options)
    stream = learned_decoder(target, random_head(target, sub_vocab), "fixed", spec, model).stream(
        PROMPT, max_new_tokens=60, **options)
    tokens, kept = list(next(stream)), []
    for new in stream:
        tokens += new
        kept.append(fixed_rounds[-1].kept)
    assert kept == trees
    assert tokens == loop.tokens
    if not options:
        assert tokens == hf_greedy
    assert len(trees) > 10


def test_learned_trees_vary_in_the_decision_test(target):
    """The decision test is not vacuous: pruned trees, whole ones and the gate's plain rounds all occur."""
    sizes, whole = set(), {TreeTopology.from_spec(spec).size for spec in ("4,2,2", "3,2,2,1,1")}
    for model in MODELS:
        for spec, sub_vocab in (("4,2,2", 0), ("3,2,2,1,1", 24)):
            for options in ({}, dict(temperature=0.8, seed=3)):
                dec = learned_decoder(target, random_head(target, sub_vocab), "loop", spec, model)
                dec.generate(PROMPT, max_new_tokens=60, on_round=lambda tree, acc: sizes.add(tree.size), **options)
    assert 1 in sizes and len(sizes - whole - {1}) >= 3


@pytest.mark.parametrize("options", [{}, dict(temperature=0.8, seed=3)], ids=["greedy", "t0.8"])
def test_learned_rounds_read_the_host_once(target, hf_greedy, options):
    """The learned policy's rounds, plain ones included, read one tensor on the host each."""
    dec = learned_decoder(target, random_head(target, 24), "fixed", "3,2,2,1,1", "constant")
    rounds, tokens = reads_per_round(dec, PROMPT, max_new_tokens=60, **options)
    assert len(rounds) > 10
    assert all(len(seen) <= 1 for seen in rounds), [seen for seen in rounds if len(seen) > 1][:3]
    if not options:
        assert tokens == hf_greedy


def test_learned_sampling_follows_the_target_distribution():
    small = tiny_llama(10, vocab=8, layers=1, sharpness=6.0, hidden=16)
    dec = learned_decoder(small, random_head(small, sub_vocab=5, seed=2), "fixed", "3,2", "constant")
    assert assert_follows_target(dec, small, SamplingConfig(0.9, top_k=6), n=1200) > 0    # drafts were accepted


@pytest.mark.parametrize("spec, policy, context, reason", [
    ("3,2,2,1,1", "learned", False, None),
    (None, "learned", False, None),                       # its own 281-node topology, cut to 64
    (None, "learned", True, None),                        # the command line's default
    ("8,4,2", "static", False, "more than 64 nodes"),
    ("4,2,2,2", "static", True, "more than 48 nodes (with 16 context slots)"),
])
def test_auto_takes_the_fixed_round_where_the_tree_fits(target, spec, policy, context, reason):
    """What round="auto" runs in fixed shapes on CUDA: the learned policy on any topology (one past the
    largest bucket drafted as its likeliest nodes), context drafting beside it; a static tree as it is,
    where it fits."""
    from mcsd.core import processors
    from mcsd.decoding.propose import Proposer
    head = FeatureDrafter(random_head(target), target)
    dec = TreeDecoder(target, [head, "context"] if context else head, tree=spec, policy=policy, attention="sdpa",
                      calibrate=False)
    assert dec.round == "auto"
    dec.target.reset()
    proposer = Proposer(dec.policy, dec.drafter, dec.context, 0, dec.context_costs)
    got = fixed_round.unavailable(dec, processors.request(target, PROMPT.numel()), proposer)
    assert got == reason if reason is None else reason in got, got


def test_a_learned_topology_past_the_bucket_keeps_its_likeliest_nodes():
    """The learned policy's default topology (281 nodes) cut to 48: a closed subtree of it (every kept
    node's parent kept, ranks as they were), its deepest chain kept whole, wider near the root."""
    topology = TreeTopology.from_spec(LearnedPolicy.default_tree)
    cut = fixed_round.drafted_topology(topology, learned=True, slots=16)
    assert topology.size == 281 and cut.size == 48
    kept = set(cut.paths)
    assert all(p[:-1] in kept or len(p) == 1 for p in kept) and kept <= set(topology.paths)
    assert cut.max_depth == topology.max_depth and (0,) * topology.max_depth in kept
    assert fixed_round.drafted_topology(topology, learned=False, slots=16) is topology
    small = TreeTopology.from_spec("3,2,2,1,1")
    assert fixed_round.drafted_topology(small, learned=True, slots=16) is small


def test_online_costs_run_on_the_loop(target):
    policy = learned()
    policy.costs.online = True
    dec = TreeDecoder(target, FeatureDrafter(random_head(target), target), policy=policy, attention="sdpa",
                      calibrate=False, round="fixed")
    with pytest.raises(ConfigError, match="online_costs"):
        dec.generate(PROMPT, max_new_tokens=5)


@pytest.mark.parametrize("spec, draft_vocab", [("4,2,2", 0), ("3,2,2,1", 24)])
def test_an_eagle3_head_runs_the_fixed_round(spec, draft_vocab):
    """An EAGLE-3 head steps over its static cache on its own layer code: the fixed round takes it, greedy
    float32 equal to `generate`, seeded text and acceptances equal to the loop's, one read a round."""
    from test_eagle3 import random_eagle3

    from mcsd.drafting.eagle3 import Eagle3Drafter
    deep = tiny_llama(4, layers=4)
    head = random_eagle3(deep, draft_vocab=draft_vocab)

    def decoder(round):
        return TreeDecoder(deep, Eagle3Drafter(head, deep), tree=spec, policy="static", attention="sdpa",
                           calibrate=False, round=round)
    fixed = decoder("fixed")
    _, rounds, tokens = host_reads.reads_per_round(fixed, PROMPT, max_new_tokens=48)
    assert tokens == generate_greedy(deep, PROMPT, 48)
    assert len(rounds) > 5 and max(map(len, rounds)) <= 1
    options = dict(temperature=0.8, seed=4)
    got, want = fixed.generate(PROMPT, max_new_tokens=40, **options), decoder("loop").generate(
        PROMPT, max_new_tokens=40, **options)
    assert got.tokens == want.tokens and got.stats.accepted_per_round == want.stats.accepted_per_round
    assert got.stats.round == "fixed" and got.stats.draft_forwards > 0


# ---------------------------------------------------------------------------- the command line's default

REPEATS = torch.tensor([3, 17, 42, 5, 9, 11, 3, 17, 42, 5, 9])      # a prompt context drafting finds matches in


def default_decoder(target, head, round, spec=None, model="mixed", **context):
    """The command line's default configuration: the feature head, context drafting grafted in, the learned
    policy (its own 281-node topology unless `spec`), on the test profile's fixed costs."""
    policy = learned(spec or LearnedPolicy.default_tree, model)
    return TreeDecoder(target, [FeatureDrafter(head, target), ContextDrafter(**context)], policy=policy,
                       attention="sdpa", calibrate=False, round=round)


def generate_greedy(model, prompt, n=60):
    prompt = prompt.to(model.device)
    with torch.no_grad():
        out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, prompt.numel():].tolist()


@pytest.mark.parametrize("spec, sub_vocab", [(None, 0), (None, 24), ("3,2,2,1,1", 24)])
def test_the_default_configuration_greedy_is_generates(target, spec, sub_vocab):
    """float32 greedy output of the command line's default in the fixed round equals the loop's and
    `generate`'s; grafted context nodes are accepted, beyond depth 1 too."""
    want = generate_greedy(target, REPEATS)
    fixed = default_decoder(target, random_head(target, sub_vocab), "fixed", spec).generate(REPEATS, max_new_tokens=60)
    loop = default_decoder(target, random_head(target, sub_vocab), "loop", spec).generate(REPEATS, max_new_tokens=60)
    assert fixed.tokens == want and loop.tokens == want
    assert fixed.stats.round == "fixed" and "16 context slots" in fixed.stats.round_reason
    assert ("281-node topology drafted as its 48 likeliest nodes" in fixed.stats.round_reason) == (spec is None)
    assert fixed.stats.context_accepted > 0 and max(fixed.stats.accepted_per_round) >= 2
    assert fixed.stats.rounds < len(want)


def test_context_paths_as_deep_as_the_recycled_levels(target):
    """Short continuations (`max_len` 2) under a shallow drafted tree: the slots' paths are as deep as the
    recycled predictions' four levels reach, and the output is still `generate`'s."""
    dec = default_decoder(target, random_head(target, 24), "fixed", "2", max_len=2)
    assert dec.generate(REPEATS, max_new_tokens=40).tokens == generate_greedy(target, REPEATS, 40)
    assert dec.fixed_round.slots.width == 4 and dec.fixed_round.tree.max_depth == 1


@pytest.mark.parametrize("options", [dict(temperature=0.8, seed=3), dict(temperature=0.9, top_p=0.9, seed=1),
                                     dict(temperature=1.0, top_k=5, seed=5)])
def test_the_default_configuration_seeded_text_is_the_loops(target, options):
    """A sampled token is the target's own seeded draw at its position: the loop's text for a seed,
    whatever either tree held."""
    fixed = default_decoder(target, random_head(target, 24), "fixed").generate(REPEATS, max_new_tokens=60, **options)
    loop = default_decoder(target, random_head(target, 24), "loop").generate(REPEATS, max_new_tokens=60, **options)
    assert fixed.tokens == loop.tokens


@pytest.mark.parametrize("options", [{}, dict(temperature=0.8, seed=3), dict(temperature=0.9, top_p=0.9, seed=1)],
                         ids=["greedy", "t0.8", "t0.9-p0.9"])
def test_the_default_configuration_reads_the_host_once_a_round(target, options):
    """Context drafting's lookups run on the host from what the round's one read returned (the emitted
    tokens, the accepted path, the target's top-k along it): still one read a round, counted at the
    dispatcher; a second generation builds no block again."""
    dec = default_decoder(target, random_head(target, 24), "fixed")
    _, rounds, tokens = host_reads.reads_per_round(dec, REPEATS, max_new_tokens=60, **options)
    assert len(rounds) > 5 and all(len(seen) <= 1 for seen in rounds), [r for r in rounds if len(r) > 1][:3]
    if not options:
        assert tokens == generate_greedy(target, REPEATS)
    built = dec.fixed_round.blocks.built, dec.target.blocks.built
    again = host_reads.reads_per_round(dec, REPEATS, max_new_tokens=60, **options)
    assert again[2] == tokens and (dec.fixed_round.blocks.built, dec.target.blocks.built) == built
    assert all(len(seen) <= 1 for seen in again[1])


def exact_three_token_probs(model, prompt, sampling, vocab):
    """P(the first three new tokens = (a, b, c)) under plain sampling from `model`: (vocab ** 3,)."""
    from mcsd.core.sampling import logits_to_probs
    with torch.no_grad():
        p0 = logits_to_probs(model(prompt[None]).logits[0, -1], sampling)                         # (V,)
        two = torch.stack([torch.cat([prompt, torch.tensor([a])]) for a in range(vocab)])
        p1 = logits_to_probs(model(two).logits[:, -1], sampling)                                   # (V, V)
        three = torch.stack([torch.cat([prompt, torch.tensor([a, b])]) for a in range(vocab) for b in range(vocab)])
        p2 = logits_to_probs(model(three).logits[:, -1], sampling).reshape(vocab, vocab, vocab)
    return (p0[:, None, None] * p1[:, :, None] * p2).flatten()


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_p=0.9)], ids=["t1", "t0.8-p0.9"])
def test_the_default_configuration_follows_the_target_beyond_depth_one(sampling):
    """Chi-square goodness of fit of 1,500 seeded runs' first three tokens against exact enumeration,
    where the second and third are often drafted and accepted in the first round (context nodes at
    depths 1 and 2 and the head's): a bias at depth 2 would show."""
    small = tiny_llama(10, vocab=8, layers=1, sharpness=25.0, hidden=16)
    prompt = torch.tensor([1, 2, 3, *generate_greedy(small, torch.tensor([1, 2, 3]), 8), 1, 2, 3])   # it repeats
    dec = default_decoder(small, random_head(small, sub_vocab=5, seed=2), "fixed", model="constant")
    exact = exact_three_token_probs(small, prompt, sampling, 8)
    counts, deep, n = torch.zeros(8 ** 3), 0, 1500
    for seed in range(n):
        out = dec.generate(prompt, max_new_tokens=4, temperature=sampling.temperature, top_p=sampling.top_p,
                           seed=seed)
        a, b, c = out.tokens[:3]
        counts[(a * 8 + b) * 8 + c] += 1
        deep += out.stats.accepted_per_round[0] >= 2            # the third token drafted at depth 2, accepted
    assert counts[exact == 0].sum() == 0
    assert deep >= 100, deep
    p = pooled_chi_square_p(counts, exact, n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


# ---------------------------------------------------------------------------- kept per decoder

@pytest.mark.parametrize("policy", ["static", "learned"])
def test_two_generations_build_the_blocks_once(target, hf_greedy, policy):
    """The decoder keeps its fixed round: a second generation builds no bucket of the head's or the
    target's again (on CUDA: captures no graph again), and a generation's set-up reads nothing but the
    prompt's check and the first token, sampled or not."""
    dec = (fixed_decoder(target, random_head(target, 24)) if policy == "static"
           else learned_decoder(target, random_head(target, 24), "fixed", "3,2,2,1,1", "constant"))
    assert dec.generate(PROMPT, max_new_tokens=60).tokens == hf_greedy
    kept, head, blocks = dec.fixed_round, dec.fixed_round.blocks, dec.target.blocks
    built = head.built, blocks.built
    assert min(built) > 1
    setup, rounds, tokens = host_reads.reads_per_round(dec, PROMPT, max_new_tokens=60)
    assert tokens == hf_greedy
    assert dec.fixed_round is kept and kept.blocks is head and dec.target.blocks is blocks
    assert (head.built, blocks.built) == built
    for options in ({}, dict(temperature=0.8, seed=2)):
        setup, rounds, _ = host_reads.reads_per_round(dec, PROMPT[1:], max_new_tokens=60, **options)
        assert sorted(setup) == ["item", "item", "item"], setup     # the prompt's min and max, the first token
        assert len(rounds) > 5 and max(map(len, rounds)) <= 1
        assert dec.fixed_round is kept


def test_two_requests_to_the_server_build_the_blocks_once(target, hf_greedy):
    """The server's engine keeps one decoder: its second request builds no bucket again (on CUDA: captures
    nothing), and both answers are `generate`'s."""
    import asyncio
    import time

    from mcsd.serve.engine import Engine, Job, Run
    engine = Engine(lambda: default_decoder(target, random_head(target, 24), "fixed"), max_queue=2)
    engine.start()

    async def ask(prompt):
        job = Job([Run(prompt.tolist(), dict(max_new_tokens=60))], asyncio.get_running_loop(), time.monotonic(), 300)
        engine.submit(job)
        while True:
            event = await job.events.get()
            if event[0] == "done":
                out = event[2]
            elif event[0] == "end":
                return out
            elif event[0] != "tokens":
                raise AssertionError(event)
    try:
        first = asyncio.run(ask(REPEATS))
        kept = engine.decoder.fixed_round
        built = kept.blocks.built, engine.decoder.target.blocks.built
        second = asyncio.run(ask(REPEATS))
    finally:
        engine.stop(60)
    assert first.tokens == second.tokens == generate_greedy(target, REPEATS)
    assert second.stats.round == "fixed" and engine.decoder.fixed_round is kept
    assert (kept.blocks.built, engine.decoder.target.blocks.built) == built and min(built) > 1


def test_the_loop_after_the_fixed_round_runs_unpadded(target):
    """The fixed round pads the target's blocks while it runs; a generation on the loop runs them as
    before it (on a CPU: at their own shapes), and its stats say which round ran and why."""
    dec = fixed_decoder(target, random_head(target, 24))
    assert dec.target.static_blocks is None
    out = dec.generate(PROMPT, max_new_tokens=20)
    assert dec.target.blocks is not None and (out.stats.round, out.stats.round_reason) == ("fixed", "round='fixed'")
    dec.round = "auto"
    out = dec.generate(PROMPT, max_new_tokens=20)
    assert dec.target.static_blocks is None and dec.target.blocks is None
    assert out.stats.round == "loop" and "CPU" in out.stats.round_reason
    assert out.stats.as_dict()["round"] == "loop"


def test_a_failed_graph_falls_back_to_the_loop(target, hf_greedy, monkeypatch):
    """A head graph that cannot be captured: one warning, the generation finishes eagerly (the same
    tokens), and round="auto" runs the loop for that decoder from then on, saying why."""
    class Capturing(fixed_round.HeadBlocks):          # as on CUDA
        def __init__(self, drafter, capture):
            super().__init__(drafter, True)

    def broken(run):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fixed_round, "HeadBlocks", Capturing)
    monkeypatch.setattr(fixed_round.graphs, "capture_graph", broken)
    monkeypatch.setattr(fixed_round, "AUTO_DEVICES", ("cuda", "cpu"))       # auto as on CUDA
    dec = TreeDecoder(target, FeatureDrafter(random_head(target, 24), target), tree="4,2,2", policy="static",
                      attention="sdpa", calibrate=False)
    with pytest.warns(RuntimeWarning, match="the next ones run the loop") as caught:
        out = dec.generate(PROMPT, max_new_tokens=60)
    assert len([w for w in caught if "feature head" in str(w.message)]) == 1
    assert out.tokens == hf_greedy and out.stats.round == "fixed"
    assert "stream is capturing" in dec.fixed_round.failure
    out = dec.generate(PROMPT, max_new_tokens=60)
    assert out.tokens == hf_greedy and out.stats.round == "loop"
    assert "a CUDA graph of the fixed round failed" in out.stats.round_reason
    assert dec.target.static_blocks is None                               # released


# ---------------------------------------------------------------------------- what it refuses

def test_the_cpu_default_runs_the_loop(target):
    dec = TreeDecoder(target, FeatureDrafter(random_head(target), target), tree="4,2,2", policy="static",
                      attention="sdpa", calibrate=False)
    assert dec.round == "auto"
    rounds, _ = reads_per_round(dec, PROMPT, max_new_tokens=20)
    assert max(map(len, rounds)) > 1                          # the loop, as before


@pytest.mark.parametrize("draft, policy, spec, reason", [
    ("context", "static", "2,1", "feature head"),
    ("head+context", "static", "8,4,1", "static tree has more than 48 nodes"),
    ("head", "heuristic", "2,1", "static trees or the learned"),
])
def test_fixed_round_refuses_what_it_cannot_run(target, draft, policy, spec, reason):
    head = FeatureDrafter(random_head(target), target)
    drafts = {"context": "context", "head": head, "head+context": [head, "context"]}
    dec = TreeDecoder(target, drafts[draft], tree=spec, policy=policy, attention="sdpa", calibrate=False,
                      round="fixed")
    with pytest.raises(ConfigError, match=reason):
        dec.generate(PROMPT, max_new_tokens=5)
    dec.round = "auto"                                        # the same generation on the loop
    assert len(dec.generate(PROMPT, max_new_tokens=5).tokens) == 5


def test_processors_and_a_bad_round_value(target):
    dec = fixed_decoder(target, random_head(target))
    with pytest.raises(ConfigError, match="processors"):
        dec.generate(PROMPT, max_new_tokens=5, repetition_penalty=1.3)
    with pytest.raises(ConfigError, match="round must be one of"):
        TreeDecoder(target, None, calibrate=False, round="graphs")


# ---------------------------------------------------------------------------- on CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [{}, dict(temperature=0.8, seed=3)], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("policy", ["static", "learned", "default"])
def test_cuda_rounds_synchronise_once(options, policy):
    """On CUDA, torch's sync debug mode counts the synchronisations: at most one a round (the read of
    the emitted tokens) once every bucket's graph is captured; float32 greedy equals `generate`."""
    import warnings
    target = tiny_llama(0).cuda()
    prompt = (REPEATS if policy == "default" else PROMPT).cuda()
    head = random_head(target, 24).cuda()
    dec = (fixed_decoder(target, head) if policy == "static"
           else learned_decoder(target, head, "fixed", "3,2,2,1,1", "constant")
           if policy == "learned" else default_decoder(target, head, "auto"))
    dec.generate(prompt, max_new_tokens=60, **options)         # captures every bucket's graphs
    stream = dec.stream(prompt, max_new_tokens=60, **options)
    tokens = list(next(stream))
    per_round = []
    while True:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    new = next(stream)
                except StopIteration:
                    break
        finally:
            torch.cuda.set_sync_debug_mode(0)
        per_round.append(sum("synchroniz" in str(w.message) for w in caught))
        tokens += new
    assert len(per_round) > 10 and max(per_round) <= 1, per_round
    if not options:
        with torch.no_grad():
            ref = target.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=60,
                                  do_sample=False, pad_token_id=0)
        assert tokens == ref[0, prompt.numel():].tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_second_generation_captures_nothing():
    """On CUDA the command line's default runs the fixed round under round="auto", and its decoder
    captures every graph once: a second generation captures none (the target's nor the head's)."""
    target = tiny_llama(0).cuda()
    dec = default_decoder(target, random_head(target, 24).cuda(), "auto")
    first = dec.generate(REPEATS.cuda(), max_new_tokens=60)
    assert first.stats.round == "fixed", first.stats.round_reason
    captured = dec.target.blocks.captures, dec.fixed_round.blocks.captures
    assert min(captured) > 0 and dec.fixed_round.failure is None
    again = dec.generate(REPEATS.cuda(), max_new_tokens=60)
    assert again.tokens == first.tokens == generate_greedy(target, REPEATS)
    assert (dec.target.blocks.captures, dec.fixed_round.blocks.captures) == captured


# ---------------------------------------------------------------------------- the policy "auto" picks

def test_where_the_fixed_round_is_the_default_policy_auto_grows_the_static_tree(target, monkeypatch):
    """On CUDA (here: the CPU taken for one) a feature head's policy "auto" is the static tree, whose
    rounds replay as graphs, not the learned policy, whose per-level decisions run eagerly; with
    round="loop", elsewhere, or with a standalone draft model, "auto" stays the learned policy."""
    head = random_head(target, 24)
    assert type(TreeDecoder(target, FeatureDrafter(head, target), attention="sdpa").policy) is LearnedPolicy
    monkeypatch.setattr(fixed_round, "AUTO_DEVICES", ("cuda", "cpu"))
    dec = TreeDecoder(target, [FeatureDrafter(head, target), ContextDrafter()], attention="sdpa", calibrate=False)
    assert type(dec.policy).__name__ == "StaticPolicy"
    assert dec.policy.topology.size == TreeTopology.from_spec("4,2,2").size == 29
    out = dec.generate(PROMPT, max_new_tokens=20)
    assert out.stats.round == "fixed" and out.tokens == generate_greedy(target, PROMPT, 20)
    loop = TreeDecoder(target, FeatureDrafter(head, target), attention="sdpa", round="loop")
    assert type(loop.policy) is LearnedPolicy
    model = TreeDecoder(target, tiny_llama(1, layers=1), attention="sdpa")
    assert type(model.policy) is LearnedPolicy


@pytest.mark.parametrize("flags, want", [
    (["--device", "cuda"], ("static", "4,2,2")),
    (["--device", "cpu"], ("learned", LearnedPolicy.default_tree)),
    (["--device", "cuda", "--drafter", "model"], ("learned", LearnedPolicy.default_tree)),
    (["--device", "cuda", "--policy", "learned"], ("learned", LearnedPolicy.default_tree)),
    (["--device", "cuda", "--tree", "3,1"], ("static", "3,1")),
])
def test_the_command_lines_settle_policy_auto_as_the_decoder_does(flags, want):
    from mcsd.cli.args import build_parser, settle_policy
    args = build_parser().parse_args(["--prompt", "x", *flags])
    settle_policy(args, drafting=True)
    assert (args.policy, args.tree) == want
