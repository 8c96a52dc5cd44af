"""Trustworthy on a busy machine: timings summarised robustly and checked, a measurement from a
busy machine or one that later rounds contradict is measured again, --baseline measures nothing,
and trees (so the output) do not depend on this run's clock. Timers and clocks here are fakes."""

import json
import random
import types

import pytest
import torch

from mcsd import TreeDecoder
from mcsd.costs import profile, store, timing
from mcsd.costs.cost_model import Costs
from mcsd.costs.profile import DeviceProfile
from mcsd.costs.store import load_cached, load_or_measure, profile_path
from mcsd.costs.timing import measure, robust_timings
from mcsd.drafting.policies.learned import LearnedPolicy
from mcsd.forward.attention import set_backend
from test_learned_policy import constant_model

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
QUICK = dict(sizes=(1, 2, 4, 8), prefix_len=16, repeats=4, draft_sizes=(1, 2))


class Quiet:
    """A BusyCheck that finds the machine quiet (or busy, with a reason)."""

    def __init__(self, reason=None):
        self.reason = reason

    def start(self):
        pass

    def finish(self):
        return self.reason


def fake_latency(absurd_calls: int = 0, absurd_rows: int = 4):
    """latency(role, rows, path) in ms: 10 + rows, but the first `absurd_calls` timings of
    `absurd_rows` rows take 1000 ms (a slow spell that landed on one size)."""
    calls = []

    def latency(role, rows, path):
        calls.append((role, rows, path))
        if rows == absurd_rows and sum(c[1] == absurd_rows for c in calls) <= absurd_calls:
            return 1000.0
        return 10.0 + rows
    return latency, calls


def test_one_absurd_size_is_detected_and_measured_again():
    plan = [("verify", n, "onednn") for n in (1, 2, 4, 8, 16)]
    latency, calls = fake_latency(absurd_calls=4)             # both rounds of 2 runs: absurd
    timed = robust_timings(plan, latency, torch.Generator().manual_seed(0), rounds=2, per_round=2)
    four = ("verify", 4, "onednn")
    assert four in timed.remeasured                           # 4 rows dearer than 8: measured again
    assert timed.ms[four] == 14.0
    assert [timed.ms[s] for s in plan] == [11.0, 12.0, 14.0, 18.0, 26.0]
    assert sum(c[1] == 4 for c in calls) > 4                  # the extra round ran
    quiet, _ = fake_latency()
    again = robust_timings(plan, quiet, torch.Generator().manual_seed(0), rounds=2, per_round=2)
    assert again.remeasured == set() and again.ms == timed.ms  # nothing to re-measure when consistent


def test_a_slow_spell_is_summarised_away_and_the_envelope_is_monotone():
    plan = [("verify", n, "onednn") for n in (1, 2, 4)]
    samples = iter([500.0] * 6 + [11.0, 12.0, 14.0] * 20)     # the whole first round is slow
    timed = robust_timings(plan, lambda r, n, p: next(samples) if n != 2 else 30.0,
                           torch.Generator().manual_seed(0), rounds=3, per_round=2, remeasure_passes=0)
    # 2 rows measured dearer than 4: capped at 4 rows' time (2 rows could run as 4)
    assert timed.lowered == {("verify", 2, "onednn")}
    ms = [timed.ms[s] for s in plan]
    assert ms == sorted(ms) and ms[0] < 100


def test_a_measured_profile_records_its_spread_and_what_was_measured_again(target, random_draft, monkeypatch):
    latency, _ = fake_latency(absurd_calls=5)                 # the pilot run and both rounds of 4 rows
    monkeypatch.setattr(timing._ModelTimer, "latency", lambda self, n: latency("any", n, "onednn"))
    prof = measure(target, random_draft, busy_check=Quiet(), **QUICK)
    assert prof.verify_ms[4] == 14.0 and prof.best_ms("verify")[4] == 14.0
    assert "verify:onednn:4" in prof.meta["remeasured"]
    assert set(prof.meta["spread"]) >= {"verify:onednn:1", "draft:onednn:2"}
    assert prof.meta["provisional"] is None and prof.meta["calibration_s"] >= 0


