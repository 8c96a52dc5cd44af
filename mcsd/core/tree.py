"""Draft trees as flat tensors, and the topology-aware causal mask derived from them.

A tree is stored breadth-first: node 0 is the root (the token the target itself
chose at the end of the previous round), and every parent comes before its
children. Everything else (ancestor mask, position offsets, root-to-leaf paths)
is derived here, in one place, with tensor ops.

Two objects:

- `TreeTopology`: the *largest* tree of a shape, built once from a spec. It
  owns the precomputed ancestor mask that every round slices.
- `DraftTree`: one round's tree, a subset of a topology's nodes (closed under
  parents) with the draft's tokens and cumulative log-probabilities filled in.
  Its mask is the topology's mask sliced to its nodes; no per-round rebuild.
  Context proposals (`mcsd.drafting.context`) can be grafted on after drafting: they
  are appended after the drafted nodes (parents still before children, so the
  tree is breadth-first in its drafted part and parent-ordered throughout),
  and only their rows of the mask are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import MAX_TREE_DEPTH, MAX_TREE_NODES, ConfigError

_HOST_MASK_NODES = 62           # a grafted tree this small builds its mask from ancestor bits in one int64 each

Paths = tuple[tuple[int, ...], ...]


# ----------------------------------------------------------------------------
# parsing

def parse_tree_spec(spec) -> Paths:
    """Turn a tree spec into the sorted set of rank paths of its draft nodes.

    Args:
        spec: "4,2,2" (k-config: branching factor per depth), or an iterable of
            paths, each a sequence of sibling ranks starting under the root.
            "" / "0" / () mean no draft nodes at all (plain decoding).
    Returns:
        Paths sorted breadth-first (by depth, then ranks), root excluded.
    Raises:
        ConfigError: on anything malformed (non-integers, zero or negative
            branching, paths whose prefix is missing, duplicate paths, ranks
            that skip a sibling), and on trees past `MAX_TREE_NODES` nodes or
            `MAX_TREE_DEPTH` levels (checked before the tree is expanded).
    """
    if isinstance(spec, str):
        text = spec.strip()
        if text in ("", "0"):
            return ()
        try:
            widths = [int(p) for p in text.split(",")]
        except ValueError:
            raise ConfigError(
                f"malformed tree spec {_shown(spec)}: expected comma-separated positive integers "
                f"such as '4,2,2' (children per node at each depth), or 0 for no drafting") from None
        if any(w < 1 for w in widths):
            raise ConfigError(f"malformed tree spec {_shown(spec)}: every branching factor must be >= 1")
        _check_size(spec, _k_config_nodes(widths), len(widths))
        paths: list[tuple[int, ...]] = [()]
        out: list[tuple[int, ...]] = []
        for w in widths:
            paths = [p + (r,) for p in paths for r in range(w)]
            out.extend(paths)
        return _sorted_paths(out)

    try:
        paths = [tuple(int(r) for r in p) for p in spec]
    except (TypeError, ValueError):
        raise ConfigError(f"malformed tree spec {_shown(spec)}: expected 'k1,k2,...' or a list of rank paths") from None
    _check_size(spec, len(paths), max(map(len, paths), default=0))
    for p in paths:
        if len(p) == 0:
            raise ConfigError("malformed tree spec: an explicit path must not be empty (the root is implicit)")
        if any(r < 0 for r in p):
            raise ConfigError(f"malformed tree spec: negative sibling rank in path {list(p)}")
    if len(set(paths)) != len(paths):
        raise ConfigError("malformed tree spec: duplicate paths")
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise ConfigError(f"malformed tree spec: path {list(p)} has no parent path {list(p[:-1])}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in have:
            raise ConfigError(
                f"malformed tree spec: path {list(p)} skips sibling rank {p[-1] - 1} "
                f"(children are the draft's top candidates in order, so ranks must be contiguous)")
    return _sorted_paths(paths)


def _k_config_nodes(widths: list[int]) -> int:
    """Draft nodes of a k-config: 4 + 4*2 + 4*2*2 for "4,2,2"."""
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
    return total


def _check_size(spec, n_nodes: int, depth: int) -> None:
    if depth > MAX_TREE_DEPTH:
        raise ConfigError(f"tree spec {_shown(spec)} is {depth} levels deep; the limit is {MAX_TREE_DEPTH}")
    if n_nodes > MAX_TREE_NODES:
        size = f"{n_nodes:,}" if n_nodes < 10**12 else f"about 10^{int(math.log10(n_nodes))}"
        raise ConfigError(f"tree spec {_shown(spec)} has {size} draft nodes; the limit is {MAX_TREE_NODES:,}")


def _shown(spec, width: int = 60) -> str:
    """The spec as a message shows it: its repr, cut short when long."""
    text = repr(spec)
    return text if len(text) <= width else text[:width] + "..."


def _sorted_paths(paths) -> Paths:
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


# ----------------------------------------------------------------------------
# pure tensor helpers

def ancestor_mask(parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self relation of a breadth-first tree.

    Args:
        parents: (N,) long, parent index of each node, -1 for the root.
        depth: (N,) long, depth of each node (root 0).
    Returns:
        (N, N) bool, `mask[i, j]` true iff node j is node i itself or one of its
        ancestors: exactly the keys query i may attend to inside the tree.
    """
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    # One vectorised step per depth: a node sees what its parent sees, plus itself.
    for d in range(1, int(depth.max()) + 1 if n else 0):
        rows = (depth == d).nonzero().squeeze(1)                    # (n_d,)
        mask[rows] |= mask[parents[rows]]
    return mask


