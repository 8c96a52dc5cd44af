"""The tree round in fixed shapes on the device, with one host read a round (the feature head's round).

On a GPU the round as `TreeDecoder`'s loop runs it is bound by the host: every level of the tree
waits for Python (a policy's decision, a slice whose size is a tensor's value, an acceptance walk),
so the device idles between small kernels. Here the whole round is fixed shapes over preallocated
buffers, so every forward can be replayed as a CUDA graph and nothing in the round reads a tensor's
value, except once at its end:

1. catch-up: the feature head reads the last round's accepted positions (the target's features
   along the accepted path and the tokens that followed them) as one block padded to a bucket,
   over the head's own static cache; the new root's predicted feature gives level 1's scores;
2. growth: each level's tokens are the top-k ranks of their parents' scores (greedy: of the
   draft's probabilities; sampling: of log q + g, the shared noise the target draws with at the
   children's position), gathered by the static topology's (parent, rank) of each node
   (`mcsd.core.static_tree.level_children`); the head steps over each level but the last, each
   a block padded to a bucket, its keys and values at fixed slots after the root's entry;
3. verify: the target's forward over the whole tree (`mcsd.forward.graphs.StaticBlocks`: padded
   to a bucket, captured on CUDA), its draws after each node (argmax, or the seeded Gumbel draw);
4. accept: Medusa style over the topology's root-to-leaf paths (`accept_paths`): the same path as
   the loop's greedy matching;
5. read: the count and the emitted tokens, in one (D+2,) tensor, read once (with context drafting,
   also the accepted path and the target's top-k along it);
6. commit: the target's cache keeps the accepted entries (`StaticCache.commit_rows`, a gather and
   a write of D+1 entries whatever was accepted); the head's cache drops the tree (a length).

With the learned policy the whole topology is still drafted, and its decisions are made on the
device as the tree grows (`mcsd.decoding.fixed_pruning`): which children each node keeps, and
whether the next level runs; a pruned node stays in the buffers and is masked out of the
acceptance, so shapes stay fixed. Its draft gate and running acceptance rate stay on the host: the
round's one read also carries the kept tree's size, depth, drafted level widths and nodes. A round
the gate sits out is the target's step after the root alone (the head reads its entry with the
next drafted round's). A learned policy's topology larger than the largest bucket holds (its own
default, 281 nodes) is drafted as its likeliest nodes (`drafted_topology`: 48 beside context slots).

With context drafting (the command line's default: the head, context nodes grafted in, the learned
policy) the round's tree is the drafted topology then `CONTEXT_SLOTS` slots the host fills before
the round from its own lookups beneath the root, fed by the round's one read
(`mcsd.decoding.fixed_context`); they are verified and accepted with the drafted nodes.

What is exact: the output. Greedy float32 output equals `generate`'s; sampled output follows the
target's processed distribution, and since a sampled token is the target's own seeded draw at its
position, a seed gives the loop's text (on a CPU the same draw routine; on CUDA torch's). The trees
equal the loop's for a static policy, except that a candidate the draft filtered out (no finite
key) stays in the buffers, never accepted, where the loop leaves it out. For the learned policy
the kept nodes equal the loop's tree where the inputs are equal, except for a decision within
rounding of a tie (sums over the padded buffers, padded head blocks: see `fixed_pruning`).

Limitations (each falls back to the loop under `round="auto"`, and is refused under
`round="fixed"` with its reason):
- the drafter is a `FeatureDrafter` whose head runs over a static cache (`fixed_block`): mcsd's
  head on the engine's own forward (Llama layers), or an EAGLE-3 head on its own layer code;
- the policy is "static" or "learned" (fixed costs: its `online_costs` runs on the loop, and the
  round's measured times do not reach its costs or their staleness check); the other dynamic
  policies run on the loop;
- no lossy roots, no rejection sampling, no logits processors or log-probabilities, no
  `on_round` callback; context nodes are grafted beneath the root only (`fixed_context`);
- static trees of at most 64 nodes (48 with context drafting), drafted to their full depth every
  round (the rounds near `max_new_tokens` draft deeper than they can accept, and accept no
  deeper); a learned policy's larger topology is cut to its likeliest nodes;
- on the CPU the same shapes run eagerly (slower than the loop there: it is not the CPU default).
Timings on CUDA (`draft_s`, `verify_s`) are the host's launch times, not the device's.
"""

