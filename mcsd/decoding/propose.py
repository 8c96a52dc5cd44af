"""A round's proposal: the tree the target verifies, from up to three proposers.

- the model drafter grows a tree under the target-initialised root, level by level, as its
  policy shapes it (`mcsd.drafting.draft.grow_tree`);
- the context drafter grafts free branches from the prompt, the output so far and the target's
  recycled predictions beneath the root and the drafted nodes (`mcsd.drafting.context`);
- with lossy_target_roots W, the target's own top-W tokens after the last accepted token are the
  tree's first level (the MCSD paper's variant; not lossless, greedy only).

After verification the proposers hear how the round went: the drafter's cache keeps the accepted
path, context drafting counts its accepted nodes, the policy sees the drafted part's acceptance and
the round's timings.

Context drafting has a gate of its own (`policies.base.LookupGate`; the learned policy has a `Gate`
for the model drafter): what a lookup is expected to be worth, from the share of lookups that found a
graft, the running value of the rounds it grafted into (its accepted nodes' worth in one-token steps,
less its nodes' verify time and the graft's work) and the price of a lookup that finds nothing, all
from the costs, not this run's clock; while that is negative it sits out, and is tried again after
`CONTEXT_PROBE_EVERY` rounds or as long as keeps its probes within `CONTEXT_BUDGET`, up to
`CONTEXT_MAX_GAP`. Where context candidates are rarely the target's draw its rounds are then plain
steps, without the lookups and their verify rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingConfig
from ..core.tree import DraftTree
from ..core.verify import Acceptance
from ..drafting.context import ContextDrafter, Graft
from ..drafting.draft import Drafter, GrownTree, grow_tree
from ..drafting.policies import TreePolicy
from ..drafting.policies.base import LookupGate
from .row_budget import BesideCosts

CONTEXT_PROBE_EVERY = 3             # rounds without context drafting before it is tried again
CONTEXT_MAX_GAP = 48                # the longest wait after a probe that lost
CONTEXT_MEMORY = 0.125              # weight of the latest grafting round in the gate's running value
CONTEXT_BUDGET = 0.0025             # lookups that lose cost at most this share of the plain steps they wait
# plain steps before a drafted round whose target features a feature drafter reads; a step further from
# the next round the policy may draft leaves them out (the head starts over from the last of these)
RESUME_WINDOW = 8
QUIET_MAX = 2 ** 31                 # a quiet run's bound where no policy gate bounds it (context drafting alone)


@dataclass
class Proposal:
    """One round's tree and where its parts came from.

    Attributes:
        grown: the tree to verify (context nodes merged in) with the draft distributions.
        drafted: the model drafter's part of it (the root alone when nothing was drafted).
        graft: context drafting's nodes, or None.
        depth: levels the model drafter was asked for (0: none).
        expected: tokens the round is expected to emit (the drafted tree's estimate, plus what the
            grafted nodes add), where the round priced context nodes or ran in a batch; else None.
    """

    grown: GrownTree
    drafted: DraftTree
    graft: Graft | None
    depth: int
    expected: float | None = None

    def emitted(self, acc: Acceptance, lossy: bool) -> torch.Tensor:
        """(k,) the tokens a round emits: the accepted path below the root, then the target's own next
        token (lossy: not that one; the next round's candidate roots stand in for it)."""
        new = self.grown.tree.tokens[acc.path[1:]]
        return new if lossy else torch.cat([new, acc.next_token.reshape(1)])


class Proposer:
    """The proposers of one generation and what they learn from its rounds.

    Args:
        policy: shapes the model drafter's tree (also the root-only tree without a drafter).
        drafter: the model drafter, or None.
        context: the context drafter, or None.
        lossy: W > 0: the target's top-W tokens are each round's candidate roots (needs a drafter).
        context_costs: `mcsd.costs.cost_model.Costs` pricing a context node's verify time, or None.

    Attributes:
        hidden: the target layers whose hidden states the drafter reads (a tuple), or False.
    """

    def __init__(self, policy: TreePolicy, drafter: Drafter | None, context: ContextDrafter | None,
                 lossy: int = 0, context_costs=None):
        self.policy, self.drafter, self.context, self.context_costs = policy, drafter, context, context_costs
        self.lossy = lossy if drafter is not None else 0
        self.hidden = (tuple(getattr(drafter, "feature_layers", (-1,)))    # default: the last layer
                       if getattr(drafter, "uses_target_hidden", False) else False)
        self.roots: torch.Tensor | None = None          # lossy: (W,) this round's candidate roots
        self._drafted_accepts: list[int] = []           # per round, the drafted part's accepted count
        self._sampling: SamplingConfig | None = None     # the settings the policy was last told
        # context is right in bursts (a repeated span) and wrong in between: a long memory while it
        # grafts, and a probe judged on its own round, so one that pays opens the gate again
        self.context_gate = LookupGate(CONTEXT_PROBE_EVERY, CONTEXT_MAX_GAP, CONTEXT_MEMORY, CONTEXT_BUDGET)
        self._quiet = 0                 # rounds of the quiet run ahead (`_quiet_rounds`)
        self._quiet_done = 0            # ... and run since its start, not yet told to the gates (`_settle`)

    def reset(self) -> None:
        """Before the prefill: the policy and the drafter start a new sequence."""
        self.policy.reset()
        self._sampling = None
        self._quiet = self._quiet_done = 0
        if self.drafter is not None:
            self.drafter.reset()
        self.context_gate.reset()

    @property
    def context_value(self) -> float:
        """Ms a lookup is expected to gain (the context gate's value, `LookupGate`); < 0: looking up loses."""
        return self.context_gate.value

    def start(self, prompt_ids: torch.Tensor, logits: torch.Tensor, prompt_hidden=None) -> None:
        """After the prefill: the proposers read the prompt (T,) and the target's last logits (1, V), the
        drafter the target's features of every prompt position (`prompt_hidden`), or skips them where
        `step_hidden` left them out."""
        if self.hidden:
            self._feed(prompt_hidden, prompt_ids.numel())
        if self.context is not None:
            self.context.reset(prompt_ids)
            self.context.observe_logits(prompt_ids[-1:], logits[-1:])   # the prompt's last token's, recycled
        if self.lossy:                     # the target's top-W become the first round's candidate roots
            self.roots = logits[-1].topk(self.lossy).indices

    def propose(self, sequence: torch.Tensor, remaining: int, sampling: SamplingConfig, gen,
                scores=None, noise=None, context_nodes: int | None = None,
                beside: tuple[int, float] | None = None) -> Proposal:
        """The tree beneath the root `sequence[-1]` ((T,) committed tokens) for a round that may emit
        `remaining` more tokens; `scores` (`mcsd.core.processors.NodeScores`) processes drafted logits;
        `noise` (`mcsd.core.sampling.PositionNoise`) ranks sampled candidates by the target's own noise;
        `context_nodes` bounds the nodes context drafting grafts this round (a batch's share);
        `beside` (a batched round): (rows, expected tokens) of the other slots' blocks in the same
        forward, so that a grafted node is priced by what it adds to the whole round.

        Returns None where the round drafts nothing and grafts nothing (`plain`), the context's lookup
        included when it finds nothing: it is then the plain loop's step (`TreeDecoder._step`), with no
        tree made; so is a round of a quiet run, which asks nothing of the proposers (`_quiet_rounds`)."""
        if self._quiet and beside is None:
            self._quiet -= 1
            self._quiet_done += 1
            return None
        if self._quiet_done:
            self._settle()
        policy, drafter = self.policy, self.drafter
        if sampling is not self._sampling:                 # the policy prices nodes for these settings
            self._sampling = sampling
            policy.decoding(sampling)
        depth = min(policy.begin_round(), remaining - (0 if self.lossy else 1)) if drafter is not None else 0
        if self.lossy:
            depth = max(depth, 1)                           # the candidate roots are this round's level 1
        elif depth and self.hidden and self.drafter.unfed:
            # the policy drafts sooner than `rounds_to_draft` said (its gate reset from outside, say): the
            # drafter has no features since it skipped them, so this round is a plain step that takes them
            depth = 0
        grafting = self.context is not None and self.context_gate.opens()
        if depth == 0 and not grafting and beside is None:
            self._quiet = self._quiet_rounds()
            return None
        if depth == 0 and beside is None:                   # context alone: chosen on the host, tree after
            return self._context_round(sequence, context_nodes, noise)
        grown = (grow_tree(drafter, policy, sequence, depth, sampling, gen, root_children=self.roots, scores=scores,
                           noise=noise)
                 if depth > 0 else GrownTree(DraftTree.root_only(policy.topology, sequence[-1]), None))
        drafted, graft, expected = grown.tree, None, None
        left = depth > 0 and drafted.size == 1 and beside is None and not self.lossy   # after its first level
        if left and not grafting:
            self._left(drafted)
            return None
        if grafting or beside is not None:
            expected = expected_tokens(policy, self._drafted_accepts, drafted.size)
        if grafting:                                        # free branches from the context, merged in
            costs, others = self.context_costs, 0.0
            if beside is not None and costs is not None:
                costs, others = BesideCosts(costs, beside[0]), beside[1]
            spent_ms = round_ms(drafted, costs)             # from costs, not this run's clock
            probs = policy.node_probabilities()
            graft = self.context.graft(drafted, sequence, expected + others, spent_ms, costs,
                                       probs if probs is not None and len(probs) == drafted.size else None,
                                       max_nodes=context_nodes, noise=noise)
            if left and graft.tree.size == drafted.size:
                # left after its first level and nothing found: the lookup's price into the gate, and the
                # round is the plain loop's step (a tree of the root alone would cost its verify machinery)
                self._value_context(0, drafted.size, drafted.size)
                self._left(drafted)
                return None
            grown = grown.with_graft(graft)
            expected += graft.gain
        return Proposal(grown, drafted, graft, depth, expected)

    def _context_round(self, sequence: torch.Tensor, context_nodes: int | None, noise=None) -> Proposal | None:
        """A round that drafts nothing but grafts (the context gate open): the graft's choice beneath the
        root, priced as `propose` prices a tree of the root alone, is made on the host first; a lookup that
        finds nothing that pays goes into the gate at its price and the round is the plain loop's step
        (None), with no tree made; else the root's tree with the chosen nodes."""
        costs = self.context_costs
        choice = self.context.choose_under_root(sequence, round_ms(None, costs), costs, max_nodes=context_nodes,
                                                noise=noise)
        if choice is None:
            self._value_context(0, 1, 1)
            return None
        drafted = DraftTree.root_only(self.policy.topology, sequence[-1])
        graft = self.context.grafted(drafted, choice)
        return Proposal(GrownTree(drafted, None).with_graft(graft), drafted, graft, 0, 1.0 + graft.gain)

    def _quiet_rounds(self) -> int:
        """After a round every gate sat out: how many rounds after it are surely plain steps that need
        nothing from the proposers, a quiet run: the policy drafts nothing (`rounds_to_draft`) and the
        drafter takes no target features (further than `RESUME_WINDOW` from its next round), context
        drafting looks nothing up and recycles nothing (its gate stays shut until after the run's last
        step). Those rounds are the plain loop's steps with no proposer asked but the policy, which
        hears each step's time for its staleness check: the gates and the drafter hear of them at once
        when the run ends (`_settle`)."""
        rounds = self.policy.rounds_to_draft() if self.drafter is not None else QUIET_MAX
        if self.hidden:
            rounds -= RESUME_WINDOW
        if self.context is not None:
            rounds = min(rounds, self.context_gate.rounds_shut() - 1)
        return max(rounds, 0)

    def _settle(self) -> None:
        """The rounds of a quiet run told at once: sat out by both gates (each would have been a shut
        gate's `opens`), the drafter's features of their positions skipped, nothing drafted in them."""
        rounds, self._quiet, self._quiet_done = self._quiet_done, 0, 0
        if self.drafter is not None:                # the policy is asked only where there is a drafter
            self.policy.sit_out(rounds)
        if self.context is not None:
            self.context_gate.sit_out(rounds)
        if self.hidden:
            self.drafter.skip_target(rounds)
        self._drafted_accepts.extend([0] * rounds)

    def _left(self, drafted: DraftTree) -> None:
        """A round the policy left after its first draft forward (`drafted`: the root alone) that runs
        as the plain loop's step: the drafter keeps the root's entry, and the policy hears of it."""
        self.drafter.commit(torch.zeros(1, dtype=torch.long, device=drafted.tokens.device))
        self.policy.observe(0, drafted)

    def observe(self, proposal: Proposal, acc: Acceptance, path_hidden: torch.Tensor | None,
                last_logits: torch.Tensor, draft_ms: float, verify_ms: float,
                forward_ms: float | None = None, context: int | None = None) -> None:
        """After verification: commit the accepted path to the drafter's cache and tell the proposers
        how the round went. `path_hidden` holds the target's hidden states along the committed path
        (where the drafter reads them), `last_logits` (V,) the target's after the deepest accepted node;
        `verify_ms` is the whole verification, `forward_ms` the target forward's part of it, if known,
        over a cache of `context` positions."""
        if self.hidden:
            self.drafter.observe_target(path_hidden)                 # features of root .. deepest accepted
        if self.drafter is not None and proposal.depth > 0:
            self.drafter.commit(acc.path)
        path, base = acc.path.tolist(), proposal.drafted.size
        if proposal.graft is not None:
            self.context.observe(proposal.graft, path)
            accepted = sum(node >= base for node in path)              # grafted nodes on the accepted path
            self._value_context(accepted, base, proposal.grown.tree.size)
        # the policy hears about its own tree: the accepted path's drafted part, and how much of it
        # context drafting proposed too
        self._drafted_accepts.append(sum(node < base for node in path) - 1)
        self.policy.observe(self._drafted_accepts[-1], proposal.drafted, shared_prefix(proposal, path))
        self.policy.observe_timing(proposal.grown.tree, draft_ms, verify_ms, forward_ms, context)
        if self.lossy:
            self.roots = last_logits.topk(self.lossy).indices

    def step_hidden(self) -> bool | tuple[int, ...]:
        """The target layers a plain step (or the prefill) returns for the drafter (as `hidden`), or
        False: none where it reads none, and none where the policy will draft nothing for more than
        `RESUME_WINDOW` rounds after this one (the head then starts over from the steps' features that
        follow: `FeatureDrafter.skip_target`), a quiet run's step included. Ask after `propose` gave
        None, or after `reset`."""
        if self._quiet_done or (self.hidden and self.policy.rounds_to_draft() >= RESUME_WINDOW):
            return False
        return self.hidden

    def observe_step(self, root: torch.Tensor, logits: torch.Tensor, states: torch.Tensor | None,
                     ms: float, forward_ms: float | None = None, context: int | None = None) -> None:
        """After a plain step (`propose` gave None): the drafter's features of the root (the target's
        hidden states `states` (1, H), fused when it next drafts; None where `step_hidden` left them
        out), the target's top-k after the root (`logits` (1, V)) recycled only where the next round
        grafts, and the policy hears the step's time (`ms`, `forward_ms` its target forward, over a cache
        of `context` positions); of a quiet run's step only its time, the rest told when the run ends
        (`_settle`)."""
        if self._quiet_done:
            self.policy.observe_step(ms, forward_ms, context)       # the staleness check's measure
            return
        if self.hidden:
            self._feed(states, 1)
        if self.context is not None and self.context_gate.will_open():
            self.context.observe_logits(root, logits)
        self._drafted_accepts.append(0)
        self.policy.observe_step(ms, forward_ms, context)

    def _feed(self, states: torch.Tensor | None, n: int) -> None:
        """The drafter's features of the next `n` committed positions: the target's states (n, L*H), or
        None where `step_hidden` left them out (the drafter skips them)."""
        if states is None:
            self.drafter.skip_target(n)
        else:
            self.drafter.observe_target(states)

    def recycles(self, proposal: Proposal) -> bool:
        """Whether a round's verify records the target's predictions along its path for context
        drafting (recycling): where this round grafted or the next one will; a round between
        rounds that do not graft skips the top-k."""
        return self.context is not None and (proposal.graft is not None or self.context_gate.will_open())

    def _value_context(self, accepted: int, base: int, size: int) -> None:
        """What a grafting round was worth, into the context gate (needs costs): its `accepted` grafted
        nodes at a step each, less the verify of the nodes it grafted (the tree of `base` nodes grown to
        `size`) and the graft's lookup and merge, and for a tree of the root alone and its graft that
        round's own work; a lookup that found nothing (`size` == `base`) costs its own price."""
        costs = self.context_costs
        if costs is None:
            return
        step = costs.verify_ms(1)
        if size == base:
            self.context_gate.missed(costs.lookup_ms, step)
            return
        own = costs.context_round_ms if base == 1 else 0.0
        self.context_gate.observe(accepted * step - (costs.verify_ms(size) - costs.verify_ms(base))
                                  - costs.graft_ms - own, step)

    def record(self, stats) -> None:
        """The proposers' totals into a `GenerationStats`."""
        if self.drafter is not None:
            stats.draft_forwards = self.drafter.forwards
        if self.context is not None:
            stats.context_nodes, stats.context_accepted = self.context.proposed_nodes, self.context.accepted_nodes
        stats.policy_s = getattr(self.policy, "predict_s", 0.0)


def shared_prefix(proposal: Proposal, path: list[int]) -> int:
    """How many accepted drafted nodes, from the root down (`path`: the accepted path's node indices,
    root first), context drafting proposed as well (each beneath one it proposed too, so it would have
    reached them without the drafted tree)."""
    graft = proposal.graft
    if graft is None or not graft.proposed:
        return 0
    shared, base = 0, proposal.drafted.size
    for node in path[1:]:
        if node >= base or node not in graft.proposed:
            break
        shared += 1
    return shared


def round_ms(tree: DraftTree | None, costs) -> float:
    """A round's time before context nodes, in ms, from the costs alone (so that the graft, and the
    output, do not depend on how long this run's forwards happened to take): the draft forwards that
    grew `tree` (one per level but the last, over that level's nodes), the drafted round's own work
    (`Costs.round_ms`) and its verify; `tree` None: the root alone (a plain step's verify)."""
    if costs is None:
        return 0.0
    if tree is None:
        return costs.verify_ms(1)
    widths = torch.bincount(tree.depth).tolist()[:-1]                 # nodes per level fed to the drafter
    own = costs.round_ms if tree.size > 1 else 0.0
    return sum(costs.draft_ms(w) for w in widths) + own + costs.verify_ms(tree.size)


def expected_tokens(policy: TreePolicy, drafted_accepts: list[int], drafted_size: int) -> float:
    """Tokens this round should emit before context nodes: 1 for the root alone, else the policy's
    estimate for its tree where it has one, else 1 + the mean accepted from drafted trees in recent
    rounds (context branches' acceptances are not the drafter's)."""
    if drafted_size == 1:                     # the root alone: it is the one token for sure
        return 1.0
    own = policy.expected_tokens()
    if own is not None:
        return own
    recent = drafted_accepts[-16:]
    return 1.0 + sum(recent) / max(len(recent), 1)
