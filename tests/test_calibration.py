"""Costs measured on the machine that runs: cached per machine, corrected online, the default policy
calibrated and lossless, drafting switched off where it cannot pay, and `--dtype auto`."""

import json

import pytest
import torch
from conftest import tiny_llama

from mcsd import TreeDecoder
from mcsd.costs.cost_model import Costs
from mcsd.costs.profile import host_key
from mcsd.costs.store import load_cached, load_or_measure, profile_path
from mcsd.decoding.choice import choose_dtype, expected_rate
from mcsd.drafting.policies import LearnedPolicy

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
QUICK = dict(sizes=(1, 2, 4), prefix_len=16, repeats=1, draft_sizes=(1, 2))


@pytest.fixture(scope="module")
def reference(target):
    return TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=60).tokens


def test_a_profile_from_another_machine_is_never_used(target, random_draft):
    prof = load_or_measure(target, random_draft, force=True, quiet=True, **QUICK)
    assert prof.meta["host"]["cpu_flags"] is not None
    assert load_cached(target, random_draft) is not None
    path = profile_path(target, random_draft)
    moved = json.loads(path.read_text())
    moved["meta"]["host"]["cpu"] = "Some Other CPU"                     # as if copied from elsewhere
    path.write_text(json.dumps(moved))
    assert load_cached(target, random_draft) is None
    path.write_text("{not json")
    assert load_cached(target, random_draft) is None                     # unreadable: measured again
    assert profile_path(target, random_draft, torch.bfloat16) != path    # one profile per dtype


def test_costs_follow_measured_rounds():
    costs = Costs(verify={1: 10.0, 8: 20.0}, draft={1: 2.0}, adapt=0.5, online=True)
    for _ in range(12):                                     # one-token steps take twice the profile's time
        costs.observe("verify", 1, costs.base_verify_ms(1), 20.0)
    assert costs.verify_ms(1) == pytest.approx(20.0, rel=1e-3)
    assert costs.verify_ms(8) == pytest.approx(40.0, rel=1e-2)  # unseen sizes take the overall correction
    for _ in range(12):
        costs.observe("verify", 8, costs.base_verify_ms(8), 20.0)     # ... until measured themselves
    assert costs.verify_ms(8) == pytest.approx(20.0, rel=1e-2)
    costs.observe("draft", None, 2.0, 6.0)
    assert costs.draft_ms(1) == pytest.approx(4.0)          # (1 - 0.5) * 2 + 0.5 * 6 in units of the profile
    costs.reset_corrections()
    assert costs.verify_ms(1) == 10.0


def test_default_decoder_is_the_calibrated_learned_policy(target, random_draft):
    dec = TreeDecoder(target, random_draft)
    assert isinstance(dec.policy, LearnedPolicy)
    assert dec.policy.topology.max_depth == len(LearnedPolicy.default_tree.split(","))
    assert dec.costs_source in ("measured", "cached")
    assert TreeDecoder(target, random_draft).costs_source == "cached"          # measured once per setup
    assert TreeDecoder(target, random_draft, calibrate=True).costs_source == "measured"
    assert TreeDecoder(target, random_draft, policy="static").costs_source is None
    assert TreeDecoder(target, None).policy.name == "static"                    # nothing to draft: no calibration


@pytest.mark.parametrize("draft_name", ["same", "random"])
def test_default_settings_are_lossless(target, random_draft, reference, draft_name):
    draft = target if draft_name == "same" else random_draft
    out = TreeDecoder(target, draft, attention="sdpa").generate(PROMPT, max_new_tokens=60)
    assert out.tokens == reference


def test_drafting_that_cannot_pay_is_switched_off(target):
    """A draft as costly as the target that never agrees with it: after the first losing rounds
    the calibrated policy runs plain steps, drafting only in ever rarer probes."""
    useless = tiny_llama(99, layers=2)
    # the costs such a pair has, fixed so that no noisy measurement can make drafting look cheap
    costs = Costs(verify={1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0, 16: 20.0, 32: 30.0, 64: 50.0},
                  draft={1: 10.0, 2: 10.5, 4: 11.0}, source="measured")
    dec = TreeDecoder(target, useless, attention="sdpa", policy_options={"costs": costs})
    drafted = []
    begin = dec.drafter.begin_round
    dec.drafter.begin_round = lambda seq: (drafted.append(len(seq)), begin(seq))[1]
    stats = dec.generate(PROMPT, max_new_tokens=80).stats
    # probes after waits of 3, 6, 12, 24 rounds (a chance acceptance shortens the next wait)
    assert stats.rounds >= 70 and len(drafted) <= 12


