"""The matmul path per block size: chosen from measured times, applied around each forward only,
left alone where it cannot matter or where threads share it, and never changing greedy output."""

import pytest
import torch
from conftest import tiny_llama

from mcsd import TreeDecoder
from mcsd.costs.cost_model import Costs
from mcsd.costs.profile import DeviceProfile
from mcsd.costs.store import load_or_measure
from mcsd.costs.timing import ATEN_MAX_ROWS
from mcsd.drafting.feature_draft import FeatureDrafter
from mcsd.forward import kernels
from mcsd.forward.lm import CachedLM

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
QUICK = dict(sizes=(1, 2, 4, 32), prefix_len=16, repeats=1, draft_sizes=(1, 2, 32))

# As measured for SmolLM2-135M in bfloat16 on a 2-core AVX512-BF16 CPU (ms): ATen wins below 4 rows.
ONEDNN_MS = {1: 43.2, 2: 41.6, 4: 47.0, 8: 40.5, 16: 49.6, 32: 62.6}
ATEN_MS = {1: 25.0, 2: 32.0, 4: 49.5, 8: 74.0, 16: 135.9}
# oneDNN on prepacked weights, same CPU: flat from 2 to 8 rows, slower than ATen for one.
PACKED_MS = {1: 34.4, 2: 31.8, 4: 29.8, 8: 34.6, 16: 41.9, 32: 59.4}
needs_packing = pytest.mark.skipif(not kernels.packable(torch.bfloat16, "cpu"),
                                   reason="this CPU's oneDNN build does not take bfloat16 products")


class FlagSpy:
    """Records torch's oneDNN flag at every forward of a module."""

    def __init__(self, module):
        self.seen = []
        self.handle = module.register_forward_pre_hook(lambda mod, args: self.seen.append(torch.backends.mkldnn.enabled))

    def remove(self):
        self.handle.remove()


def test_table_picks_the_faster_path_per_size():
    table = kernels.KernelTable(ONEDNN_MS, ATEN_MS)
    assert [table.use_onednn(n) for n in (1, 2, 3, 4, 8, 16)] == [False, False, False, True, True, True]
    assert table.use_onednn(500)                       # past the largest size ATen was timed at: oneDNN
    assert table.describe() == "ATen kernels for 1-3 rows, oneDNN above"
    assert kernels.KernelTable(ONEDNN_MS, {n: 2 * ms for n, ms in ONEDNN_MS.items()}).describe() == \
        "oneDNN for every block"
    assert kernels.KernelTable({1: 5.0, 2: 5.0, 4: 5.0}, {1: 1.0, 2: 9.0, 4: 1.0}).describe() == \
        "ATen kernels for 1 row, oneDNN for 2-3 rows, ATen kernels for 4 rows, oneDNN above"


def test_the_flag_is_set_for_one_block_and_restored():
    table = kernels.KernelTable(ONEDNN_MS, ATEN_MS)
    assert torch.backends.mkldnn.enabled
    with table.running(1):
        assert not torch.backends.mkldnn.enabled
    assert torch.backends.mkldnn.enabled
    with table.running(8):
        assert torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError), table.running(1):
        raise RuntimeError("a failing forward")
    assert torch.backends.mkldnn.enabled              # restored on error too
    with kernels.suspend(), table.running(1):
        assert torch.backends.mkldnn.enabled          # suspended: left as it was
    with kernels.running(None, 1):
        assert torch.backends.mkldnn.enabled


def test_only_reduced_precision_on_a_cpu_is_switchable():
    assert not kernels.switchable(torch.float32, "cpu")
    assert not kernels.switchable(torch.bfloat16, "cuda")
    assert not kernels.switchable(torch.float16, "meta")
    expected = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert kernels.switchable(torch.bfloat16, "cpu") == expected


def test_cached_lm_runs_each_block_on_its_path(target):
    lm = CachedLM(target)
    lm.kernels = kernels.KernelTable(ONEDNN_MS, ATEN_MS)
    spy = FlagSpy(target.lm_head)                 # a module both forwards (the engine's, transformers') call
    try:
        lm.reset()
        lm.extend(PROMPT)                              # 6 rows: oneDNN
        lm.extend(torch.tensor([7]))                   # 1 row: ATen
        lm.extend(torch.tensor([7, 8]))                # 2 rows: ATen
    finally:
        spy.remove()
    assert spy.seen == [True, False, False]
    assert torch.backends.mkldnn.enabled


