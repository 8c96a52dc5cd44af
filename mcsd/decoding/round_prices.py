"""What a drafted round costs in decoding beyond its levels' prices, measured on the decoder's own rounds.

The profile (`mcsd.costs.timing`) times forwards: a verify of n rows, a draft level of width w. A
drafted round also pays what no forward timing holds: the head's catch-up on the target's states
after the target's forward (its weights read back from memory), the policy's features and decisions
per level, the draws, the tree's bookkeeping, and the context graft's lookups. Priced at its levels
alone, a drafted round looked 2-3x cheaper than it ran, so the gates drafted where drafting loses.

`measure` runs the decoder itself on a fixed prompt, drafting its levels on every other round
(`LearnedPolicy.every_round`), and, with context drafting, drafting nothing but looking up on every
other round, greedy and sampled; it times each round against the plain steps beside it, in the
profile's ms (`beyond`), and returns

- `round_ms` (greedy) and `round_ms_sampled`: what a drafted round takes beyond a plain step, its
  levels' prices, its extra rows' verify price and its graft (under sampling the draws and the
  acceptance over every node cost more than under greedy matching);
- `graft_ms`: per graft, the context drafter's lookup and merge;
- `lookup_ms`: a lookup beneath a root alone that finds nothing worth grafting, as decoding pays it
  (what the context gate pays for trying): its own time, the mean over such lookups (one whose
  continuations did not pay has built their trie, most cost a fraction of a graft), and the recycling
  of the target's top-k on the step before it, which the steps of a shut gate skip (without it a miss
  was priced at a third of what a probe added to decoding's rounds at T 1.0 on a 2-core Xeon, so a
  shut gate probed three times as often as its budget allows);
- `context_round_ms` (greedy) and `context_round_ms_sampled`: a round that drafts nothing but
  grafts, beyond a plain step, its lookup and merge, and its extra rows' verify price (the tree of
  the root and its graft made, verified and accepted where a plain step makes none);
- `draft_value` (greedy) and `draft_value_sampled`: what a round the drafter probes was worth in
  decoding, in the profile's ms: the drafted tokens it had accepted that context drafting did not
  propose too, at a plain step each, less what it took beyond the plain step before it and added to
  the one after (its head forwards, the catch-up on the features of the steps before it, its rows
  and draws; the context drafter's own work and rows left out), on a fixed English text, every
  `WORTH_SPACING`-th round a probe with the first-level test (spaced as a shut gate's probes are, the
  head starting over from the last `RESUME_WINDOW` steps' features: probes on every other round, with
  every feature fed, read 2-3 ms a probe cheaper than decoding runs them on a 2-core Xeon). Where it
  is a loss the learned policy's gate starts each generation shut (`LearnedPolicy.prior`), for the
  wait a probe that lost that much would sit out: a drafter that does not pay on this machine beside
  context drafting (its forwards or its rows dear beside the target's step) is then not tried at
  every text's start. 0 where there is no drafter, policy gate or tokenizer for the text.

They are measured once per (profile, policy, drafters) and cached beside the profile, so a
command's trees, and its text in bfloat16, repeat from run to run on the same machine: decisions
read these fixed figures, never this run's clock. Each figure is what a round took beyond the
profile's prices, so it holds for the prices it was measured against alone: the cache entry keeps
their fingerprint (`prices_key`), and a profile measured again (a stale one, at the next start or
by `TreeDecoder.recalibrate`) has its figures measured again too (a profile's price of a second
row ranged from 0.15 to 0.80 ms above a step between measurements on one machine).
`Costs.round_ms`, `graft_ms` and `context_round_ms` carry them to the learned policy's gate and tree
growth, to the context gate and to the context drafter's choice beneath a root alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from ..costs import store
from ..loading.data import chat_ids
from .propose import RESUME_WINDOW

PROMPT_TOKENS = 96                 # a fixed pseudo-random prompt: the prefix a measured round reads
NEW_TOKENS = 128                   # tokens generated; every other round drafts: ~10 rounds timed greedy, ~50 sampled
CONTEXT_TOKENS = 128               # ... where every other round looks up: about 60 lookups, some grafting
PASSES = 5                         # generations of each kind, the quietest one's figures kept (`quietest`)
# sampled with a nucleus (what a chat client sends): each extra node's filtering and draw lands in the
# round's figure, a price on the safe side for plain temperature sampling
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "seed": 0}
VERSION = 10                       # of what is measured; a cached figure of another version is measured again
FIGURES = ("round_ms", "round_ms_sampled", "graft_ms", "lookup_ms", "context_round_ms", "context_round_ms_sampled",
           "draft_value", "draft_value_sampled")
# the fixed text a drafted round's worth is measured on (the drafter's acceptance needs language, not the
# timing prompt's random ids), answered for `WORTH_TOKENS`
WORTH_TEXT = ("Explain, in a few short paragraphs, how a bicycle stays upright while it is moving, and why "
              "it falls over when it stops. Mention the role of the rider, the front wheel and the speed.")
WORTH_TOKENS = 128
# a probe's spacing there: a shut gate's probe follows a wait longer than `RESUME_WINDOW`, so the head
# starts over from the window's features, as it does in decoding; a probe every other round would have
# them all fed and read cheaper than it runs
WORTH_SPACING = RESUME_WINDOW + 2
NO_WORTH = {"draft_value": 0.0, "draft_value_sampled": 0.0}     # where nothing measures a drafter's worth


def cache_path(decoder) -> Path:
    """Where the figures for the decoder's profile are cached: beside the profile."""
    prof = store.profile_path(decoder.target.model, decoder.calibration.timed_draft())
    return prof.with_name(prof.stem + ".rounds.json")


