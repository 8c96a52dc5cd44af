"""A static topology as fixed-shape buffers, and a round's growth and acceptance as tensor operations.

The fixed-shape round (`mcsd.decoding.fixed_round`) drafts the whole topology every round, so
everything about the tree's shape is known before the round starts: which nodes each level holds,
each node's parent and sibling rank, the root-to-leaf paths (Medusa's "retrieve indices") and the
additive ancestor mask. They are made here once, as tensors on the round's device. The round's
data-dependent parts are then tensor operations over those buffers, with no host read:

- growth: a level's children are the top-k ranks of their parents' scores (or of the scores plus
  the shared Gumbel noise), gathered by the static (parent, rank) of each child (`level_children`);
- acceptance: a node matches when its token equals the target's draw after its parent; along every
  root-to-leaf path the matches are multiplied (`cumprod`), and the longest run wins (`argmax`),
  exactly the path `mcsd.core.verify.accept_greedy` finds (`accept_paths`).

Everything here is a pure function of tensors; nothing reads a value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TreeTopology


@dataclass(frozen=True)
class StaticTree:
    """A `TreeTopology` laid out for rounds of fixed shape.

    Attributes (N nodes, root included; D = depth; L leaves; all on one device):
        topology: the topology it was made from.
        levels: per depth d, the nodes' index range (start, stop) (host ints, from the topology).
        parents: (N,) long, -1 for the root.
        depth: (N,) long.
        parent_row: per depth d >= 1, (W_d,) long: each node's parent as a row of level d-1.
        rank: per depth d >= 1, (W_d,) long: each node's sibling rank (which of its parent's top-k).
        fan_out: per depth d >= 1, the widest fan-out of level d-1 (the k its top-k takes).
        paths: (L, D+1) long, root-to-leaf node indices; past a shallow leaf the leaf repeats.
        path_len: (L,) long, nodes on each path (root included).
        allowed: (N, N) bool ancestor-or-self mask.
    """

    topology: TreeTopology
    levels: tuple[tuple[int, int], ...]
    parents: torch.Tensor
    depth: torch.Tensor
    parent_row: tuple[torch.Tensor, ...]
    rank: tuple[torch.Tensor, ...]
    fan_out: tuple[int, ...]
    paths: torch.Tensor
    path_len: torch.Tensor
    allowed: torch.Tensor

    @classmethod
    def of(cls, topology: TreeTopology, device=None) -> "StaticTree":
        """The buffers of `topology` on `device` (default: the topology's), worked out on the host from
        the topology's values (read once) and moved to the device at the end: no device read."""
        dev = topology.parents.device if device is None else torch.device(device)
        parents, n_children = topology.parents.tolist(), topology.n_children.tolist()
        depth_of = topology.depth.tolist()
        D = max(depth_of)
        levels = tuple((topology.level_ptr[d], topology.level_ptr[d + 1]) for d in range(D + 1))
        parent_row, rank, fan_out = [[]], [[]], [0]
        ranks = topology.rank.tolist()
        for d in range(1, D + 1):
            lo, hi = levels[d]
            parent_row.append([p - levels[d - 1][0] for p in parents[lo:hi]])
            rank.append(ranks[lo:hi])
            fan_out.append(max(n_children[levels[d - 1][0]:levels[d - 1][1]]))
        # Medusa's retrieve indices: one row per leaf, its ancestors by depth, the leaf repeated past it
        rows = []
        for leaf in (i for i in range(len(parents)) if n_children[i] == 0):
            chain = [leaf]
            while chain[-1] > 0:
                chain.append(parents[chain[-1]])
            chain.reverse()
            rows.append(chain + [leaf] * (D + 1 - len(chain)))
        as_long = lambda values: torch.tensor(values, dtype=torch.long).to(dev)   # noqa: E731
        topo = topology.to(dev)
        return cls(topo, levels, topo.parents, topo.depth, tuple(map(as_long, parent_row)), tuple(map(as_long, rank)),
                   tuple(fan_out), as_long(rows).reshape(len(rows), D + 1),
                   as_long([depth_of[row[-1]] + 1 for row in rows]), topo.mask)

    @property
    def size(self) -> int:
        return self.parents.numel()

    @property
    def max_depth(self) -> int:
        return len(self.levels) - 1


def level_children(keys: torch.Tensor, parent_row: torch.Tensor, rank: torch.Tensor, k: int,
                   ids: torch.Tensor | None = None, columns: bool = False):
    """One level's tokens from its parents' ranked candidates.

    Args:
        keys: (F, V) the parents' scores the candidates are ranked by (probabilities when greedy, the
            noise keys log q + g when sampling; -inf for a token that may not be proposed), or (F, K)
            over the sub-vocabulary `ids`.
        parent_row: (W,) long, each child's parent as a row of `keys`.
        rank: (W,) long, each child's sibling rank.
        k: the widest fan-out (the top-k taken).
        ids: (K,) long token ids of the columns, or None (the columns are the token ids).
    Returns:
        (tokens (W,) long, valid (W,) bool: False where the parent had fewer than rank + 1 finite keys;
        such a node is never accepted, as `mcsd.drafting.draft.grow_tree` leaves it out); with
        `columns`, also (W,) long each node's column of its parent's row in `keys`.
    """
    top = torch.topk(keys, k, dim=-1)                                          # (F, k)
    cand = top.indices[parent_row, rank]                                        # (W,)
    valid = torch.isfinite(top.values[parent_row, rank])
    tokens = cand if ids is None else ids[cand]
    return (tokens, valid, cand) if columns else (tokens, valid)


def accept_paths(tree: StaticTree, tokens: torch.Tensor, draws: torch.Tensor, valid: torch.Tensor | None = None,
                 depth_limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted path of a whole static tree, on the device (Medusa style).

    Args:
        tree: the round's static tree.
        tokens: (N,) long node tokens (node 0 the root).
        draws: (N,) long the target's token after each node (its argmax, or its seeded Gumbel draw).
        valid: optional (N,) bool, nodes that may be accepted (False: a candidate the draft had no
            finite key for).
        depth_limit: accept no node deeper than this (the tokens left to emit), or None.
    Returns:
        (n (1,) long accepted draft tokens; path (D+1,) long node indices root first, entries past
        n repeating the deepest accepted node; next_token (1,) long, the target's draw after it).
        The path is the one `mcsd.core.verify.accept_greedy` returns, n its `n_accepted`.
    """
    match = torch.ones_like(tokens, dtype=torch.bool)
    match[1:] = tokens[1:] == draws[tree.parents[1:]]                          # (N,)
    if valid is not None:
        match &= valid
    on_path = match[tree.paths]                                                 # (L, D+1)
    cols = torch.arange(tree.paths.shape[1], device=tokens.device)
    inside = cols[None] < tree.path_len[:, None]                               # the leaf's own repeats: no
    if depth_limit is not None:
        inside &= cols[None] <= depth_limit
    run = (on_path & inside).long().cumprod(dim=1)                             # (L, D+1) 1 while all matched
    lengths = run.sum(dim=1)                                                    # (L,) nodes accepted, root incl.
    # the longest; between equally long ones the lowest deepest node (the loop's rule, where siblings repeat)
    deepest = tree.paths.gather(1, (lengths - 1)[:, None])[:, 0]               # (L,)
    # (1,) and looked up with index_select: indexing with a 0-dim tensor reads it on the host
    best = torch.argmax(lengths * (tree.size + 1) - deepest).reshape(1)
    n = lengths.index_select(0, best) - 1                                       # (1,)
    path = tree.paths.index_select(0, best)[0]                                  # (D+1,)
    # past the accepted part the path repeats its deepest accepted node
    path = torch.where(cols <= n, path, path.gather(0, n))
    next_token = draws.gather(0, path.gather(0, n))
    return n, path, next_token


def emitted_tokens(tokens: torch.Tensor, path: torch.Tensor, n: torch.Tensor,
                   next_token: torch.Tensor) -> torch.Tensor:
    """(D+2,) long: the count n, then the round's emitted tokens (the accepted tokens below the root,
    the target's next token at index n), padded: what the round reads on the host, once."""
    out = tokens[path[1:]]                                                      # (D,)
    out = torch.cat([out, next_token])                                          # (D+1,)
    out = out.scatter(0, n, next_token)
    return torch.cat([n, out])
