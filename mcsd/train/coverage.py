"""How much of the target's argmax a sub-vocabulary can propose at all.

A feature head scores only a frequency-ranked sub-vocabulary (`vocab_ids`):
a position whose target argmax lies outside it can never be accepted, so the
sub-vocabulary's coverage of the target's argmax on text it was not built
from caps the head's acceptance. In a greedy response the target's argmax at
each position is the token it wrote, so greedy token shards measure this
without running the model.

Prompts are split by a hash of their id, so a prompt's responses are all on
one side: sub-vocabularies are ranked on the fitting side and measured on the
held-out side.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from mcsd.train.shards import Record

SIZES = (1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768)


def heldout(prompt_id: str, every: int = 5) -> bool:
    """Whether a prompt is on the held-out side: one in `every`, by a stable hash of its id."""
    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) % every == 0


def split_records(records: Iterable[Record], every: int = 5) -> tuple[list[Record], list[Record]]:
    """(fitting, held-out) records, split by prompt."""
    fit, out = [], []
    for r in records:
        (out if heldout(r.prompt_id, every) else fit).append(r)
    return fit, out


def frequency_ranked(seqs: Iterable[Sequence[int]]) -> list[int]:
    """Token ids by descending frequency over `seqs` (ties by id, so the ranking is stable)."""
    counts: Counter = Counter()
    for s in seqs:
        counts.update(s)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def coverage(vocab_ids: Iterable[int], tokens: Sequence[int]) -> float:
    """Fraction of `tokens` inside `vocab_ids`."""
    if not tokens:
        raise ValueError("coverage of no tokens")
    ids = torch.as_tensor(list(vocab_ids), dtype=torch.long)
    return float(torch.isin(torch.as_tensor(tokens, dtype=torch.long), ids).float().mean())


def coverage_curve(ranked: Sequence[int], tokens: Sequence[int], sizes: Sequence[int] = SIZES) -> list[dict]:
    """Coverage of `tokens` by the first `size` ids of `ranked`, for each size (a size past the
    ranking's length takes all of it, and says how many ids that was)."""
    return [{"size": size, "ids": min(size, len(ranked)), "coverage": round(coverage(ranked[:size], tokens), 4)}
            for size in sizes]


def smallest_size(curve: list[dict], target: float) -> int | None:
    """The smallest sub-vocabulary size in `curve` whose coverage reaches `target`, or None."""
    for point in curve:
        if point["coverage"] >= target:
            return point["size"]
    return None


def report(records: Iterable[Record], head_vocab_ids: Sequence[int] | None = None, every: int = 5,
           sizes: Sequence[int] = SIZES) -> dict:
    """The coverage report of greedy response records: the curve over sub-vocabulary sizes ranked
    on the fitting prompts and measured on the held-out ones, and, given a head's `vocab_ids`,
    that head's coverage of the held-out argmax.

    Returns:
        {"fit_tokens", "heldout_tokens", "heldout_prompts", "distinct_fit_ids", "curve",
         "size_for_99", "size_for_995", ["head": {"size", "coverage"}]}.
    """
    fit, out = split_records(records, every)
    held = [t for r in out for t in r.response]
    if not fit or not held:
        raise ValueError(f"coverage needs responses on both sides of the split (fitting {len(fit)}, "
                         f"held-out {len(out)})")
    ranked = frequency_ranked(r.response for r in fit)
    curve = coverage_curve(ranked, held, sizes)
    result = {"fit_tokens": sum(len(r.response) for r in fit), "heldout_tokens": len(held),
              "heldout_prompts": len({r.prompt_id for r in out}), "distinct_fit_ids": len(ranked),
              "curve": curve, "size_for_99": smallest_size(curve, 0.99), "size_for_995": smallest_size(curve, 0.995)}
    if head_vocab_ids is not None:
        result["head"] = {"size": len(head_vocab_ids), "coverage": round(coverage(head_vocab_ids, held), 4)}
    return result
