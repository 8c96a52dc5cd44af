"""Tree specs, topology tensors, the sliced mask, positions and paths, on hand-drawn trees."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcsd.config import ConfigError
from mcsd.core.tree import DraftTree, TreeTopology, ancestor_mask, parse_tree_spec
from mcsd.forward.attention import additive_mask


def test_k_config_counts_and_order():
    paths = parse_tree_spec("4,2,2")
    assert len(paths) == 4 + 8 + 16
    assert paths[:5] == ((0,), (1,), (2,), (3,), (0, 0))
    assert parse_tree_spec("1,1,1,1") == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    assert parse_tree_spec(" 2, 1 ") == ((0,), (1,), (0, 0), (1, 0))
    assert parse_tree_spec("") == ()


def test_explicit_paths_are_sorted_breadth_first():
    assert parse_tree_spec([[0, 0], [1], [0]]) == ((0,), (1,), (0, 0))


@pytest.mark.parametrize("spec, fragment", [
    ("4,x,2", "comma-separated positive integers"),
    ("4,0", ">= 1"),
    ("-1", ">= 1"),
    ([[0, 1]], "no parent path"),
    ([[0], [2]], "skips sibling rank 1"),
    ([[0], [0]], "duplicate"),
    ([[]], "must not be empty"),
    ([[0], [-1]], "negative"),
    (42, "malformed tree spec"),
])
def test_malformed_specs_raise_clear_errors(spec, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_tree_spec(spec)


def test_topology_of_2_1():
    # root -> a, b ; a -> c ; b -> d
    topo = TreeTopology.from_spec("2,1")
    assert topo.parents.tolist() == [-1, 0, 0, 1, 2]
    assert topo.depth.tolist() == [0, 1, 1, 2, 2]
    assert topo.rank.tolist() == [0, 0, 1, 0, 0]
    assert topo.n_children.tolist() == [2, 1, 1, 0, 0]
    assert topo.level_ptr == (0, 1, 3, 5)
    assert topo.child_table.tolist() == [[1, 2], [3, -1], [4, -1], [-1, -1], [-1, -1]]
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(topo.mask, expected)


def test_ancestor_mask_of_irregular_tree():
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 4])
    depth = torch.tensor([0, 1, 1, 1, 2, 2, 3])
    m = ancestor_mask(parents, depth)
    assert m[6].nonzero().squeeze(1).tolist() == [0, 1, 4, 6]
    assert m[5].nonzero().squeeze(1).tolist() == [0, 1, 5]
    assert m[3].nonzero().squeeze(1).tolist() == [0, 3]
    assert m.sum().item() == 1 + 2 + 2 + 2 + 3 + 3 + 4


def test_additive_mask_values():
    allowed = torch.tensor([[True, False], [True, True]])
    m = additive_mask(allowed, prefix_len=3, dtype=torch.float32)
    lo = torch.finfo(torch.float32).min
    assert m.shape == (1, 1, 2, 5)
    assert m.dtype == torch.float32
    assert m[0, 0].tolist() == [[0, 0, 0, 0, lo], [0, 0, 0, 0, 0]]
    assert additive_mask(allowed, 0, torch.bfloat16).dtype == torch.bfloat16


def _tree_2_1(tokens=(10, 11, 12, 13, 14)):
    topo = TreeTopology.from_spec("2,1")
    tree = DraftTree.root_only(topo, torch.tensor(tokens[0]))
    tree.append_level(torch.tensor(tokens[1:3]), torch.tensor([0, 0]), torch.tensor([-0.1, -0.2]),
                      torch.tensor([1, 2]))
    tree.append_level(torch.tensor(tokens[3:]), torch.tensor([1, 2]), torch.tensor([-0.5, -0.7]),
                      torch.tensor([3, 4]))
    return topo, tree


def test_draft_tree_positions_paths_and_slices():
    topo, tree = _tree_2_1()
    assert tree.depth.tolist() == [0, 1, 1, 2, 2]
    assert tree.positions(7).tolist() == [7, 8, 8, 9, 9]
    assert tree.leaf_paths().tolist() == [[0, 1, 3], [0, 2, 4]]
    assert torch.equal(tree.mask(), topo.mask)
    # the level-1 draft step: queries = nodes 1, 2; keys = nodes 0, 1, 2
    rows = torch.tensor([1, 2])
    assert tree.mask(rows, torch.arange(3)).tolist() == [[True, True, False], [True, False, True]]


def test_select_keeps_a_parent_closed_subtree_and_slices_the_same_mask():
    topo, tree = _tree_2_1()
    sub = tree.select(torch.tensor([True, False, True, False, True]))
    assert sub.tokens.tolist() == [10, 12, 14]
    assert sub.parents.tolist() == [-1, 0, 1]
    assert sub.topo_ids.tolist() == [0, 2, 4]
    assert sub.mask().tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    with pytest.raises(ValueError, match="parent-closed"):
        tree.select(torch.tensor([True, False, False, True, False]))


@pytest.mark.parametrize("spec, fragment", [
    ("100,100,100", "has 1,010,100 draft nodes; the limit is 1,024"),
    ("9" * 30, "has about 10^30 draft nodes; the limit is 1,024"),
    (",".join(["1"] * 65), "is 65 levels deep; the limit is 64"),
    ([(r,) for r in range(1025)], "has 1,025 draft nodes; the limit is 1,024"),
    ([(0,) * d for d in range(1, 66)], "is 65 levels deep; the limit is 64"),
])
def test_oversized_specs_name_the_limit_and_their_size(spec, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        TreeTopology.from_spec(spec)


def test_specs_at_the_limits_are_accepted():
    from mcsd.config import MAX_TREE_DEPTH, MAX_TREE_NODES
    assert len(parse_tree_spec(",".join(["1"] * MAX_TREE_DEPTH))) == MAX_TREE_DEPTH
    assert len(parse_tree_spec(str(MAX_TREE_NODES))) == MAX_TREE_NODES
    assert TreeTopology.from_spec("0").size == 1 and parse_tree_spec(" 0 ") == ()


spec_texts = st.one_of(st.text(max_size=40), st.from_regex(r"[0-9, +_-]{0,40}", fullmatch=True),
                       st.lists(st.integers(-3, 10**40), max_size=70).map(lambda ks: ",".join(map(str, ks))))
path_lists = st.lists(st.lists(st.integers(-2, 1100), max_size=70), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.one_of(spec_texts, path_lists))
def test_any_spec_parses_within_the_limits_or_raises_config_error(spec):
    from mcsd.config import MAX_TREE_DEPTH, MAX_TREE_NODES
    try:
        paths = parse_tree_spec(spec)
    except ConfigError:
        return
    assert len(paths) <= MAX_TREE_NODES and max(map(len, paths), default=0) <= MAX_TREE_DEPTH
