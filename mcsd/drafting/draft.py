"""Growing a round's draft tree, level by level, under the target-initialised root.

`Drafter` is the small protocol a draft source implements; `ModelDrafter` is a
standalone Hugging Face causal LM with its own KV cache. `grow_tree` runs one
draft forward per level over every node of that level, with the topology's
precomputed mask sliced to the nodes in play, and asks the policy how many
children each node gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import SamplingConfig
from ..core.sampling import logits_to_probs, sample_without_replacement
from ..core.tree import DraftTree
from ..forward import kv_cache
from ..forward.lm import CachedLM
from .policies.base import Frontier, TreePolicy


class Drafter(Protocol):
    """What the decoder needs from a draft source (one sequence at a time).

    Cache contract: between rounds the drafter has consumed some prefix of the
    committed sequence; `begin_round` feeds it whatever is missing (the new
    root included) and `step` appends tree nodes after that; `commit` keeps the
    accepted path and drops the other nodes.
    """

    forwards: int  # draft forward passes so far (for stats)
    uses_target_hidden: bool  # True: the decoder calls observe_target with the target's features

    def observe_target(self, hidden: torch.Tensor) -> None:
        """hidden: (n, H) target last hidden states of newly committed positions, in order
        (the prompt after prefill; root .. deepest accepted node after each round)."""

    def reset(self) -> None: ...

    def begin_round(self, sequence: torch.Tensor) -> torch.Tensor:
        """sequence: (T,) committed tokens ending with the root. Returns (V,) logits after the root
        ((K,) over `vocab_ids` where the drafter has them)."""

    def step(self, tree: DraftTree, rows: torch.Tensor) -> torch.Tensor:
        """Run tree nodes `rows` (M,) (all one depth); returns (M, V) logits after each ((M, K) over
        `vocab_ids` where the drafter has them)."""

    # Optional: a drafter whose draft gives probability 0 to every token outside a sub-vocabulary may
    # score only that: `vocab_ids` (K,) long, those tokens' ids (None: the whole vocabulary), and
    # `widen(scores)` turning (..., K) scores into (..., V), -inf elsewhere. Its trees are then grown
    # over K entries a row instead of V.

    def commit(self, path: torch.Tensor) -> None:
        """path: (k+1,) accepted tree node indices, root first."""


class ModelDrafter:
    """A standalone draft model (any causal LM sharing the target's tokenizer)."""

    uses_target_hidden = False

    def __init__(self, model: torch.nn.Module, cuda_graphs: bool = True):
        self.lm = CachedLM(model, cuda_graphs=cuda_graphs)     # `mcsd.forward.graphs` on CUDA, as the target's
        self.forwards = 0
        self.keep_hidden = False                # set by a policy that reads the draft's hidden states
        self.last_hidden: torch.Tensor | None = None   # (M, H) last hidden states of the rows just run
        self._base = 0                          # cache position of this round's root
        self._slots = torch.zeros(0, dtype=torch.long)  # tree node held at cache offset i after _base

    @property
    def model(self) -> torch.nn.Module:
        return self.lm.model

    @property
    def directory(self) -> str | None:
        """The folder the draft model was loaded from (transformers' name_or_path), if any."""
        return getattr(self.model, "name_or_path", None) or None

    @property
    def kernels(self):
        """The CPU matmul path per block size of the draft's forwards (`mcsd.forward.kernels`)."""
        return self.lm.kernels

    @kernels.setter
    def kernels(self, table) -> None:
        self.lm.kernels = table

    def reset(self) -> None:
        self.lm.reset()
        self.forwards = 0

    def begin_round(self, sequence: torch.Tensor) -> torch.Tensor:
        if self.lm.length >= sequence.numel():              # root already cached (lossy multi-root rounds):
            kv_cache.truncate(self.lm.cache, sequence.numel() - 1)   # re-read it for its logits
        pending = sequence[self.lm.length:]                 # the root, plus any accepted leaf not yet seen
        logits = self.lm.extend(pending, hidden=self.keep_hidden, last_logits=True)   # (1, V): the root's
        if self.keep_hidden:
            logits, hidden = logits
            self.last_hidden = hidden[-1:]                  # (1, H) the root's
        self.forwards += 1
        self._base = sequence.numel() - 1
        self._slots = torch.zeros(1, dtype=torch.long, device=pending.device)   # node 0 = root
        return logits[-1]

    def step(self, tree: DraftTree, rows: torch.Tensor) -> torch.Tensor:
        cols = torch.cat([self._slots, rows])               # keys: nodes already cached, then these
        logits = self.lm.forward(tree.tokens[rows], tree.positions(self._base, rows), tree.mask(rows, cols),
                                 hidden=self.keep_hidden)
        if self.keep_hidden:
            logits, self.last_hidden = logits               # (M, V), (M, H)
        self.forwards += 1
        self._slots = cols
        return logits

    def commit(self, path: torch.Tensor) -> None:
        # Offsets of the accepted nodes the draft has processed (a prefix of the path).
        slot_of = torch.full((int(path.max()) + 1,), -1, dtype=torch.long, device=path.device)
        in_range = self._slots <= path.max()
        slot_of[self._slots[in_range]] = torch.arange(self._slots.numel(), device=path.device)[in_range]
        offsets = slot_of[path]
        self.lm.commit(self._base, offsets[offsets >= 0])


@dataclass
class GrownTree:
    """A drafted tree plus what verification needs from the draft.

    Attributes:
        tree: the draft tree (root = target-initialised token).
        q_draft: (N, V) float draft distribution that each node's children were
            drawn from (rows of childless nodes are zero; after a graft, the drafted
            nodes' rows only). Only kept when sampling.
        deterministic: None, or (N,) bool marking nodes proposed from context
            (point-mass proposals, see `mcsd.core.verify.accept_sampling`).
    """

    tree: DraftTree
    q_draft: torch.Tensor | None
    deterministic: torch.Tensor | None = None

    def with_graft(self, graft) -> "GrownTree":
        """This tree with a `mcsd.drafting.context.Graft`'s nodes appended, marked deterministic for
        verification. `q_draft` keeps the drafted rows only: nothing is drawn beneath a context
        node, so no row past them is ever read."""
        if graft.tree.size == self.tree.size:
            return self
        return GrownTree(graft.tree, self.q_draft, graft.deterministic)


def _draft_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    if sampling.greedy:
        return logits.float().softmax(-1)
    return logits_to_probs(logits, sampling)


@torch.inference_mode()
def grow_tree(drafter: Drafter, policy: TreePolicy, sequence: torch.Tensor, depth_limit: int,
              sampling: SamplingConfig, generator: torch.Generator | None,
              root_children: torch.Tensor | None = None, scores=None, noise=None) -> GrownTree:
    """Grow one round's tree under the root `sequence[-1]`.

    Args:
        drafter: the draft source (its cache is extended; commit after verification).
        policy: decides depth and fan-out; owns the topology.
        sequence: (T,) committed tokens, the last being the target-chosen root.
        depth_limit: deepest level to draft this round (0 = no drafting).
        sampling: greedy -> children are the draft's top-k; otherwise drawn
            without replacement from q_draft (processed like p_target).
        generator: randomness for sampling.
        root_children: (W,) fixed first level instead of drafted children (the
            lossy multi-root variant puts the target's top-W tokens there).
        scores: optional `mcsd.core.processors.NodeScores`: the logits processors,
            applied to the draft's logits at each expanded node with its own
            prefix, as verification applies them to the target's.
        noise: optional `mcsd.core.sampling.PositionNoise` (sampling): children are the
            top keys log q + g at their position, g the noise the target draws
            with there, so the first child is the target's draw whenever q and p
            rank it first under that noise. (Without it, draws without replacement.)
    Returns:
        GrownTree. One draft forward per level actually expanded.
    """
    topo = policy.topology
    tree = DraftTree.root_only(topo, sequence[-1])
    if depth_limit < 1 or topo.max_depth < 1:
        return GrownTree(tree, None)
    device = tree.tokens.device
    # A drafter that scores a sub-vocabulary: its trees are grown over those K entries, and a candidate's
    # index maps back to its token, unless logits processors (which read the whole vocabulary) or
    # rejection sampling (which keeps each node's whole draft distribution) need every entry.
    ids = getattr(drafter, "vocab_ids", None)
    widen = None
    if ids is not None:
        ids = ids.to(device)
        if scores is not None or not (sampling.greedy or noise is not None):
            widen, ids = drafter.widen, None
    logits = drafter.begin_round(sequence)[None].to(device)               # (1, V), or (1, K) over ids
    frontier = torch.zeros(1, dtype=torch.long, device=device)
    q_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    first = 0
    if root_children is not None:                                          # a given first level
        w = root_children.numel()
        tree.append_level(root_children.to(device), torch.zeros(w, dtype=torch.long, device=device),
                          torch.zeros(w, device=device), topo.child_table[0, :w])
        policy.given_level(w)
        new = torch.arange(1, w + 1, device=device)
        frontier = new[topo.n_children[tree.topo_ids[new]] > 0]
        if depth_limit < 2 or frontier.numel() == 0:
            return GrownTree(tree, None)
        logits = drafter.step(tree, frontier).to(device)
        first = 1

    for depth in range(first, depth_limit):
        if widen is not None:
            logits = widen(logits)
        if scores is not None:
            logits = scores.at_nodes(sequence[:-1], tree, frontier, logits)
        probs = _draft_probs(logits, sampling)                             # (F, V)
        max_children = topo.n_children[tree.topo_ids[frontier]]           # (F,)
        n_children = policy.expand(Frontier(depth, frontier, max_children, probs, tree))
        n_children = max_children if n_children is None else torch.minimum(n_children, max_children)
        k = int(n_children.max())
        if k == 0:
            break
        if sampling.greedy:
            top = torch.topk(probs, k, dim=-1)
            cand, valid = top.indices, torch.ones_like(top.indices, dtype=torch.bool)
        elif noise is not None:                                            # ranked by the target's noise
            # the draft's candidates ranked by the noise the target draws with (measured: more accepted than
            # with the noise scaled down or left out, docs/results.md)
            keys = noise.keys(probs.log(), tree.depth[frontier] + sequence.numel(), ids)   # children at T + d
            top = torch.topk(keys, k, dim=-1)
            cand, valid = top.indices, torch.isfinite(top.values)
        else:
            cand, valid = sample_without_replacement(probs, k, generator)  # (F, k) in draw order
        rank = torch.arange(k, device=device).expand_as(cand)
        # A rank-r child exists if the policy allows r+1 children and the draft had r+1 tokens to
        # offer (ranks are contiguous: an invalid draw is always last among its siblings).
        keep = (rank < n_children[:, None]) & valid                        # (F, k)
        parents = frontier[:, None].expand_as(cand)[keep]                  # (M,)
        tokens, ranks = (cand if ids is None else ids[cand])[keep], rank[keep]
        q_token = probs.gather(1, cand)[keep]
        if sampling.greedy is False and noise is None:                     # rejection sampling reads q
            q_rows.append((frontier, probs))
        start = tree.size
        tree.append_level(tokens, parents, tree.logp[parents] + q_token.log(),
                          topo.child_table[tree.topo_ids[parents], ranks])
        policy.level_added(keep)
        if depth + 1 == depth_limit:
            break
        new = torch.arange(start, tree.size, device=device)
        frontier = new[topo.n_children[tree.topo_ids[new]] > 0]
        if frontier.numel() == 0 or not policy.continue_drafting(tree, frontier):
            break
        logits = drafter.step(tree, frontier).to(device)                   # (F', V)

    q_draft = None
    if q_rows:
        q_draft = torch.zeros(tree.size, q_rows[0][1].shape[-1], device=device)
        for nodes, probs in q_rows:
            q_draft[nodes] = probs
    return GrownTree(tree, q_draft)