@pytest.mark.measures
def test_a_busy_measurement_is_provisional_and_measured_again_when_quiet(target, random_draft, fresh_cache,
                                                                         monkeypatch):
    latency, _ = fake_latency()                               # consistent timings: only the busy check decides
    monkeypatch.setattr(timing._ModelTimer, "latency", lambda self, n: latency("any", n, "onednn"))
    monkeypatch.setattr(timing, "BusyCheck", lambda: Quiet("other processes used 1.0 cores"))
    busy = load_or_measure(target, random_draft, quiet=True, **QUICK)
    assert busy.meta["provisional"]
    monkeypatch.setattr(timing, "quiet_now", lambda threads_used=None: False)
    assert load_cached(target, random_draft) is not None          # still busy: the provisional one serves
    monkeypatch.setattr(timing, "quiet_now", lambda threads_used=None: True)
    assert load_cached(target, random_draft) is None              # quiet: measure again
    assert load_cached(target, random_draft, remeasure=False) is not None   # --no-calibrate keeps it
    monkeypatch.setattr(timing, "BusyCheck", Quiet)
    dec = TreeDecoder(target, random_draft)
    assert dec.costs_source == "measured" and dec.calibration_s > 0
    assert load_cached(target, random_draft).meta["provisional"] is None


class FakeClock:
    """time.perf_counter for the decoder: every reading advances by a jittering step (ms)."""

    def __init__(self, seed: int, step_ms: float = 1.0, jitter: float = 0.9):
        self.rng, self.step, self.jitter, self.now = random.Random(seed), step_ms, jitter, 0.0

    def perf_counter(self):
        self.now += self.step * (1 + self.jitter * (2 * self.rng.random() - 1)) / 1000
        return self.now


def use_clock(monkeypatch, clock):
    monkeypatch.setattr("mcsd.decoding.decoder.time", types.SimpleNamespace(perf_counter=clock.perf_counter))


def poisoned(target, draft, factor=1000.0):
    """Cache a profile whose every time is `factor` times what this machine takes (a busy first run)."""
    path = profile_path(target, draft)
    prof = DeviceProfile.from_json(path.read_text())
    for name in profile._TABLES:
        setattr(prof, name, {n: ms * factor for n, ms in getattr(prof, name).items()})
    path.write_text(prof.to_json())
    return prof


@pytest.mark.measures
def test_a_profile_cached_from_a_busy_run_is_replaced_after_contrary_evidence(target, random_draft,
                                                                               fresh_cache, monkeypatch):
    monkeypatch.setattr(timing, "BusyCheck", Quiet)
    monkeypatch.setattr(timing, "quiet_now", lambda threads_used=None: True)
    latency, _ = fake_latency()                                # what measuring finds: 10 + rows ms
    monkeypatch.setattr(timing._ModelTimer, "latency", lambda self, n: latency("any", n, "onednn"))
    for model in (target, random_draft):                       # the attention the decoder runs: part of the key
        set_backend(model, "auto")
    load_or_measure(target, random_draft, quiet=True, **QUICK)
    poisoned(target, random_draft)                             # as if measured while the machine was busy
    use_clock(monkeypatch, FakeClock(0, step_ms=11.0, jitter=0.2))   # rounds take what the machine takes
    dec = TreeDecoder(target, random_draft)
    assert dec.costs_source == "cached" and dec.policy.costs.verify[1] == 11_000.0
    first = dec.generate(PROMPT, max_new_tokens=60, ignore_eos=True)
    assert dec.policy.costs.stale and "faster" in dec.policy.costs.stale
    assert dec.policy.costs.verify[1] == 11_000.0              # fixed for the run that found it stale
    assert load_cached(target, random_draft, remeasure=False).meta["stale"]    # flagged in the cache
    # a generation never measures, the next one on the same decoder included ...
    again = dec.generate(PROMPT, max_new_tokens=60, ignore_eos=True)
    assert dec.costs_source == "cached" and dec.calibration_s == 0 and again.tokens == first.tokens
    # ... a new decoder measures again at its start, or this one when asked to
    assert TreeDecoder(target, random_draft).costs_source == "measured"
    assert dec.recalibrate()
    assert dec.costs_source == "measured" and dec.policy.costs.stale is None
    assert dec.policy.costs.verify[1] == 11.0 and dec.calibration_s > 0
    fresh = load_cached(target, random_draft)
    assert fresh is not None and not fresh.meta.get("stale") and fresh.verify_ms[1] == 11.0
    second = dec.generate(PROMPT, max_new_tokens=60, ignore_eos=True)
    assert first.tokens == second.tokens                       # float32: exact either way


