"""What a drafted round costs in decoding beyond its levels' prices, measured on the decoder's own rounds.

The profile (`mcsd.costs.timing`) times forwards: a verify of n rows, a draft level of width w. A
drafted round also pays what no forward timing holds: the head's catch-up on the target's states
after the target's forward (its weights read back from memory), the policy's features and decisions
per level, the draws, the tree's bookkeeping, and the context graft's lookups. Priced at its levels
alone, a drafted round looked 2-3x cheaper than it ran, so the gates drafted where drafting loses.

`measure` runs the decoder itself on a fixed prompt for a few dozen drafted rounds (the policy's
gate reopened after each round, so that every round drafts), greedy and sampled, times each round,
and returns

- `round_ms` (greedy) and `round_ms_sampled`: what a drafted round takes beyond a plain step, its
  levels' prices, its extra rows' verify price and its graft (under sampling the draws and the
  acceptance over every node cost more than under greedy matching);
- `graft_ms`: per graft, the context drafter's lookup and merge;
- `context_round_ms` (greedy) and `context_round_ms_sampled`: what a round that grafts context nodes
  and drafts nothing takes beyond a plain step, its extra rows' verify price and its graft (the tree,
  the verify's acceptance over every node and its draws, the recycled predictions, the context's
  statistics): measured on rounds with the drafter's gate shut and the context gate held open.

The prompt is a fixed request in the tokenizer's chat template where the decoder has a tokenizer (the
context drafter's lookups then meet text that repeats as answers do), else fixed pseudo-random tokens.

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
VERSION = 4                        # of what is measured; a cached figure of another version is measured again
FIGURES = ("round_ms", "round_ms_sampled", "graft_ms", "context_round_ms", "context_round_ms_sampled")
REQUEST = ("Here is a list of tasks for the week: water the plants on Monday, call the bank about the card on "
           "Tuesday, send the report to the team on Wednesday, water the plants again on Thursday, and send the "
           "invoice to the client on Friday. Rewrite the list as a numbered list, one task a line, each line "
           "starting with the day, then say which tasks appear twice.")


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
                     f"{figures['graft_ms']:.2f} ms, a grafting round with nothing drafted "
                     f"{figures['context_round_ms']:.2f} ms beyond its rows and graft greedy, "
                     f"{figures['context_round_ms_sampled']:.2f} ms sampled ({how})")


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
            c.context_round_ms = figures["context_round_ms" if greedy else "context_round_ms_sampled"]


def measure_prompt(decoder) -> torch.Tensor:
    """The measured rounds' prompt: `REQUEST` in the tokenizer's chat template (or as plain text where it
    has none), else `PROMPT_TOKENS` fixed pseudo-random tokens of the target's vocabulary."""
    tok = decoder.tokenizer
    if tok is not None:
        try:
            from ..loading.data import chat_ids
            ids = chat_ids(tok, REQUEST) if getattr(tok, "chat_template", None) else tok(REQUEST)["input_ids"]
            if ids:
                return torch.tensor(ids, dtype=torch.long)
        except Exception:                   # a tokenizer of another kind: the pseudo-random prompt
            pass
    vocab = decoder.target.model.get_input_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))


