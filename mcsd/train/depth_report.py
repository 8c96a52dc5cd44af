"""A feature head's acceptance by depth, teacher-forced and in real decoding, on the same prompts.

Both sides run on the target's own greedy responses to held-out prompts:

- teacher-forced: the head's chain from every response position
  (`mcsd.train.feature_head.agreement`), depth j counted where depths
  1..j-1 were right, which is what a chain's acceptance at depth j means;
- decoding: `TreeDecoder` with a static chain of `depth` nodes, greedy,
  from the same prompts, the drafter as the product runs it; acceptance at
  depth j given depth j-1, as `GenerationStats.accept_by_depth` reports it.

The two differ in which positions root a round (every position, or those
decoding happens to reach: `replayed` counts the teacher-forced chains at
decoding's roots only, which separates the two causes) and in the prompt positions the drafter reads
(the trainer's windows read none before the response; the drafter its
`window`); with a window of one, tests/test_feature_training.py checks round
by round that they are the same computation.

    python tools/measure_draft.py --depth-report models/smollm2-135m-feature-head --data-run heldout-greedy
"""

from __future__ import annotations

import math

import torch

from mcsd.loading.data import group_of


def first_per_group(examples: list[dict], n: int) -> list[dict]:
    """The first `n` examples of each category group, in their order."""
    taken: dict[str, int] = {}
    out = []
    for ex in examples:
        group = group_of(ex["category"])
        if taken.get(group, 0) < n:
            out.append(ex)
            taken[group] = taken.get(group, 0) + 1
    return out