@pytest.mark.measures
def test_a_stale_flag_that_measuring_again_does_not_confirm_changes_nothing(target, random_draft, fresh_cache,
                                                                             monkeypatch):
    """A profile flagged stale (a slow spell during a run) and measured again within the noise keeps
    its figures, so the kernel paths and trees (and a bfloat16 output) stay; a real change replaces it."""
    monkeypatch.setattr(timing, "BusyCheck", Quiet)
    monkeypatch.setattr(timing, "quiet_now", lambda threads_used=None: True)
    scale = {"factor": 1.0}
    latency, _ = fake_latency()
    monkeypatch.setattr(timing._ModelTimer, "latency", lambda self, n: latency("any", n, "onednn") * scale["factor"])
    first = load_or_measure(target, random_draft, quiet=True, **QUICK)
    assert first.verify_ms[1] == 11.0
    store.mark_stale(target, random_draft, "the last 8 plain steps took 1.36x the profile's time")
    scale["factor"] = 1.15                                     # measuring noise
    again = load_or_measure(target, random_draft, quiet=True, **QUICK)
    assert again.verify_ms == first.verify_ms and again.draft_ms == first.draft_ms
    assert again.meta["stale"] is None and again.meta["confirmed"]["largest_ratio"] == pytest.approx(1.15)
    assert load_cached(target, random_draft).verify_ms == first.verify_ms          # cached as confirmed
    assert load_or_measure(target, random_draft, quiet=True, force=True, **QUICK).verify_ms[1] == \
        pytest.approx(11 * 1.15)                               # --calibrate on an unflagged profile: new figures
    store.mark_stale(target, random_draft, "the last 8 plain steps took 2.0x the profile's time")
    scale["factor"] = 2.0                                      # the machine really changed
    changed = load_or_measure(target, random_draft, quiet=True, **QUICK)
    assert changed.verify_ms[1] == pytest.approx(22.0) and "confirmed" not in changed.meta


def test_agreeing_rounds_do_not_mark_a_profile_stale():
    costs = Costs(verify={1: 10.0, 8: 20.0}, draft={1: 2.0}, source="cached")
    marks = []
    costs.on_stale = marks.append
    rng = random.Random(0)
    for i in range(200):
        n = 1 if i % 2 else 8
        costs.observe("verify", n, costs.base_verify_ms(n), costs.base_verify_ms(n) * rng.uniform(0.85, 1.2))
    assert costs.stale is None and marks == []
    for _ in range(8):                                          # then plain steps take 1.5x: stale, once
        costs.observe("verify", 1, 10.0, 15.0)
    assert costs.stale and "slower" in costs.stale and len(marks) == 1
    assert costs.verify_ms(1) == 10.0                           # not corrected: costs fixed for the run


def test_the_staleness_check_reads_the_forward_not_the_sampling_around_it(target):
    """A sampled round spends time around its forward (nucleus filtering, draws) that the profile,
    which times forwards, never saw: rounds whose forward agrees keep the profile."""
    from mcsd.forward.lm import CachedLM
    costs = Costs(verify={1: 10.0, 8: 20.0}, draft={1: 2.0}, source="cached")
    for _ in range(16):
        costs.observe("verify", 1, 10.0, 15.0, forward_ms=10.5)
    assert costs.stale is None
    for _ in range(8):
        costs.observe("verify", 1, 10.0, 15.0, forward_ms=15.0)
    assert costs.stale and "slower" in costs.stale
    lm = CachedLM(target)
    lm.reset()
    assert lm.forward_ms is None
    lm.extend(torch.tensor([3, 5, 7]))
    assert lm.forward_ms > 0                                    # the last forward's time, on a CPU


