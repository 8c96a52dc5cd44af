"""What a drafted round costs in decoding beyond its levels' prices, measured on the decoder's own rounds.

The profile (`mcsd.costs.timing`) times forwards: a verify of n rows, a draft level of width w. A
drafted round also pays what no forward timing holds: the head's catch-up on the target's states
after the target's forward (its weights read back from memory), the policy's features and decisions
per level, the draws, the tree's bookkeeping, and the context graft's lookups. Priced at its levels
alone, a drafted round looked 2-3x cheaper than it ran, so the gates drafted where drafting loses.

`measure` runs the decoder itself on a fixed prompt for a few dozen drafted rounds (every round
drafting its levels: `LearnedPolicy.every_round`), greedy and sampled, times each round, and returns

- `round_ms` (greedy) and `round_ms_sampled`: what a drafted round takes beyond a plain step, its
  levels' prices, its extra rows' verify price and its graft (under sampling the draws and the
  acceptance over every node cost more than under greedy matching);
- `graft_ms`: per graft, the context drafter's lookup and merge.

They are measured once per (profile, policy, drafters) and cached beside the profile, so a
command's trees, and its text in bfloat16, repeat from run to run on the same machine: decisions
read these fixed figures, never this run's clock. `Costs.round_ms` and `Costs.graft_ms` carry them
to the learned policy's gate and tree growth and to the context gate.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from ..costs import store

PROMPT_TOKENS = 96                 # a fixed pseudo-random prompt: the prefix a measured round reads
NEW_TOKENS = 64                    # tokens generated; every round drafts, so about 25-50 drafted rounds
VERSION = 3                        # of what is measured; a cached figure of another version is measured again
FIGURES = ("round_ms", "round_ms_sampled", "graft_ms")


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
    """The cached figures for the decoder (`FIGURES`), or None."""
    try:
        entry = json.loads(cache_path(decoder).read_text()).get(key(decoder))
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) for k in FIGURES):
        return {k: float(entry[k]) for k in FIGURES}
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


def apply(decoder, calibrate: bool | None = None) -> tuple[dict | None, str | None]:
    """This machine's figures for the decoder (`FIGURES`): cached, else measured now (not with
    `calibrate=False`, nor where the costs are the generic defaults or nothing drafts), else None;
    with a line for `--stats` (None where nothing prices trees). `use` gives them to the costs."""
    costs = [c for c in (getattr(decoder.policy, "costs", None), decoder.context_costs) if c is not None]
    if not costs or (decoder.drafter is None and decoder.context is None):
        return None, None
    if costs[0].source == "default":
        return None, "not measured (generic costs)"
    figures, how = cached(decoder), "cached"
    if figures is None and calibrate is not False:
        figures, how = measure(decoder, costs[0]), "measured in this run"
        if not save(decoder, figures):
            how += ", not cached (the cache cannot be written)"
    if figures is None:
        return None, "not measured (calibrate=False and none cached)"
    return figures, (f"a drafted round {figures['round_ms']:.2f} ms beyond a plain step and its levels' and "
                     f"rows' prices greedy, {figures['round_ms_sampled']:.2f} ms sampled, a context graft "
                     f"{figures['graft_ms']:.2f} ms ({how})")


def use(decoder, greedy: bool) -> None:
    """Give the decoder's costs its figures (`decoder.round_figures`, from `apply`) for a generation's
    decoding, greedy or sampled; fixed for the generation."""
    figures = decoder.round_figures
    if not figures:
        return
    for c in (getattr(decoder.policy, "costs", None), decoder.context_costs):
        if c is not None:
            c.round_ms = figures["round_ms" if greedy else "round_ms_sampled"]
            c.graft_ms = figures["graft_ms"]


def measure(decoder, costs) -> dict:
    """Run the decoder's own drafted rounds and return {"round_ms", "round_ms_sampled", "graft_ms"}
    (see the module).

    Uses `decoder.policy` and the decoder's context drafter where it has one, `costs` (the ones
    they read) with `round_ms` and `graft_ms` at 0 meanwhile; its rounds leave the costs as they
    were (`Costs.held`: no correction, no staleness verdict). On a fixed prompt of the target's
    vocabulary, greedy and sampled (temperature 1, top-p 0.95, a fixed seed): each round is timed, and a drafted
    round's figure is its time less a plain step's (the median step of `generate_baseline` on the
    same prompt and settings), its graft's, its levels' prices and its extra rows' verify price
    (`verify_ms(size) - verify_ms(1)`), the median over the generation's drafted rounds but its
    first (whose catch-up reads the prompt's states, once a generation); a graft's, the mean of
    its grafts (most find little, a few build a deep trie).
    """
    policy = decoder.policy
    vocab = decoder.target.model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    context = decoder.context
    graft, timed = (context.graft if context is not None else None), []      # timed: per round
    lone_round = decoder._round

    def timed_graft(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return graft(*args, **kwargs)
        finally:
            timed[-1]["graft_ms"] += (time.perf_counter() - t0) * 1000

    def timed_round(*args, **kwargs):
        timed.append({"graft_ms": 0.0})
        t0 = time.perf_counter()
        out = lone_round(*args, **kwargs)
        timed[-1]["ms"] = (time.perf_counter() - t0) * 1000
        return out

    def on_round(tree, acc) -> None:
        drafted = int(tree.depth.max()) > 0 and getattr(policy, "gate", None) is not None and policy.gate.ran
        timed[-1].update(size=tree.size, priced=policy._draft_ms if drafted else None)

    def figures(**sampling) -> tuple[float, list[float]]:
        """(a drafted round's figure, the grafts' times) under `sampling`."""
        timed.clear()
        decoder.generate_baseline(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
        step = statistics.median(r["ms"] for r in timed[1:])
        timed.clear()
        decoder.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, on_round=on_round, **sampling)
        drafted = [r for r in timed if r.get("priced") is not None][1:]
        beyond = [r["ms"] - step - r["graft_ms"] - r["priced"] - (costs.verify_ms(r["size"]) - costs.verify_ms(1))
                  for r in drafted]
        return (statistics.median(beyond) if beyond else 0.0), [r["graft_ms"] for r in timed if r["graft_ms"]]

    shared = {id(c): c for c in (costs, getattr(policy, "costs", None), decoder.context_costs) if c is not None}
    decoder._round = timed_round                      # this decoder's own round and context drafter, for now
    if context is not None:
        context.graft = timed_graft
    every_round = getattr(policy, "every_round", None)           # every round drafts its levels, to be timed
    try:
        with contextlib.ExitStack() as stack:
            if every_round is not None:
                stack.enter_context(every_round())
            for held in shared.values():
                stack.enter_context(held.held()).round_ms = 0.0
            decoder.generate(prompt, max_new_tokens=8, ignore_eos=True)          # first-call costs out of it
            greedy, grafts = figures()
            # sampled with a nucleus (what a chat client sends): each extra node's filtering and draw
            # lands in the round's figure, a price on the safe side for plain temperature sampling
            sampled, more = figures(temperature=1.0, top_p=0.95, seed=0)
    finally:
        del decoder._round
        if context is not None:
            del context.graft
    grafts += more
    return {"round_ms": round(max(greedy, 0.0), 4), "round_ms_sampled": round(max(sampled, 0.0), 4),
            "graft_ms": round(statistics.fmean(grafts), 4) if grafts else 0.0}