@pytest.mark.measures
def test_profile_times_both_paths_for_small_blocks(target, random_draft, monkeypatch):
    monkeypatch.setattr(kernels, "switchable", lambda dtype, device: True)
    prof = load_or_measure(target, random_draft, force=True, quiet=True, **QUICK)
    assert set(prof.verify_ms) == {1, 2, 4, 32} and set(prof.verify_aten_ms) == {1, 2, 4}
    assert set(prof.draft_aten_ms) == {1, 2} and max(prof.verify_aten_ms) <= ATEN_MAX_ROWS
    assert torch.backends.mkldnn.enabled
    again = DeviceProfile.from_json(prof.to_json())
    assert again.verify_aten_ms == prof.verify_aten_ms and again.draft_aten_ms == prof.draft_aten_ms
    assert prof.kernel_table("verify") is not None and prof.kernel_table("draft") is not None


def test_costs_are_those_of_the_faster_path():
    prof = DeviceProfile(verify_ms=ONEDNN_MS, verify_aten_ms=ATEN_MS, draft_ms={1: 4.5, 8: 5.0},
                         draft_aten_ms={1: 2.6, 8: 10.5})
    costs = Costs.from_profile(prof)
    assert costs.verify_ms(1) == 25.0 and costs.verify_ms(8) == 40.5 and costs.verify_ms(32) == 62.6
    assert costs.draft_ms(1) == 2.6 and costs.draft_ms(8) == 5.0
    assert prof.verify_cost(2) == 32.0
    assert DeviceProfile(verify_ms=ONEDNN_MS).kernel_table("verify") is None    # one path timed: no choice


@pytest.mark.measures
@pytest.mark.parametrize("policy,tree", [("static", "2,2,1"), ("learned", None)])
def test_decoder_applies_the_measured_paths_and_stays_lossless(monkeypatch, policy, tree):
    # models of its own: the measured paths may give them prepacked copies
    target, random_draft = tiny_llama(0), tiny_llama(1, layers=1)
    reference = TreeDecoder(target, None, attention="sdpa").generate_baseline(PROMPT, max_new_tokens=40).tokens
    monkeypatch.setattr(kernels, "switchable", lambda dtype, device: True)
    dec = TreeDecoder(target, random_draft, tree=tree, policy=policy, calibrate=True)
    assert dec.target.kernels is not None and dec.drafter.kernels is not None
    assert dec.kernels_note is not None and dec.kernels_note.startswith("target: ")
    forced = kernels.KernelTable(ONEDNN_MS, ATEN_MS)            # ATen for 1-3 rows, whatever was measured
    dec.target.kernels = dec.drafter.kernels = forced
    spy = FlagSpy(target.lm_head)                 # a module both forwards (the engine's, transformers') call
    try:
        out = dec.generate(PROMPT, max_new_tokens=40)
        plain = dec.generate_baseline(PROMPT, max_new_tokens=40)
    finally:
        spy.remove()
    assert out.tokens == reference and plain.tokens == reference
    assert False in spy.seen and True in spy.seen                 # small blocks on ATen, the prefill on oneDNN
    assert torch.backends.mkldnn.enabled


def test_nothing_is_switched_where_it_cannot_matter(monkeypatch):
    model, draft = tiny_llama(0).double(), tiny_llama(1, layers=1).double()   # float64: one path only
    dec = TreeDecoder(model, draft, policy="static", tree="2,1")
    assert dec.target.kernels is None and dec.kernels_note is None
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # a build without oneDNN
    assert not kernels.packable(torch.float32, "cpu")
    dec = TreeDecoder(tiny_llama(0), tiny_llama(1, layers=1), policy="static", tree="2,1")
    assert dec.target.kernels is None and dec.kernels_note is None


