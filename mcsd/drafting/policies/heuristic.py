"""Hugging Face assisted generation's schedules, on any tree shape.

- `HeuristicPolicy`: the "heuristic" schedule: the draft depth grows by 2
  after a round where every drafted level was accepted, and shrinks by 1
  otherwise (never below 1, never past the topology).
- `ConfidencePolicy`: the "assistant confidence threshold" rule: a node is
  expanded only while the draft's probability of its own token reaches a
  threshold; the low-confidence token itself is still verified (dropping it
  would skew sampling), but nothing is drafted beneath it.
"""

from __future__ import annotations

import torch

from ...core.tree import DraftTree, TreeTopology
from .base import Frontier, TreePolicy


class HeuristicPolicy(TreePolicy):
    name = "heuristic"
    default_tree = "1,1,1,1,1,1,1,1"   # a chain, as in Hugging Face assisted generation

    def __init__(self, topology: TreeTopology, start_depth: int = 5):
        super().__init__(topology)
        self.start_depth = start_depth
        self.reset()

    def reset(self) -> None:
        self.depth = min(self.start_depth, self.topology.max_depth)

    def begin_round(self) -> int:
        return self.depth

    def observe(self, n_accepted: int, tree: DraftTree, shared: int = 0) -> None:
        drafted = int(tree.depth.max())
        if drafted and n_accepted == drafted:
            self.depth = min(self.depth + 2, self.topology.max_depth)
        else:
            self.depth = max(1, self.depth - 1)


class ConfidencePolicy(TreePolicy):
    name = "confidence"
    default_tree = "1,1,1,1,1,1,1,1"

    def __init__(self, topology: TreeTopology, threshold: float = 0.4):
        super().__init__(topology)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def expand(self, frontier: Frontier) -> torch.Tensor:
        tree = frontier.tree
        # A node's own probability under its parent's draft distribution: exp of the log-prob step.
        parent_logp = torch.where(tree.parents[frontier.nodes] >= 0,
                                  tree.logp[tree.parents[frontier.nodes].clamp(min=0)], 0.0)
        q_own = (tree.logp[frontier.nodes] - parent_logp).exp()
        confident = (q_own >= self.threshold) | (frontier.nodes == 0)   # the root is the target's own token
        return torch.where(confident, frontier.max_children, 0)
