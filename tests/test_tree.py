"""Tree specs, topology tensors, the sliced mask, positions and paths, on hand-drawn trees."""

import pytest
import torch

from mcsd.config import ConfigError
from mcsd.tree import DraftTree, TreeTopology, additive_mask, ancestor_mask, parse_tree_spec


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
