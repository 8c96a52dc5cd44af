"""A learned tree policy: scikit-learn acceptance models decide which branches to grow and when to stop.

For every candidate child (frontier node f, sibling rank r) the policy asks an
acceptance model, in one call per level (`AcceptanceModel.level_rows`: the level's
columns read from the device once, the score summed on the host),
for P(accepted | parent accepted) from the candidate's features (the columns
`FEATURE_NAMES`, as `candidate_features` builds them). Multiplying along the
path gives each candidate's probability of being on the accepted path, i.e.
its expected contribution to the tokens a round emits. Candidates are added
best first while they raise the expected tokens per second of the round, with
costs from the device profile (verify time against tree size, draft time per
level). When none pays, drafting stops.

Models are stored as plain JSON parameters (logistic regression coefficients,
or gradient-boosted regression trees as arrays), evaluated here with torch (a
logistic model's level in Python floats on its columns read once);
loading never runs code from the file. scikit-learn is only needed to *fit*
them (tools/train_decision_models.py).

Exactness: the decision for node f's children uses only f's own draft
distribution and its ancestors, before any child is drawn (see base.py), so
greedy and sampled output stay exactly the target's.
"""

from __future__ import annotations

import time
import contextlib
from pathlib import Path

import torch

from ...config import ConfigError
from ...core.tree import DraftTree, TreeTopology
from ...costs.cost_model import Costs
from .acceptance import (
    AcceptanceModel,
    default_model_path,
    drafter_model_path,
)
from .base import Frontier, Gate, TreePolicy


def choose_best_first(path: torch.Tensor, tokens: torch.Tensor, time_ms: torch.Tensor, n_now: torch.Tensor,
                      verify_ms: torch.Tensor) -> torch.Tensor:
    """`LearnedPolicy._choose` as tensor operations, nothing read on the host (the fixed-shape round).

    The same arithmetic in the same order: the candidates sorted best first (a stable sort, so equal
    values keep their row-major order, as Python's `sorted` keeps them), the running tokens and times
    as float64 sums from the left (`cumsum`, sequential on a CPU), and the first candidate that does
    not pay ends the choice.

    Args:
        path: (F, k) float32 candidates' path probabilities (0: not a candidate).
        tokens: () or (1,) float64 expected tokens of the tree so far (its path probabilities' sum).
        time_ms: () or (1,) float64 the round's time so far (draft levels + the verify of `n_now` nodes).
        n_now: () or (1,) long nodes in the tree so far.
        verify_ms: (M,) float64 the verify time of n nodes at index n, for n up to the most
            nodes a level can leave (indices past it are clamped; they are never reached).
    Returns:
        (F,) long children per node (its contiguous ranks from 0), as `_choose` returns them.
    """
    flat = path.flatten()
    values, order = torch.sort(flat, descending=True, stable=True)                    # (M,)
    v = values.double()
    steps = torch.arange(v.numel(), device=v.device)
    n = (n_now + steps).clamp_max(verify_ms.numel() - 2)
    dt = verify_ms.index_select(0, n + 1) - verify_ms.index_select(0, n)                # (M,)
    before = torch.cat([tokens.reshape(1), v[:-1]]).cumsum(0)                          # tokens before step i
    times = torch.cat([time_ms.reshape(1), dt[:-1]]).cumsum(0)                          # time before step i
    pays = (v > 0) & ((before + v) * times > before * (times + dt))
    taken = pays.long().cumprod(0).bool()                                               # until the first that does not
    take = torch.zeros_like(taken).scatter(0, order, taken)
    return take.view(path.shape).long().cumprod(dim=1).sum(dim=1)


# ---------------------------------------------------------------------------- the policy

