"""Property tests: derived tree tensors and greedy acceptance agree with slow reference walks."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcsd.core.tree import TreeTopology
from mcsd.core.verify import accept_greedy

k_configs = st.lists(st.integers(1, 3), min_size=1, max_size=4).map(lambda ks: ",".join(map(str, ks)))


def _ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@settings(max_examples=60, deadline=None)
@given(k_configs)
def test_mask_is_the_ancestor_relation(spec):
    topo = TreeTopology.from_spec(spec)
    parents = topo.parents.tolist()
    for i in range(topo.size):
        assert set(topo.mask[i].nonzero().squeeze(1).tolist()) == _ancestors(parents, i)
        assert topo.depth[i] == len(_ancestors(parents, i)) - 1
        assert parents[i] < i                                   # parents before children


@settings(max_examples=80, deadline=None)
@given(k_configs, st.integers(0, 2**31 - 1))
def test_greedy_acceptance_matches_a_slow_walk(spec, seed):
    topo = TreeTopology.from_spec(spec)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (topo.size,), generator=g)
    # make siblings distinct, as top-k candidates are
    tokens[1:] = topo.rank[1:] + 4 * torch.randint(0, 2, (topo.size - 1,), generator=g)
    argmax = torch.randint(0, 8, (topo.size,), generator=g)
    acc = accept_greedy(tokens, topo.parents, topo.depth, topo.mask, argmax)

    node, path = 0, [0]                                          # reference: walk down while a child matches
    while True:
        match = [c for c in range(topo.size) if topo.parents[c] == node and tokens[c] == argmax[node]]
        if not match:
            break
        node = match[0]
        path.append(node)
    assert acc.path.tolist() == path
    assert int(acc.next_token) == int(argmax[node])
