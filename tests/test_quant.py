"""q4 weights: a Q4_1 GGUF's linear layers on the native kernel or torch's int4 kernel (mcsd.forward.quant),
every test on each kernel that runs here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, torch_threads, write_tiny_gguf

from mcsd.config import ConfigError
from mcsd.costs.profile import _model_key
from mcsd.decoding.decoder import TreeDecoder
from mcsd.drafting.pair import load_model
from mcsd.forward import native, quant
from mcsd.loading.models import gguf_source

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11])
LONG_PROMPT = (torch.arange(quant.PREFILL_ROWS + 8) * 7 + 3) % 61      # a prompt past PREFILL_ROWS


@pytest.fixture(autouse=True, params=["native", "torch"])
def kernel(request, tmp_path, monkeypatch):
    """Each test on each q4 kernel (a private cache, whose native library is the session's: built once,
    keyed by its source, flags and compiler)."""
    shared = Path(os.environ["MCSD_CACHE"]) / "native"      # the session's: the library is keyed by its build
    (tmp_path / "cache").mkdir()
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / "native").symlink_to(shared.resolve())
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MCSD_NATIVE", "1" if request.param == "native" else "0")
    native.reset()
    if quant.kernel_name() != request.param:
        pytest.skip(f"the {request.param} q4 kernel does not run here ({native.reason()})")
    yield request.param
    native.reset()


def _products(kernel) -> int:
    """Q4_1 products in a forward of the 2-layer model: q / k / v joined, o, gate, up, down per layer
    (the native kernel joins gate and up too)."""
    return 2 * (4 if kernel == "native" else 5)


def _heads(kernel) -> int:
    """Q8_0 LM heads attached: the native kernel runs the head on its codes, torch's int4 kernel leaves it dense."""
    return 1 if kernel == "native" else 0


def _q4_model(path):
    return load_model(str(path), dtype="bfloat16", weights="q4")


def _layer(model, name="model.layers.1.mlp.down_proj"):
    return dict(model.named_modules())[name]


def test_every_q4_1_linear_layer_runs_on_its_codes(q4_gguf_file, kernel):
    model = _q4_model(q4_gguf_file)
    assert quant.attached(model) == 2 * 7 + _heads(kernel)      # q, k, v, o, gate, up, down in each layer
    found, _ = quant.codes(q4_gguf_file, 4, 2)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                 "model.layers.1.mlp.down_proj"):
        q, d, m = found[name]
        weight = quant.dequantize(q, d, m)                         # float32, transformers' row order
        x = torch.randn(3, weight.shape[1]).bfloat16()
        with torch.inference_mode():
            out = _layer(model, name)(x)
        exact = x.float() @ weight.t()
        assert out.dtype == torch.bfloat16 and out.shape == exact.shape
        assert torch.allclose(out.float(), exact, atol=0.03, rtol=0.02), name
        dense = x.float() @ _layer(model, name).weight.float().t()  # bfloat16 weights: another rounding
        assert not torch.equal(out.float(), dense)


