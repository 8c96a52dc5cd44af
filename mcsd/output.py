"""What a generation returns: the tokens and text, logprobs where asked for, and the round statistics.

Its own module so that every way of decoding (the tree loop, PEARL's concurrent mode) returns the same
types without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tree import DraftTree


@dataclass
class GenerationStats:
    """Counters and timings of one generation."""

    new_tokens: int = 0
    target_forwards: int = 0          # prefill included: plain decoding has one per token
    draft_forwards: int = 0
    rounds: int = 0
    tree_nodes: int = 0               # draft nodes verified, summed over rounds
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy_s: float = 0.0             # inside draft_s: the policy's own decisions (features, predictions)
    context_nodes: int = 0            # nodes proposed from context (grafted), summed over rounds
    context_accepted: int = 0         # of those, accepted
    accepted_per_round: list[int] = field(default_factory=list)
    offered_by_depth: list[int] = field(default_factory=list)   # rounds that could accept depth d+1
    accepted_by_depth: list[int] = field(default_factory=list)  # rounds that did

    @property
    def mean_accepted(self) -> float:
        """tau: tokens emitted per target forward (plain decoding = 1.0)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def accept_by_depth(self) -> list[float]:
        """P(depth d accepted | depth d-1 accepted and the tree reached depth d), d = 1, 2, ..."""
        return [a / o if o else 0.0 for a, o in zip(self.accepted_by_depth, self.offered_by_depth)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def other_s(self) -> float:
        return max(self.wall_s - self.prefill_s - self.draft_s - self.verify_s, 0.0)

    def record_round(self, tree: DraftTree, n_accepted: int) -> None:
        drafted_depth = int(tree.depth.max())
        self.rounds += 1
        self.tree_nodes += tree.size - 1
        self.accepted_per_round.append(n_accepted)
        for d in range(min(drafted_depth, n_accepted + 1)):
            if d >= len(self.offered_by_depth):
                self.offered_by_depth.append(0)
                self.accepted_by_depth.append(0)
            self.offered_by_depth[d] += 1
            self.accepted_by_depth[d] += int(d < n_accepted)

    def as_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "target_forwards": self.target_forwards,
                "draft_forwards": self.draft_forwards, "rounds": self.rounds,
                "mean_accepted": self.mean_accepted, "accept_by_depth": self.accept_by_depth,
                "tree_nodes": self.tree_nodes, "tokens_per_s": self.tokens_per_s, "wall_s": self.wall_s,
                "prefill_s": self.prefill_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
                "policy_s": self.policy_s, "other_s": self.other_s, "context_nodes": self.context_nodes,
                "context_accepted": self.context_accepted}


@dataclass
class GenerationOutput:
    """Result of `TreeDecoder.generate`.

    Attributes:
        tokens: the new tokens only (EOS included when generation ended on it).
        text: decoded new text (special tokens skipped), or None without a tokenizer.
        stats: counters and timings.
        finish_reason: "eos", "stop_string" or "length".
        logprobs: with `return_logprobs` (or `output_scores`), the target's
            float32 log-probability of each of `tokens`, from the verify pass:
            greedy, the log-softmax of the processed logits (after any logits
            processors); sampling, the log of the distribution the token was
            drawn from (processors, then temperature, top-k, top-p, min-p,
            typical-p), i.e. the target's own, not a rejection's residual.
            Else None.
    """

    tokens: list[int]
    text: str | None
    stats: GenerationStats
    finish_reason: str
    logprobs: list[float] | None = None
