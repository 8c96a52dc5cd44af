"""Deciding which drafted tokens the target accepts. Pure functions over one tree.

Both rules return an `Acceptance`: the accepted root-to-node path and the one
extra token the target contributes (its bonus token after a fully accepted
path, or the residual token after a rejection). That extra token becomes the
next round's target-initialised root.

Greedy: a node is accepted when its token equals the target's argmax at its
parent and its parent is accepted; the deepest accepted node wins (siblings
hold distinct tokens, so there is at most one such path). Vectorised: no loop
over nodes.

Sampling: multi-candidate rejection sampling without replacement (MCSD). At
the current node the children are tried in the order the draft drew them; a
child with token x is accepted with probability min(1, p(x) / q(x)); on
rejection p <- normalise(max(p - q, 0)), q(x) <- 0, q <- normalise(q). If no
child is accepted, one token is drawn from the final p. The emitted tokens are
then distributed exactly as plain sampling from p_target. The walk down the
tree is inherently sequential (each decision changes the next p), so it loops
over the accepted depth and the siblings tried, not over all nodes.

Deterministic siblings (context proposals, `mcsd.drafting.context`) join the same
walk. The rule is SpecInfer's multi-step speculative sampling (Miao et al.,
2023): candidates may come from different proposal distributions, and a
candidate x drawn from q_i is tested against the current residual p with
min(1, p(x) / q_i(x)); on rejection p <- normalise(max(p - q_i, 0)). Each step
is then ordinary speculative sampling against the current p, which returns a
token distributed as p, so by induction the emitted token follows the
original p. What the induction needs is that, given everything tested
before, each candidate is distributed as the q used in its test:
- a model child is the r-th draw without replacement from q_draft, i.e.
  distributed as q_draft with the earlier draws removed: the q kept here;
- a context child is a fixed function of the committed text: q_i = the point
  mass at x, so it is accepted with probability p(x), and a rejection removes
  x from p and renormalises.
Model children come first, then context children. A context token that
duplicates a rejected sibling is never added as a second node: after a
rejection its residual mass is exactly 0 (rejection is only possible where
p(x) < q(x), and max(p - q, 0) is then 0 at x), so its own test would reject
it with certainty and leave p unchanged. Dropping it changes nothing, which is
why merging duplicate siblings in the trie keeps sampling exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying one tree.

    Attributes:
        path: (k+1,) long node indices from the root down to the deepest accepted node.
        next_token: () long, the target's own token after the path (next round's root).
    """

    path: torch.Tensor
    next_token: torch.Tensor

    @property
    def n_accepted(self) -> int:
        """Draft tokens accepted (the root is the previous round's token, not counted)."""
        return self.path.numel() - 1


def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                  anc_mask: torch.Tensor, target_argmax: torch.Tensor,
                  given: torch.Tensor | None = None) -> Acceptance:
    """Longest path whose tokens all equal the target's argmax.

    Args:
        tokens: (N,) node tokens; parents: (N,) (root -1); depth: (N,).
        anc_mask: (N, N) bool ancestor-or-self mask.
        target_argmax: (N,) the target's argmax next token after each node.
        given: optional (N,) bool, nodes accepted without a test (the lossy
            multi-root variant's candidate roots). Ties in depth go to the
            lowest index.
    Returns:
        Acceptance; next_token = target_argmax at the deepest accepted node.
    """
    match = torch.ones_like(tokens, dtype=torch.bool)
    match[1:] = tokens[1:] == target_argmax[parents[1:]]                       # (N,)
    if given is not None:
        match |= given
    # A node is accepted iff no node on its root path (itself included) mismatches.
    accepted = ~(anc_mask & ~match.unsqueeze(0)).any(-1)                       # (N,)
    best = torch.argmax(torch.where(accepted, depth, -1))                      # deepest; root at worst
    path = anc_mask[best].nonzero().squeeze(1)                                 # breadth-first = root first
    return Acceptance(path=path, next_token=target_argmax[best])


