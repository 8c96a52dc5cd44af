"""Context drafting's grafted nodes in the fixed-shape round (`mcsd.decoding.fixed_round`).

The loop grafts context candidates beneath the root and beneath the drafted nodes, best first while
they pay for their verify time (`mcsd.drafting.context`); that needs the drafted tree on the host,
a read in the middle of the round. Here the candidates are looked up beneath the root alone, on the
host, from what the host already holds: the committed text (the emitted tokens, read once a round)
and the target's top-k along the accepted path (read with them). They fill G fixed slots after the
drafted topology: their tokens, parents, depths, root-to-node paths and ancestor bits are written
into one staging buffer (pinned on CUDA) and copied to the device without a synchronisation, and
the round's tree is the drafted topology's nodes then the slots (`RoundTree`), verified and accepted
as one (the longest matching path wins, drafted or grafted). A slot left empty is never accepted.

Where it differs from the loop: no candidates beneath drafted nodes, and no cost test or gate (the
slots' verify rows are there whether they are filled or not); the sources, their lookups and their
measured acceptance are the loop's. The output is exact either way: a grafted node is accepted only
where it is the target's own draw (greedy: its argmax; sampling: its seeded draw at that position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.static_tree import StaticTree


@dataclass
class RoundTree:
    """A round's tree with context nodes: a static tree's nodes, then the context slots, as the
    tensors `accept_paths` and the verify read (`StaticTree`'s names; see `ContextSlots.joined`)."""

    tokens: torch.Tensor            # (N + G,) long
    valid: torch.Tensor             # (N + G,) bool: nodes that may be accepted
    parents: torch.Tensor           # (N + G,) long
    depth: torch.Tensor             # (N + G,) long
    paths: torch.Tensor             # (L + G, W + 1) long root-to-node paths, the node repeated past it
    path_len: torch.Tensor          # (L + G,) long
    allowed: torch.Tensor           # (N + G, N + G) bool ancestor-or-self
    size: int
    max_depth: int                  # W: the paths' width less the root


class ContextSlots:
    """Context drafting's grafted nodes in the fixed-shape round: G slots after the drafted topology.

    Before a round the host looks candidates up beneath the root (`ContextDrafter.graft_under_root`:
    the n-gram index of the committed text and the recycled target predictions, both fed from the
    round's one read) and writes them, their parents, depths, root-to-node paths and ancestor bits
    into one staging buffer (pinned on CUDA), copied to the device without a synchronisation; an
    unfilled slot is never accepted. The slots' verify rows are there whether filled or not (fixed
    shapes), so every candidate more likely than the drafter's `min_score` is grafted, up to G, with
    no cost test and no gate. After the read the host hears the accepted path and the target's top-k
    along it (`ContextDrafter.observe_path`, `recycle`).

    Args:
        context: the context drafter.
        slots: G, the grafted nodes a round holds at most.
        width: the widest path of the rounds' trees (the drafted topology's depth, or the context's).
        device: where the round runs.
    """

    def __init__(self, context, slots: int, width: int, device):
        self.context, self.n, self.width, self.device = context, slots, width, device
        if width < self.reach(context, slots):
            raise ValueError(f"paths {width} deep cannot hold a graft {self.reach(context, slots)} deep")
        g, w = slots, width + 1
        fields = {"tokens": g, "parents": g, "depth": g, "valid": g, "paths": g * w, "path_len": g,
                  "ancestors": g * g}
        size = sum(fields.values())
        pin = torch.device(device).type == "cuda"
        self._staged = torch.zeros(size, dtype=torch.long, pin_memory=pin)
        self._host = self._staged.numpy()                  # written by the host, no tensor operation
        self._device = torch.zeros(size, dtype=torch.long, device=device)
        # each field's view of the staging buffer (host) and of its device copy, made once
        self._host_fields, self._device_fields, start = {}, {}, 0
        for name, n in fields.items():
            self._host_fields[name] = self._host[start:start + n]
            self._device_fields[name] = self._device[start:start + n]
            start += n
        self._joined: dict[int, tuple] = {}                # per base tree size: its persistent buffers
        self.proposed: dict[int, list[tuple]] = {}
        self.parent_of: dict[int, int] = {}

    @staticmethod
    def reach(context, slots: int) -> int:
        """The deepest a graft of `slots` nodes beneath the root goes: a continuation (`max_len`) or the
        recycled predictions' levels, whichever is longer, and no more than the slots."""
        cfg = context.config
        return min(slots, max(cfg.max_len, len(cfg.recycle_widths)))

    def fill(self, base: StaticTree, root: int) -> tuple[int, int]:
        """This round's candidates beneath the root token `root` into the slots after `base`'s N nodes;
        returns (how many were grafted, the deepest)."""
        g, w, n = self.n, self.width + 1, base.size
        tokens, parents, proposed = self.context.graft_under_root(root, g)
        self._host[:] = 0
        depth, index = [0], {0: 0}                           # graft node i (1 = first) -> round index
        chains: list[list[int]] = [[0]]
        for i, (token, parent) in enumerate(zip(tokens, parents), start=1):
            index[i] = n + i - 1
            depth.append(depth[parent] + 1)
            chains.append(chains[parent] + [i])
        h = self._host_fields
        for j in range(g):
            i = j + 1
            anc = h["ancestors"][j * g:(j + 1) * g]
            anc[j] = 1                                       # an unfilled slot sees the root and itself
            if i > len(tokens):
                h["parents"][j], h["depth"][j] = 0, 1
                h["paths"][j * w:(j + 1) * w] = [0] + [n + j] * (w - 1)
                h["path_len"][j] = 1                         # its own match never counts
                continue
            h["tokens"][j], h["parents"][j], h["depth"][j] = tokens[j], index[parents[j]], depth[i]
            h["valid"][j], h["path_len"][j] = 1, depth[i] + 1
            chain = [index[k] for k in chains[i]]
            h["paths"][j * w:(j + 1) * w] = chain + [chain[-1]] * (w - len(chain))
            for k in chains[i][1:]:
                anc[k - 1] = 1
        self._device.copy_(self._staged, non_blocking=True)
        self.proposed = {index[i]: keys for i, keys in proposed.items()}
        self.parent_of = {index[i]: index[parents[i - 1]] for i in range(1, len(tokens) + 1)}
        return len(tokens), max(depth)

    def joined(self, base: StaticTree, tokens: torch.Tensor, valid: torch.Tensor | None) -> RoundTree:
        """The round's tree: `base`'s nodes (`tokens` (N,), `valid` (N,) or None: all) then the slots."""
        n, g, w = base.size, self.n, self.width + 1
        if n not in self._joined:                          # the base's part, made once
            allowed = torch.zeros(n + g, n + g, dtype=torch.bool, device=self.device)
            allowed[:n, :n] = base.allowed
            allowed[n:, 0].fill_(True)
            cols = torch.arange(w, device=self.device).clamp(max=base.max_depth)
            paths = base.paths.gather(1, cols[None].expand(base.paths.shape[0], w))   # the leaf repeated
            self._joined[n] = (allowed, paths)
        allowed, base_paths = self._joined[n]
        dev = self._device_fields
        allowed[n:, n:] = dev["ancestors"].view(g, g).bool()
        ones = torch.ones(n, dtype=torch.bool, device=self.device) if valid is None else valid
        return RoundTree(tokens=torch.cat([tokens, dev["tokens"]]),
                         valid=torch.cat([ones, dev["valid"].bool()]),
                         parents=torch.cat([base.parents, dev["parents"]]),
                         depth=torch.cat([base.depth, dev["depth"]]),
                         paths=torch.cat([base_paths, dev["paths"].view(g, w)]),
                         path_len=torch.cat([base.path_len, dev["path_len"]]),
                         allowed=allowed, size=n + g, max_depth=self.width)

    def recycled(self, logits: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """(P * k,) the target's top-k after each node of the path, for the round's one read."""
        return logits.index_select(0, path).topk(self.context.config.recycle_k, dim=-1).indices.flatten()

    def split(self, rest: list[int], path_width: int) -> tuple[list[int], list[int], list[list[int]]]:
        """The read's tail -> (what precedes the context's part, the path, its top-k rows)."""
        k = self.context.config.recycle_k
        tail = path_width * (1 + k)
        head, path, top = rest[:len(rest) - tail], rest[len(rest) - tail:len(rest) - tail + path_width], \
            rest[len(rest) - tail + path_width:]
        return head, path, [top[i * k:(i + 1) * k] for i in range(path_width)]

    def observe(self, root: int, new: list[int], path: list[int], top: list[list[int]]) -> None:
        """After the read: the accepted path's tokens join the n-gram index, the target's top-k after each
        of its nodes is recycled, and each source hears whether its candidates were accepted."""
        ctx = self.context
        ctx.recycle([root] + new[:len(path) - 1], top[:len(path)])
        ctx.observe_path(self.proposed, self.parent_of, path, _Grafted())
        ctx.extend_history(new)


class _Grafted:
    """Every node `observe_path` asks about in the fixed round is a grafted one."""

    def __getitem__(self, index: int) -> bool:
        return True