def test_a_step_over_a_cache_far_from_the_profiles_is_not_checked_against_it(target):
    """The profile times forwards over a cache of `prefix_len` positions; a step over four times as many
    reads four times the keys and values, and takes longer without the machine having changed: a long
    prompt's steps leave the profile alone, those over a cache like the profile's still flag it."""
    from mcsd.forward.lm import CachedLM
    costs = Costs(verify={1: 10.0, 8: 20.0}, draft={1: 2.0}, source="cached")
    costs.prefix_len = 200
    for context in (800, 1000, 60):
        for _ in range(16):
            costs.observe("verify", 1, 10.0, 15.0, forward_ms=15.0, context=context)
    assert costs.stale is None
    for _ in range(8):
        costs.observe("verify", 1, 10.0, 15.0, forward_ms=15.0, context=300)
    assert costs.stale and "slower" in costs.stale
    unknown = Costs(verify={1: 10.0}, draft={1: 2.0}, source="cached")
    unknown.prefix_len = 200
    for _ in range(8):
        unknown.observe("verify", 1, 10.0, 15.0, forward_ms=15.0)          # the cache it read unknown: checked
    assert unknown.stale
    lm = CachedLM(target)
    lm.reset()
    lm.extend(torch.tensor([3, 5, 7]))
    lm.extend(torch.tensor([9]))
    assert lm.forward_context == 4                              # the positions the last forward read


def test_costs_from_a_profile_know_the_cache_its_forwards_read(target, random_draft, fresh_cache):
    dec = TreeDecoder(target, random_draft, policy="learned", attention="sdpa")
    assert dec.policy.costs.prefix_len == dec.calibration.profile().prefix_len > 0


def test_a_ratio_that_measuring_again_confirmed_is_expected_from_then_on(target, random_draft, fresh_cache,
                                                                          monkeypatch):
    """Decoding's plain steps may take a steady multiple of the profile's 1-row time (work around a
    forward that the profile does not time, or a spell of a drifting machine). Flagged once and
    confirmed by measuring again, that ratio is expected beside the profile's own: later runs at
    either do not flag the profile again (no measuring every other start); a ratio off both does."""
    monkeypatch.setattr(timing, "BusyCheck", Quiet)
    monkeypatch.setattr(timing, "quiet_now", lambda threads_used=None: True)
    latency, _ = fake_latency()
    monkeypatch.setattr(timing._ModelTimer, "latency", lambda self, n: latency("any", n, "onednn"))
    first = load_or_measure(target, random_draft, quiet=True, **QUICK)

    def run(prof, ratio):
        costs = Costs.from_profile(prof, source="cached")
        costs.on_stale = lambda reason: store.mark_stale(target, random_draft, reason, ratio=costs.stale_ratio)
        for _ in range(8):
            costs.observe("verify", 1, costs.base_verify_ms(1), costs.base_verify_ms(1) * ratio)
        return costs

    assert run(first, 1.36).stale                                        # flagged: measured again at the next start
    again = load_or_measure(target, random_draft, quiet=True, **QUICK)
    assert again.meta["confirmed"]["observed"] == pytest.approx(1.36)    # the same figures: confirmed
    assert run(again, 1.36).stale is None and run(again, 1.5).stale is None
    assert load_cached(target, random_draft).meta.get("stale") is None   # nothing to measure at the next start
    assert run(again, 1.0).stale is None                                 # the profile's own figures: no change either
    moved = run(again, 2.0)
    assert moved.stale and "slower than the 1.36x expected" in moved.stale
    assert run(again, 0.7).stale                                         # off both