from __future__ import annotations

import time

import torch

from ..config import ConfigError, DecodeConfig
from ..core.output import GenerationStats
from ..core.sampling import PositionNoise, logits_to_probs
from ..core.static_tree import StaticTree, accept_paths, emitted_tokens, level_children
from ..core.tree import TreeTopology
from ..drafting.feature_draft import FeatureDrafter
from ..drafting.policies.learned import LearnedPolicy
from ..drafting.policies.static import StaticPolicy
from ..forward import graphs
from ..forward.attention import additive_mask, causal_allowed
from ..forward.lm import CachedLM
from .fixed_context import ContextSlots
from .fixed_head import HeadBlocks
from .fixed_pruning import DevicePruning

ROUNDS = ("auto", "fixed", "loop")
CONTEXT_SLOTS = 16              # context drafting's grafted nodes a round holds at most, beside the drafted tree
# a drafted node's prior of being accepted by its sibling rank (product along its path): which nodes of a
# learned policy's topology the fixed round keeps where the whole topology does not fit the largest bucket
RANK_PRIOR = (0.7, 0.15, 0.06, 0.03)


def drafted_topology(topology: TreeTopology, learned: bool, slots: int) -> TreeTopology:
    """The topology a fixed round drafts: the policy's own, or, for a learned policy's topology with
    more nodes than the largest bucket holds beside `slots` context nodes, its likeliest nodes by
    `RANK_PRIOR` (parents before children, so the subtree is closed; the learned policy prunes it
    further on the device). A static tree is drafted as it is (`unavailable` refuses one too large)."""
    room = graphs.BUCKETS[-1] - slots
    if not learned or topology.size <= room:
        return topology
    paths = list(topology.paths)
    prior = {(): 1.0}
    for path in paths:                                 # breadth-first: a parent's prior first
        prior[path] = prior[path[:-1]] * (RANK_PRIOR[path[-1]] if path[-1] < len(RANK_PRIOR) else RANK_PRIOR[-1] / 2)
    kept = set(sorted(paths, key=lambda p: -prior[p])[:room - 1])
    return TreeTopology.from_spec([p for p in paths if p in kept])
AUTO_DEVICES = ("cuda",)        # device types where round="auto" takes the fixed round


def default_on(device) -> bool:
    """Whether round="auto" takes the fixed round on `device` (a torch.device, or its name as a flag
    gives it: "cuda:1"; not parsed, so a malformed one is left to the flag's own check)."""
    return getattr(device, "type", str(device).partition(":")[0]) in AUTO_DEVICES


def unavailable(decoder, cfg: DecodeConfig, proposer, on_round=None) -> str | None:
    """Why the fixed-shape round cannot run this generation (None: it can)."""
    drafter = proposer.drafter
    if not isinstance(drafter, FeatureDrafter) or not drafter.static_blocks:
        return "it drafts with a feature head (mcsd's on the engine's own forward, or an EAGLE-3 head) only"
    policy = proposer.policy
    if type(policy) not in (StaticPolicy, LearnedPolicy):
        return f"it grows static trees or the learned policy's, not policy {policy.name!r}"
    if type(policy) is LearnedPolicy and policy.costs.online:
        return "the learned policy's online_costs run on the loop"
    if proposer.lossy:
        return "lossy_target_roots runs on the loop"
    if not cfg.sampling.greedy and cfg.sampling.method != "gumbel":
        return "rejection sampling runs on the loop"
    if cfg.processing.active or cfg.return_logprobs:
        return "logits processors and log-probabilities run on the loop"
    if on_round is not None:
        return "on_round callbacks run on the loop"
    if decoder.target._running is None:
        return "the target does not run on the engine's own forward"
    if proposer.policy.topology.max_depth < 1:
        return "its tree drafts nothing"
    room = graphs.BUCKETS[-1] - (CONTEXT_SLOTS if proposer.context is not None else 0)
    if type(policy) is StaticPolicy and proposer.policy.topology.size > room:
        return f"its static tree has more than {room} nodes" + (f" (with {CONTEXT_SLOTS} context slots)"
                                                                 if proposer.context is not None else "")
    return None


