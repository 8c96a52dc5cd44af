"""The learned policy's decisions in the fixed-shape round: tensor operations over a static tree.

The loop asks `LearnedPolicy` level by level which children to grow (`expand`, a best-first choice
while the expected tokens per millisecond rise) and whether to run the next draft level
(`continue_drafting`); both read the draft's probabilities on the host. Here the fixed-shape round
drafts the policy's whole topology (at most 64 nodes) and the same decisions are made on the device
over it: a level's candidates get the same acceptance (`AcceptanceModel.level_proba`), the same model
(its parameters moved to the device once), the same best-first choice (`choose_best_first`, float64
sums from the left as `_choose` adds them) and the same stop rule, with costs from tables of the
policy's fixed costs. A node the policy would not grow is *pruned*: it stays in the buffers (drafted
and verified, so shapes stay fixed), but is never accepted. The kept nodes are the loop's tree.

What stays on the host, from the round's one read: the draft gate (`Gate.opens`, once a round, as
`begin_round` asks it) and the running acceptance rate `recent`; both change only after a round, so
the read that emits the tokens also carries the kept tree's size, depth and drafted level widths.

Where it can differ from the loop (documented, tested):
- sums and products round as the device and the layout make them: the path probabilities' float32
  sum runs over the whole topology (zeros where pruned) rather than the kept nodes alone, the head
  and the model see padded blocks; a decision within such rounding of a tie may go the other way;
- costs are the policy's fixed costs (`online_costs` runs on the loop), and measured round times do
  not reach the policy (`observe_timing`: on CUDA a round's host time is not its device time).
"""

from __future__ import annotations

import torch

from ..core.static_tree import StaticTree
from ..drafting.policies.learned import LearnedPolicy, choose_best_first


class DevicePruning:
    """One generation's learned-policy decisions over a static tree, on its device.

    Args:
        policy: the learned policy (its model, costs and host state: the gate, `recent`).
        tree: the round's static tree (the policy's topology).
        device: where the round runs.
    """

    def __init__(self, policy: LearnedPolicy, tree: StaticTree, device):
        self.policy, self.tree = policy, tree
        self.model = policy.model.to(device)
        n_children = tree.topology.n_children.to(device)
        self.max_children = [n_children[lo:hi] for lo, hi in tree.levels]      # per depth, (W_d,)
        self.has_children = [c > 0 for c in self.max_children]
        self.device = device
        self._tables: tuple | None = None
        self.refresh()

    def refresh(self) -> None:
        """The cost tables (verify time by kept-tree size, draft time by level width) from the policy's
        costs, made again only where they changed (a recalibration): host arithmetic, then one upload."""
        costs, n = self.policy.costs, self.tree.size
        tables = (tuple(costs.verify_ms(i) for i in range(n + 2)), tuple(costs.draft_ms(w) for w in range(n + 1)))
        if tables != self._tables:
            self._tables = tables
            self.verify_ms, self.draft_ms = (torch.tensor(t, dtype=torch.float64, device=self.device) for t in tables)

    def begin(self, depth_limit: int) -> None:
        """A drafted round that may grow `depth_limit` levels (the gate opened)."""
        dev = self.device
        self.depth_limit = depth_limit
        self.recent = self.policy.recent
        self.kept = [torch.ones(1, dtype=torch.bool, device=dev)]                # per depth, (W_d,)
        self.path_pred = [torch.ones(1, device=dev)]                              # 0 where pruned
        self.tokens = torch.cat(self.path_pred).sum().double()     # expected tokens of the kept tree
        self.logp = [torch.zeros(1, device=dev)]
        # (1,) tensors, looked up with index_select: indexing with a 0-dim tensor may read it on the host
        self.size = torch.ones(1, dtype=torch.long, device=dev)
        self.spent_ms = torch.full((1,), self.policy.costs.draft_ms(1) + self.policy.costs.round_ms,
                                   dtype=torch.float64, device=dev)
        self.alive = torch.ones(1, dtype=torch.bool, device=dev)                 # drafting goes on
        self.widths: list[torch.Tensor] = []

    def level(self, depth: int, probs: torch.Tensor, columns: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Which of level `depth`'s nodes the policy grows.

        Args:
            depth: the level (>= 1); its parents are level depth-1.
            probs: (W_{depth-1}, K) the parents' draft distributions (as the loop's `Frontier.probs`).
            columns: (W_depth,) long each node's column of its parent's row in `probs`.
            valid: (W_depth,) bool nodes the draft had a finite key for.
        Returns:
            (W_depth,) bool kept nodes.
        """
        tree, dev = self.tree, self.device
        parent_row, rank, k = tree.parent_row[depth], tree.rank[depth], tree.fan_out[depth]
        kept_parent, pred_parent, logp_parent = self.kept[-1], self.path_pred[-1], self.logp[-1]
        allowed = torch.arange(k, device=dev)[None] < self.max_children[depth - 1][:, None]    # (F, k)
        allowed &= kept_parent[:, None]
        accept = self.model.level_proba(probs, logp_parent, depth - 1, k, pred_parent, self.recent,
                                        self.policy.shift)                                      # (F, k)
        path = torch.where(allowed, accept * pred_parent[:, None], 0.0)                          # (F, k)
        counts = choose_best_first(path, self.tokens, self.spent_ms + self._verify(0), self.size,
                                   self.verify_ms)                                              # (F,)
        go = self.alive if depth <= self.depth_limit else torch.zeros_like(self.alive)
        kept = go & kept_parent[parent_row] & (rank < counts[parent_row]) & valid                # (W,)
        pred = torch.where(kept, path[parent_row, rank], 0.0)
        q = probs.float()[parent_row].gather(1, columns[:, None])[:, 0]
        logp = torch.where(kept, logp_parent[parent_row] + q.log(), 0.0)
        self.kept.append(kept)
        self.path_pred.append(pred)
        self.tokens = torch.cat(self.path_pred).sum().double()
        self.logp.append(logp)
        self.size = self.size + kept.sum()
        if depth < min(self.depth_limit, tree.max_depth):                        # continue_drafting
            frontier = kept & self.has_children[depth]
            width = frontier.sum().reshape(1)
            gain = torch.where(frontier, pred, float("-inf")).max().double() * self.recent
            time_ms = self.spent_ms + self._verify(0)
            level_ms = self.draft_ms.index_select(0, width)
            extra = level_ms + self._verify(1) - self._verify(0)
            go_on = self.alive & (width > 0) & ((self.tokens + gain) * time_ms > self.tokens * (time_ms + extra))
            self.spent_ms = torch.where(go_on, self.spent_ms + level_ms, self.spent_ms)
            self.widths.append(torch.where(go_on, width, 0))
            self.alive = go_on
        else:
            self.alive = torch.zeros_like(self.alive)
        return kept

    def _verify(self, more: int) -> torch.Tensor:
        """(1,) float64 the verify time of the kept tree and `more` nodes."""
        return self.verify_ms.index_select(0, self.size + more)

    def summary(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept (N,) bool every node, counts (2 + D',) long: the kept tree's size, its depth, then the
        width of each level the head ran over (0: not run)), for the round's one read."""
        kept = torch.cat(self.kept)
        depth = (self.tree.depth * kept).max().reshape(1)
        return kept, torch.cat([self.size, depth, *self.widths])

    def observe(self, n_accepted: int, counts: list[int]) -> None:
        """After the read: the policy's host state (the gate, `recent`) hears the round, as from the loop."""
        size, depth, widths = counts[0], counts[1], counts[2:]
        self.policy.observe_round(n_accepted, depth, size, self.policy.round_draft_ms(widths))