# ----------------------------------------------------------------------------
# topology: the largest tree of a shape, built once

@dataclass(frozen=True)
class TreeTopology:
    """The largest tree of one shape, with everything a round slices from it.

    Attributes (N = 1 + number of draft nodes; node 0 is the root):
        parents: (N,) long, -1 for the root.
        depth: (N,) long.
        rank: (N,) long, sibling rank = which of the parent's ordered draft
            candidates (top-k order, or draw order when sampling) this node takes.
        mask: (N, N) bool ancestor-or-self mask, computed once here.
        level_ptr: depth d's nodes are `level_ptr[d]:level_ptr[d+1]` (breadth-first).
        n_children: (N,) long, how many candidates each node needs from the draft.
        child_table: (N, K) long, `child_table[i, r]` = index of node i's child of
            rank r, or -1 (K = the widest fan-out, at least 1).
    """

    paths: Paths
    parents: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    mask: torch.Tensor
    level_ptr: tuple[int, ...]
    n_children: torch.Tensor
    child_table: torch.Tensor

    @classmethod
    def from_spec(cls, spec, device=None) -> "TreeTopology":
        paths = parse_tree_spec(spec)
        index = {(): 0}
        parents, depth, rank = [-1], [0], [0]
        for i, p in enumerate(paths, start=1):
            index[p] = i
            parents.append(index[p[:-1]])
            depth.append(len(p))
            rank.append(p[-1])
        parents_t = torch.tensor(parents, dtype=torch.long, device=device)
        depth_t = torch.tensor(depth, dtype=torch.long, device=device)
        n_children = torch.zeros(len(parents), dtype=torch.long, device=device)
        if len(paths):
            n_children.scatter_add_(0, parents_t[1:], torch.ones_like(parents_t[1:]))
        child_table = torch.full((len(parents), max(1, int(n_children.max()))), -1,
                                 dtype=torch.long, device=device)
        for i, p in enumerate(paths, start=1):
            child_table[parents[i], p[-1]] = i
        max_depth = max(depth)
        level_ptr = tuple(int((depth_t < d).sum()) for d in range(max_depth + 2))
        return cls(paths=paths, parents=parents_t, depth=depth_t,
                   rank=torch.tensor(rank, dtype=torch.long, device=device),
                   mask=ancestor_mask(parents_t, depth_t), level_ptr=level_ptr,
                   n_children=n_children, child_table=child_table)

    @property
    def size(self) -> int:
        """Number of nodes, root included."""
        return self.parents.numel()

    @property
    def max_depth(self) -> int:
        return len(self.level_ptr) - 2

    def level(self, d: int) -> slice:
        return slice(self.level_ptr[d], self.level_ptr[d + 1])

    def to(self, device) -> "TreeTopology":
        return TreeTopology(self.paths, self.parents.to(device), self.depth.to(device),
                            self.rank.to(device), self.mask.to(device), self.level_ptr,
                            self.n_children.to(device), self.child_table.to(device))