def choose(decoder, choice: str, cfg: DecodeConfig, proposer, on_round=None) -> "FixedRound | None":
    """The fixed-shape round for this generation, or None for the loop. "auto": fixed on CUDA where it
    can run; "loop": never; "fixed": always (a ConfigError saying why where it cannot). Which round
    runs and why is left in `decoder.round_choice` ((round, reason), for `--stats`).

    The decoder keeps its `FixedRound` (`decoder.fixed_round`) from one generation to the next, and
    with it the head's blocks and their CUDA graphs: a generation with the same drafter, topology and
    policy builds and captures nothing again (a cache that grows captures its graphs again, once).
    The target's padded blocks are switched on while the fixed round runs, and back to what they
    were for a generation on the loop."""
    kept = decoder.fixed_round
    if choice == "loop" or (choice == "auto" and not default_on(decoder.target.device)):
        decoder.round_choice = ("loop", "round='loop'" if choice == "loop" else
                                "the fixed round is CUDA's default; on a CPU the loop is faster")
        if kept is not None:
            kept.release()
        return None
    decoder.target.reset()                       # which forward runs the target is decided at a reset
    reason = unavailable(decoder, cfg, proposer, on_round)
    if reason is None and choice == "auto" and kept is not None and kept.failure is not None:
        reason = f"a CUDA graph of the fixed round failed ({kept.failure})"
    if reason is not None:
        if choice == "fixed":
            raise ConfigError(f"round='fixed' cannot run this generation: {reason}")
        decoder.round_choice = ("loop", reason)
        if kept is not None:
            kept.release()
        return None
    learned = proposer.policy if type(proposer.policy) is LearnedPolicy else None
    topology, cuda_graphs, context = proposer.policy.topology, decoder.target.cuda_graphs, proposer.context
    if kept is None or not kept.serves(decoder.target, proposer.drafter, topology, learned, cuda_graphs, context):
        if kept is not None:
            kept.release()
        slots = 0 if context is None else min(CONTEXT_SLOTS, context.config.max_nodes)
        kept = decoder.fixed_round = FixedRound(decoder.target, proposer.drafter, topology, cuda_graphs, learned,
                                                context, slots)
    kept.prepare(cfg)
    why = ["round='fixed'" if choice == "fixed" else "round='auto' on CUDA"]
    if kept.drafted is not topology:
        why.append(f"the learned policy's {topology.size}-node topology drafted as its {kept.drafted.size} "
                   f"likeliest nodes")
    if kept.slots is not None:
        why.append(f"{kept.slots.n} context slots")
    decoder.round_choice = ("fixed", "; ".join(why))
    if kept.failure is not None:
        decoder.round_choice = ("fixed", f"round='fixed', eagerly: a CUDA graph failed ({kept.failure})")
    return kept


