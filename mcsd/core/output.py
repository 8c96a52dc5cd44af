"""What a generation returns (the tokens and text, logprobs where asked for, and the round statistics)
and when it ends (EOS, a stop string, `max_new_tokens`).

Its own module so that every way of decoding (the tree loop, PEARL's concurrent mode) emits by the same
rules and returns the same types without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import DecodeConfig
from .tree import DraftTree


@dataclass
class GenerationStats:
    """Counters and timings of one generation."""

    new_tokens: int = 0
    target_forwards: int = 0          # prefill included: plain decoding has one per token
    draft_forwards: int = 0
    rounds: int = 0
    plain_rounds: int = 0             # of those, rounds that drafted and grafted nothing: plain steps
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
    round: str = "loop"               # how the rounds ran: "loop" or "fixed" (`mcsd.decoding.fixed_round`)
    round_reason: str = ""            # ... and why
    batch_rounds: int = 0             # batched forwards it had rows in (`mcsd.decoding.batch`), prompt chunks too
    batch_rows: int = 0               # ... the rows it fed them
    batch_all_rows: int = 0           # ... and every slot's rows in them
    batch_slots: int = 0              # ... and the slots they fed, summed
    batch_exact: bool | None = None   # batched: whether its answer is guaranteed its lone run's (None: unbatched)

    @property
    def batch_share(self) -> float | None:
        """Its share of the batched forwards it ran in (its rows over all their rows); None unbatched."""
        return self.batch_rows / self.batch_all_rows if self.batch_all_rows else None

    @property
    def batch_size(self) -> float | None:
        """Slots in the batched forwards it ran in, on average; None unbatched."""
        return self.batch_slots / self.batch_rounds if self.batch_rounds else None

    def record_batch(self, rows: int, all_rows: int, slots: int) -> None:
        """A batched forward it fed `rows` of `all_rows` rows in, over `slots` slots."""
        self.batch_rounds += 1
        self.batch_rows += rows
        self.batch_all_rows += all_rows
        self.batch_slots += slots

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

    def record_step(self, seconds: float) -> None:
        """One plain step (a round with nothing drafted or grafted): a target forward of the root alone."""
        self.target_forwards += 1
        self.rounds += 1
        self.plain_rounds += 1
        self.verify_s += seconds
        self.accepted_per_round.append(0)

    def record_round(self, tree: DraftTree | None, n_accepted: int, draft_s: float = 0.0, verify_s: float = 0.0,
                     drafted_depth: int | None = None, nodes: int | None = None) -> None:
        """One verified round (its target forward counted): its tree (or, read nowhere on the host, its
        depth and node count), its accepted count, and its drafting and verify seconds."""
        self.target_forwards += 1
        self.draft_s += draft_s
        self.verify_s += verify_s
        drafted_depth = int(tree.depth.max()) if drafted_depth is None else drafted_depth
        self.rounds += 1
        self.tree_nodes += (tree.size if nodes is None else nodes) - 1
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
                "plain_rounds": self.plain_rounds,
                "mean_accepted": self.mean_accepted, "accept_by_depth": self.accept_by_depth,
                "tree_nodes": self.tree_nodes, "tokens_per_s": self.tokens_per_s, "wall_s": self.wall_s,
                "prefill_s": self.prefill_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
                "policy_s": self.policy_s, "other_s": self.other_s, "context_nodes": self.context_nodes,
                "context_accepted": self.context_accepted, "round": self.round, "round_reason": self.round_reason,
                "batch_rounds": self.batch_rounds, "batch_share": self.batch_share, "batch_size": self.batch_size,
                "batch_exact": self.batch_exact}


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


def eos_ids(cfg: DecodeConfig, model, tokenizer) -> set[int]:
    """The token ids that end generation: `cfg.eos_token_ids`, else the model's generation config's
    and the tokenizer's EOS."""
    if cfg.eos_token_ids:
        return set(cfg.eos_token_ids)
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return ids


class Emission:
    """The tokens a generation has emitted so far, cut at EOS, a stop string or `max_new_tokens`.

    Args:
        cfg: the generation's settings (stop rules, whether logprobs are kept).
        eos: token ids that end generation (see `eos_ids`).
        tokenizer: decodes the text for stop strings and the output; None: ids only.

    Attributes:
        tokens: the new tokens emitted.
        logprobs: with `cfg.return_logprobs`, one float per token; else None.
        finish: the finish reason ("eos", "stop_string", "length") once generation ends, else None.
    """

    def __init__(self, cfg: DecodeConfig, eos: set[int], tokenizer=None):
        self.cfg, self.eos, self.tokenizer = cfg, eos, tokenizer
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if cfg.return_logprobs else None
        self.finish: str | None = None

    def add(self, new: list[int], new_logprobs: torch.Tensor | None = None) -> list[int]:
        """Append new tokens (and their (k,) log-probabilities, when kept), cut by the stop rules.
        Returns the tokens emitted by this call."""
        start = len(self.tokens)
        if self.logprobs is not None:
            self.logprobs.extend(new_logprobs.tolist())
        self.finish = self._finish(new)
        if self.logprobs is not None:
            del self.logprobs[len(self.tokens):]
        return self.tokens[start:]

    def output(self, stats: GenerationStats) -> GenerationOutput:
        """The generation's result, `stats` counting the emitted tokens."""
        stats.new_tokens = len(self.tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationOutput(tokens=self.tokens, text=text, stats=stats, finish_reason=self.finish,
                                logprobs=self.logprobs)

    def _finish(self, new: list[int]) -> str | None:
        out, cfg = self.tokens, self.cfg
        start = len(out)
        out.extend(new)
        if not cfg.ignore_eos:
            for i in range(start, len(out)):
                if out[i] in self.eos:
                    del out[i + 1:]
                    return "eos"
        if cfg.stop_strings and self.tokenizer is not None:
            cut = self._stop_string_cut(start, cfg.stop_strings)
            if cut is not None:
                del out[cut:]
                return "stop_string"
        if len(out) >= cfg.max_new_tokens:
            del out[cfg.max_new_tokens:]
            return "length"
        return None

    def _stop_string_cut(self, start: int, stops: tuple[str, ...]) -> int | None:
        # Find the first new token whose arrival completes a stop string.
        # Any stop string completed this round ends within the new tokens; a window of
        # earlier tokens covers one that began before them.
        out = self.tokens
        lo = max(0, start - 32)
        for end in range(start + 1, len(out) + 1):
            text = self.tokenizer.decode(out[lo:end], skip_special_tokens=False)
            if any(s in text for s in stops):
                return end
        return None