def test_baseline_calibrates_nothing(model_dirs, fresh_cache, monkeypatch, capsys, target):
    from mcsd.cli import main

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured")
    monkeypatch.setattr(timing, "measure", no_measuring)
    pair = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    for dtype in ("auto", "float32", "bfloat16"):
        assert main(pair + ["--prompt", "w03 w17", "--max-new-tokens", "4", "--baseline", "--threads", "1",
                            "--dtype", dtype, "--json"]) == 0
        settings = json.loads(capsys.readouterr().out)["settings"]
        assert settings["calibration_s"] == 0 and settings["costs"] is None
    assert not list(fresh_cache.rglob("*.json"))
    assert TreeDecoder(target, None).generate_baseline(PROMPT, max_new_tokens=4).tokens


@pytest.mark.parametrize("draft_kind", ["model", "model+context"])
def test_trees_do_not_depend_on_this_runs_clock(target, random_draft, fresh_cache, monkeypatch, draft_kind):
    """Two runs whose forwards seem to take very different, jittering times grow the same trees
    and emit the same tokens: the costs are the cached profile's, fixed for the run."""
    monkeypatch.setattr(timing, "BusyCheck", Quiet)
    load_or_measure(target, random_draft, quiet=True, **QUICK)
    # these clocks contradict the profile, which is flagged; kept here (as on a busy machine) so both
    # runs start from the same profile
    monkeypatch.setattr(timing, "quiet_now", lambda threads_used=None: False)
    # waits that only double after a losing round, so that 40 tokens hold several drafted rounds to compare
    monkeypatch.setattr(LearnedPolicy, "probe_budget", None)
    draft = random_draft if draft_kind == "model" else [random_draft, "context"]

    def run(clock, **options):
        use_clock(monkeypatch, clock)
        sizes = []
        # an acceptance model sure enough of the draft that rounds draft (not left after their first level)
        options["model"] = constant_model(0.8)
        dec = TreeDecoder(target, draft, attention="sdpa", policy="learned", policy_options=options)
        out = dec.generate(PROMPT, max_new_tokens=40, ignore_eos=True,
                           on_round=lambda tree, acc: sizes.append(tree.size))
        return out.tokens, sizes

    fast, slow = FakeClock(1, step_ms=0.01), FakeClock(2, step_ms=500.0, jitter=0.99)
    assert run(fast) == run(slow)
    # with corrections from measured times asked for, the clock does shape the trees
    assert run(FakeClock(1, step_ms=0.01), online_costs=True)[1] != run(FakeClock(2, step_ms=500.0),
                                                                      online_costs=True)[1]


@pytest.mark.measures
def test_a_first_measurement_on_a_slow_machine_is_bounded_and_provisional(target, random_draft, fresh_cache,
                                                                          monkeypatch):
    """Past its budget no further round starts: a slow machine gets what the first pass measured,
    marked provisional, rather than minutes of measuring. The clock is a fake: every timed forward
    moves it on by 10 s."""
    clock = [0.0]

    def latency(self, n):
        clock[0] += 10.0
        return 10.0 + n
    monkeypatch.setattr(timing._ModelTimer, "latency", latency)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(timing, "BusyCheck", Quiet)
    prof = load_or_measure(target, random_draft, quiet=True, **QUICK)
    steps = len(QUICK["sizes"]) + len(QUICK["draft_sizes"])      # float32 here: how many paths depends on oneDNN
    assert clock[0] <= 10.0 * (1 + 3 * 2 * steps)               # the first forward and the warm-up pass, no round
    # the budget bounds when rounds start, not the warm-up pass, and the reason says so with the real time
    assert prof.meta["provisional"] == (f"cut short: no round of timings started past the 30 s budget "
                                        f"({clock[0]:.0f} s in all, the warm-up pass included)")
    assert clock[0] > 30.0
    assert prof.verify_ms[1] == 11.0 and set(prof.verify_ms) == set(QUICK["sizes"])
    unbounded = measure(target, random_draft, busy_check=Quiet(), **QUICK)      # no budget: every round
    assert unbounded.meta["provisional"] is None