class FixedRound:
    """A decoder's rounds in fixed shapes (see the module's docstring), kept from one generation to
    the next (`choose`): its buffers, the head's blocks and their graphs are made once.

    Args:
        target: the decoder's target (`CachedLM` on the engine's own forward); its blocks are padded
            to buckets while the fixed round runs (captured on CUDA; `engage`, `release`).
        drafter: the feature drafter.
        topology: the static tree drafted every round (at most 64 nodes).
        cuda_graphs: capture the head's blocks as CUDA graphs on CUDA.
        learned: the learned policy, which prunes the drafted topology on the device
            (`mcsd.decoding.fixed_pruning`) and gates drafting on the host; None: a static tree.

    Attributes:
        kept: after a round, the topology's nodes its tree kept (the static tree's all), read with
            the emitted tokens.
        failure: why a CUDA graph of the round (the head's or the target's) was given up, or None;
            the generation goes on in the same shapes eagerly, and `round="auto"` runs the loop for
            this decoder from its next generation.
    """

    def __init__(self, target: CachedLM, drafter: FeatureDrafter, topology, cuda_graphs: bool = True,
                 learned: LearnedPolicy | None = None, context=None, slots: int = 0):
        self.target, self.drafter, self.topology, self.learned = target, drafter, topology, learned
        self.cuda_graphs, self.context = cuda_graphs, context
        self.device = target.device
        self.drafted = drafted_topology(topology, learned is not None, slots)
        self.tree = StaticTree.of(self.drafted, self.device)
        self.plain = StaticTree.of(TreeTopology.from_spec("0"), self.device)     # a round without drafting
        self.pruning = None if learned is None else DevicePruning(learned, self.tree, self.device)
        self.kept: list[int] = []
        self.slots = None
        if context is not None and slots > 0:
            width = max(self.tree.max_depth, ContextSlots.reach(context, slots))
            self.slots = ContextSlots(context, slots, width, self.device)
        self._root_host: int | None = None                 # the root token, as the host read it
        self.hidden = tuple(drafter.feature_layers)
        self.sampling = self.noise = None
        self.ids = None if drafter.vocab_ids is None else drafter.vocab_ids.to(self.device)
        capture = cuda_graphs and self.device.type == "cuda"
        self.blocks = HeadBlocks(drafter, capture)
        self._before: bool | None = None                   # the target's static_blocks while engaged
        self._engaged = False
        # the tree's additive mask among its own nodes, in the two models' dtypes
        self.tree_mask = additive_mask(self.tree.allowed, 0, drafter.dtype)[0, 0]      # (N, N)

    def serves(self, target, drafter, topology, learned, cuda_graphs: bool, context=None) -> bool:
        """This round runs a generation of these parts (else the decoder makes another)."""
        same = all(a is b for a, b in zip((self.target, self.drafter, self.topology, self.learned, self.context),
                                           (target, drafter, topology, learned, context)))
        return same and self.cuda_graphs == cuda_graphs and drafter.dtype == self.tree_mask.dtype \
            and drafter.device == self.device

    @property
    def failure(self) -> str | None:
        target_blocks = self.target.blocks if self._engaged else None
        return self.blocks.failure or (target_blocks.failure if target_blocks is not None else None)

    def prepare(self, cfg: DecodeConfig) -> None:
        """Before a generation: its settings, the target's blocks padded, the pruning's cost tables
        made again only where the policy's costs changed (host arithmetic, no device read)."""
        self.sampling = cfg.sampling
        self.engage()
        if self.pruning is not None:
            self.pruning.policy.decoding(cfg.sampling)
            self.pruning.refresh()

    def engage(self) -> None:
        """The target's blocks padded to buckets (captured on CUDA), as the fixed round runs them."""
        if not self._engaged:
            self._before, self._engaged = self.target.static_blocks, True
        self.target.static_blocks = True

    def release(self) -> None:
        """The target's blocks back to what they were before `engage` (a generation on the loop)."""
        if self._engaged:
            self.target.static_blocks, self._engaged = self._before, False

    # ------------------------------------------------------------------ set-up

    def start(self, sequence: torch.Tensor, noise: PositionNoise | None = None, root: int | None = None) -> None:
        """After the prefill (`sequence` (T+1,): the prompt and the root; `noise`: the generation's
        shared noise, None when greedy; `root`: the root token as the prefill read it): the head reads
        the prompt's last `window` positions, eagerly at their own shape (before the rounds, not one
        of them); context drafting's index (the prompt's, from the prefill) gets the root."""
        self.noise = noise                       # the generation's (sampling), or None (greedy)
        self._root_host = root
        if self.slots is not None:
            self.context.extend_history([root])
        d = self.drafter                         # reset by the prefill, the prompt's features observed
        t_end = sequence.numel() - 1
        offset = 0 if d.window is None else max(0, t_end - d.window)
        n = t_end - offset
        feats = d.features_from(offset)[:n]
        cache = d.cache
        cache.reserve(n)
        positions = torch.arange(offset + 1, t_end + 1, device=self.device)[None]
        mask = additive_mask(causal_allowed(n, self.device), 0, d.dtype)
        pred = d.fixed_block(feats, d.embed(sequence[offset + 1:t_end + 1]), positions, mask,
                             torch.arange(n, device=self.device))
        cache.length = n
        d.forwards += 1
        self.root_pos = t_end                    # the root's position in the sequence
        self.root_pred = pred[-1:]               # (1, H) its predicted feature
        self.root_scores = d._scores(self.root_pred)
        self.pending = []                        # [(feats (R, H), tokens (R,))] the head has yet to read
        self._root = sequence[-1:]               # (1,) the root token, on the device

    # ------------------------------------------------------------------ one round

    def run(self, remaining: int, stats: GenerationStats) -> list[int]:
        """One round that may emit `remaining` more tokens; returns the tokens it emits (read once)."""
        tree, d, pruning, slots = self.tree, self.drafter, self.pruning, self.slots
        t0 = time.perf_counter()
        drafted_limit = min(tree.max_depth, remaining - 1)
        plain = pruning is not None and not (pruning.policy.gate.opens() and drafted_limit >= 1)
        base = self.plain if plain else tree
        n_context, context_depth = slots.fill(base, self._root_host) if slots is not None else (0, 0)   # host lookups
        if plain:                                # the learned policy's gate: the target's step (and context's)
            tokens, valid = self.target_root(), None
        else:
            self._catch_up()                     # 1. the head reads the accepted positions it has not read
            if pruning is not None:
                pruning.begin(drafted_limit)
            tokens, valid = self._grow()         # 2. the tree, level by level (pruned by the policy)
        t1 = time.perf_counter()
        read = []
        if pruning is not None and not plain:
            kept, counts = pruning.summary()
            valid = valid & kept
            read = [counts, kept.long()]
        round_tree = base if slots is None else slots.joined(base, tokens, valid)
        if slots is not None:
            tokens, valid = round_tree.tokens, round_tree.valid
        depth_limit = min(round_tree.max_depth, remaining - 1)
        n, path, next_token, states, logits = self._verify(round_tree, tokens, valid, depth_limit)   # 3-4.
        out = emitted_tokens(tokens, path, n, next_token)                                 # (D+2,)
        if slots is not None:                    # the accepted path and the target's top-k along it (recycling)
            read += [path, slots.recycled(logits, path)]
        values = torch.cat([out, *read]).tolist()    # 5. the round's one host read
        accepted = values[0]
        new = values[1:accepted + 2]
        # 6. commit: the target keeps the accepted entries, the head drops the tree but the root's entry
        self.target.cache.commit_rows(self.root_pos, path, accepted + 1)
        if not plain:
            d.cache.truncate(self._root_slot + 1)
        self.pending.append((d.head.fused(states.index_select(0, path[:accepted + 1])).to(d.dtype),
                             out[1:accepted + 2]))
        self.root_pos += accepted + 1
        rest = values[round_tree.max_depth + 2:]
        if slots is not None:
            rest, path_host, top = slots.split(rest, round_tree.max_depth + 1)
            slots.observe(self._root_host, new, path_host[:accepted + 1], top)
        self._root_host = new[-1]
        if plain:
            self.kept = [0]
            self.pruning.policy.observe_round(0, 0, 1, self.pruning.policy.round_draft_ms([]))
            depth, nodes = 0, 1
        elif pruning is not None:
            counts = rest[:-tree.size]
            self.kept = [i for i, k in enumerate(rest[-tree.size:]) if k]
            drafted = accepted if slots is None else _drafted_depth(path_host, accepted, tree.size)
            pruning.observe(drafted, counts)
            depth, nodes = counts[1], counts[0]
        else:
            self.kept = list(range(tree.size))
            depth, nodes = tree.max_depth, tree.size
        t2 = time.perf_counter()
        stats.record_round(None, accepted, t1 - t0, t2 - t1, drafted_depth=max(depth, context_depth),
                           nodes=nodes + n_context)
        return new

    def _catch_up(self) -> None:
        """The head reads the committed positions it has not read yet (the last drafted round's accepted
        path and any plain rounds' since), in blocks of at most the largest bucket; the last one's
        predicted feature and scores are the new root's."""
        if not self.pending:
            return
        d = self.drafter
        feats = torch.cat([f for f, _ in self.pending])
        tokens = torch.cat([t for _, t in self.pending])
        self.pending = []
        rows, step = tokens.numel(), graphs.BUCKETS[-1]
        first = self.root_pos - rows + 1
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            pred, scores = self.blocks(feats[lo:hi], tokens[lo:hi], first + lo, d.cache.length)
        self.root_pred, self.root_scores = pred[-1:], scores[-1:]

    def _grow(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole topology's tokens (N,) and which nodes may be accepted (N,) bool, no host read."""
        tree, d = self.tree, self.drafter
        root = self.target_root()
        tokens, valid = [root], [torch.ones(1, dtype=torch.bool, device=self.device)]
        self._root_slot = d.cache.length - 1                # node i sits at slot root_slot + i
        pred, scores = self.root_pred, self.root_scores
        for depth in range(1, tree.max_depth + 1):
            probs, keys = self._keys(scores, self.root_pos + depth)         # (W_{d-1}, K)
            level, ok, columns = level_children(keys, tree.parent_row[depth], tree.rank[depth], tree.fan_out[depth],
                                                self.ids, columns=True)
            if self.pruning is not None:         # the learned policy's decisions for this level
                self.pruning.level(depth, probs, columns, ok)
            tokens.append(level)
            valid.append(ok & valid[-1][tree.parent_row[depth]])
            if depth == tree.max_depth:
                break
            lo, hi = tree.levels[depth]
            start = self._root_slot + lo
            rows_mask = torch.zeros(hi - lo, start + (hi - lo), dtype=d.dtype, device=self.device)
            rows_mask[:, self._root_slot:] = self.tree_mask[lo:hi, :hi]
            pred, scores = self.blocks(pred[tree.parent_row[depth]], level, self.root_pos + depth, start, rows_mask)
            pred, scores = pred.clone(), scores.clone()     # the bucket's buffers: the next step may reuse it
        return torch.cat(tokens), torch.cat(valid)

    def target_root(self) -> torch.Tensor:
        """(1,) the root token: the target's own draw, kept on the device between rounds."""
        return self._root

    def _keys(self, scores: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's probabilities (as the loop's `Frontier.probs`) and what a level's candidates are
        ranked by: those probabilities (greedy), or log q + g at the children's `position` (sampling),
        as `mcsd.drafting.draft.grow_tree` ranks them."""
        if self.noise is None:
            probs = scores.float().softmax(-1)
            return probs, probs
        probs = logits_to_probs(scores, self.sampling)
        at = torch.full((scores.shape[0],), position, dtype=torch.long, device=self.device)
        return probs, self.noise.keyed(probs.log(), self.noise.device_keys(at), self.ids)

    def _verify(self, tree, tokens: torch.Tensor, valid: torch.Tensor | None, depth_limit: int):
        """The target's forward over `tree` (a `StaticTree`, or a `RoundTree` with context nodes), its
        draws, the accepted path (all on the device); also the target's states and logits."""
        positions = tree.depth + self.root_pos
        logits, states = self.target.forward(tokens, positions, tree.allowed, hidden=self.hidden)   # (N, V)
        if self.noise is None:
            draws = logits.argmax(-1)
        else:                                   # the target's seeded draw after each node, at T + depth
            draws = self.noise.draw_keyed(logits, self.sampling, self.noise.device_keys(positions + 1))
        n, path, next_token = accept_paths(tree, tokens, draws, valid, depth_limit)
        self._root = next_token
        return n, path, next_token, states, logits


def _drafted_depth(path: list[int], accepted: int, drafted: int) -> int:
    """How deep the accepted path runs through drafted nodes (indices below `drafted`): what the
    learned policy hears (context nodes are not its)."""
    return sum(1 for node in path[1:accepted + 1] if node < drafted)
