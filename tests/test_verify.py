"""Acceptance rules and sampling helpers, exact on hand-drawn trees and statistical where random."""

import math

import pytest
import torch

from mcsd.config import SamplingConfig
from mcsd.core.sampling import logits_to_probs, sample_without_replacement
from mcsd.core.tree import TreeTopology, ancestor_mask
from mcsd.core.verify import accept_drawn, accept_greedy, accept_sampling

# Tree used below (node: token):      0:5
#                                   /     \
#                                 1:7     2:8
#                                /   \      \
#                              3:9   4:3    5:4
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2])
DEPTH = torch.tensor([0, 1, 1, 2, 2, 2])
TOKENS = torch.tensor([5, 7, 8, 9, 3, 4])
ANC = ancestor_mask(PARENTS, DEPTH)


@pytest.mark.parametrize("argmax, path, nxt", [
    ([7, 3, 0, 0, 6, 0], [0, 1, 4], 6),     # 7 accepted, then 3 (second child) accepted; bonus 6
    ([8, 0, 4, 0, 0, 2], [0, 2, 5], 2),     # the other branch
    ([8, 0, 1, 0, 0, 0], [0, 2], 1),        # 8 accepted, its child 4 rejected: correction 1
    ([6, 9, 4, 0, 0, 0], [0], 6),           # nothing accepted; the target's own token 6
])
def test_greedy_acceptance_on_hand_drawn_tree(argmax, path, nxt):
    acc = accept_greedy(TOKENS, PARENTS, DEPTH, ANC, torch.tensor(argmax))
    assert acc.path.tolist() == path
    assert int(acc.next_token) == nxt
    assert acc.n_accepted == len(path) - 1


def test_greedy_mismatch_above_blocks_a_matching_child():
    # node 3's token matches the target after node 1, but node 1 itself was rejected
    acc = accept_greedy(TOKENS, PARENTS, DEPTH, ANC, torch.tensor([2, 9, 0, 0, 0, 0]))
    assert acc.path.tolist() == [0]
    assert int(acc.next_token) == 2


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_multi_candidate_rejection_sampling_matches_target_distribution():
    """Over many trials, the first emitted token follows p_target exactly (TV below 4 sigma of noise)."""
    torch.manual_seed(0)
    vocab, trials, width = 6, 20000, 3
    p = torch.softmax(torch.randn(vocab) * 1.5, 0)
    q = torch.softmax(torch.randn(vocab) * 1.5, 0)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    parents = torch.tensor([-1] + [0] * width)
    p_rows = torch.cat([p[None], torch.full((width, vocab), 1.0 / vocab)])
    q_rows = torch.cat([q[None], torch.zeros(width, vocab)])
    drafts, _ = sample_without_replacement(q.expand(trials, vocab), width, gen)
    for i in range(trials):
        tokens = torch.cat([torch.tensor([0]), drafts[i]])
        acc = accept_sampling(tokens, parents, p_rows, q_rows, gen)
        first = tokens[acc.path[1]] if acc.n_accepted else acc.next_token
        counts[int(first)] += 1
    # Expected TV of an exact sampler is about sum(sqrt(p(1-p)/(2 pi n))); allow 4x that.
    noise = float(torch.sqrt(p * (1 - p) / (2 * math.pi * trials)).sum())
    assert _tv(counts, p) < 4 * noise


def test_rejection_with_disjoint_supports_uses_the_residual():
    # q puts all mass where p has none: every draft is rejected and the residual is p itself.
    p = torch.tensor([0.0, 0.0, 0.5, 0.5])
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    tokens, parents = torch.tensor([3, 0, 1]), torch.tensor([-1, 0, 0])
    for _ in range(50):
        acc = accept_sampling(tokens, parents, torch.stack([p, p, p]), torch.stack([q, q, q]), gen)
        assert acc.path.tolist() == [0]
        assert int(acc.next_token) in (2, 3)


def test_identical_draft_is_always_accepted():
    p = torch.tensor([0.1, 0.6, 0.3])
    gen = torch.Generator().manual_seed(0)
    tokens, parents = torch.tensor([0, 1, 2]), torch.tensor([-1, 0, 1])
    for _ in range(50):
        acc = accept_sampling(tokens, parents, torch.stack([p, p, p]), torch.stack([p, p, p]), gen)
        assert acc.path.tolist() == [0, 1, 2]