@pytest.mark.measures
@pytest.mark.skipif(not kernels.packable(torch.float32, "cpu"), reason="no oneDNN on this CPU")
@pytest.mark.parametrize("policy,tree", [("static", "2,2,1"), ("learned", None)])
def test_float32_on_prepacked_weights_stays_lossless(policy, tree):
    model, draft = tiny_llama(0), tiny_llama(1, layers=1)
    reference = TreeDecoder(model, None, calibrate=False).generate_baseline(PROMPT, max_new_tokens=40).tokens
    dec = TreeDecoder(model, draft, tree=tree, policy=policy, calibrate=True)
    timed = dec.calibration.profile()
    assert timed.verify_ms and timed.verify_packed_ms             # float32 is timed with and without packing
    forced = kernels.KernelTable({1: 10.0, 64: 10.0}, {}, {1: 5.0, 64: 5.0})   # every block prepacked
    dec.target.kernels = dec.drafter.kernels = forced
    kernels.pack(model), kernels.pack(draft)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a),
                   raising=False)
        out = dec.generate(PROMPT, max_new_tokens=40)
        plain = dec.generate_baseline(PROMPT, max_new_tokens=40)
    assert calls                                                  # the products ran on the packed weights
    assert out.tokens == reference and plain.tokens == reference


def test_feature_drafter_forwards_follow_the_table(target):
    from test_feature_draft import random_head
    drafter = FeatureDrafter(random_head(target), target)
    dec = TreeDecoder(target, drafter, tree="1,1", policy="static", calibrate=False)
    drafter.kernels = kernels.KernelTable(ONEDNN_MS, ATEN_MS)       # whatever a cached profile said
    spy = FlagSpy(drafter.head.reduce)                              # its first product, on either forward
    try:
        out = dec.generate(PROMPT, max_new_tokens=12)
    finally:
        spy.remove()
    assert out.tokens
    assert spy.seen[0] is True and False in spy.seen                # prompt block on oneDNN, tree steps on ATen


def test_a_feature_drafters_scores_run_on_its_path_too(target):
    """The head's LM rows are a linear layer of its own, among the drafter's: the same scores as the plain
    product (float32, bit for bit), and on the prepacked path a packed product like every other layer."""
    from test_feature_draft import random_head
    head = random_head(target, sub_vocab=40)
    drafter = FeatureDrafter(head, target)
    pred = torch.randn(3, target.config.hidden_size)
    with torch.inference_mode():
        assert torch.equal(drafter.widen(drafter._scores(pred)), head.full_scores(pred @ head.lm_rows.T))
    assert drafter.module[1].weight.data_ptr() == head.lm_rows.data_ptr() and not drafter.module[1].weight.requires_grad
    assert not any(k.startswith("lm") for k in head.state_dict())          # never saved with the head
    head.attach_lm_head(2 * target.get_output_embeddings().weight.detach())       # rows attached since
    with torch.inference_mode():
        assert torch.equal(drafter.widen(drafter._scores(pred)), head.full_scores(pred @ head.lm_rows.T))   # the new rows score
    if not kernels.packable(torch.bfloat16, "cpu"):
        return
    target16 = tiny_llama(0).to(torch.bfloat16)
    half = FeatureDrafter(random_head(target16, sub_vocab=40).to(torch.bfloat16), target16)
    kernels.pack(half.module)
    assert kernels.is_packed(half.head.lm)
    pred = pred.to(torch.bfloat16)
    with torch.inference_mode():
        plain = half.head.scores(pred)
        with kernels.using("packed"):
            packed = half.head.scores(pred)
    rows = packed.isfinite()
    assert torch.equal(rows, plain.isfinite()) and int(rows.sum()) == 3 * 40
    assert torch.allclose(packed[rows].float(), plain[rows].float(), atol=0.05, rtol=0.05)


def test_pearl_leaves_the_shared_flag_alone(target, monkeypatch):
    draft = tiny_llama(1, layers=1)
    monkeypatch.setattr(kernels, "switchable", lambda dtype, device: True)
    dec = TreeDecoder(target, draft, policy="pearl", tree="1,1,1", calibrate=True)
    dec.target.kernels = dec.drafter.kernels = kernels.KernelTable(ONEDNN_MS, ATEN_MS)
    spy_t, spy_d = FlagSpy(target), FlagSpy(draft)
    try:
        dec.generate(PROMPT, max_new_tokens=16)
    finally:
        spy_t.remove()
        spy_d.remove()
    assert all(spy_t.seen) and all(spy_d.seen)


