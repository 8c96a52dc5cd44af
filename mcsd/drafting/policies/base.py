"""The small protocol every tree policy follows, and the frontier it judges.

A policy owns the *largest* tree it may grow (a `TreeTopology`, whose mask is
built once) and decides, round by round, how much of it to use:

- `bind_drafter(drafter)` is told the draft source once (for policies that
  read its hidden states);
- `begin_round()` returns the depth limit for this round;
- `expand(frontier)` sees one level of frontier nodes (as tensors, in one
  call), each with the draft distribution its children would be drawn from,
  and returns how many children each gets; all zeros stops drafting;
- `observe(n_accepted, tree)` hears how the round went, and
  `observe_timing(tree, draft_ms, verify_ms, forward_ms, context)` what it took;
  a round it drafted nothing for (and no context was grafted into) runs as
  the plain loop's step, and `observe_step(ms, forward_ms, context)` hears of it alone.

Why decide per *parent* and not per drawn child: under sampling, a child's
own token must not decide whether it is verified (keeping only the children
the draft happens to like skews the candidates away from q and breaks exact
rejection sampling). A decision made from the parent's distribution, before
its children are drawn, never does. Under greedy decoding the children are
the parent's top-k, so the same hook sees everything it needs.

Policies never touch models, caches or masks; the decoder does that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...core.tree import DraftTree, TreeTopology


@dataclass(frozen=True)
class Frontier:
    """The nodes whose children come next (F nodes at one depth).

    Attributes:
        depth: depth of the frontier nodes (their children land at depth + 1).
        nodes: (F,) long indices in the current tree.
        max_children: (F,) long, how many children the topology allows each.
        probs: (F, V) float, the draft distribution each node's children are
            drawn from (greedy: softmax of the draft logits; sampling: the
            processed q_draft); (F, K) over a drafter's sub-vocabulary where it
            scores one (`mcsd.drafting.draft.Drafter`), the other tokens' 0s left out.
        tree: the tree grown so far (frontier included).
    """

    depth: int
    nodes: torch.Tensor
    max_children: torch.Tensor
    probs: torch.Tensor
    tree: DraftTree


class Gate:
    """Whether a proposer runs this round, from what its rounds have been worth.

    `value` is a running mean of each run round's worth in ms (what it gained less what it cost, the
    caller's arithmetic), the first round's its own worth (a new text's gate is open with no worth
    yet, not with a round worth 0 that would halve its first loss and so its wait); while it is
    negative the proposer sits out and is tried again after
    `probe_every` rounds, each probe that loses doubling the wait up to `max_gap`, and one that wins
    resetting it. `memory` weighs the latest round in the mean; with `probe_alone` a probe is judged
    on its own round, so one that pays opens the gate at once.

    With `budget` (a fraction) and the plain step's price passed to `observe`, a losing gate also waits
    long enough that its probes cost at most `budget` of the plain rounds it sits out: after a value of
    -L ms, at least L / (budget x step) rounds. Where drafting loses a lot a round (a costly drafter,
    sampling at a high temperature) a few probes a generation are then all it pays; where it loses
    little, the doubling alone decides, as without a budget.
    """

    def __init__(self, probe_every: int, max_gap: int, memory: float = 0.5, probe_alone: bool = False,
                 budget: float | None = None):
        self.probe_every, self.max_gap, self.memory, self.probe_alone = probe_every, max_gap, memory, probe_alone
        self.budget = budget
        self.reset()

    def reset(self) -> None:
        """Open: the next round runs."""
        self.value = 0.0
        self.observed = False           # a round observed since the reset
        self.skipped = 0                # rounds in a row sat out (0: the last round asked ran)
        self.gap = self.probe_every     # rounds to sit out before the next probe

    def start_from(self, value: float, step_ms: float | None = None) -> None:
        """After a reset: start from a worth measured before this text (`value` ms a round, a prior), as
        if observed: a negative one sits out the wait a probe that lost that much would (`budget` with
        `step_ms`, a plain step's price), and the first round of the text's own decides from there."""
        self.value, self.observed = value, True
        if value < 0:
            self.gap = self._budget_gap(self.probe_every, step_ms)

    def opens(self) -> bool:
        """Whether this round runs; call once a round."""
        skip = self.value < 0 and self.skipped < self.gap
        self.skipped = self.skipped + 1 if skip else 0
        return not skip

    def will_open(self) -> bool:
        """Whether the next `opens` will open, asked without counting a round (no round observed
        between the two)."""
        return not (self.value < 0 and self.skipped < self.gap)

    def rounds_shut(self) -> int:
        """Rounds that will sit out before the next one `opens` runs (0: the next runs), asked without
        counting a round; exact unless the gate is reset from outside (only a round that ran changes
        its value)."""
        return 0 if self.will_open() else self.gap - self.skipped

    def sit_out(self, rounds: int) -> None:
        """`rounds` rounds sat out, counted at once (each a shut `opens`): only where `rounds_shut` said
        at least that many would."""
        self.skipped += rounds

    @property
    def ran(self) -> bool:
        """The round `opens` was last asked about runs."""
        return self.skipped == 0

    def observe(self, value: float, step_ms: float | None = None) -> None:
        """What a round that ran was worth, in ms; `step_ms`: a plain step's price (for `budget`)."""
        was_losing = self.value < 0
        self.value = value if (was_losing and self.probe_alone) or not self.observed else \
            (1 - self.memory) * self.value + self.memory * value
        self.observed = True
        if self.value >= 0:
            self.gap = self.probe_every
            return
        gap = min(2 * self.gap, self.max_gap) if was_losing else self.gap   # a probe that lost: wait longer
        self.gap = self._budget_gap(gap, step_ms)

    def _budget_gap(self, gap: int, step_ms: float | None) -> int:
        """`gap`, or with a budget, at least the wait that keeps a probe losing `-value` ms within it."""
        if self.budget and step_ms:
            gap = max(gap, min(math.ceil(-self.value / (self.budget * step_ms)), self.max_gap))
        return gap


class LookupGate(Gate):
    """Context drafting's gate: whether a round looks up the context, from what a lookup is expected to
    be worth. A lookup either finds a graft, worth what its round gained (its accepted nodes less their
    rows and the graft's work), or finds nothing and costs its own time; the two are kept apart: the
    share of lookups that found a graft (`found`, a running rate) and what a graft has been worth
    (`graft_value`, a running mean judged on its own after losing, as `Gate`'s with `probe_alone`), so
    `value` = found x graft_value - (1 - found) x a miss's cost. A lookup that finds nothing then moves
    the rate, not what grafts are worth: on text that repeats in bursts, misses between the bursts
    (about a hundredth of a step each) no longer shut a gate whose grafts gain several steps.

    While `value` is negative the gate sits out `probe_every` rounds, and with `budget` long enough
    that its probes cost at most that share of the rounds it waits (`Gate`), without doubling: the
    budget alone bounds what lookups that keep missing, or grafts that keep losing, cost.
    """

    def __init__(self, probe_every: int, max_gap: int, memory: float, budget: float | None = None):
        super().__init__(probe_every, max_gap, memory, probe_alone=True, budget=budget)

    def reset(self) -> None:
        super().reset()
        self.found = 1.0                # share of lookups that found a graft (a new text: as if all did)
        self.graft_value = 0.0          # running ms a grafting round gained
        self.miss_ms = 0.0              # what a lookup that found nothing cost

    def observe(self, value: float, step_ms: float | None = None) -> None:
        """A round that grafted was worth `value` ms; `step_ms`: a plain step's price (for `budget`)."""
        losing = self.value < 0
        self.graft_value = value if losing and self.probe_alone else \
            (1 - self.memory) * self.graft_value + self.memory * value
        self._weigh(1.0, step_ms)

    def missed(self, cost_ms: float, step_ms: float | None = None) -> None:
        """A lookup found nothing, at `cost_ms`."""
        self.miss_ms = cost_ms
        self._weigh(0.0, step_ms)

    def _weigh(self, found: float, step_ms: float | None) -> None:
        self.found = (1 - self.memory) * self.found + self.memory * found
        self.value = self.found * self.graft_value - (1 - self.found) * self.miss_ms
        self.gap = self.probe_every if self.value >= 0 else self._budget_gap(self.probe_every, step_ms)


class TreePolicy:
    """Base class: grow the whole topology every round (a static tree)."""

    name = "base"
    default_tree = "4,2,2"   # the largest tree this policy grows when none is given (benchmarks use it)

    def __init__(self, topology: TreeTopology):
        self.topology = topology

    def begin_round(self) -> int:
        """Depth limit for this round's tree."""
        return self.topology.max_depth

    def rounds_to_draft(self) -> int:
        """After `begin_round`: how many rounds will surely draft nothing before the next one that may
        (0: the next may). A drafter that reads the target's features skips them for the plain steps
        further than its resume window from a drafted round (`mcsd.decoding.propose`)."""
        return 0

    def sit_out(self, rounds: int) -> None:
        """`rounds` rounds this policy was not asked about, each one `rounds_to_draft` said would draft
        nothing (a quiet run's, told when it ends: `mcsd.decoding.propose`): counted as such rounds."""

    def expand(self, frontier: Frontier) -> torch.Tensor | None:
        """(F,) long children per frontier node (clamped to max_children), or None for the maximum."""
        return None

    def level_added(self, kept: torch.Tensor) -> None:
        """Called after a level was appended. kept: (F, k) bool, which (frontier node, rank)
        children exist (row-major = the order they were appended in)."""

    def given_level(self, n: int) -> None:
        """Called when the first level was given, not drafted (n candidate roots of the lossy
        multi-root variant); they count as certain."""

    def continue_drafting(self, tree: DraftTree, new_nodes: torch.Tensor) -> bool:
        """Whether to run the next draft forward over `new_nodes` (the level just added)."""
        return True

    def bind_drafter(self, drafter) -> None:
        """Called once by the decoder with its drafter. A policy that reads the draft's last hidden
        states sets `drafter.keep_hidden = True` here and reads `drafter.last_hidden` ((F, H), the
        frontier's rows, in order) in `expand`."""

    wants_target_logits = False   # True: the decoder also calls observe_target after each verify

    def observe_target(self, tree: DraftTree, logits: torch.Tensor) -> None:
        """The target's logits (N, V) at every node of the verified tree (trace collection)."""

    def observe(self, n_accepted: int, tree: DraftTree, shared: int = 0) -> None:
        """Called after verification with the number of accepted draft tokens; `shared` of them, the
        first, context drafting proposed too (they would have been accepted without this tree)."""

    def observe_timing(self, tree: DraftTree, draft_ms: float, verify_ms: float,
                       forward_ms: float | None = None, context: int | None = None) -> None:
        """Called after each round with its measured draft time (policy decisions included), verify
        time and, where known, the target forward's part of it, in milliseconds, and the cache
        positions that forward read (`context`); cost-aware policies correct their costs with it."""

    def observe_step(self, ms: float, forward_ms: float | None = None, context: int | None = None) -> None:
        """Called after a round this policy drafted nothing for (`begin_round` gave 0 and no context
        was grafted), run as a plain step of `ms` milliseconds (`forward_ms` the target forward's
        part, where known, over a cache of `context` positions); `observe` and `observe_timing` are
        not called for it."""

    def expected_tokens(self) -> float | None:
        """Tokens this round's tree is expected to emit (the target's own included), once
        drafting ended; None when the policy has no estimate. Prices context proposals."""
        return None

    def node_probabilities(self) -> list[float] | None:
        """Each node of this round's tree's probability of being accepted (N host floats), where the
        policy estimates it (None otherwise). Prices context proposals beneath drafted nodes."""
        return None

    def decoding(self, sampling) -> None:
        """The sampling settings (`mcsd.config.SamplingConfig`) of the rounds that follow: told before
        a generation's first round and whenever they change."""

    def reset(self) -> None:
        """Called at the start of every generation."""