def test_logits_to_probs_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    ref = torch.softmax(logits / 0.5, 0)
    assert torch.allclose(logits_to_probs(logits, SamplingConfig(0.5)), ref)
    top2 = logits_to_probs(logits, SamplingConfig(1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([math.e, 1.0, 0, 0]) / (math.e + 1))
    full = torch.softmax(logits, 0)                       # approx [0.644, 0.237, 0.087, 0.032]
    nucleus = logits_to_probs(logits, SamplingConfig(1.0, top_p=0.85))
    assert nucleus.nonzero().squeeze(1).tolist() == [0, 1]       # 0.644 < 0.85 <= 0.881
    assert torch.allclose(nucleus[:2], full[:2] / full[:2].sum())
    assert logits_to_probs(logits, SamplingConfig(1.0, top_p=0.5)).nonzero().squeeze(1).tolist() == [0]
    with pytest.raises(ValueError):
        logits_to_probs(logits, SamplingConfig(0.0))


def test_sampling_without_replacement_draw_order():
    """Second draw ~ q with the first removed: P(second = j) = sum_i q_i q_j / (1 - q_i)."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40000
    toks, valid = sample_without_replacement(q.expand(n, 4), 2, torch.Generator().manual_seed(0))
    assert valid.all() and (toks[:, 0] != toks[:, 1]).all()
    first = torch.bincount(toks[:, 0], minlength=4).float()
    second = torch.bincount(toks[:, 1], minlength=4).float()
    expected_second = torch.stack([sum(q[i] * q[j] / (1 - q[i]) for i in range(4) if i != j) for j in range(4)])
    assert _tv(first, q) < 0.01
    assert _tv(second, expected_second) < 0.01


def test_sampling_without_replacement_marks_missing_candidates():
    q = torch.tensor([[0.7, 0.3, 0.0, 0.0]])
    toks, valid = sample_without_replacement(q, 3, torch.Generator().manual_seed(0))
    assert valid.tolist() == [[True, True, False]]
    assert sorted(toks[0, :2].tolist()) == [0, 1]


def test_topology_children_follow_rank_order():
    topo = TreeTopology.from_spec("3")
    assert topo.rank.tolist() == [0, 0, 1, 2]


def _by_sort(scores, mass):
    """Nucleus filtering by sorting the whole row (the definition), and each kept token's mass above it."""
    log_norm = torch.logsumexp(scores, dim=-1, keepdim=True)
    top, order = torch.sort(scores, dim=-1, descending=True, stable=True)     # ties: the lower index first
    top = (top - log_norm).exp()
    before = torch.zeros_like(scores).scatter(-1, order, top.cumsum(-1) - top)
    return scores.masked_fill(before >= mass, float("-inf")), before


def test_top_p_keeps_what_a_full_sort_keeps_on_every_path():
    """Nucleus filtering finds its kept set among 64 candidates, among as many as a histogram bounds,
    or by sorting the vocabulary: each row keeps what sorting it alone keeps, whichever path a block
    of rows takes."""
    from mcsd.core import sampling

    g = torch.Generator().manual_seed(0)
    # peaked rows (a few tokens hold the mass), middling ones (hundreds) and flat ones (most of the vocabulary)
    rows = torch.cat([torch.randn(3, 4096, generator=g) * s for s in (12.0, 4.0, 0.3)])
    rows[1, :5] = float("-inf")                                              # masked entries stay out
    kept = {}
    for mass in (0.5, 0.9, 0.95, 0.999):
        want = _by_sort(rows, mass)[0]
        assert torch.equal(sampling._top_p_torch(rows, mass), want)
        for i in range(rows.shape[0]):
            assert torch.equal(sampling._top_p_torch(rows[i:i + 1], mass), want[i:i + 1])
        kept[mass] = (want > float("-inf")).sum(-1)
    sizes = kept[0.95].tolist()
    assert min(sizes) < sampling.TOP_P_FIRST < max(sizes[:6]) < 2048 < max(sizes)     # every path ran


def test_native_top_p_keeps_what_a_full_sort_keeps():
    """The native filter keeps each row's nucleus as sorting it does, row by row whatever the block,
    but for a token whose mass above is within rounding of the threshold (it adds in double)."""
    from mcsd.forward import native
    if native.library() is None:
        pytest.skip(f"no native library: {native.reason()}")
    g = torch.Generator().manual_seed(1)
    for vocab in (4096, 49152, 1003):                   # 1003: a tail shorter than 8
        rows = torch.cat([torch.randn(3, vocab, generator=g) * s for s in (12.0, 4.0, 0.3)])
        rows[1, :5] = float("-inf")                     # masked entries stay out
        rows[2, 10:20] = rows[2].max()                  # tied at the top: the lower index ranks first
        for mass in (0.5, 0.9, 0.95, 0.999):
            want, before = _by_sort(rows, mass)
            got = native.top_p(rows, mass)
            differ = torch.isfinite(got) != torch.isfinite(want)
            assert ((before - mass).abs()[differ] < 1e-5).all()
            assert torch.equal(got[~differ], want[~differ])
            assert torch.equal(got.isfinite().sum(-1) > 0, torch.ones(rows.shape[0], dtype=torch.bool))
            for i in range(rows.shape[0]):                                  # a row alone, bit for bit
                assert torch.equal(native.top_p(rows[i:i + 1], mass), got[i:i + 1])
    assert torch.equal(native.top_p(torch.full((1, 9), float("-inf")), 0.9), torch.full((1, 9), float("-inf")))
    tied = torch.zeros(1, 8)                            # eight equal tokens: the first half, lowest index first
    assert native.top_p(tied, 0.5).isfinite().nonzero()[:, 1].tolist() == [0, 1, 2, 3]
    signed = torch.zeros(1, 8)
    signed[0, ::2] = -0.0                               # -0 ties with 0: the index alone orders them
    assert native.top_p(signed, 0.5).isfinite().nonzero()[:, 1].tolist() == [0, 1, 2, 3]
    many = torch.zeros(1, 4096)                         # a nucleus of thousands (the radix sort's case)
    many[0, 1::3] = -0.0
    many[0, 2::3] = -1e-3
    kept = native.top_p(many, 0.5).isfinite().nonzero()[:, 1]
    assert kept.tolist() == [i for i in range(4096) if i % 3 != 2][:kept.numel()] and kept.numel() > 1300


def test_native_argmax_is_torchs():
    """Greedy's token from the native library is torch.argmax's: the first of equal maxima (-0 equal to
    0), the first NaN where a row has one, index 0 for a row of -inf; on every row length around the
    eight-float step, one row or many, and on a full vocabulary."""
    from mcsd.core.sampling import greedy_tokens
    from mcsd.forward import native
    if native.library() is None:
        pytest.skip(f"no native library: {native.reason()}")
    g = torch.Generator().manual_seed(3)
    for vocab in (*range(1, 34), 255, 49152):
        for rows in (1, 2, 5):
            x = torch.randn(rows, vocab, generator=g)
            cases = [x, x.round(), torch.full_like(x, float("-inf")),
                     torch.where(x > 1.0, torch.full_like(x, float("inf")), x),
                     torch.where(x > 1.5, torch.full_like(x, float("nan")), x),
                     torch.where(x > 0, torch.zeros_like(x), -torch.zeros_like(x))]
            for case in cases:
                assert torch.equal(native.argmax(case), case.argmax(-1)), case
                assert torch.equal(greedy_tokens(case[0]), case[0].argmax(-1))
    tail = torch.zeros(1, 19)
    tail[0, 17] = 1.0                                   # the maximum in the tail past the last full step
    assert native.argmax(tail).tolist() == [17]
    late_nan = torch.zeros(1, 40)
    late_nan[0, 3], late_nan[0, 37] = 5.0, float("nan")
    assert native.argmax(late_nan).tolist() == [37]
    with pytest.raises(ValueError):
        native.argmax(torch.zeros(2, 0))


def test_native_topk_is_a_stable_descending_sort():
    """Recycling's top-k from the native library: each row's k largest, largest first, ties to the lower
    index, NaN above every number (a stable descending sort's first k), on row lengths around the
    eight-float step and a full vocabulary; the context drafter's recycled predictions are those."""
    from mcsd.drafting.context import ContextDrafter
    from mcsd.forward import native
    if native.library() is None:
        pytest.skip(f"no native library: {native.reason()}")
    g = torch.Generator().manual_seed(4)
    for vocab in (*range(1, 26), 257, 49152):
        for rows in (1, 3):
            x = torch.randn(rows, vocab, generator=g)
            for case in (x, x.round(), torch.full_like(x, float("-inf")),
                         torch.where(x > 1.0, torch.full_like(x, float("nan")), x),
                         torch.where(x < 0, torch.full_like(x, float("-inf")), x)):
                for k in {1, min(4, vocab), min(9, vocab)}:
                    want = torch.sort(case, dim=-1, descending=True, stable=True).indices[:, :k]
                    assert torch.equal(native.topk_indices(case, k), want), (case, k)
    with pytest.raises(ValueError):
        native.topk_indices(torch.zeros(2, 8), 65)
    ctx = ContextDrafter()
    ctx.bind(100, "cpu")
    ctx.reset(torch.tensor([1, 2, 3]))
    logits = torch.randn(2, 100, generator=g)
    ctx.observe_logits(torch.tensor([7, 8]), logits)
    assert ctx._next[7] == logits[0].topk(ctx.config.recycle_k).indices.tolist()
    assert ctx._next[8] == logits[1].topk(ctx.config.recycle_k).indices.tolist()


def test_drawing_only_where_accepted_gives_what_drawing_every_node_gives():
    """`accept_drawn` (the seeded sampler's judge: the target's draw after a node made only once the node
    is accepted, a level at a time) returns `accept_greedy`'s path and next token over every node's draw,
    on random trees with few token values (so paths match deep, and siblings share a token), and draws
    no node that is not accepted."""
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        n = int(torch.randint(1, 24, (1,), generator=g))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        depth = torch.zeros(n, dtype=torch.long)
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        tokens = torch.randint(0, 3, (n,), generator=g)
        after = torch.randint(0, 3, (n,), generator=g)                # the target's token after each node
        want = accept_greedy(tokens, parents, depth, ancestor_mask(parents, depth), after)
        asked = []

        def draw(nodes):
            asked.extend(nodes)
            return after[nodes].tolist()
        got = accept_drawn(tokens, parents, draw)
        assert torch.equal(got.path, want.path) and int(got.next_token) == int(want.next_token), trial
        assert len(asked) == len(set(asked))
        accepted = set(got.path.tolist())
        for node in asked:                                  # every drawn node's path matched the draws
            walk = node
            while walk != 0:
                assert int(tokens[walk]) == int(after[parents[walk]])
                walk = int(parents[walk])
        assert accepted <= set(asked)