def test_q_k_v_run_as_one_int4_product_with_the_separate_results(q4_gguf_file, kernel):
    joined = _q4_model(q4_gguf_file)
    assert quant.joined(joined) == 2 * (5 if kernel == "native" else 3)    # q, k, v (gate, up) in each layer
    separate = load_model(str(q4_gguf_file), dtype="bfloat16")
    assert quant.attach(separate, q4_gguf_file, join=False) == 14 + _heads(kernel) and quant.joined(separate) == 0
    logits = {}
    with torch.inference_mode():
        calls = _int4_rows(lambda: logits.update(joined=joined(PROMPT[None]).logits),
                           lambda: logits.update(separate=separate(PROMPT[None]).logits))
    assert len(calls[1]) == 14 and len(calls[0]) == _products(kernel)
    assert torch.allclose(logits["joined"].float(), logits["separate"].float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(logits["joined"].argmax(-1), logits["separate"].argmax(-1))


def test_q_and_k_rows_come_back_in_transformers_order(q4_gguf_file):
    model = load_model(str(q4_gguf_file), dtype="bfloat16")                 # dense: transformers' rows
    found, _ = quant.codes(q4_gguf_file, 4, 2)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
        assert torch.equal(quant.dequantize(*found[name]).bfloat16(), _layer(model, name).weight)


def _int4_rows(*forwards) -> list[list[int]]:
    """The rows of every Q4_1 product (either kernel) in each of `forwards` (callables), in order."""
    real, real_native = torch.ops.aten._weight_int4pack_mm_for_cpu, native.q4_mm
    seen: list[list[int]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant.torch.ops.aten, "_weight_int4pack_mm_for_cpu",
                   lambda *a: seen[-1].append(a[0].shape[0]) or real(*a), raising=False)
        mp.setattr(quant.native, "q4_mm", lambda *a: seen[-1].append(a[0].shape[0]) or real_native(*a))
        for fn in forwards:
            seen.append([])
            fn()
    return seen


# a long prompt starts on the dense weights; static trees are always verified on the codes after it
@pytest.mark.parametrize("policy,tree,prompt", [("static", "2,2,1", PROMPT), ("static", "3,1", PROMPT),
                                                ("learned", None, PROMPT), ("static", "2,2,1", LONG_PROMPT),
                                                ("static", "3,1", LONG_PROMPT)])
def test_decoding_on_q4_weights_is_exact_wrt_plain_q4_decoding(q4_gguf_file, policy, tree, prompt, kernel):
    model = _q4_model(q4_gguf_file)
    draft = tiny_llama(1, layers=1).to(torch.bfloat16)
    with torch.inference_mode():
        reference = model.generate(prompt[None], max_new_tokens=30, do_sample=False, min_new_tokens=30,
                                   pad_token_id=0)[0, prompt.numel():].tolist()
    dec = TreeDecoder(model, draft, tree=tree, policy=policy, calibrate=True)
    assert quant.attached(model) == 14 + _heads(kernel)          # calibration and packing left them on q4
    runs = {}
    calls = sum(_int4_rows(lambda: runs.update(out=dec.generate(prompt, max_new_tokens=30)),
                           lambda: runs.update(plain=dec.generate_baseline(prompt, max_new_tokens=30))), [])
    out, plain = runs["out"], runs["plain"]
    assert calls and max(calls) > 1                               # trees were verified on the int4 kernel
    assert plain.tokens == reference and out.tokens == reference


@pytest.mark.parametrize("policy,tree", [("static", "2,2,1"), ("static", "3,1"), ("static", "4,2,2"),
                                         ("learned", None)])
def test_decoding_on_8bit_activations_is_exact_wrt_plain_q4q8_decoding(q4_gguf_file, policy, tree, kernel):
    """q4q8 defines its own target (the activations rounded to 8 bits): every tree's greedy output
    equals plain decoding and transformers' generate in that arithmetic, the trees verified in blocks
    of rows on the 8-bit products (the layers in one native call, the Q8_0 head in Python)."""
    if kernel != "native":
        pytest.skip("8-bit activations run on the native kernel only")
    model = load_model(str(q4_gguf_file), dtype="float32", weights="q4q8")
    assert quant.on_8bit_activations(model) and quant.attached(model) == 14 + _heads(kernel)
    draft = tiny_llama(1, layers=1)
    with torch.inference_mode():
        reference = model.generate(PROMPT[None], max_new_tokens=30, do_sample=False, min_new_tokens=30,
                                   pad_token_id=0)[0, PROMPT.numel():].tolist()
    dec = TreeDecoder(model, draft, tree=tree, policy=policy, calibrate=False)
    rows, real = [], native.q8q8_mm
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant.native, "q8q8_mm", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
        out = dec.generate(PROMPT, max_new_tokens=30)
        plain = dec.generate_baseline(PROMPT, max_new_tokens=30)
    assert rows and max(rows) > 1                                  # trees were verified on the 8-bit head
    assert dec.target._running.native_layers() is not None          # and on the one-call layers
    assert plain.tokens == reference and out.tokens == reference
    with torch.inference_mode():                                    # a target of its own: not q4's logits
        on_float = load_model(str(q4_gguf_file), dtype="float32", weights="q4")(PROMPT[None]).logits
        assert not torch.equal(model(PROMPT[None]).logits, on_float)


def test_a_long_prompt_starts_on_the_dense_weights_and_every_later_forward_on_the_codes(q4_gguf_file, kernel):
    from transformers import DynamicCache

    from mcsd.forward.kernels import switchable
    from mcsd.forward.kv_cache import cache_keyword
    model, dense = _q4_model(q4_gguf_file), load_model(str(q4_gguf_file), dtype="bfloat16")
    cache, out = {cache_keyword(model): DynamicCache(config=model.config)}, {}
    with torch.inference_mode():
        def start():
            out["q4"] = model(LONG_PROMPT[None], use_cache=True, **cache).logits
        rows = _int4_rows(start,
                          lambda: model(LONG_PROMPT[None, :2], use_cache=True, **cache),
                          lambda: model(PROMPT[None]),                           # short: a sequence on the codes
                          lambda: model(LONG_PROMPT[None, :quant.PREFILL_ROWS - 1]))
        reference = dense(LONG_PROMPT[None]).logits
    if switchable(torch.bfloat16, "cpu") and quant.kernel_name() == "torch":    # dense prefill: torch's kernel
        assert rows[0] == [] and torch.equal(out["q4"], reference)
    else:
        assert len(rows[0]) == _products(kernel) and not torch.equal(out["q4"], reference)
    assert len(rows[1]) == len(rows[2]) == len(rows[3]) == _products(kernel)
    assert not quant._local.dense                               # nothing left switched on after the forwards
    with pytest.raises(IndexError), torch.inference_mode():   # a forward that fails inside switches it off too
        model(torch.full((1, quant.PREFILL_ROWS), 10 ** 6))
    assert not quant._local.dense and not quant._local.stack


def test_without_native_bfloat16_a_long_prompt_stays_on_the_codes(q4_gguf_file, monkeypatch, kernel):
    import mcsd.forward.kernels
    monkeypatch.setattr(mcsd.forward.kernels, "switchable", lambda dtype, device: False)
    model = _q4_model(q4_gguf_file)
    with torch.inference_mode():
        rows = _int4_rows(lambda: model(LONG_PROMPT[None]))
    assert rows[0] == [LONG_PROMPT.numel()] * _products(kernel)


def test_a_detached_model_loses_the_prefill_switch(q4_gguf_file):
    model = _q4_model(q4_gguf_file)
    assert model._forward_pre_hooks and model._forward_hooks
    quant.detach(model)
    assert not model._forward_pre_hooks and not model._forward_hooks and quant.attached(model) == 0


def test_a_model_that_is_not_the_files_is_refused(q4_gguf_file, gguf_file):
    other = load_model(str(gguf_file), dtype="bfloat16")          # another GGUF's weights, same shapes
    with pytest.raises(quant.Q4Error, match="does not dequantise to the model's"):
        quant.attach(other, q4_gguf_file)
    assert quant.attached(other) == 0                             # all or nothing
    model = _q4_model(q4_gguf_file)                               # the codes are now cached: rows are sampled
    quant.detach(model)
    with torch.no_grad():
        _layer(model).weight[0, 0] += 1
    with pytest.raises(quant.Q4Error, match="mlp.down_proj"):
        quant.attach(model, q4_gguf_file)


def test_q4_needs_a_dtype_of_its_kernel_the_cpu_and_a_gguf(q4_gguf_file, gguf_file, model_dirs, kernel):
    if kernel == "torch":
        with pytest.raises(quant.Q4Error, match="compute in bfloat16 here"):
            load_model(str(q4_gguf_file), dtype="float32", weights="q4")
    else:                                                            # the native kernel computes in float32
        assert quant.attached(load_model(str(q4_gguf_file), dtype="float32", weights="q4")) == 15
    with pytest.raises(quant.Q4Error, match="compute in"):
        load_model(str(q4_gguf_file), dtype="float16", weights="q4")
    with pytest.raises(quant.Q4Error, match="no Q4_1 linear weights"):
        load_model(str(gguf_file), dtype="bfloat16", weights="q4")     # a float32 GGUF has no codes
    with pytest.raises(ConfigError, match="neither one, nor a preset"):
        load_model(str(model_dirs / "target"), dtype="bfloat16", weights="q4")
    with pytest.raises(ConfigError, match="unknown weights"):
        load_model(str(q4_gguf_file), weights="q8")
    assert gguf_source(str(q4_gguf_file)) == q4_gguf_file
    assert gguf_source(str(model_dirs / "target")) is None


def test_codes_are_cached_and_a_damaged_cache_is_rebuilt(q4_gguf_file, capsys):
    first, cached = quant.codes(q4_gguf_file, 4, 2)
    assert not cached
    assert "mcsd: reading the 4-bit codes of tiny-q4_1.gguf" in capsys.readouterr().err   # the one-time work says so
    again, cached = quant.codes(q4_gguf_file, 4, 2)
    assert cached and first.keys() == again.keys()
    assert capsys.readouterr().err == ""                                               # and later loads say nothing
    assert first[quant.HEAD][2] is None                                    # the Q8_0 head has no offsets
    same = lambda a, b: a is b is None or torch.equal(a, b)
    assert all(same(a, b) for k in first for a, b in zip(first[k], again[k]))
    quant._cache_file(q4_gguf_file.resolve()).write_bytes(b"not a safetensors file")
    rebuilt, cached = quant.codes(q4_gguf_file, 4, 2)
    assert not cached and all(same(a, b) for k in first for a, b in zip(first[k], rebuilt[k]))


def test_calibrated_costs_of_q4_weights_are_kept_apart(q4_gguf_file, kernel):
    model = _q4_model(q4_gguf_file)
    key = _model_key(model)
    quant.detach(model)
    own = f":q4-native{native.VERSION}" if kernel == "native" else ":q4"         # each kernel (version) its own
    assert key == _model_key(model) + own
    if kernel == "native":                         # 8-bit activations cost otherwise: a profile of their own
        on8 = load_model(str(q4_gguf_file), dtype="float32", weights="q4q8")
        dense = _model_key(load_model(str(q4_gguf_file), dtype="float32"))
        assert _model_key(on8) == dense + f":q4q8-native{native.VERSION}" == \
            _model_key(load_model(str(q4_gguf_file), dtype="float32"), weights="q4q8")


def test_a_copied_model_runs_dense_until_attached_or_shares_the_only_codes(q4_gguf_file, kernel):
    import copy
    model = _q4_model(q4_gguf_file)
    twin = copy.deepcopy(model)
    with torch.inference_mode():
        ours, theirs = model(PROMPT[None]).logits, twin(PROMPT[None]).logits
    if kernel == "torch":                                       # dense weights of its own
        assert quant.attached(twin) == 0 and theirs.shape == ours.shape
    else:                                                       # the codes are the only weights: shared
        assert quant.attached(twin) == quant.attached(model) and torch.equal(theirs, ours)


def test_the_native_kernel_holds_the_weights_once(q4_gguf_file, kernel):
    if kernel != "native":
        pytest.skip("torch's int4 kernel keeps the dense weights (a long prompt may read them)")
    from mcsd.costs.forward_profile import resident_bytes
    dense = load_model(str(q4_gguf_file), dtype="float32")
    model = load_model(str(q4_gguf_file), dtype="float32", weights="q4")
    name = "model.layers.0.self_attn.k_proj"                    # a joined sibling: its own rows of the product
    assert _layer(model, name).weight.is_meta and _layer(model, name).weight.shape == _layer(dense, name).weight.shape
    assert not model.lm_head.weight.is_meta                     # the tied embedding is still gathered by row
    held, before = resident_bytes(model), resident_bytes(dense)
    assert held["dense"] < before["dense"] and held["int4"] > 0
    x = torch.randn(3, 32)
    with torch.inference_mode():
        expected = x @ _layer(dense, name).weight.t()
        assert torch.allclose(_layer(model, name)(x), expected, atol=1e-5)
    with torch.enable_grad():                                   # autograd reads the weight dequantised
        out = _layer(model, name)(x.clone().requires_grad_())
    assert out.requires_grad and torch.allclose(out.detach(), expected, atol=1e-5)
    quant.detach(model)                                         # and detach brings the dense weights back
    for layer_name, layer in dense.named_modules():
        if isinstance(layer, torch.nn.Linear):
            assert torch.equal(_layer(model, layer_name).weight, layer.weight), layer_name


def test_the_unpermutation_undoes_llama_cpps_rotary_permutation():
    heads, rows, cols = 4, 32, 8
    w = torch.randn(rows, cols)
    head = rows // heads
    # llama.cpp's conversion: within each head, interleave the two rotary halves
    permuted = w.view(heads, 2, head // 2, cols).transpose(1, 2).reshape(rows, cols)
    assert torch.equal(permuted[quant._unpermute_rows(rows, heads)], w)


def test_a_larger_model_with_more_heads_attaches(tmp_path, kernel):
    path = write_tiny_gguf(tmp_path / "wide.gguf", hidden=64, heads=8, kv_heads=4, q4=True)
    model = _q4_model(path)
    assert quant.attached(model) == 14 + _heads(kernel)
    found, _ = quant.codes(path, 8, 4)
    quant.detach(model)                                                    # the dense weights, as loaded
    assert torch.equal(quant.dequantize(*found["model.layers.0.self_attn.k_proj"]).bfloat16(),
                       _layer(model, "model.layers.0.self_attn.k_proj").weight)


def test_a_rows_result_does_not_depend_on_the_block_size():
    """Each row of an int4 product comes out the same whether it runs alone or in a block (checked on
    this machine's kernel; on the native one, on float32 and 8-bit activations, the latter on every
    instruction set this CPU has), so q4 linear layers add no dependence on the tree's size."""
    torch.manual_seed(0)
    n = 67 if quant.kernel_name() == "native" else 64       # the native kernel: a short last block of outputs
    q = torch.randint(0, 16, (n, 96), dtype=torch.uint8)
    d, m = (torch.rand(n, 3) * 0.01).half(), (-torch.rand(n, 3) * 0.08).half()
    q8 = torch.randint(-127, 128, (n, 96), dtype=torch.int8)
    layers = [(quant.Q4Linear(q, d, m), None)]
    if layers[0][0].native:                                               # the LM head's Q8_0 product too
        layers.append((quant.Q8Linear(q8, d), None))
        for isa in native.int8_isas_here():                               # and both on 8-bit activations
            layers += [(quant.Q4Linear(q, d, m, act8=True), isa), (quant.Q8Linear(q8, d, act8=True), isa)]
    for layer, isa in layers:
        if isa is not None:
            native.int8_isa(isa)
        for dtype in layer.dtypes:
            # scaled rows: each row's blocks quantise to codes of their own scale
            x = (torch.randn(80, 96) * torch.logspace(-2, 2, 80)[:, None]).to(dtype)
            alone = torch.cat([layer(x[i:i + 1]) for i in range(80)])
            with torch_threads(2):                                     # a prompt's rows quantised on threads
                for rows in [*range(2, 17), 63, 64, 80]:              # every path of the native kernel
                    assert torch.equal(layer(x[:rows]), alone[:rows])
            assert torch.equal(layer(x[3:12]), alone[3:12])              # the rows beside it do not matter
            assert torch.equal(layer(x.flip(0)), alone.flip(0))
    if layers[0][0].native:
        native.int8_isa(native.int8_isas_here()[0])


def _quantised_rows(x: torch.Tensor):
    """Rows of x (M, K) rounded to 8 bits per block of 32 as llama.cpp's Q8_1 (computed here in float32,
    as the kernel does): codes (M, K / 32, 32), scales dx and block sums sx (M, K / 32), float64."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None])                             # ties to even, as the kernel
    dx = amax / 127.0
    return codes.double(), dx.double(), (dx * codes.sum(-1)).double()


def test_products_on_8bit_activations_are_the_sums_of_the_quantised_rows(kernel):
    """q4q8: the Q4_1 and Q8_0 products on 8-bit activations equal, within float32 rounding, the
    dequantised weights times the Q8-quantised rows summed in float64; every instruction set this CPU
    has gives the same bits; and they stay within the quantisation's bound of the float32 product."""
    if kernel != "native":
        pytest.skip("the native kernel's own products")
    torch.manual_seed(2)
    for n, k in ((64, 96), (7, 32), (130, 288)):                           # short last blocks, odd block counts
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d, m = (torch.rand(n, k // 32) * 0.01).half(), (-torch.rand(n, k // 32) * 0.08).half()
        q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)               # -128 too: a foreign file's code
        x = torch.randn(11, k) * torch.logspace(-3, 3, 11)[:, None]
        x[3, :32] = 0.0                                                       # a block of zeros
        codes, dx, sx = _quantised_rows(x)
        g = k // 32
        for weights, size, layer, on_float in (
                (quant.dequantize(q, d, m), quant.dequantize(q, d.abs(), m.abs()), quant.Q4Linear(q, d, m, act8=True),
                 quant.Q4Linear(q, d, m)),
                (quant.dequantize(q8, d, None), quant.dequantize(q8, d, None).abs(), quant.Q8Linear(q8, d, act8=True),
                 quant.Q8Linear(q8, d))):
            w = weights.double().view(n, g, 32)
            exact = torch.einsum("rgk,ngk->rn", codes * dx[..., None], w)  # the quantised rows, summed exactly
            outs = {}
            for isa in native.int8_isas_here():
                native.int8_isa(isa)
                outs[isa] = layer(x)
                for rows in (1, 2, 5, 8, 9):                                  # each set's passes of fewer rows
                    outs[isa, rows] = torch.cat([layer(x[:rows]), outs[isa][rows:]])
            native.int8_isa(native.int8_isas_here()[0])
            out = outs[native.int8_isas_here()[0]]
            assert all(torch.equal(o, out) for o in outs.values())             # VNNI and AVX2: the same bits
            # float32 rounding: each term's magnitude (the scale and the offset parts apart) through at most
            # a block count's fmas, the scale's product and the final sums
            scale = torch.einsum("rgk,ngk->rn", (codes * dx[..., None]).abs(), size.double().view(n, g, 32))
            assert out.dtype == torch.float32
            assert ((out.double() - exact).abs() <= (g + 8) * 2.0 ** -24 * scale).all()
            # against float32 activations: each element is off by at most half its block's step
            bound = torch.einsum("rg,ngk->rn", dx / 2, w.abs())
            dense = x.double() @ weights.double().t()
            assert ((out.double() - dense).abs() <= bound * (1 + 1e-5) + 1e-6 * scale).all()
            assert not torch.equal(out, on_float(x))                            # not the float32 path
    with pytest.raises(ValueError, match="cannot run on 'avx9'"):
        native.int8_isa("avx9")


def test_a_block_of_tiny_values_quantises_to_the_same_sane_codes_on_every_instruction_set(kernel):
    """A block whose largest |x| is tiny but not zero (denormals; 127 / max overflows float32) is
    quantised to codes in -127..127 that follow x (its largest element +-127, a zero 0), the codes
    127 / max would give were it finite, with the same bits on every instruction set here. (They all
    came out -128 before, and AVX2 and VNNI then parted on negative weights.) The codes are read back
    through one-hot Q8_0 weights of either sign, scaled by 2^15 so that the block's scale is normal."""
    if kernel != "native":
        pytest.skip("the native kernel's own quantisation")
    amaxes = torch.tensor([1e-45, 1e-40, 1e-38, 3e-37, 1e-30, 1.0, 0.0])      # float32: denormals first
    t = torch.linspace(-1, 1, 32)
    t[[3, 20]] = 0.0
    x = t * amaxes[:, None]                                                   # row i's largest |x|: amaxes[i]
    q8 = torch.zeros(64, 32, dtype=torch.int8)
    q8[torch.arange(32), torch.arange(32)] = 1
    q8[32 + torch.arange(32), torch.arange(32)] = -1
    head = quant.Q8Linear(q8, torch.full((64, 1), 2.0 ** 15).half(), act8=True)
    q4 = quant.Q4Linear(torch.randint(0, 16, (24, 32), dtype=torch.uint8), torch.rand(24, 1).half(),
                        -torch.rand(24, 1).half(), act8=True)
    outs = {}
    for isa in native.int8_isas_here():
        native.int8_isa(isa)
        outs[isa] = head(x), q4(x)
    native.int8_isa(native.int8_isas_here()[0])
    first = outs[native.int8_isas_here()[0]]
    for isa, out in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(out, first)), isa
    out = first[0].double()
    assert torch.isfinite(out).all() and torch.isfinite(first[1]).all()
    scale = (2.0 ** 15 * (amaxes / 127.0)).double()                           # dw * dx, as the kernel has it
    seen = scale >= 2.0 ** -126                                               # normal: the codes come back
    assert seen.tolist() == [False, True, True, True, True, True, False]
    assert (out[~seen] == 0).all()                                            # dx 0: the block adds nothing
    codes = torch.round(out[seen, :32] / scale[seen, None])
    assert torch.equal(codes, -torch.round(out[seen, 32:] / scale[seen, None]))
    up = torch.where(amaxes[seen] < 2.0 ** -64, 2.0 ** 64, 1.0)[:, None]       # float32 throughout, as the kernel
    expected = torch.round(x[seen] * up * (127.0 / (amaxes[seen, None] * up))).clamp(-127, 127)
    assert torch.equal(codes, expected.double())
    assert (codes[:, -1] == 127).all() and (codes[:, 0] == -127).all() and (codes[:, [3, 20]] == 0).all()
    assert (codes.abs() <= 127).all() and ((codes == 0) | (codes.sign() == t.sign())).all()


def test_the_interleaved_layout_of_the_8bit_products_comes_back_as_the_codes():
    """The 8-row layout of the products on 8-bit activations holds the codes, scales and offsets
    (the last group padded), and a q4q8 layer reads its dense weight back from it."""
    torch.manual_seed(3)
    for n in (8, 13, 67):
        q = torch.randint(0, 16, (n, 96), dtype=torch.uint8)
        d, m = torch.rand(n, 3), -torch.rand(n, 3)
        codes, d8, m8 = quant.interleave_q4(q, d, m)
        assert codes.shape == (-(-n // 8), 3, 4, 32) and d8.shape == (-(-n // 8), 3, 8)
        back = quant.deinterleave_q4(codes, d8, m8, n)
        assert all(torch.equal(a, b) for a, b in zip(back, (q, d, m)))
        q8 = torch.randint(-128, 128, (n, 96), dtype=torch.int8)
        c8, d8, w128 = quant.interleave_q8(q8, d)
        assert c8.view(-1, 3, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(-1, 96)[:n].equal(q8)
        assert w128.dtype == torch.int32 and torch.equal(w128.transpose(1, 2).reshape(-1, 3)[:n],
                                                         q8.view(n, 3, 32).int().sum(-1) * 128)
        if quant.kernel_name() == "native":
            layer = quant.Q4Linear(q, d.half(), m.half(), act8=True)
            assert torch.equal(layer.dense(2, n, torch.float32), quant.dequantize(q, d.half(), m.half())[2:])



def test_the_native_kernel_computes_with_the_float32_weights_a_gguf_loader_computes(kernel):
    if kernel != "native":
        pytest.skip("the native kernel's own check")
    torch.manual_seed(1)
    for n, k in ((64, 96), (7, 32), (130, 256)):                           # short last blocks of output rows
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d, m = (torch.rand(n, k // 32) * 0.01).half(), (-torch.rand(n, k // 32) * 0.08).half()
        x = torch.randn(11, k, dtype=torch.float64)
        exact = x @ quant.dequantize(q, d, m).double().t()                  # the dense weights, summed exactly
        out = quant.Q4Linear(q, d, m)(x.float())
        assert out.dtype == torch.float32 and torch.allclose(out.double(), exact, atol=1e-5, rtol=1e-5)
        q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        head = quant.Q8Linear(q8, d)
        exact = x @ quant.dequantize(q8, d, None).double().t()
        assert torch.allclose(head(x.float()).double(), exact, atol=1e-5, rtol=1e-5)
        alone = torch.cat([head(x[i:i + 1].float()) for i in range(11)])
        assert torch.equal(head(x.float()), alone)


def test_the_command_line_runs_a_q4_target_and_says_so(q4_gguf_file, capsys, kernel):
    import json

    from mcsd.cli import main
    assert main(["--target", str(q4_gguf_file), "--drafter", "context", "--weights", "q4", "--prompt", "ABCABC",
                 "--max-new-tokens", "4", "--json", "--no-calibrate"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["weights"] == "q4" and out["settings"]["dtype"] == quant.compute_dtype()
    assert "q4" in out["settings"]["dtype_reason"] and len(out["tokens"]) == 4
    assert out["settings"]["matmul_kernels"].startswith(f"target: {14 + _heads(kernel)} linear layers on q4 weights")


def test_the_command_line_runs_q4q8_and_its_baseline_in_the_same_arithmetic(q4_gguf_file, capsys, kernel):
    import json

    from mcsd.cli import main
    common = ["--target", str(q4_gguf_file), "--drafter", "context", "--weights", "q4q8", "--prompt", "ABCABCAB",
              "--max-new-tokens", "8", "--json", "--no-calibrate"]
    if kernel != "native":
        assert main(common) == 2
        assert "--weights q4q8 runs on mcsd's native kernel" in capsys.readouterr().err
        return
    runs = {}
    for name, extra in (("tree", []), ("baseline", ["--baseline"])):
        assert main(common + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    for out in runs.values():
        assert out["settings"]["weights"] == "q4q8" and out["settings"]["dtype"] == "float32"
    assert "on 8-bit activations" in runs["tree"]["settings"]["matmul_kernels"]
    # the instruction set that ran, by name: amx, avx512vnni, avxvnni or avx2
    assert f"({native.int8_isa()} integer products)" in runs["tree"]["settings"]["matmul_kernels"]
    assert native.int8_isa() == native.int8_isas_here()[0]
    assert runs["tree"]["tokens"] == runs["baseline"]["tokens"]          # --baseline: the same arithmetic
    assert main(common + ["--dtype", "bfloat16"]) == 2
    assert "--weights q4q8 computes in float32 here" in capsys.readouterr().err


def test_the_memory_floor_of_a_q4_model_counts_its_codes_not_its_dense_weights(q4_gguf_file, kernel):
    from mcsd.costs.forward_profile import weight_bytes
    model = _q4_model(q4_gguf_file)
    q4 = {}
    dense_linear = 0
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            read = quant.read_bytes(layer)
            if read is None:
                dense_linear += layer.weight.nbytes
            else:
                q4[read[0]] = read[1]
    assert q4 and bool(dense_linear) == (kernel == "torch")      # torch's kernel leaves the LM head dense
    down = _layer(model)
    k, n = down.in_features, down.out_features
    scales = 2 * 2 if kernel == "torch" else 2 * 4                # bfloat16 scale + zero, float32 scale + offset
    assert quant.read_bytes(down)[1] == n * k // 2 + (k // quant.GROUP) * n * scales    # 4-bit codes
    norms = sum(p.nbytes for name, p in model.named_parameters() if "norm" in name)
    assert weight_bytes(model) == sum(q4.values()) + dense_linear + norms
    assert weight_bytes(model) < sum(layer.weight.nbytes for layer in model.modules()
                                     if isinstance(layer, torch.nn.Linear))


def test_resident_bytes_count_each_form_of_the_weights_once(q4_gguf_file, kernel):
    from mcsd.costs.forward_profile import resident_bytes
    from mcsd.forward import kernels
    model = _q4_model(q4_gguf_file)
    held = resident_bytes(model, model)                          # the same module twice counts once
    assert held["dense"] == sum(p.nbytes for p in model.parameters() if not p.is_meta)   # let go: nothing held
    codes = {r[0]: (r[1], quant.code_bits(m)) for m in model.modules() for r in [quant.read_bytes(m)] if r}
    assert held["int4"] == sum(n for n, bits in codes.values() if bits == 4) > 0
    assert held["int8"] == sum(n for n, bits in codes.values() if bits == 8)
    assert held["prepacked"] == 0
    dense = tiny_llama(3)
    if kernels.packable(torch.float32, "cpu"):
        kernels.pack(dense)
        assert resident_bytes(dense)["prepacked"] > 0


def test_a_native_kernel_that_cannot_be_built_leaves_torchs_with_the_cause(kernel, monkeypatch, tmp_path):
    if kernel != "native":
        pytest.skip("checked once, from a machine where the native kernel builds")
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    native.reset()
    assert native.library() is None and "could not be built" in native.reason()
    assert quant.kernel_name() == ("torch" if quant._torch_kernel_runs() else None)
    if quant.kernel_name() == "torch":
        assert "could not be built" in quant.describe_kernel()


def test_a_path_the_compiler_cannot_build_is_left_out_and_the_rest_still_builds(kernel, tmp_path):
    """Each optional path of the 8-bit products (AVX-VNNI's {vex} form, AVX512-VNNI, AMX) is test-compiled
    first: a compiler that fails one leaves that path out (-DMCSD_NO_<path>) and only it, and the kernel
    built without every one of them runs the 8-bit products on AVX2 alone, with the same bits."""
    import ctypes
    import subprocess

    if kernel != "native":
        pytest.skip("checked once, from a machine where the native kernel builds")
    cc = native._compiler()
    fussy = tmp_path / "cc"                       # the compiler, failing any source that holds a tile instruction
    fussy.write_text(f'#!/bin/sh\nfor a; do case "$a" in *.c) grep -q tdpbssd "$a" && exit 1;; esac; done\n'
                     f'exec {cc} "$@"\n')
    fussy.chmod(0o755)
    assert native._left_out(str(fussy), tmp_path) == ["-DMCSD_NO_AMX"]
    assert native._left_out(cc, tmp_path) == []
    flags = ["-DMCSD_NO_AVXVNNI", "-DMCSD_NO_AVX512VNNI", "-DMCSD_NO_AMX"]
    lib_path = tmp_path / "plain.so"
    subprocess.run([cc, *native.FLAGS, *flags, str(native.SOURCE), "-o", str(lib_path), *native.LIBS], check=True,
                   capture_output=True)
    plain = ctypes.CDLL(str(lib_path))
    assert plain.mcsd_int8_isas_built() == 1 and plain.mcsd_amx_grant() == -1
    assert plain.mcsd_int8_isa(3) == 0 and plain.mcsd_int8_isa(2) == 0          # nothing but AVX2 to set
    n, k, rows = 13, 96, 6
    torch.manual_seed(4)
    q, d, m = torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, 3).half(), -torch.rand(n, 3).half()
    layer, x = quant.Q4Linear(q, d, m, act8=True), torch.randn(rows, k)
    out = torch.empty(rows, n)
    assert plain.mcsd_q4q8_mm(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(rows), ctypes.c_int64(k),
                              ctypes.c_void_p(layer.codes.data_ptr()), ctypes.c_void_p(layer.d.data_ptr()),
                              ctypes.c_void_p(layer.m.data_ptr()), ctypes.c_int64(n), ctypes.c_void_p(out.data_ptr()),
                              1) == 0
    assert torch.equal(out, layer(x))


def test_the_lean_forward_on_the_native_kernel_agrees_with_transformers_forward(q4_gguf_file, kernel):
    """On the native kernel the engine's own forward also runs its norms and attention through the native
    library; in float32 its logits stay within 1e-4 of transformers' forward on the same q4 products, for a
    prompt, a tree block after it and a step."""
    from mcsd.forward.attention import causal_allowed
    from mcsd.forward.lm import CachedLM
    if kernel != "native":
        pytest.skip("the native library's own forward")
    model = load_model(str(q4_gguf_file), dtype="float32", weights="q4")
    lms = {lean: CachedLM(model, lean=lean) for lean in (True, False)}
    assert lms[True].reset() is None and lms[True]._running.one_call
    tree_tokens = torch.tensor([7, 8, 9, 10])
    allowed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]],
                           dtype=causal_allowed(1, "cpu").dtype)      # 0 -> {1, 2 -> 3}: two branches
    outs = {}
    with torch.inference_mode():
        for lean, lm in lms.items():
            lm.reset()
            first = lm.extend(PROMPT)
            n = lm.length
            block = lm.forward(tree_tokens, torch.tensor([n, n + 1, n + 1, n + 2]), allowed)
            lm.truncate(n)
            step = lm.extend(torch.tensor([11]))
            outs[lean] = (first, block, step)
    for a, b in zip(outs[True], outs[False]):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