def _by_group(examples: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for ex in examples:
        groups.setdefault(group_of(ex["category"]), []).append(ex)
    return dict(sorted(groups.items()))


def teacher_forced(head, embed, examples: list[dict], depth: int = 3, window: int = 256) -> dict:
    """{"all": [...], group: [...]}: per depth, `top1_given_prev` (and its positions) from
    `agreement` over windows of `window` response positions."""
    from mcsd.train.feature_head import agreement

    def summary(exs):
        return [{"depth": a["step"], "acceptance": round(a["top1_given_prev"], 4), "reached": a["positions_reached"]}
                for a in agreement(head, embed, exs, window, "cpu", steps=depth)]
    return {"all": summary(examples), **{g: summary(exs) for g, exs in _by_group(examples).items()}}


def _rates(counts: dict[str, list[list[int]]]) -> dict:
    """{key: [(accepted, offered) per depth]} counts as {key: [{"depth", "acceptance", "reached"}]}."""
    return {key: [{"depth": d + 1, "acceptance": round(a / o, 4) if o else None, "reached": o}
                  for d, (a, o) in enumerate(zip(acc, off))] for key, (acc, off) in counts.items()}


def _chain_decoder(target, drafter, depth: int):
    """The product's decoder with a static chain of `depth` nodes (no policy, no context)."""
    from mcsd import TreeDecoder
    return TreeDecoder(target, drafter, tree=",".join(["1"] * depth), policy="static", threads=None)


def _count(counts: list[list[int]], stats) -> None:
    """Add one generation's accepted / offered rounds by depth into `counts` ([accepted, offered])."""
    for d, (a, o) in enumerate(zip(stats.accepted_by_depth, stats.offered_by_depth)):
        counts[0][d] += a
        counts[1][d] += o


def replayed(head, embed, examples: list[dict], depth: int = 3, max_new_tokens: int = 128) -> dict:
    """{"all": [...], group: [...]}: teacher-forced chains, counted only at the positions greedy
    decoding roots its rounds at. Decoding's first round is rooted at the response's first token;
    a round that accepts a tokens roots the next one a + 1 tokens later (the accepted tokens, then
    the target's own), so the roots are replayed from the chain lengths alone
    (`mcsd.train.feature_head.chain_lengths`). Where the head reads what the drafter reads, this
    is decoding's count, round for round; it differs from `teacher_forced` only in which
    positions root a round."""
    from mcsd.train.feature_head import chain_lengths

    counts: dict[str, list[list[int]]] = {}
    for ex in examples:
        runs = chain_lengths(head, embed, ex, steps=depth)
        limit = min(len(ex["response"]), max_new_tokens)
        root = 0
        while root < limit - 1:                  # the response's tokens up to `root` are emitted
            drafted = min(depth, limit - root - 2)        # a round of k drafted nodes may emit k + 1 tokens
            got = min(int(runs[root]), max(drafted, 0))
            for key in ("all", group_of(ex["category"])):
                acc, off = counts.setdefault(key, [[0] * depth, [0] * depth])
                for d in range(drafted):
                    off[d] += 1
                    if got <= d:
                        break
                    acc[d] += 1
            root += got + 1
    return _rates(counts)


def decoding(target, drafter, examples: list[dict], depth: int = 3, max_new_tokens: int = 128,
             ignore_eos: bool = False) -> dict:
    """{"all": [...], group: [...]}: per depth, acceptance given the depth above and rounds that
    reached it, decoding each example's prompt greedily with a static chain; also how many
    outputs equal the stored responses (the same target and dtype write the same tokens)."""
    dec = _chain_decoder(target, drafter, depth)
    counts: dict[str, list[list[int]]] = {}
    same = 0
    for ex in examples:
        out = dec.generate(torch.as_tensor(ex["prompt"], dtype=torch.long), max_new_tokens=max_new_tokens,
                           ignore_eos=ignore_eos)
        same += out.tokens == ex["response"][:len(out.tokens)].tolist()
        for key in ("all", group_of(ex["category"])):
            _count(counts.setdefault(key, [[0] * depth, [0] * depth]), out.stats)
    result = _rates(counts)
    result["outputs_equal_to_stored"] = f"{same}/{len(examples)}"
    return result


def chain_acceptance(target, drafter, prompts: list[list[int]], settings=((0.0, 1.0), (0.7, 0.95), (1.0, 1.0)),
                     seeds=(0, 1), depth: int = 3, max_new_tokens: int = 128) -> list[dict]:
    """A drafter's acceptance along a static chain of `depth` nodes in real decoding, per sampling setting.

    Each (temperature, top_p) in `settings` decodes every prompt (token ids, chat-formatted by the
    caller) once greedily, or once per seed when sampling, with the default shared-noise verify: a
    drafted token is accepted exactly when it is the target's draw at its position, so acceptance
    at depth 1 is how often the drafter's first guess is the target's own next token. Returns one
    row per setting: acceptance at each depth given the depth above (`GenerationStats`'s
    accepted / offered, summed over prompts and seeds), the rounds that reached each depth, and
    tau (tokens per target forward).
    """
    dec = _chain_decoder(target, drafter, depth)
    rows = []
    for temperature, top_p in settings:
        counts, tokens, forwards = [[0] * depth, [0] * depth], 0, 0
        runs = [(ids, seed) for ids in prompts for seed in (seeds if temperature > 0 else seeds[:1])]
        for ids, seed in runs:
            out = dec.generate(torch.as_tensor(ids, dtype=torch.long), max_new_tokens=max_new_tokens,
                               temperature=temperature, top_p=top_p, seed=seed)
            _count(counts, out.stats)
            tokens += len(out.tokens)
            forwards += out.stats.target_forwards
        by_depth = _rates({"chain": counts})["chain"]
        rows.append({"temperature": temperature, "top_p": top_p,
                     "acceptance": [r["acceptance"] for r in by_depth], "reached": [r["reached"] for r in by_depth],
                     "tau": round(tokens / max(forwards, 1), 3), "generations": len(runs)})
    return rows


def differs(a: float, n_a: int, b: float, n_b: int, z: float = 2.0) -> bool:
    """Whether two acceptance rates differ by more than `z` standard errors of their difference."""
    if not n_a or not n_b:
        return False
    p = (a * n_a + b * n_b) / (n_a + n_b)
    se = math.sqrt(max(p * (1 - p), 1e-12) * (1 / n_a + 1 / n_b))
    return abs(a - b) > z * se


def _beyond(label: str, side: dict, real: dict) -> list[str]:
    """Where `side` and decoding differ beyond noise, per group and depth, one line each."""
    return [f"{g} depth {t['depth']}: {label} {t['acceptance']} ({t['reached']}) vs decoding "
            f"{r['acceptance']} ({r['reached']})"
            for g in side for t, r in zip(side[g], real.get(g, []))
            if None not in (t["acceptance"], r["acceptance"])
            and differs(t["acceptance"], t["reached"], r["acceptance"], r["reached"])]


def report(target, drafter, embed, examples: list[dict], depth: int = 3, max_new_tokens: int = 128) -> dict:
    """Both sides per group and depth, and where they differ beyond noise (2 standard errors)."""
    tf = teacher_forced(drafter.head, embed, examples, depth)
    at_roots = replayed(drafter.head, embed, examples, depth, max_new_tokens)
    real = decoding(target, drafter, examples, depth, max_new_tokens)
    beyond = _beyond("teacher-forced", tf, real)
    beyond_at_rounds = _beyond("at decoding's roots", at_roots, real)
    return {"teacher_forced": tf, "teacher_forced_at_rounds": at_roots, "decoding": real, "beyond_noise": beyond,
            "beyond_noise_at_rounds": beyond_at_rounds,
            "what": f"static chain of {depth}, greedy, {len(examples)} held-out prompts, {max_new_tokens} new "
                    f"tokens in decoding; acceptance at depth j given depth j-1"}
