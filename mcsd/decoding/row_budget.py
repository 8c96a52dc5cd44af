"""How many rows each slot's tree may have in a batched round, from the calibrated cost of T rows.

One lone round (`TreeDecoder`) spends on its tree what speculation gains back: verify(T) - verify(1)
more than a plain step. A batched round of B slots gets the same allowance on top of plain batched
decoding's forward: the round's rows R are the most whose verify time stays within

    verify(B) + (verify(T_lone) - verify(1)),

and each slot's tree may have R // B rows (its root included). With one slot that is the lone tree;
as slots join, a row costs more of the forward (its products leave the memory-bound regime) and the
share shrinks toward plain rows: it never falls below the root and one node, so a slot's drafting is
never switched off and on (its context drafter keeps observing its own text every round), and it
never grows back while the batch grows. Costs come from `mcsd.costs.cost_model.Costs` (measured per
machine, pair, dtype and threads); without them the lone tree is divided evenly.

Within its share a slot grafts what pays for its place in the whole round (`BesideCosts`): a context
node joins where its expected tokens, against the round's expected tokens, outweigh what its row adds
to the round's forward beside every other slot's rows. A row beside three others costs more than the
lone tree's next row (the products leave the memory-bound regime), so a slot grafts the nodes likely
to be accepted, not every candidate its share would hold.

Limitations: the costs are a lone sequence's verify of T rows at a fixed prefix; a batch's rows
attend over their own slots' prefixes, each slot's keys and values read in full, so B slots of one row
cost more than B rows of one tree (a 2-core Xeon, SmolLM2-135M, 384 positions a slot: 4 slots 12.3 ms,
11 slots 26.6, one slot 6.7; by the verify curve 11 rows cost 2x one). `max_batch` still reads the
verify curve: with more requests than slots the others wait, and there 11 slots served 16 clients
451 tokens/s with p95 4.3 s where the 4 slots that keep each request within 2x its lone step served
380 with p95 4.9 s (4 clients: the same). A tree node's row within its slot reads the keys and values
its root's row reads, so `BesideCosts`' slope of a tree's rows prices it.
"""

from __future__ import annotations

MIN_ROWS = 2                # the root and one node: a slot's tree shrinks to this, never to nothing
BATCH_SLOWDOWN = 2.0        # `max_batch`: a slot's plain round may cost at most this many lone steps
MAX_SLOTS = 16


class RowBudget:
    """Rows a slot's tree may have (root included) when `active` slots decode in one round.

    Args:
        costs: `Costs` with `base_verify_ms(n)`, or None (the lone tree divided evenly).
        lone_rows: the tree a lone round may verify (root included): today's tree at one slot.
    """

    def __init__(self, costs, lone_rows: int):
        self.costs, self.lone_rows = costs, max(int(lone_rows), 1)
        self._shares = [self.lone_rows]               # index b - 1: the share at b slots, non-increasing

    def per_slot(self, active: int) -> int:
        """A slot's rows (root included) with `active` slots in the round."""
        active = max(int(active), 1)
        while len(self._shares) < active:
            b = len(self._shares) + 1
            self._shares.append(min(self._shares[-1], self._share(b)))
        return self._shares[active - 1]

    def _share(self, active: int) -> int:
        if self.lone_rows <= 1:
            return 1
        if self.costs is None:
            return max(MIN_ROWS, self.lone_rows // active)
        cost = self.costs.base_verify_ms
        allowed = cost(active) + (cost(self.lone_rows) - cost(1))
        rows = active
        while rows < active * self.lone_rows and cost(rows + 1) <= allowed:
            rows += 1
        return min(self.lone_rows, max(MIN_ROWS, rows // active))


class BesideCosts:
    """A slot's view of the calibrated costs in a batched round: its tree's n rows are verified in one
    forward beside `others` rows of the other slots, so n rows cost what `others + n` rows do and a
    node's row adds that forward's slope there. Drafting costs are the slot's own.

    Args:
        costs: the lone costs (`mcsd.costs.cost_model.Costs`).
        others: rows of the other slots' blocks in the same forward.
    """

    def __init__(self, costs, others: int):
        self.costs, self.others = costs, max(int(others), 0)

    def base_verify_ms(self, n: int) -> float:
        return self.costs.base_verify_ms(self.others + n)

    def verify_ms(self, n: int) -> float:
        return self.costs.verify_ms(self.others + n)

    def marginal_verify_ms(self, n: int) -> float:
        return self.costs.marginal_verify_ms(self.others + n)

    def draft_ms(self, width: int) -> float:
        return self.costs.draft_ms(width)


def max_batch(costs, slowdown: float = BATCH_SLOWDOWN, limit: int = MAX_SLOTS) -> tuple[int, str]:
    """(slots, why): the most sequences a round decodes together on this machine, from the calibrated
    cost of T rows: the largest B whose forward of B rows costs at most `slowdown` lone steps, so that
    each of B requests still runs at least 1 / slowdown of its lone speed while the aggregate grows.
    1 without measured costs (generic defaults say nothing of this machine)."""
    if costs is None or costs.source == "default":
        return 1, "no costs measured on this machine"
    one = costs.base_verify_ms(1)
    slots = 1
    while slots < limit and costs.base_verify_ms(slots + 1) <= slowdown * one:
        slots += 1
    return slots, (f"a forward of {slots} rows costs {costs.base_verify_ms(slots):.1f} ms, within "
                   f"{slowdown:g}x one row's {one:.1f} ms")