def key(decoder) -> str:
    """The figures' key within the cache file: the policy, the drafters, the tree."""
    drafter = getattr(decoder.drafter, "name", type(decoder.drafter).__name__) if decoder.drafter else "none"
    return (f"v{VERSION}|{decoder.policy.name}|{drafter}|context={decoder.context is not None}|"
            f"tree={decoder.policy.topology.size}|threads={torch.get_num_threads()}")


def prices_key(costs) -> str:
    """A fingerprint of the profile's prices the figures are measured beyond (`costs`' verify and draft
    tables, to 0.1 us): figures measured against other prices do not hold for these."""
    tables = {kind: sorted((int(n), round(float(ms), 4)) for n, ms in getattr(costs, kind).items())
              for kind in ("verify", "draft")}
    return hashlib.sha256(json.dumps(tables).encode()).hexdigest()[:16]


def cached(decoder, costs) -> dict | None:
    """The cached figures for the decoder (`FIGURES`), measured against `costs`' prices, or None."""
    try:
        entry = json.loads(cache_path(decoder).read_text()).get(key(decoder))
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(entry, dict) and entry.get("prices") == prices_key(costs) \
            and all(isinstance(entry.get(k), (int, float)) for k in FIGURES):
        return {k: float(entry[k]) for k in FIGURES}
    return None


def save(decoder, figures: dict, costs) -> bool:
    """Cache `figures`, measured against `costs`' prices, beside the profile; False where the cache
    cannot be written (read-only)."""
    path = cache_path(decoder)
    try:
        entries = json.loads(path.read_text()) if path.exists() else {}
        entries[key(decoder)] = {**figures, "prices": prices_key(costs)}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(path)
        return True
    except (OSError, ValueError):
        return False


def apply(decoder, calibrate: bool | None = None) -> tuple[dict | None, str | None]:
    """This machine's figures for the decoder (`FIGURES`): cached against its profile's prices, else
    measured now (not with `calibrate=False`, nor where the costs are the generic defaults or nothing
    drafts), else None; with a line for `--stats` (None where nothing prices trees). `use` gives them
    to the costs."""
    costs = [c for c in (getattr(decoder.policy, "costs", None), decoder.context_costs) if c is not None]
    if not costs or (decoder.drafter is None and decoder.context is None):
        return None, None
    if costs[0].source == "default":
        return None, "not measured (generic costs)"
    figures, how = cached(decoder, costs[0]), "cached"
    if figures is None and calibrate is not False:
        figures, how = measure(decoder, costs[0]), "measured in this run"
        if not save(decoder, figures, costs[0]):
            how += ", not cached (the cache cannot be written)"
    if figures is None:
        return None, "not measured (calibrate=False and none cached)"
    return figures, (f"a drafted round {figures['round_ms']:.2f} ms beyond a plain step and its levels' and "
                     f"rows' prices greedy, {figures['round_ms_sampled']:.2f} ms sampled, a context graft "
                     f"{figures['graft_ms']:.2f} ms, a lookup that finds nothing {figures['lookup_ms']:.2f} ms, "
                     f"a round of the root and its graft {figures['context_round_ms']:.2f} / "
                     f"{figures['context_round_ms_sampled']:.2f} ms; a drafted round worth "
                     f"{figures['draft_value']:+.2f} / {figures['draft_value_sampled']:+.2f} ms ({how})")