def test_table_with_prepacked_weights_picks_the_fastest_of_three():
    table = kernels.KernelTable(ONEDNN_MS, ATEN_MS, PACKED_MS)
    assert [table.path(n) for n in (1, 2, 4, 8, 32, 500)] == ["aten", "packed", "packed", "packed", "packed", "packed"]
    assert table.uses_packed and table.use_onednn(4) and not table.use_onednn(1)
    assert table.describe() == "ATen kernels for 1 row, prepacked oneDNN weights above"
    assert not kernels.KernelTable(ONEDNN_MS, ATEN_MS).uses_packed
    slow = kernels.KernelTable(ONEDNN_MS, ATEN_MS, {n: 2 * ms for n, ms in ONEDNN_MS.items()})
    assert not slow.uses_packed and slow.describe() == "ATen kernels for 1-3 rows, oneDNN above"
    with table.running(4):
        assert torch.backends.mkldnn.enabled and kernels._local.packed
    with table.running(1):
        assert not torch.backends.mkldnn.enabled and not kernels._local.packed
    assert not getattr(kernels._local, "packed", False)
    with pytest.raises(ValueError, match="unknown matmul path"), kernels.using("mkl"):
        pass


def test_costs_include_the_prepacked_path():
    prof = DeviceProfile(verify_ms=ONEDNN_MS, verify_aten_ms=ATEN_MS, verify_packed_ms=PACKED_MS)
    assert prof.verify_cost(1) == 25.0 and prof.verify_cost(8) == 34.6 and prof.verify_cost(32) == 59.4
    again = DeviceProfile.from_json(prof.to_json())
    assert again.verify_packed_ms == PACKED_MS and again.kernel_table("verify").uses_packed
    assert DeviceProfile(verify_ms=ONEDNN_MS, verify_packed_ms=PACKED_MS).kernel_table("verify").uses_packed