# ----------------------------------------------------------------------------
# one round's tree

@dataclass
class DraftTree:
    """One round's draft tree: a parent-closed subset of a topology's nodes.

    Attributes (N = nodes in this tree, root included, breadth-first):
        tokens: (N,) long token ids; tokens[0] is the target-initialised root.
        parents: (N,) long indices *into this tree*, -1 for the root.
        depth: (N,) long.
        logp: (N,) float, cumulative draft log-probability of the path to each
            node (root 0).
        topo_ids: (N,) long, each node's index in the topology, used to slice
            the precomputed mask (-1 for grafted nodes).
        grafted_mask: None, or the (N, N) ancestor mask once nodes were grafted.
    """

    topology: TreeTopology
    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    logp: torch.Tensor
    topo_ids: torch.Tensor
    grafted_mask: torch.Tensor | None = None   # (N, N) once nodes outside the topology were grafted on

    @classmethod
    def root_only(cls, topology: TreeTopology, root_token: torch.Tensor) -> "DraftTree":
        dev = topology.parents.device
        return cls(topology, root_token.reshape(1).to(dev), torch.tensor([-1], device=dev),
                   torch.zeros(1, dtype=torch.long, device=dev),
                   torch.zeros(1, dtype=torch.float32, device=dev),
                   torch.zeros(1, dtype=torch.long, device=dev))

    @property
    def size(self) -> int:
        return self.tokens.numel()

    def mask(self, rows=None, cols=None) -> torch.Tensor:
        """The topology's precomputed ancestor mask sliced to this tree's nodes.

        Args:
            rows: which of this tree's nodes are queries (index tensor or slice; default all).
            cols: which of this tree's nodes are keys (default all).
        Returns:
            (Q, K) bool visibility.
        """
        if self.grafted_mask is not None:
            m = self.grafted_mask if rows is None else self.grafted_mask[rows]
            return m if cols is None else m[:, cols]
        q_ids = self.topo_ids if rows is None else self.topo_ids[rows]
        k_ids = self.topo_ids if cols is None else self.topo_ids[cols]
        return self.topology.mask[q_ids][:, k_ids]

    def positions(self, prefix_len: int, rows=None) -> torch.Tensor:
        """(Q,) long position ids: each node sits at prefix length + its depth."""
        d = self.depth if rows is None else self.depth[rows]
        return d + prefix_len

    def append_level(self, tokens, parents, logp, topo_ids) -> None:
        """Add one breadth-first level (all arguments (M,) tensors; parents index this tree)."""
        self.tokens = torch.cat([self.tokens, tokens])
        self.depth = torch.cat([self.depth, self.depth[parents] + 1])
        self.parents = torch.cat([self.parents, parents])
        self.logp = torch.cat([self.logp, logp.to(self.logp.dtype)])
        self.topo_ids = torch.cat([self.topo_ids, topo_ids])

    def graft(self, tokens, parents, logp) -> "DraftTree":
        """A new tree with nodes appended that are not in the topology (context proposals).

        Args:
            tokens, parents, logp: the M new nodes, as (M,) tensors or host lists; each parent indexes
                this tree or an earlier new node (parents come before children, so paths stay in
                index order).
        Returns:
            DraftTree whose mask is the sliced topology mask extended by the new rows (each
            sees its parent's ancestors and itself: one vectorised step per depth). The new
            nodes have topo_ids -1; no more levels can be drafted beneath them. Its fields are made
            from host lists, one tensor each: a round's graft is a few nodes, and the tensor
            operations of appending them cost more than the lists.
        """
        new_tokens, new_parents, new_logp = (x.tolist() if isinstance(x, torch.Tensor) else list(x)
                                             for x in (tokens, parents, logp))
        n, m = self.size, len(new_tokens)
        dev = self.tokens.device
        if m == 0:
            return self
        if any(not 0 <= p < n + i for i, p in enumerate(new_parents)):
            raise ValueError("graft() needs every new node's parent to come before it")
        all_parents = self.parents.tolist() + new_parents
        depths = self.depth.tolist()
        for p in new_parents:
            depths.append(depths[p] + 1)
        if n + m <= _HOST_MASK_NODES and self.grafted_mask is None:
            # a small tree: each node's ancestors (itself included) as the bits of one host integer
            seen = []
            for i, p in enumerate(all_parents):
                seen.append((seen[p] if p >= 0 else 0) | (1 << i))
            bits = torch.tensor(seen, device=dev)[:, None] >> torch.arange(n + m, device=dev)
            mask = (bits & 1).bool()
        else:
            mask = torch.zeros(n + m, n + m, dtype=torch.bool, device=dev)
            mask[:n, :n] = self.mask()
            new = torch.arange(n, n + m, device=dev)
            mask[new, new] = True
            new_depth = torch.tensor(depths[n:], device=dev)
            parents_of = torch.tensor(all_parents, device=dev)
            for d in range(min(depths[n:]), max(depths[n:]) + 1):
                rows = new[new_depth == d]                               # their parents' rows are complete
                mask[rows] |= mask[parents_of[rows]]
        def field(values: list, like: torch.Tensor) -> torch.Tensor:
            return torch.tensor(values, dtype=like.dtype, device=dev)
        return DraftTree(self.topology, field(self.tokens.tolist() + new_tokens, self.tokens),
                         field(all_parents, self.parents), field(depths, self.depth),
                         field(self.logp.tolist() + new_logp, self.logp),
                         field(self.topo_ids.tolist() + [-1] * m, self.topo_ids), mask)

    def leaf_paths(self) -> torch.Tensor:
        """Root-to-leaf paths, Medusa style.

        Returns:
            (L, D+1) long node indices, one row per leaf, padded with -1 after
            the leaf. Row order follows the leaves' breadth-first order.
        """
        anc = self.mask()                                              # (N, N)
        has_child = torch.zeros(self.size, dtype=torch.bool, device=self.tokens.device)
        has_child[self.parents[1:]] = True
        leaves = (~has_child).nonzero().squeeze(1)                     # (L,)
        width = int(self.depth.max()) + 1
        paths = torch.full((leaves.numel(), width), -1, dtype=torch.long, device=self.tokens.device)
        rows = anc[leaves]                                             # (L, N) ancestors of each leaf
        li, nj = rows.nonzero(as_tuple=True)
        paths[li, self.depth[nj]] = nj
        return paths

    def select(self, keep: torch.Tensor) -> "DraftTree":
        """Keep a parent-closed subset of nodes (bool (N,) or sorted indices), reindexing parents."""
        idx = keep.nonzero().squeeze(1) if keep.dtype == torch.bool else keep
        remap = torch.full((self.size,), -1, dtype=torch.long, device=idx.device)
        remap[idx] = torch.arange(idx.numel(), device=idx.device)
        par = self.parents[idx]
        new_par = torch.where(par >= 0, remap[par.clamp(min=0)], par)
        if bool((new_par[1:] < 0).any()):
            raise ValueError("select() needs a parent-closed set of nodes that includes the root")
        mask = None if self.grafted_mask is None else self.grafted_mask[idx][:, idx]
        return DraftTree(self.topology, self.tokens[idx], new_par, self.depth[idx],
                         self.logp[idx], self.topo_ids[idx], mask)