def measure(decoder, costs) -> dict:
    """Run the decoder's own drafted rounds and return `FIGURES` (see the module).

    Uses `decoder.policy` and the decoder's context drafter where it has one, `costs` (the ones
    they read) with the figures at 0 meanwhile; its rounds leave the costs as they were
    (`Costs.held`: no correction, no staleness verdict). On a fixed prompt (`measure_prompt`), greedy
    and sampled (temperature 1, top-p 0.95, a fixed seed): each round is timed, and a drafted round's
    figure is its time less a plain step's (the median step of `generate_baseline` on the same prompt
    and settings), its graft's, its levels' prices and its extra rows' verify price (`verify_ms(size) -
    verify_ms(1)`), the median over the generation's drafted rounds but its first (whose catch-up reads
    the prompt's states, once a generation); a graft's, the mean of its grafts (most find little, a few
    build a deep trie); a grafting round's with nothing drafted, its time less the plain step's, its
    graft's and its extra rows' verify price, the median over such rounds of a generation whose
    drafter's gate is shut and whose context gate is held open.
    """
    policy = decoder.policy
    prompt = measure_prompt(decoder)
    context = decoder.context
    graft, timed = (context.graft if context is not None else None), []      # timed: per round
    lone_round = decoder._round
    hold_context_open = [False]

    def timed_graft(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return graft(*args, **kwargs)
        finally:
            timed[-1]["graft_ms"] += (time.perf_counter() - t0) * 1000

    def timed_round(sequence, cfg, gen, proposer, *args, **kwargs):
        if hold_context_open[0]:
            proposer.context_gate.reset()             # open: this round looks up and grafts what pays
        timed.append({"graft_ms": 0.0})
        t0 = time.perf_counter()
        out = lone_round(sequence, cfg, gen, proposer, *args, **kwargs)
        timed[-1]["ms"] = (time.perf_counter() - t0) * 1000
        return out

    def on_round(tree, acc) -> None:
        drafted = int(tree.depth.max()) > 0 and getattr(policy, "gate", None) is not None and policy.gate.ran
        timed[-1].update(size=tree.size, priced=policy._draft_ms if drafted and not hold_context_open[0] else None)
        forget = getattr(policy, "forget", None)
        if forget is not None and not hold_context_open[0]:
            forget()                                  # the next round drafts too

    def plain_step(**sampling) -> float:
        timed.clear()
        decoder.generate_baseline(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
        return statistics.median(r["ms"] for r in timed[1:])

    def figures(step: float, **sampling) -> tuple[float, list[float]]:
        """(a drafted round's figure, the grafts' times) under `sampling`."""
        timed.clear()
        decoder.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, on_round=on_round, **sampling)
        drafted = [r for r in timed if r.get("priced") is not None][1:]
        beyond = [r["ms"] - step - r["graft_ms"] - r["priced"] - (costs.verify_ms(r["size"]) - costs.verify_ms(1))
                  for r in drafted]
        return (statistics.median(beyond) if beyond else 0.0), [r["graft_ms"] for r in timed if r["graft_ms"]]

    def grafting(step: float, **sampling) -> float:
        """A grafting round's figure with nothing drafted, under `sampling` (0 without a context drafter)."""
        if context is None:
            return 0.0
        timed.clear()
        own = policy.begin_round
        policy.begin_round = lambda: (own(), 0)[1]    # the drafter's gate shut for this generation
        hold_context_open[0] = True
        try:
            decoder.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, on_round=on_round, **sampling)
        finally:
            hold_context_open[0] = False
            del policy.begin_round
        rounds = [r for r in timed if r.get("size", 1) > 1]
        beyond = [r["ms"] - step - r["graft_ms"] - (costs.verify_ms(r["size"]) - costs.verify_ms(1)) for r in rounds]
        return statistics.median(beyond) if beyond else 0.0

    shared = {id(c): c for c in (costs, getattr(policy, "costs", None), decoder.context_costs) if c is not None}
    decoder._round = timed_round                      # this decoder's own round and context drafter, for now
    if context is not None:
        context.graft = timed_graft
    sampled_with = dict(temperature=1.0, top_p=0.95, seed=0)
    try:
        with contextlib.ExitStack() as stack:
            for held in shared.values():
                stack.enter_context(held.held()).round_ms = 0.0
                held.graft_ms = held.context_round_ms = 0.0
            decoder.generate(prompt, max_new_tokens=8, ignore_eos=True)          # first-call costs out of it
            step = plain_step()
            greedy, grafts = figures(step)
            greedy_grafting = grafting(step)
            # sampled with a nucleus (what a chat client sends): each extra node's filtering and draw
            # lands in the round's figure, a price on the safe side for plain temperature sampling
            step = plain_step(**sampled_with)
            sampled, more = figures(step, **sampled_with)
            sampled_grafting = grafting(step, **sampled_with)
    finally:
        del decoder._round
        if context is not None:
            del context.graft
    grafts += more
    return {"round_ms": round(max(greedy, 0.0), 4), "round_ms_sampled": round(max(sampled, 0.0), 4),
            "graft_ms": round(statistics.fmean(grafts), 4) if grafts else 0.0,
            "context_round_ms": round(max(greedy_grafting, 0.0), 4),
            "context_round_ms_sampled": round(max(sampled_grafting, 0.0), 4)}