def test_expected_rate_prefers_cheap_verification():
    flat = Costs(verify={1: 10.0, 16: 10.5}, draft={1: 1.0})           # verify cost barely grows
    steep = Costs(verify={1: 10.0, 2: 20.0, 16: 160.0}, draft={1: 1.0})  # every token costs a full step
    assert expected_rate(flat, drafting=True)[1] > 1
    assert expected_rate(steep, drafting=True)[1] == 0                  # plain decoding wins
    assert expected_rate(steep, drafting=False) == (100.0, 0)


def test_choose_dtype_measures_each_candidate(target, random_draft):
    t, d = tiny_llama(0), tiny_llama(1, layers=1)
    choice = choose_dtype(t, d, candidates=("float32", "bfloat16"), calibrate=True, quiet=True)
    assert choice.dtype in ("float32", "bfloat16") and set(choice.rates) == {"float32", "bfloat16"}
    assert choice.dtype in choice.reason and "tokens/s" in choice.reason
    assert next(t.parameters()).dtype == torch.float32                 # the originals are not converted
    assert load_cached(t, d, torch.bfloat16) is not None               # both cached for the next run
    again = choose_dtype(t, d, candidates=("float32", "bfloat16"), quiet=True)
    assert again.rates == choice.rates                                  # from the cache, nothing re-measured


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_is_measured_only_where_the_cpu_runs_it_natively(monkeypatch, native):
    import mcsd.costs.profile
    real = mcsd.costs.profile.host_key
    monkeypatch.setattr("mcsd.decoding.choice.host_key", lambda device: {**real(device), "onednn_bf16": native})
    t, d = tiny_llama(6), tiny_llama(7, layers=1)
    choice = choose_dtype(t, d, calibrate=True, quiet=True)
    assert set(choice.rates) == ({"float32", "bfloat16"} if native else {"float32"})
    assert native or (choice.dtype == "float32" and "no native bfloat16" in choice.reason)


def test_choose_dtype_without_calibration_uses_a_rule():
    t = tiny_llama(5)
    choice = choose_dtype(t, None, calibrate=False)
    assert choice.rates == {} and "not calibrated" in choice.reason and choice.dtype in ("float32", "bfloat16")


def test_cli_dtype_auto_is_a_choice_of_dtype(model_dirs, capsys):
    from mcsd.cli import main
    pair = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    common = ["--prompt", "w03 w17 w42 w05", "--max-new-tokens", "16", "--json"]
    assert main(pair + ["--dtype", "auto"] + common) == 0
    auto = json.loads(capsys.readouterr().out)
    chosen = auto["settings"]["dtype"]
    assert chosen in ("float32", "bfloat16") and chosen in auto["settings"]["dtype_reason"]
    assert auto["settings"]["costs"] in ("measured", "cached")
    assert main(pair + ["--dtype", chosen] + common) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == auto["tokens"]    # same output as asking for it
    assert main(pair + ["--dtype", "auto", "--no-calibrate", "--stats"] + common) == 0
    err = capsys.readouterr().err
    assert "dtype: " in err and "costs: " in err


def test_a_gguf_born_target_weighs_its_q4_weights_too(q4_gguf_file):
    from mcsd.decoding.choice import DtypeChoice, apply_choice
    from mcsd.drafting.pair import load_model
    from mcsd.forward import quant
    if not quant.kernel_available():
        pytest.skip("no CPU int4 kernel in this torch")
    t = load_model(str(q4_gguf_file), "float32")
    choice = choose_dtype(t, None, calibrate=True, quiet=True, free_draft=True, gguf=q4_gguf_file)
    native_bf16 = host_key(torch.device("cpu"))["onednn_bf16"]
    takes = quant.dtypes()
    pairs = {f"q4/{d}" for d in takes if d == "float32" or native_bf16 or len(takes) == 1}
    assert pairs and ("q4/float32" in pairs) == (quant.kernel_name() == "native")
    if quant.kernel_name() == "native":
        pairs.add("q4q8/float32")                                       # 8-bit activations: weighed too
    assert pairs <= choice.rates.keys() and "float32" in choice.rates  # every (weights, compute dtype) pair
    best = max(choice.rates, key=choice.rates.get)
    weights, _, dtype = best.rpartition("/")
    assert (choice.weights, choice.dtype) == (weights or "dense", dtype)
    assert quant.attached(t) == 0                                       # measured on a copy
    for pair in pairs:
        weights, _, dtype = pair.partition("/")
        assert load_cached(t, None, getattr(torch, dtype), weights=weights) is not None
    again = choose_dtype(t, None, quiet=True, free_draft=True, gguf=q4_gguf_file)
    assert again.rates == choice.rates                                  # from the cache, nothing re-measured
    t, _ = apply_choice(t, None, DtypeChoice("bfloat16", "q4 chosen", {}, weights="q4"), q4_gguf_file)
    assert quant.attached(t) > 0 and next(t.parameters()).dtype == torch.bfloat16