def _children(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children in index order, from the parents list (root first, -1)."""
    children: dict[int, list[int]] = {}
    for child, parent in enumerate(parents[1:], start=1):
        children.setdefault(parent, []).append(child)
    return children


def accept_drawn(tokens: torch.Tensor, parents: torch.Tensor, draw) -> Acceptance:
    """`accept_greedy`'s answer where the target's token after each node is a draw, made only for the
    nodes accepted so far: `draw(nodes)` (a host list of node indices -> the host list of their tokens,
    each row on its own) is called a level at a time, from the root down while some node of the level
    is accepted. A tree whose first level misses costs one row's draw, not one a node; the path and
    next token are what drawing every node and matching would give (deepest accepted node, ties to the
    lowest index). The walk is on the host: greedy matching passes every node's argmax, looked up.

    Args:
        tokens: (N,) node tokens; parents: (N,) parent indices, parents before children (root -1).
        draw: the target's token after each of the given nodes.
    """
    par, toks = parents.tolist(), tokens.tolist()
    children = _children(par)
    level, drawn = [0], {}
    while True:
        got = draw(level)
        drawn.update(zip(level, got))
        below = [c for node, t in zip(level, got) for c in children.get(node, ()) if toks[c] == t]
        if not below:
            break
        level = below
    best = min(level)                                    # the deepest level reached; its lowest index
    path = [best]
    while path[-1] != 0:
        path.append(par[path[-1]])
    return Acceptance(path=torch.tensor(path[::-1], device=tokens.device),
                      next_token=torch.tensor(drawn[best], device=tokens.device))


def accept_sampling(tokens: torch.Tensor, parents: torch.Tensor, p_target: torch.Tensor,
                    q_draft: torch.Tensor | None, generator: torch.Generator | None,
                    deterministic: torch.Tensor | None = None) -> Acceptance:
    """Multi-candidate rejection sampling without replacement, with deterministic siblings.

    Args:
        tokens: (N,) node tokens, parents before children; siblings stored in draw order.
        parents: (N,) parent indices, root -1.
        p_target: (N, V) processed target distribution after each node.
        q_draft: (N', V) processed draft distribution each node's drawn children
            came from, for the first N' nodes, which hold every node with drawn
            children (other rows are never read); None when no node has any.
        generator: randomness for the accept tests and the final draw.
        deterministic: optional (N,) bool, nodes proposed deterministically (q =
            point mass; context proposals). They are tried after their drawn siblings.
    Returns:
        Acceptance with the accepted path and the emitted extra token.
    """
    children = _children(parents.tolist())                                     # one host copy per round
    toks = tokens.tolist()
    det = [False] * len(toks) if deterministic is None else deterministic.tolist()
    if deterministic is not None:
        for kids in children.values():
            kids.sort(key=det.__getitem__)                                     # stable: drawn ones first

    node, path = 0, [0]
    while True:
        kids = children.get(node)
        p = p_target[node]
        if not kids:                                   # leaf, or every child accepted so far: bonus token
            return Acceptance(torch.tensor(path, device=tokens.device), sample(p, generator))
        q = q_draft[node].clone() if not det[kids[0]] else None
        u = torch.rand(len(kids), generator=generator, device=p.device)
        for i, child in enumerate(kids):
            x = toks[child]
            if det[child]:                             # point mass: accept with probability p(x)
                if bool(u[i] < p[x]):
                    node = child
                    path.append(child)
                    break
                p = p.clone()
                p[x] = 0.0
                p = normalise(p, fallback=p)
                continue
            if bool(u[i] * q[x] < p[x]):               # u < min(1, p/q) without dividing by q
                node = child
                path.append(child)
                break
            p = normalise(torch.clamp(p - q, min=0.0), fallback=p)
            q[x] = 0.0
            q = normalise(q, fallback=q)
        else:                                          # every sibling rejected: draw from the residual
            return Acceptance(torch.tensor(path, device=tokens.device), sample(p, generator))


def normalise(v: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    # The residual max(p - q, 0) has positive mass whenever a rejection is possible
    # (p(x) < q(x) for the rejected x); an all-zero vector only arises from float
    # round-off when p == q, where keeping the previous distribution is the limit.
    total = v.sum()
    return torch.where(total > 0, v / total.clamp(min=torch.finfo(v.dtype).tiny), fallback)
