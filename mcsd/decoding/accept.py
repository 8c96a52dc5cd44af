"""A round's judgement of the target's logits over a tree: which path is accepted, the target's own
next token, and what the proposers and the caller need from it.

Shared by the lone round (`mcsd.decoding.decoder.TreeDecoder._verify`) and the batched round
(`mcsd.decoding.batch`): both run the target's forward their own way (one sequence, or every slot's
rows in one flat batch) and hand each tree's logits here, so a slot's answer is judged by exactly the
code that judges a lone sequence's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import DecodeConfig
from ..core import processors
from ..core.sampling import PositionNoise, greedy_tokens, logits_to_probs, processed_scores
from ..core.verify import Acceptance, accept_drawn, accept_greedy, accept_sampling
from ..drafting.context import ContextDrafter
from ..drafting.draft import GrownTree
from ..drafting.policies import TreePolicy


class Judgement(NamedTuple):
    """What a round's logits decided.

    Attributes:
        acc: the accepted path and the target's next token.
        kept: (k,) rows of the fed block to keep in the target's cache (the accepted path's).
        last: (V,) the target's logits after the deepest accepted node.
        emitted_lp: with `cfg.return_logprobs`, the (k+1,) float32 log-probabilities of the emitted
            tokens, else None.
    """

    acc: Acceptance
    kept: torch.Tensor
    last: torch.Tensor
    emitted_lp: torch.Tensor | None


def judge(grown: GrownTree, sequence: torch.Tensor, logits: torch.Tensor, cfg: DecodeConfig, gen,
          policy: TreePolicy, skip_root: bool = False, context: ContextDrafter | None = None,
          proc: processors.NodeScores | None = None, noise: PositionNoise | None = None) -> Judgement:
    """Accept a path of `grown`'s tree from the target's logits over its fed rows.

    Args:
        grown: the round's tree (and draft distributions).
        sequence: (T,) the committed sequence ending with the root.
        logits: (N - s, V) the target's logits at the tree's fed rows (s = 1 with skip_root: the
            lossy variant feeds every node but the root, whose children are accepted as given).
        cfg, gen, noise: the generation's settings, private generator and seeded noise; sampling with
            `noise`: the target's draw after each node is the Gumbel-max token at the next position,
            and a node is accepted exactly as under greedy matching.
        policy: hears the target's logits where it wants them.
        context: the context drafter, which recycles the target's predictions along the path.
        proc: processes each node's logits with that node's own prefix.
    """
    tree, sampling = grown.tree, cfg.sampling
    s = int(skip_root)
    if policy.wants_target_logits and not skip_root:
        policy.observe_target(tree, logits)
    if proc is not None:                     # the processed distribution at each node, with its own prefix
        logits = proc.at_nodes(sequence[:-1], tree, torch.arange(tree.size, device=logits.device), logits)
    p_target = None
    if sampling.greedy and not skip_root:    # the target's token after each node (one native pass), matched
        after = greedy_tokens(logits).tolist()
        acc = accept_drawn(tree.tokens, tree.parents, lambda nodes: [after[i] for i in nodes])
    elif sampling.greedy:                    # the root's row is not computed; its children are accepted as given
        argmax = torch.cat([logits.new_full((1,), -1, dtype=torch.long), greedy_tokens(logits)])
        acc = accept_greedy(tree.tokens, tree.parents, tree.depth, tree.mask(), argmax, given=tree.depth == 1)
    elif noise is not None:                  # the target's own seeded draw after each node, matched
        # drawn only where a node is accepted so far, a level at a time (node at depth d draws T + d)
        base, depth = sequence.numel(), tree.depth.tolist()
        acc = accept_drawn(tree.tokens, tree.parents,
                           lambda nodes: noise.draw_rows(logits, sampling, nodes, [base + depth[n] for n in nodes]))
    else:
        p_target = logits_to_probs(logits, sampling)
        q_draft = grown.q_draft.to(p_target.device) if grown.q_draft is not None else None
        acc = accept_sampling(tree.tokens, tree.parents, p_target, q_draft, gen, deterministic=grown.deterministic)
    kept = acc.path[s:] - s                                            # rows of the fed block
    if context is not None:                  # the target's predictions along the accepted path, recycled
        context.observe_rows(tree.tokens[acc.path].tolist(), logits, kept.tolist())
    emitted_lp = None
    if cfg.return_logprobs:                  # row path[j] is the distribution the j-th emitted token came from
        emitted = torch.cat([tree.tokens[acc.path[1:]], acc.next_token.reshape(1)])
        dist = (logits[kept].float().log_softmax(-1) if sampling.greedy
                else p_target[kept].log() if p_target is not None
                else processed_scores(logits[kept], sampling).log_softmax(-1))
        emitted_lp = dist.gather(1, emitted[:, None]).squeeze(1)
    return Judgement(acc, kept, logits[acc.path[-1] - s], emitted_lp)