@needs_packing
def test_prepacked_weights_give_the_products_of_plain_onednn():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    reference = layer(x)
    assert kernels.pack(layer) == 1 and kernels.is_packed(layer) and kernels.pack(layer) == 0   # idempotent
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a),
                   raising=False)
        with kernels.using("packed"):
            packed = layer(x)
        outside = layer(x)                                   # outside a packed block: the plain product
    assert len(calls) == 1
    assert torch.allclose(packed.float(), reference.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(outside, reference)
    with torch.no_grad():
        layer.weight.mul_(2)                                 # a changed weight is never read from a stale copy
    assert not kernels.is_packed(layer)
    with kernels.using("packed"):
        assert torch.allclose(layer(x).float(), (2 * reference - layer.bias).float(), atol=5e-2, rtol=2e-2)
    kernels.unpack(layer)
    assert "forward" not in layer.__dict__ and not kernels.is_packed(layer)


@needs_packing
def test_bfloat16_decoding_on_prepacked_weights_matches_plain_onednn():
    model = tiny_llama(0).to(torch.bfloat16)
    ids = torch.tensor([3, 17, 42, 5, 9, 11, 23, 4])
    with torch.inference_mode():
        reference = model(ids[None]).logits
        kernels.pack(model)
        with kernels.using("packed"):
            packed = model(ids[None]).logits
    assert torch.allclose(packed.float(), reference.float(), atol=0.05, rtol=0.05)
    assert (packed.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.85


@pytest.mark.measures
@needs_packing
def test_calibration_times_prepacked_weights_and_the_decoder_packs_them():
    model, draft = tiny_llama(0).to(torch.bfloat16), tiny_llama(1, layers=1).to(torch.bfloat16)
    prof = load_or_measure(model, draft, force=True, quiet=True, **QUICK)
    assert set(prof.verify_packed_ms) == {1, 2, 4, 32} and set(prof.draft_packed_ms) == {1, 2, 32}
    assert not kernels.is_packed(model) and not kernels.is_packed(draft)     # timing leaves no copies behind
    prof.verify_packed_ms = {n: 0.5 * ms for n, ms in prof.verify_ms.items()}   # as if they won everywhere
    prof.verify_aten_ms = {}
    dec = TreeDecoder(model, draft, tree="2,1", policy="static", calibrate=False)
    dec.calibration.use_kernels(prof)
    assert dec.target.kernels.uses_packed and kernels.is_packed(model)
    assert "prepacked oneDNN weights" in dec.kernels_note and "q / k / v as one product" in dec.kernels_note
    out = dec.generate(PROMPT, max_new_tokens=16)
    assert len(out.tokens) == 16


@pytest.mark.skipif(not kernels.packable(torch.float32, "cpu"), reason="no oneDNN on this CPU")
def test_a_packed_model_can_be_copied():
    """oneDNN's blocked weights cannot be deep-copied; the copy runs on its plain weights, same output."""
    import copy
    model = tiny_llama(3)
    kernels.pack(model)
    twin = copy.deepcopy(model)
    assert kernels.is_packed(model) and not kernels.is_packed(twin)
    ids = PROMPT[None]
    with torch.no_grad(), kernels.using("packed"):
        assert torch.allclose(model(ids).logits, twin(ids).logits, atol=1e-5)


def test_weights_are_held_in_one_layout():
    table = kernels.KernelTable(ONEDNN_MS, ATEN_MS, PACKED_MS)
    assert table.one_layout((1,)) == "plain" and table.one_layout((1, 2, 4, 8, 16)) == "packed"
    trees = kernels.KernelTable({}, {}, PACKED_MS)
    assert trees.packed_only and trees.path(1) == "packed" and trees.describe() == \
        "prepacked oneDNN weights for every block"
    assert not table.packed_only and trees.one_layout((1,)) == "packed"
    with pytest.raises(ValueError, match="oneDNN or the prepacked"):
        kernels.KernelTable({}, ATEN_MS)
    # the profile's costs follow the layout its decoder holds; the choice is not saved with it
    prof = DeviceProfile(verify_ms=ONEDNN_MS, verify_aten_ms=ATEN_MS, verify_packed_ms=PACKED_MS)
    assert prof.hold_once({"verify": (1, 2, 4, 8, 16)}) is prof and prof.layouts == {"verify": "packed"}
    assert prof.verify_cost(1) == PACKED_MS[1] and prof.kernel_table("verify").packed_only
    assert DeviceProfile.from_json(prof.to_json()).verify_cost(1) == ATEN_MS[1]
    plain = DeviceProfile(verify_ms=ONEDNN_MS, verify_aten_ms=ATEN_MS, verify_packed_ms=PACKED_MS)
    plain.hold_once({"verify": (1,)})
    alone = plain.kernel_table("verify")
    assert plain.verify_cost(8) == ONEDNN_MS[8] and not alone.uses_packed
    assert alone.path(1) == "aten" and alone.path(8) == "onednn"


@pytest.mark.skipif(not kernels.packable(torch.float32, "cpu"), reason="no oneDNN on this CPU")
def test_plain_weights_let_go_for_their_prepacked_copy(fresh_cache):
    # an empty profile cache: one an earlier test measured for these shapes, where packed weights won,
    # would have the reference decoder below let the plain weights go before the test looks
    from transformers import LlamaConfig, LlamaForCausalLM
    model = tiny_llama(0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = TreeDecoder(model, None, calibrate=False).generate_baseline(PROMPT, max_new_tokens=30).tokens
    x = torch.randn(3, 32)
    q = model.model.layers[0].self_attn.q_proj
    with kernels.using("packed"):
        kernels.pack(model)
        on_copy = q(x)
    assert kernels.released(model) == 0 and not q.weight.is_meta
    kernels.pack(model, release=True)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert kernels.released(model) == len(linears) and all(m.weight.is_meta for m in linears)
    assert kernels.is_packed(model) and kernels.pack(model, release=True) == 0     # nothing made twice
    for path in kernels.PATHS:                     # every path reads the copy: there is nothing else
        with kernels.using(path):
            assert torch.equal(q(x), on_copy)
    dec = TreeDecoder(model, tiny_llama(1, layers=1), policy="static", tree="2,2,1", calibrate=False)
    dec.target.kernels = kernels.KernelTable({}, {}, {1: 5.0, 64: 5.0})
    assert dec.generate(PROMPT, max_new_tokens=30).tokens == reference
    assert dec.generate_baseline(PROMPT, max_new_tokens=30).tokens == reference
    kernels.unpack(model)                          # read back from the copies, exactly
    assert kernels.released(model) == 0
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    # weights another parameter shares (a tied LM head and embedding) are never let go
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    kernels.pack(tied, release=True)
    assert not tied.lm_head.weight.is_meta and tied.lm_head.weight is tied.model.embed_tokens.weight
    assert kernels.released(tied) == sum(isinstance(m, torch.nn.Linear) for m in tied.modules()) - 1
    # a deep copy holds no copy of the packed weights: it says what to do, rather than read a meta tensor
    import copy
    kernels.pack(model, release=True)
    with pytest.raises(RuntimeError, match="kernels.unpack"):
        copy.deepcopy(model).model.layers[0].self_attn.q_proj(x)


@pytest.mark.measures
@pytest.mark.skipif(not kernels.packable(torch.float32, "cpu"), reason="no oneDNN on this CPU")
def test_a_decoder_on_prepacked_weights_holds_them_once(monkeypatch, fresh_cache):
    from mcsd.costs.forward_profile import resident_bytes
    from mcsd.decoding import calibration
    model, draft = tiny_llama(0), tiny_llama(1, layers=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = TreeDecoder(model, None, calibrate=False).generate_baseline(PROMPT, max_new_tokens=30).tokens
    dense = resident_bytes(model)["dense"]
    packed_wins = DeviceProfile(verify_ms={1: 10.0, 8: 12.0, 32: 20.0}, verify_packed_ms={1: 8.0, 8: 9.0, 32: 15.0},
                                draft_ms={1: 2.0, 8: 3.0}, draft_packed_ms={1: 2.5, 8: 3.5})
    monkeypatch.setattr(calibration, "device_profile", lambda *a, **k: (packed_wins, "cached"))
    dec = TreeDecoder(model, draft, policy="static", tree="2,2,1", release_weights=True)
    held = resident_bytes(model)
    assert kernels.released(model) and not kernels.released(draft)             # the draft runs plain
    assert held["dense"] < dense / 10 and held["prepacked"] >= dense * 0.9
    assert "its plain weights let go" in dec.kernels_note
    assert dec.generate(PROMPT, max_new_tokens=30).tokens == reference
    assert dec.target.path == "lean"                            # the engine's own forward reads the copies too
    assert dec.calibration.costs().verify == {1: 8.0, 8: 9.0, 32: 15.0}        # priced as it runs
    # measuring again times the plain paths on plain weights, then they are held once more
    from mcsd.costs.timing import measure
    measure(model, draft, **QUICK)
    assert kernels.released(model) == 0 and not kernels.is_packed(model)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    dec.calibration.use_kernels(dec.calibration.profile())
    assert kernels.released(model) and dec.generate(PROMPT, max_new_tokens=30).tokens == reference


PACKED_WINS = DeviceProfile(verify_ms={1: 10.0, 8: 12.0, 32: 20.0}, verify_packed_ms={1: 8.0, 8: 9.0, 32: 15.0},
                            draft_ms={1: 2.0, 8: 3.0}, draft_packed_ms={1: 1.5, 8: 2.5})


@pytest.mark.skipif(not kernels.packable(torch.float32, "cpu"), reason="no oneDNN on this CPU")
def test_the_users_models_stay_usable_after_a_decoder_on_prepacked_weights(monkeypatch):
    """A profile where prepacked weights win every block: the decoder makes the copies beside the plain
    weights (the models are the user's), so the pair can be cast and given to a new decoder afterwards."""
    import copy

    from mcsd.decoding import calibration
    from mcsd.drafting.pair import cast_pair
    model, draft = tiny_llama(0), tiny_llama(1, layers=1)
    twin_model, twin_draft = copy.deepcopy(model), copy.deepcopy(draft)
    monkeypatch.setattr(calibration, "device_profile", lambda *a, **k: (copy.deepcopy(PACKED_WINS), "cached"))
    dec = TreeDecoder(model, draft, policy="static", tree="2,2,1")
    assert kernels.is_packed(model) and kernels.is_packed(draft)
    assert kernels.released(model) == kernels.released(draft) == 0 and "let go" not in dec.kernels_note
    first = dec.generate(PROMPT, max_new_tokens=20).tokens
    assert first == TreeDecoder(model, None, calibrate=False).generate_baseline(PROMPT, max_new_tokens=20).tokens
    assert all(not p.is_meta for p in (*model.parameters(), *draft.parameters()))
    cast_pair(model, draft, "bfloat16")
    cast_pair(twin_model, twin_draft, "bfloat16")
    again = TreeDecoder(model, draft, policy="static", tree="2,2,1").generate(PROMPT, max_new_tokens=20)
    plain = TreeDecoder(twin_model, twin_draft, policy="static", tree="2,2,1").generate(PROMPT, max_new_tokens=20)
    assert len(again.tokens) == 20 and again.tokens == plain.tokens
    with torch.no_grad():                          # and the model runs by itself, as transformers runs it
        assert torch.equal(model(PROMPT[None]).logits, twin_model(PROMPT[None]).logits)
