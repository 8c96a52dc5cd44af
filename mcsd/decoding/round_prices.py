"""What a drafted round costs in decoding beyond its levels' prices, measured on the decoder's own rounds.

The profile (`mcsd.costs.timing`) times forwards: a verify of n rows, a draft level of width w. A
drafted round also pays what no forward timing holds: the head's catch-up on the target's states
after the target's forward (its weights read back from memory), the policy's features and decisions
per level, the draws, the tree's bookkeeping, and the context graft's lookups. Priced at its levels
alone, a drafted round looked 2-3x cheaper than it ran, so the gates drafted where drafting loses.

`measure` runs the decoder itself on a fixed prompt for a few dozen drafted rounds (the policy's
gate reopened after each round, so that every round drafts), twice at two lengths whose difference
it keeps (what a generation pays once, the first catch-up over the prompt, drops out), and returns

- `round_ms`: per drafted round, its drafting time less the levels' prices and the graft's time;
- `graft_ms`: per graft, the context drafter's lookup and merge.

They are measured once per (profile, policy, drafters) and cached beside the profile, so a
command's trees, and its text in bfloat16, repeat from run to run on the same machine: decisions
read these fixed figures, never this run's clock. `Costs.round_ms` and `Costs.graft_ms` carry them
to the learned policy's gate and tree growth and to the context gate.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from ..costs import store

PROMPT_TOKENS = 96                 # a fixed pseudo-random prompt: the prefix a measured round reads
NEW_TOKENS = 64                    # tokens generated; every round drafts, so about 25-50 drafted rounds
SHORT_TOKENS = 16                  # ... and a shorter run whose rounds are differenced out (see `measure`)
PASSES = 2                         # measured this many times, the lowest kept
VERSION = 1                        # of what is measured; a cached figure of another version is measured again


def cache_path(decoder) -> Path:
    """Where the figures for the decoder's profile are cached: beside the profile."""
    prof = store.profile_path(decoder.target.model, decoder.calibration.timed_draft())
    return prof.with_name(prof.stem + ".rounds.json")


def key(decoder) -> str:
    """The figures' key within the cache file: the policy, the drafters, the tree."""
    drafter = getattr(decoder.drafter, "name", type(decoder.drafter).__name__) if decoder.drafter else "none"
    return (f"v{VERSION}|{decoder.policy.name}|{drafter}|context={decoder.context is not None}|"
            f"tree={decoder.policy.topology.size}|threads={torch.get_num_threads()}")


def cached(decoder) -> dict | None:
    """The cached figures for the decoder ({"round_ms", "graft_ms"}), or None."""
    try:
        entry = json.loads(cache_path(decoder).read_text()).get(key(decoder))
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) for k in ("round_ms", "graft_ms")):
        return {"round_ms": float(entry["round_ms"]), "graft_ms": float(entry["graft_ms"])}
    return None


def save(decoder, figures: dict) -> bool:
    """Cache `figures` beside the profile; False where the cache cannot be written (read-only)."""
    path = cache_path(decoder)
    try:
        entries = json.loads(path.read_text()) if path.exists() else {}
        entries[key(decoder)] = figures
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(path)
        return True
    except (OSError, ValueError):
        return False


def apply(decoder, calibrate: bool | None = None) -> str | None:
    """Give the costs the decoder's policy and context drafting read (`Costs.round_ms`, `graft_ms`)
    this machine's figures: cached, else measured now (not with `calibrate=False`, nor where the costs
    are the generic defaults or nothing drafts), else left at 0. Returns a line for `--stats`, or None
    where nothing prices trees."""
    costs = [c for c in (getattr(decoder.policy, "costs", None), decoder.context_costs) if c is not None]
    if not costs or (decoder.drafter is None and decoder.context is None):
        return None
    if costs[0].source == "default":
        return "not measured (generic costs)"
    figures, how = cached(decoder), "cached"
    if figures is None and calibrate is not False:
        figures, how = measure(decoder, costs[0]), "measured in this run"
        if not save(decoder, figures):
            how += ", not cached (the cache cannot be written)"
    if figures is None:
        return "not measured (calibrate=False and none cached)"
    for c in costs:
        c.round_ms, c.graft_ms = figures["round_ms"], figures["graft_ms"]
    return (f"a drafted round {figures['round_ms']:.2f} ms beyond its levels, a context graft "
            f"{figures['graft_ms']:.2f} ms ({how})")


def measure(decoder, costs) -> dict:
    """Run the decoder's own drafted rounds and return {"round_ms", "graft_ms"} (see the module).

    Uses `decoder.policy` and the decoder's context drafter where it has one, `costs` (the ones
    they read) with `round_ms` and `graft_ms` at 0 meanwhile; its rounds leave the costs as they
    were (`Costs.held`: no correction, no staleness verdict). Greedy, on a fixed prompt of the
    target's vocabulary.
    """
    policy = decoder.policy
    vocab = decoder.target.model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    priced, grafts = [], []
    context = decoder.context
    graft = context.graft if context is not None else None

    def timed_graft(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return graft(*args, **kwargs)
        finally:
            grafts.append((time.perf_counter() - t0) * 1000)

    def on_round(tree, acc) -> None:
        if int(tree.depth.max()) > 0 and getattr(policy, "gate", None) is not None and policy.gate.ran:
            priced.append(policy._draft_ms)           # the levels as the policy priced them, the root's included
        forget = getattr(policy, "forget", None)
        if forget is not None:
            forget()                                  # the next round drafts too

    def run(tokens: int) -> tuple[float, float, float, int, int]:
        """(draft ms, priced ms, graft ms, drafted rounds, grafts) of a generation of `tokens`."""
        priced.clear(), grafts.clear()
        out = decoder.generate(prompt, max_new_tokens=tokens, ignore_eos=True, on_round=on_round)
        return out.stats.draft_s * 1000, sum(priced), sum(grafts), len(priced), len(grafts)

    shared = {id(c): c for c in (costs, getattr(policy, "costs", None), decoder.context_costs) if c is not None}
    if context is not None:
        context.graft = timed_graft                   # this decoder's own context drafter, for this run only
    try:
        with contextlib.ExitStack() as stack:
            for held in shared.values():
                stack.enter_context(held.held()).round_ms = 0.0
            decoder.generate(prompt, max_new_tokens=8, ignore_eos=True)          # first-call costs out of it
            # Two lengths, differenced: the first drafted round's catch-up reads the whole prompt's states,
            # a cost of the generation rather than of its rounds, and both runs pay it alike. Twice, the
            # lower kept: a slow spell in one pass (another process) does not price rounds dear.
            passes = [_figures(run(SHORT_TOKENS), run(NEW_TOKENS)) for _ in range(PASSES)]
    finally:
        if context is not None:
            del context.graft
    return {name: min(p[name] for p in passes) for name in ("round_ms", "graft_ms")}

def _figures(short: tuple, long: tuple) -> dict:
    """{"round_ms", "graft_ms"} from two runs' (draft ms, priced ms, graft ms, drafted rounds, grafts)."""
    draft_ms, priced_ms, graft_ms, rounds, n_grafts = (b - a for a, b in zip(short, long))
    per_graft = graft_ms / n_grafts if n_grafts > 0 else (long[2] / long[4] if long[4] else 0.0)
    beyond = (draft_ms - graft_ms - priced_ms) / rounds if rounds > 0 else 0.0
    return {"round_ms": round(max(beyond, 0.0), 4), "graft_ms": round(max(per_graft, 0.0), 4)}