def test_weights_auto_is_dense_with_a_dtype_given(q4_gguf_file, capsys):
    from mcsd.cli import main
    assert main(["--target", str(q4_gguf_file), "--drafter", "context", "--dtype", "float32", "--prompt", "ABCABC",
                 "--max-new-tokens", "4", "--json", "--no-calibrate"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["weights"] == "dense"


@pytest.mark.measures
def test_a_feature_heads_steps_are_timed_after_a_target_forward(monkeypatch):
    """On a CPU a round's first head step finds the target's weights, not its own, in the processor's
    caches: the profile times every head step right after a target forward, as decoding runs it."""
    from test_feature_draft import random_head

    from mcsd.costs import timing
    from mcsd.drafting.feature_draft import FeatureDrafter
    target = tiny_llama(0)
    drafter = FeatureDrafter(random_head(target), target)
    order = []
    for cls, name in ((timing._ModelTimer, "target"), (timing._HeadTimer, "head")):
        def spy(self, n, _inner=cls.latency, _name=name):
            order.append(_name)
            return _inner(self, n)
        monkeypatch.setattr(cls, "latency", spy)
    prof = timing.measure(target, drafter, **QUICK)
    heads = [i for i, name in enumerate(order) if name == "head"]
    assert heads and prof.draft_ms and all(order[i - 1] == "target" for i in heads)


class _Priced:
    """A stand-in profile whose method runs at `rate` tokens/s (the choice's pricing patched to read it)."""
    meta: dict = {}

    def __init__(self, rate):
        self.rate = rate


@pytest.mark.parametrize("fastest", ["q4/float32", "q4/bfloat16", "q4q8/float32", "float32", "bfloat16"])
def test_every_weights_and_compute_dtype_pair_is_weighed_and_the_fastest_runs(q4_gguf_file, monkeypatch, fastest):
    """q4 weights with float32 compute is a candidate of its own beside q4 with bfloat16 and q4 on 8-bit
    activations (no fixed rule picks the q4 compute dtype or the activations), the fastest measured pair
    is chosen and the others' figures are said."""
    from mcsd.decoding import choice
    from mcsd.drafting.pair import load_model
    from mcsd.forward import quant
    if quant.kernel_name() != "native":
        pytest.skip("the native q4 kernel (float32 and bfloat16 activations) is not built here")
    monkeypatch.setattr(choice, "host_key", lambda device: {"onednn_bf16": True})
    rates = {"float32": 77.0, "bfloat16": 114.0, "q4/float32": 120.0, "q4/bfloat16": 133.0, "q4q8/float32": 141.0}
    rates[fastest] = 200.0

    def cached(target, draft, dtype, remeasure=True, weights=None):
        name = str(dtype).removeprefix("torch.")
        return _Priced(rates[f"{weights}/{name}" if weights else name])
    monkeypatch.setattr(choice, "load_cached", cached)
    monkeypatch.setattr(choice.Costs, "from_profile", staticmethod(lambda prof: prof))
    monkeypatch.setattr(choice, "expected_rate", lambda costs, *a, **k: (costs.rate, 2))
    t = load_model(str(q4_gguf_file), "float32")
    got = choice.choose_dtype(t, None, gguf=q4_gguf_file)
    assert got.rates == rates
    weights, _, dtype = fastest.rpartition("/")
    assert (got.weights, got.dtype) == (weights or "dense", dtype)
    for name, rate in rates.items():                  # the losing candidates' figures, in the reason
        assert f"{rate:.1f}" in got.reason
    only_q4 = choice.choose_dtype(t, None, gguf=q4_gguf_file, weights="q4")     # --weights q4 --dtype auto
    assert set(only_q4.rates) == {"q4/float32", "q4/bfloat16"} and only_q4.weights == "q4"
    only_q8 = choice.choose_dtype(t, None, gguf=q4_gguf_file, weights="q4q8")
    assert set(only_q8.rates) == {"q4q8/float32"} and (only_q8.weights, only_q8.dtype) == ("q4q8", "float32")
    assert "q4 weights on 8-bit activations (float32)" in got.reason