class LearnedPolicy(TreePolicy):
    """Grow the branches whose predicted path acceptance pays for their draft and verify time.

    Expected tokens of a round = 1 (the target's own token) + the sum of the
    tree nodes' path probabilities; its time = the draft levels run + the
    verify of all nodes. Candidates are taken best first while they raise
    tokens per millisecond; the next draft level runs only if its best
    plausible gain (the new nodes' path probabilities times the recent
    acceptance rate) pays for that level's draft time.

    Drafting itself is gated, so that the policy is never much slower than
    plain decoding: a running mean of what drafting has been worth per round
    (accepted tokens times a target step, less the draft and extra verify
    time spent) decides whether the next round drafts at all. While it is
    negative the draft sits out and is tried again after `probe_every`
    plain rounds; each probe that loses doubles the wait (up to
    `max_probe_gap`), and the wait is at least long enough that the probes
    cost at most `probe_budget` of the plain steps sat out (a probe that lost
    2 ms where a step costs 6.4 waits 125 rounds at 0.25%), so on a machine or text
    where drafting never pays the probes cost about that much, and one that
    wins resets it (`base.Gate`, which context drafting shares). A round
    whose first level cannot gain on a plain step (its chosen nodes'
    expected tokens, the likeliest continued at the running acceptance,
    against the rest of the round's price) drafts nothing after that first
    draft forward (`leave_unpaying`; the loop's rounds: the fixed-shape
    round drafts its levels on the device). A round without drafting is a
    plain target step; the draft catches up on the skipped tokens in its
    next forward, a feature head from the steps just before it
    (`rounds_to_draft`, `mcsd.decoding.propose.RESUME_WINDOW`). The gate
    starts again at each generation's `reset`, so a request's trees never
    depend on the requests before it: open, or where this machine's own
    drafted rounds on a fixed text lost (`prior`, measured with the round
    prices, `mcsd.decoding.round_prices`), shut for the wait a probe that
    lost that much would sit out, so that a drafter that does not pay here
    is not tried at the start of every text.

    Costs come from this machine's calibrated profile, fixed for the run,
    so that the trees grown (and in bfloat16, where a tree's size changes
    the target's rounding, the output) depend only on the inputs and the
    profile, not on how long this run's forwards happened to take.
    `observe_timing` still compares every round's target forward with the
    profile; a profile that persistently disagrees is flagged for
    measuring again (see `mcsd.costs.cost_model.Costs`). With `online_costs` the
    measured times also correct the costs within the run (faster to adapt to
    a machine that slowed down; trees then vary from run to run).

    Acceptance is the drafter's: a drafter whose folder ships its own model
    (`acceptance.json`, fit on that drafter's traces) replaces the generic
    one when the decoder binds it, since how often a draft probability of,
    say, 0.6 is accepted differs from drafter to drafter. A model passed
    as `model` is always kept.

    Args:
        topology: the largest tree allowed (depth and fan-out bounds).
        model: an AcceptanceModel, or a path to one (default: the drafter's
            own model where it ships one, else the generic shipped model).
        costs: device costs (default: `Costs.default()`; see `Costs.from_profile`).
        online_costs: correct the costs within the run from measured round times
            (default False: costs fixed for the run, trees repeatable).

    Attributes:
        model_source: where the acceptance model came from (a path, or "given").
    """

    name = "learned"
    default_tree = "4,3,2,2,1,1,1,1"
    uses_device_profile = True          # the decoder passes costs from the cached device profile
    probe_every = 3                     # plain rounds before drafting is tried again
    max_probe_gap = 256                 # the longest wait after probes that kept losing
    probe_budget = 0.0025               # what losing probes may cost, a fraction of the plain steps sat out
    leave_unpaying = True               # a round whose first level cannot beat a plain step drafts no more

    def __init__(self, topology: TreeTopology, model: AcceptanceModel | str | Path | None = None,
                 costs: Costs | None = None, online_costs: bool = False):
        super().__init__(topology)
        self._model_given = model is not None
        path = None if isinstance(model, AcceptanceModel) else Path(model if model is not None
                                                                   else default_model_path())
        self.model = model if path is None else AcceptanceModel.load(path)
        self.model_source = "given" if path is None else str(path)
        self.costs = costs or Costs.default()
        if not isinstance(online_costs, bool):
            raise ConfigError(f"online_costs must be true or false, got {online_costs!r}")
        self.costs.online = online_costs
        self.predict_s = 0.0          # feature building + prediction time, for the overhead report
        self._path_pred: list[float] = [1.0]             # each node's path probability, this round's tree
        self._last: list[list[float]] | None = None     # the level just expanded: its candidates' path probabilities
        self._every = False                              # inside `every_round`
        self._every_tests = False                        # ... keeping the first-level test
        self.prior: float | None = None                  # ms a drafted round was worth here (`reset`)
        self.shift = self.model.logit_shift(0.0)         # the acceptance model's logit shift (`decoding`)
        self.reset()

    def bind_drafter(self, drafter) -> None:
        own = drafter_model_path(drafter)
        if own is not None and not self._model_given:
            self.model, self.model_source = AcceptanceModel.load(own), str(own)

    def decoding(self, sampling) -> None:
        """Sampled, a node's acceptance is the acceptance model's with the logit shift its file gives for
        the temperature (`AcceptanceModel.logit_shift`); greedy, the shift at temperature 0."""
        self.shift = self.model.logit_shift(0.0 if sampling.greedy else sampling.temperature)

    def reset(self) -> None:
        """A new generation: everything starts over, the draft gate included, so that a request's
        trees (and so, in bfloat16, its rounding) never depend on the requests before it."""
        self.recent = 0.5
        self.predict_s = 0.0
        self._draft_ms = self._draft_base_ms = 0.0      # a drafted round's so far (set as it begins)
        self.forget()

    def forget(self) -> None:
        """Forget what drafting has been worth in this text: the gate starts again, from `prior` where
        that is a loss, else open (the next round drafts)."""
        self.gate = Gate(self.probe_every, self.max_probe_gap, budget=self.probe_budget)
        if self.prior is not None and self.prior < 0:
            self.gate.start_from(self.prior, self.costs.verify_ms(1))

    @contextlib.contextmanager
    def every_round(self, first_level_test: bool = False):
        """Within: every round drafts (the gate opened afresh each round), and says so (`rounds_to_draft`
        0); its levels all, or with `first_level_test` as a probe would (a first level that cannot pay
        is left, the round a plain step): for measuring drafted rounds (`round_prices`, the sampled
        table's fit)."""
        before, self._every, tests = self._every, True, self._every_tests
        self._every_tests = first_level_test
        try:
            yield self
        finally:
            self._every, self._every_tests = before, tests

    @property
    def draft_value(self) -> float:
        """Running ms gained per drafted round; < 0: drafting loses (the gate's value)."""
        return self.gate.value

    @draft_value.setter
    def draft_value(self, value: float) -> None:
        self.gate.value, self.gate.observed = value, True        # a worth held, as if observed

    def begin_round(self) -> int:
        self._path_pred, self._last = [1.0], None                           # the root is certain
        if self._every:
            self.gate.reset()
        if not self.gate.opens():
            return 0                        # a plain step: nothing else of a drafted round is needed
        self._draft_ms = self.costs.draft_ms(1) + self.costs.round_ms         # the root's step, the round's own
        self._draft_base_ms = self.costs.base_draft_ms(1)                     # the same, uncorrected
        return self.topology.max_depth

    def rounds_to_draft(self) -> int:
        return 0 if self._every else self.gate.rounds_shut()

    def sit_out(self, rounds: int) -> None:
        self.gate.sit_out(rounds)

    def expand(self, frontier: Frontier) -> torch.Tensor:
        t0 = time.perf_counter()
        limits = frontier.max_children.tolist()
        k = max(limits)
        parents = [self._path_pred[i] for i in frontier.nodes.tolist()]
        accept = self.model.level_rows(frontier.probs, frontier.tree.logp[frontier.nodes], frontier.depth, k,
                                       parents, self.recent, self.shift)                # F lists of k
        path = [[a * parent if r < limit else 0.0 for r, a in enumerate(row)]
                for row, parent, limit in zip(accept, parents, limits)]
        counts = self._choose(path, frontier.tree.size)
        if frontier.depth == 0 and self.leave_unpaying and (not self._every or self._every_tests) \
                and not self._first_level_pays(path, counts):
            counts = [0] * len(counts)    # the round is a plain step, priced as a drafted round's start
        self._last = path
        self.predict_s += time.perf_counter() - t0
        return torch.tensor(counts, device=frontier.max_children.device)

    def _first_level_pays(self, path: list[list[float]], counts: list[int]) -> bool:
        """Whether the round the first level's chosen nodes begin can gain on a plain step: their
        path probabilities, with the likeliest continued at the running acceptance rate to the
        topology's depth (an optimistic deeper part), each worth a step, against what drafting on
        costs beyond a step (the round's own work, the verify of the chosen nodes, one more draft
        level where the topology has one). A round that cannot is left after its first head forward,
        and the decoder runs the plain step instead of verifying a tree of the root alone."""
        chosen = [v for row, n in zip(path, counts) for v in row[:n]]
        if not chosen:
            return False
        depth, n, step = self.topology.max_depth, len(chosen), self.costs.verify_ms(1)
        deeper = max(chosen) * sum(self.recent ** d for d in range(1, depth))
        rest = self.costs.round_ms + self.costs.verify_ms(1 + n) - step + (self.costs.draft_ms(n) if depth > 1 else 0.0)
        return (sum(chosen) + deeper) * step > rest

    def _choose(self, path: list[list[float]], n_now: int) -> list[int]:
        """Best first, while expected tokens per ms increase; ranks stay contiguous per node. `path`: each
        frontier node's candidates' path probabilities (0: not a candidate); returns the children per node."""
        tokens = sum(self._path_pred)
        time_now = self._draft_ms + self.costs.verify_ms(n_now)
        values = [v for row in path for v in row]
        take = [False] * len(values)
        for i in sorted(range(len(values)), key=values.__getitem__, reverse=True):
            dt = self.costs.verify_ms(n_now + 1) - self.costs.verify_ms(n_now)
            if values[i] <= 0 or (tokens + values[i]) * time_now <= tokens * (time_now + dt):
                break
            take[i] = True
            tokens, time_now, n_now = tokens + values[i], time_now + dt, n_now + 1
        counts, width = [], len(path[0]) if path else 0
        for row in range(len(path)):
            n = 0
            while n < width and take[row * width + n]:
                n += 1
            counts.append(n)
        return counts

    def level_added(self, kept: torch.Tensor) -> None:
        for row, flags in zip(self._last, kept.tolist()):
            self._path_pred.extend(v for v, flag in zip(row, flags) if flag)

    def given_level(self, n: int) -> None:
        self._path_pred.extend([1.0] * n)

    def continue_drafting(self, tree: DraftTree, new_nodes: torch.Tensor) -> bool:
        width = new_nodes.numel()
        gain = max(self._path_pred[i] for i in new_nodes.tolist()) * self.recent    # best next child, roughly
        tokens = sum(self._path_pred)
        time_now = self._draft_ms + self.costs.verify_ms(tree.size)
        extra = self.costs.draft_ms(width) + self.costs.verify_ms(tree.size + 1) - self.costs.verify_ms(tree.size)
        if (tokens + gain) * time_now <= tokens * (time_now + extra):
            return False
        self._draft_ms += self.costs.draft_ms(width)
        self._draft_base_ms += self.costs.base_draft_ms(width)
        return True

    def node_probabilities(self) -> list[float] | None:
        return list(self._path_pred)

    def expected_tokens(self) -> float | None:
        return sum(self._path_pred)

    def observe(self, n_accepted: int, tree: DraftTree, shared: int = 0) -> None:
        self.observe_round(n_accepted, int(tree.depth.max()), tree.size, self._draft_ms, shared)

    def observe_round(self, n_accepted: int, drafted_depth: int, size: int, draft_ms: float,
                      shared: int = 0) -> None:
        """`observe` from a round's numbers (the fixed-shape round has no `DraftTree` on the host):
        its tree's depth and size, and the draft levels' cost `draft_ms` (`round_draft_ms`)."""
        self.recent = running_acceptance(self.recent, n_accepted, drafted_depth)
        if self.gate.ran:                                          # this round drafted
            # worth what only drafting brought: tokens context drafting proposed too came without it
            step = self.costs.verify_ms(1)
            self.gate.observe((n_accepted - shared) * step
                              - (draft_ms + self.costs.verify_ms(size) - step), step)

    def round_draft_ms(self, widths) -> float:
        """The draft levels' cost as `continue_drafting` sums it: the root's step and the round's own
        work (`Costs.round_ms`), then each level the head ran over (its width; 0 for a level it did
        not run), in order."""
        total = self.costs.draft_ms(1) + self.costs.round_ms
        for width in widths:
            if width:
                total += self.costs.draft_ms(width)
        return total

    def observe_timing(self, tree: DraftTree, draft_ms: float, verify_ms: float,
                       forward_ms: float | None = None, context: int | None = None) -> None:
        self.costs.observe("verify", tree.size, self.costs.base_verify_ms(tree.size), verify_ms, forward_ms,
                           context)
        if self.gate.ran:
            self.costs.observe("draft", None, self._draft_base_ms, draft_ms)

    def observe_step(self, ms: float, forward_ms: float | None = None, context: int | None = None) -> None:
        # a plain step: the staleness check's own measure of a 1-row verify (nothing drafted, so the
        # running acceptance and the gate's value are as they were)
        self.costs.observe("verify", 1, self.costs.base_verify_ms(1), ms, forward_ms, context)


def recent_acceptance(recent: float, n_accepted: int, tree: DraftTree) -> float:
    """The `recent_accept` feature: a running mean of accepted / drafted depth per round."""
    return running_acceptance(recent, n_accepted, int(tree.depth.max()))


def running_acceptance(recent: float, n_accepted: int, drafted: int) -> float:
    """`recent_acceptance` from the drafted depth alone."""
    return 0.8 * recent + 0.2 * (n_accepted / drafted) if drafted else recent