def use(decoder, greedy: bool) -> None:
    """Give the decoder's costs its figures (`decoder.round_figures`, from `apply`) for a generation's
    decoding, greedy or sampled; fixed for the generation."""
    figures = decoder.round_figures
    if not figures:
        return
    for c in (getattr(decoder.policy, "costs", None), decoder.context_costs):
        if c is not None:
            c.round_ms = figures["round_ms" if greedy else "round_ms_sampled"]
            c.graft_ms, c.lookup_ms = figures["graft_ms"], figures["lookup_ms"]
            c.context_round_ms = figures["context_round_ms" if greedy else "context_round_ms_sampled"]
    if hasattr(decoder.policy, "prior"):           # where this machine's drafted rounds lost, the gate starts shut
        decoder.policy.prior = figures["draft_value" if greedy else "draft_value_sampled"]


def measure(decoder, costs) -> dict:
    """Run the decoder's own rounds and return its `FIGURES` (see the module).

    Uses `decoder.policy` and the decoder's context drafter where it has one, `costs` (the ones
    they read) with every figure at 0 meanwhile; its rounds leave the costs as they were
    (`Costs.held`: no correction, no staleness verdict). On a fixed prompt of the target's
    vocabulary, greedy and sampled (temperature 1, top-p 0.95, a fixed seed), rounds that draft or
    graft alternating with plain steps, each priced against the steps beside it (`beyond`):
    - a drafted round's figure (every other round drafting its levels, as a shut gate's probe follows
      a plain step): beyond its levels' prices, its graft's and its extra rows' verify price, the
      median over a generation's drafted rounds, the least of `PASSES` generations' (`quietest`); a
      graft's, the mean of its grafts (most find little, a few build a deep trie);
    - with context drafting, rounds that draft nothing (the policy kept from drafting), every other
      one looking up, on the prompt's first third repeated, so that the lookups find continuations:
      a round that grafts, beyond its lookup and merge and its extra rows' verify price; the median
      of those, likewise the least of `PASSES` generations'.
    """
    policy = decoder.policy
    vocab = decoder.target.model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    repeated = prompt[:PROMPT_TOKENS // 3].repeat(3)               # the same length: a plain step's price holds
    context = decoder.context
    timed = []                                                      # per round
    misses = []                                                     # ms of each lookup that found nothing
    recycles = []                                                   # ms of each step's recycled top-k
    looking = []                                                    # [the every-other gate] in a timed generation
    lone_round = decoder._round

    def timed_round(sequence, cfg, gen, proposer, *args, **kwargs):
        if looking:
            proposer.context_gate = looking[0]                      # every other round looks up
        timed.append({"graft_ms": 0.0})
        t0 = time.perf_counter()
        out = lone_round(sequence, cfg, gen, proposer, *args, **kwargs)
        timed[-1]["ms"] = (time.perf_counter() - t0) * 1000
        return out

    def on_round(tree, acc) -> None:
        drafted = int(tree.depth.max()) > 0 and getattr(policy, "gate", None) is not None and policy.gate.ran
        timed[-1].update(size=tree.size, priced=policy._draft_ms if drafted else None)

    def generation(tokens, new_tokens, drafting, sampling) -> None:
        """One generation, its rounds timed, every other round looking up (with context drafting) and,
        under `drafting`, drafting, the rounds between being plain steps."""
        timed.clear()
        looking.append(_EveryOther())
        try:
            with drafting(policy):
                decoder.generate(tokens, max_new_tokens=new_tokens, ignore_eos=True, on_round=on_round, **sampling)
        finally:
            looking.clear()

    def figures() -> tuple[dict, dict, list[float]]:
        """Greedy and sampled: ({greedy: a drafted round's figure}, {greedy: the grafting rounds' own
        work}, the grafts' times). The passes take turns, greedy then sampled, so that a busy spell of
        the machine lands on passes of both kinds rather than on all of one kind's."""
        drafted, rounds, grafts = {True: [], False: []}, {True: [], False: []}, []
        for _ in range(PASSES):
            for greedy, sampling in ((True, {}), (False, SAMPLED)):
                generation(prompt, NEW_TOKENS, _drafting_every_other, sampling)
                drafted[greedy].append(beyond(timed, costs, True))
                grafts += [r["graft_ms"] for r in timed if r["graft_ms"]]
                if context is not None:
                    generation(repeated, CONTEXT_TOKENS, _drafting_nothing, sampling)
                    rounds[greedy].append(beyond(timed, costs, False))
        return ({g: quietest(p) for g, p in drafted.items()}, {g: quietest(p) for g, p in rounds.items()}, grafts)

    shared = {id(c): c for c in (costs, getattr(policy, "costs", None), decoder.context_costs) if c is not None}
    decoder._round = timed_round                      # this decoder's own round and context drafter, for now
    try:
        with contextlib.ExitStack() as stack, _lookups_timed(context, timed, misses, recycles):
            for held in shared.values():
                stack.enter_context(held.held())
                held.round_ms = held.graft_ms = held.lookup_ms = held.context_round_ms = 0.0
            decoder.generate(prompt, max_new_tokens=8, ignore_eos=True)          # first-call costs out of it
            drafted, rounds, grafts = figures()
    finally:
        del decoder._round

    def figure(value: float | None) -> float:
        return round(max(value, 0.0), 4) if value is not None else 0.0

    out = {"round_ms": figure(drafted[True]), "round_ms_sampled": figure(drafted[False]),
           "graft_ms": figure(statistics.fmean(grafts) if grafts else None),
           "lookup_ms": figure(statistics.fmean(misses) + (statistics.fmean(recycles) if recycles else 0.0)
                               if misses else None),
           "context_round_ms": figure(rounds[True]), "context_round_ms_sampled": figure(rounds[False])}
    return {**out, **worth(decoder, out, costs, list(shared.values()))}


def worth(decoder, figures: dict, costs, held: list) -> dict:
    """`draft_value` and `draft_value_sampled` (see the module): the decoder answers `WORTH_TEXT` (as a
    chat turn where the tokenizer has a template) greedy and sampled (`SAMPLED`) with `figures` in use
    and context drafting as it runs, the `held` costs each left as it was, every `WORTH_SPACING`-th
    round drafting as a shut gate's probe would (the first-level test kept); each figure is the mean
    over the probes of what the drafter added to its round (`_probes_worth`, in the profile's ms of
    `costs`). Both 0 where nothing measures it."""
    policy, tok, context = decoder.policy, decoder.tokenizer, decoder.context
    if decoder.drafter is None or tok is None or not hasattr(policy, "prior"):
        return dict(NO_WORTH)
    prompt = decoder.encode(chat_ids(tok, WORTH_TEXT) if getattr(tok, "chat_template", None) else WORTH_TEXT)
    window = decoder.context_window
    tokens = WORTH_TOKENS if window is None else min(WORTH_TOKENS, window - prompt.numel())
    if tokens < 16:                                    # a context window too small for the text and an answer
        return dict(NO_WORTH)
    rounds: list[dict] = []
    lone_round, kept, own_observe = decoder._round, decoder.round_figures, policy.observe

    def timed_round(*args, **kwargs):
        rounds.append({"accepted": 0, "shared": 0, "size": 1, "drafted": 1, "graft_ms": 0.0})
        t0 = time.perf_counter()
        out = lone_round(*args, **kwargs)
        rounds[-1]["ms"] = (time.perf_counter() - t0) * 1000
        return out

    def observed(n_accepted, tree, shared=0):
        rounds[-1]["shared"] = shared
        return own_observe(n_accepted, tree, shared)

    def on_round(tree, acc) -> None:
        topo = tree.topo_ids.tolist()
        rounds[-1].update(accepted=sum(topo[n] >= 0 for n in acc.path.tolist()[1:]), size=len(topo),
                          drafted=sum(t >= 0 for t in topo))

    out = {}
    with contextlib.ExitStack() as stack:
        for c in held:
            stack.enter_context(c.held())
        decoder._round, policy.observe = timed_round, observed
        stack.enter_context(_lookups_timed(context, rounds))
        decoder.round_figures = {**figures, **NO_WORTH}                              # what `use` gives
        try:
            for name, sampling in (("draft_value", {}), ("draft_value_sampled", SAMPLED)):
                rounds.clear()
                with _drafting_every_other(policy, first_level_test=True, every=WORTH_SPACING):
                    decoder.generate(prompt, max_new_tokens=tokens, on_round=on_round, **sampling)
                out[name] = _probes_worth(rounds, costs, WORTH_SPACING)
        finally:
            del decoder._round, policy.observe
            decoder.round_figures = kept
    return out


@contextlib.contextmanager
def _lookups_timed(context, rounds: list[dict], misses: list | None = None, recycles: list | None = None):
    """Within: the context drafter's lookups and merges (`graft`, `choose_under_root`, `grafted`; none
    where `context` is None) add each call's time to the last of `rounds`' "graft_ms"; with `misses`,
    each lookup beneath a root alone that finds nothing (None) is also kept there; with `recycles`, the
    time of each plain step's recycling (`observe_logits`) is kept there."""
    def timing(method, kept):
        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            result = method(*args, **kwargs)
            kept((time.perf_counter() - t0) * 1000, result)
            return result
        return timed_call

    def in_round(ms, result) -> None:
        rounds[-1]["graft_ms"] += ms

    def a_miss(ms, result) -> None:
        in_round(ms, result)
        if misses is not None and result is None:
            misses.append(ms)

    if context is None:
        yield
        return
    context.graft, context.grafted = timing(context.graft, in_round), timing(context.grafted, in_round)
    context.choose_under_root = timing(context.choose_under_root, a_miss)
    if recycles is not None:
        context.observe_logits = timing(context.observe_logits, lambda ms, result: recycles.append(ms))
    try:
        yield
    finally:
        del context.graft, context.choose_under_root, context.grafted
        if recycles is not None:
            del context.observe_logits


def _probes_worth(rounds: list[dict], costs, every: int = 2) -> float:
    """The mean worth, in the profile's ms, of a generation's probes (every `every`-th round, 1-based),
    each between two rounds that drafted and grafted nothing: its accepted drafted tokens that context
    drafting did not propose too (`shared`) at a plain step each, less what it took beyond the step
    before it and added to the one after, the context drafter's lookups and merges left out of all
    three and the rows it grafted priced out, as the draft gate credits a drafted round. The median
    plain step stands for the profile's `verify_ms(1)`. Each round: {"ms", "graft_ms", "accepted",
    "shared", "size", "drafted"}; 0 where no probe sits between two plain steps."""
    probes = range(every - 1, len(rounds) - 1, every)
    plain = [r["ms"] - r["graft_ms"] for i, r in enumerate(rounds) if r["size"] == 1 and (i + 1) % every]
    if not plain:
        return 0.0
    step = costs.verify_ms(1)
    scale = statistics.median(plain) / step
    values = []
    for before, r, after in ((rounds[i - 1], rounds[i], rounds[i + 1]) for i in probes):
        if before["size"] == 1 and after["size"] == 1:
            base = before["ms"] - before["graft_ms"]
            took = (r["ms"] - r["graft_ms"] - base) + (after["ms"] - after["graft_ms"] - base)
            values.append((r["accepted"] - r["shared"]) * step - took / scale
                          + costs.verify_ms(r["size"]) - costs.verify_ms(r["drafted"]))
    return round(statistics.fmean(values), 4) if values else 0.0


def quietest(passes: list[list[float]]) -> float | None:
    """The least of the passes' medians (passes without a round left out; None where none has one):
    another process's work on the machine slows a round that drafts or grafts more than the plain
    steps beside it (it reads more memory), so a pass run while the machine was busy reads high,
    and for seconds at a time, which pooling the rounds does not undo."""
    medians = [statistics.median(p) for p in passes if p]
    return min(medians) if medians else None


def beyond(timed: list[dict], costs, drafted: bool) -> list[float]:
    """Of a generation's timed rounds (each {"ms", "size", "graft_ms", "priced": its levels' price
    where it drafted, else None}), each that drafted (`drafted`) or, in a generation that drafts
    nothing, grafted, and sits between two plain steps: what it took beyond the step before it, with
    what it added to the step after it (that step runs slower), less its lookups and merges, in the
    profile's ms (the generation's median plain step against the profile's `verify_ms(1)`: decoding runs
    slower than the profile's forwards where the host's own work or the memory traffic between forwards
    is larger, and the decisions weigh these figures against the profile's prices), less its priced
    levels and its extra rows' verify price. A generation's first two rounds are left out (its first
    drafted round reads the prompt's states, once a generation)."""
    plain = {id(r): r["ms"] for r in timed[1:] if r["size"] == 1 and not r["graft_ms"]}
    if not plain:
        return []
    scale = statistics.median(plain.values()) / costs.verify_ms(1)
    out = []
    for before, r, after in zip(timed[1:], timed[2:], timed[3:]):
        if id(before) in plain and id(after) in plain and r["size"] > 1 and (r["priced"] is not None or not drafted):
            out.append(((r["ms"] - before["ms"]) + (after["ms"] - before["ms"]) - r["graft_ms"]) / scale
                       - (r["priced"] if drafted else 0.0) - (costs.verify_ms(r["size"]) - costs.verify_ms(1)))
    return out


class _EveryOther:
    """The context gate while context rounds are measured: open on every other round, so that each
    round that looks up sits between two plain steps."""

    value = 0.0

    def __init__(self):
        self.rounds = 0

    def opens(self) -> bool:
        self.rounds += 1
        return self.rounds % 2 == 0

    def will_open(self) -> bool:
        return (self.rounds + 1) % 2 == 0

    def rounds_shut(self) -> int:
        return 0 if self.will_open() else 1

    def sit_out(self, rounds: int) -> None:
        self.rounds += rounds

    def observe(self, value: float, step_ms: float | None = None) -> None:
        """What a round was worth: not needed to decide anything here."""

    def missed(self, cost_ms: float, step_ms: float | None = None) -> None:
        """A lookup that found nothing: likewise."""

    def reset(self) -> None:
        self.rounds = 0


@contextlib.contextmanager
def _drafting_every_other(policy, first_level_test: bool = False, every: int = 2):
    """Within (one generation): `policy` drafts its levels on every other round, or every `every`-th
    (`every_round` where it has it: no gate, the first-level test only with `first_level_test`), and
    says how many rounds until the next (`rounds_to_draft`), so that the plain steps between take the
    target's features as a shut gate's do: each drafted round follows a plain step, as a probe of a
    shut gate does, and is timed against it (a quiet run's rounds, `sit_out`, counted as rounds)."""
    own, rounds = policy.begin_round, [0]          # the rounds so far

    def begin_round() -> int:
        rounds[0] += 1
        return own() if rounds[0] % every == 0 else 0

    def sit_out(n: int) -> None:
        rounds[0] += n
    policy.begin_round, policy.sit_out = begin_round, sit_out
    policy.rounds_to_draft = lambda: every - 1 - rounds[0] % every
    try:
        with (policy.every_round(first_level_test) if hasattr(policy, "every_round") else contextlib.nullcontext()):
            yield policy
    finally:
        del policy.begin_round, policy.rounds_to_draft, policy.sit_out


@contextlib.contextmanager
def _drafting_nothing(policy):
    """Within: `policy` drafts nothing, and says so (`rounds_to_draft`), so every round is context
    drafting's alone (a lookup, and a graft where it finds one) or a plain step."""
    policy.begin_round, policy.rounds_to_draft = (lambda: 0), (lambda: 2 ** 31)
    try:
        yield policy
    finally:
        del policy.begin_round, policy.rounds_to_draft
