"""Every decoder layer in one native call (`mcsd_layers` in q4_kernel.c, run by `mcsd.forward.llama`):
float32 models on native Q4_1 products, against transformers' forward and the engine's forward
operation by operation, for every family the engine's forward runs (biases, per-head q / k norms,
llama3 rope scaling), and on 8-bit activations (the weights "q4q8") for the families that differ in
what the products feed."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import perturbed, require_native, torch_threads
from test_lean_forward import FAMILIES, PROMPT, TREE, TREE_DEPTH, _family

from mcsd import TreeDecoder
from mcsd.forward import llama, native, quant
from mcsd.forward.attention import causal_allowed
from mcsd.forward.lm import CachedLM

NAMES = {v: k for k, v in quant._LLAMA_NAMES.items()}          # transformers' module path -> GGUF name


@pytest.fixture(scope="module", autouse=True)
def native_kernel(tmp_path_factory):
    yield from require_native(tmp_path_factory)


def _llama_cpp_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter gives a q / k weight (what `quant.read_codes` undoes)."""
    half = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(n_rows)


def _on_q4_codes(model, path, act8: bool = False):
    """`model` with every decoder linear weight replaced by its Q4_1 dequantisation and attached to
    those codes (on 8-bit activations with `act8`), written into a GGUF at `path` as llama.cpp's
    converter lays them out."""
    import gguf

    qtype = gguf.GGMLQuantizationType.Q4_1
    writer = gguf.GGUFWriter(str(path), "llama")
    cfg = model.config
    with torch.no_grad():
        for name, layer in model.named_modules():
            parts = name.split(".")
            if not isinstance(layer, torch.nn.Linear) or parts[:2] != ["model", "layers"]:
                continue
            raw = gguf.quants.quantize(layer.weight.numpy(), qtype)
            layer.weight.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype)).view(layer.weight.shape))
            short = ".".join(parts[3:])
            if short in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if short.endswith("q_proj") else cfg.num_key_value_heads
                raw = raw[_llama_cpp_rows(raw.shape[0], heads)]
            writer.add_tensor(f"blk.{parts[2]}.{NAMES[short]}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert quant.attach(model, path, act8=act8) == 7 * cfg.num_hidden_layers
    assert quant.on_8bit_activations(model) == act8
    return model


# every family on float32 activations; on 8-bit ones plain llama, biases (qwen2) and q / k norms (qwen3)
ON_CODES = [(f, False) for f in FAMILIES] + [(f, True) for f in ("llama", "qwen2", "qwen3")]


@pytest.fixture(scope="module", params=ON_CODES, ids=lambda p: p[0] + ("-q4q8" if p[1] else ""))
def q4_family(request, tmp_path_factory):
    name, act8 = request.param
    model = _on_q4_codes(_family(name), tmp_path_factory.mktemp("q4") / f"{name}.gguf", act8)
    return name, model


def _run(lm):
    """The outputs of a prompt, a tree block after it and a step after the tree is dropped."""
    lm.reset()
    first = lm.extend(PROMPT)
    n = lm.length
    block = lm.forward(torch.tensor([7, 8, 9, 10, 12]), n + TREE_DEPTH, TREE.to(causal_allowed(1, "cpu").dtype))
    lm.truncate(n)
    step = lm.extend(torch.tensor([11]))
    return first, block, step


def _one_op_at_a_time(lm):
    """`lm` made to run the engine's forward operation by operation (no whole-layer calls)."""
    lm.reset()
    lm._running._make_plan = lambda: None
    lm._running._plan_at = None
    return lm


def test_a_layer_in_one_call_agrees_with_transformers_and_the_op_by_op_forward(q4_family):
    name, model = q4_family
    fused, ops, reference = CachedLM(model, lean=True), _one_op_at_a_time(CachedLM(model, lean=True)), \
        CachedLM(model, lean=False)
    fused.reset()
    assert fused._running.native_layers() is not None, name
    # the one-call layer multiplies as the model's own layers do: on 8-bit activations for q4q8
    assert {w.act8 for w, *_ in fused._running.native_layers()} == {int(quant.on_8bit_activations(model))}
    with torch.inference_mode():
        got = _run(fused)
        by_op = _run(_one_op_at_a_time(ops))
        want = _run(reference)
    assert ops._running.native_layers() is None
    for a, b, c in zip(got, by_op, want):
        assert torch.allclose(a, c, atol=1e-4, rtol=1e-4), name
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), name


def test_a_rows_result_in_one_call_does_not_depend_on_the_block(q4_family):
    """The final hidden states of a chain of 9 rows computed in one block equal, bit for bit, the same
    rows one at a time: what makes a verify agree with the steps of plain decoding (the tiny models'
    dense LM heads run on torch's products, whose rows may differ in the last bit)."""
    _, model = q4_family
    lm = CachedLM(model, lean=True)
    chain = torch.tensor([4, 30, 2, 61, 17, 8, 44, 5, 19])
    with torch.inference_mode():
        lm.reset()
        lm.extend(PROMPT)
        _, block = lm.extend(chain, hidden=(-1,))
        lm.reset()
        lm.extend(PROMPT)
        rows = torch.cat([lm.extend(chain[i:i + 1], hidden=(-1,))[1] for i in range(chain.numel())])
    assert torch.equal(block, rows)


def test_hidden_states_come_from_the_layers_in_one_call(q4_family):
    _, model = q4_family
    n = model.config.num_hidden_layers
    out = {}
    with torch.inference_mode():
        for lean in (True, False):
            lm = CachedLM(model, lean=lean)
            lm.reset()
            out[lean] = lm.extend(PROMPT, hidden=(0, 1, n))
    (la, sa), (lb, sb) = out[True], out[False]
    assert torch.allclose(la, lb, atol=1e-4, rtol=1e-4) and torch.allclose(sa, sb, atol=1e-4, rtol=1e-4)


def test_greedy_decoding_on_layers_in_one_call_equals_plain_decoding_and_generate(q4_family):
    name, model = q4_family
    prompt = PROMPT[:6]
    want = model.generate(prompt[None], max_new_tokens=30, do_sample=False,
                          attention_mask=torch.ones(1, prompt.numel()))[0, prompt.numel():].tolist()
    dec = TreeDecoder(model, perturbed(_family(name), 0.3), tree="4,2,2", policy="static")
    out, plain = dec.generate(prompt, max_new_tokens=30), dec.generate_baseline(prompt, max_new_tokens=30)
    assert dec.target._running is not None and dec.target._running.native_layers() is not None
    assert out.tokens == plain.tokens == want, name


def test_the_layers_go_back_to_one_op_at_a_time_once_the_codes_are_detached(tmp_path):
    model = _on_q4_codes(_family("llama"), tmp_path / "llama.gguf")
    dense = copy.deepcopy(model)
    quant.detach(dense)
    lm = CachedLM(model, lean=True)
    lm.reset()
    assert lm._running.native_layers() is not None
    quant.detach(model)
    assert lm._running.native_layers() is None               # made again: no codes to point into
    with torch.inference_mode():
        got, want = _run(lm), _run(CachedLM(dense, lean=False))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_the_layer_plan_is_kept_between_sequences_until_what_it_reads_changes(tmp_path):
    """The whole-layer plan is made once, not once a sequence; a bias edited in place (the plan copies
    biases; through `.data`, which moves no version counter), a norm weight replaced and a module
    swapped each make it again at the next sequence, and the one-call forward then computes what the
    op-by-op one and transformers' forward do on the edited model (the joined q / k / v product adds
    each sibling's bias as it is now, not a copy made when the codes were attached)."""
    model = _on_q4_codes(_family("qwen2"), tmp_path / "qwen2.gguf")
    lm = CachedLM(model, lean=True)
    lm.reset()
    plan = lm._running.native_layers()
    assert plan is not None
    lm.reset()
    assert lm._running.native_layers() is plan                  # nothing changed: kept
    layer = model.model.layers[1]
    edits = [lambda: layer.self_attn.v_proj.bias.data.add_(0.25),
             lambda: setattr(layer.input_layernorm, "weight", torch.nn.Parameter(layer.input_layernorm.weight * 1.5)),
             lambda: setattr(layer.mlp, "act_fn", copy.deepcopy(layer.mlp.act_fn))]
    for edit in edits:
        with torch.no_grad():
            edit()
        lm.reset()
        again = lm._running.native_layers()
        assert again is not None and again is not plan
        plan = again
        with torch.inference_mode():
            got, by_op = _run(lm), _run(_one_op_at_a_time(CachedLM(model, lean=True)))
            want = _run(CachedLM(model, lean=False))
        for a, b, c in zip(got, by_op, want):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
            assert torch.allclose(a, c, atol=1e-4, rtol=1e-4)


def test_a_model_in_bfloat16_runs_one_op_at_a_time(q4_gguf_file):
    from mcsd.drafting.pair import load_model
    model = load_model(str(q4_gguf_file), dtype="bfloat16", weights="q4")
    lm = CachedLM(model, lean=True)
    lm.reset()
    assert lm._running.one_call and lm._running.native_layers() is None
    assert isinstance(lm._running, llama.LeanForward)


def test_a_q8_0_weight_quantises_back_to_its_own_codes():
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    q[:, ::32] = 127                                                  # each block reaches the end of the range
    d = (torch.rand(8, 2) * 0.01).half().float()
    w = quant.dequantize(q, d, None)
    codes, scales = quant.quantize_q8_0(w)
    assert torch.equal(codes, q) and torch.equal(scales, d)
    zero_codes, zero_scales = quant.quantize_q8_0(torch.zeros(2, 32))
    assert not zero_codes.any() and not zero_scales.any()


def _feature_head(width: int, vocab: int):
    from mcsd.drafting.feature_draft import FeatureHead, FeatureHeadConfig
    torch.manual_seed(5)
    return FeatureHead(FeatureHeadConfig(target_hidden=width, layers=1, heads=2, kv_heads=1, intermediate=2 * width,
                                         vocab_size=vocab,
                                         sub_vocab=24)).eval()


def test_a_feature_drafter_beside_a_native_q4_target_drafts_on_q8_0_and_stays_exact(tmp_path, monkeypatch):
    from mcsd.drafting.feature_draft import FeatureDrafter
    model = _on_q4_codes(_family("llama"), tmp_path / "llama.gguf")
    drafter = FeatureDrafter(_feature_head(model.config.hidden_size, model.config.vocab_size), model)
    assert drafter.q8_layers == 9                  # reduce, q / k / v / o, gate / up / down, the LM rows
    plain = TreeDecoder(model, None).generate_baseline(PROMPT, max_new_tokens=40).tokens
    dec = TreeDecoder(model, drafter, tree="3,2,2,1", policy="static")
    out = dec.generate(PROMPT, max_new_tokens=40)
    assert out.tokens == plain and out.stats.draft_forwards > 0
    # --stats names the codes each model runs on, and a matmul path only for layers left without codes
    # (here the target's float32 LM head: the draft has none), where the profile found packing faster
    from mcsd.costs.profile import DeviceProfile
    from mcsd.decoding import calibration
    packed_wins = DeviceProfile(verify_ms={1: 10.0, 8: 12.0}, verify_packed_ms={1: 8.0, 8: 9.0},
                                draft_ms={1: 2.0, 8: 3.0}, draft_packed_ms={1: 1.5, 8: 2.5})
    monkeypatch.setattr(calibration, "device_profile", lambda *a, **k: (packed_wins, "cached"))
    packed_dec = TreeDecoder(model, drafter, tree="3,2,2,1", policy="static")
    note = packed_dec.kernels_note
    assert "draft: 9 linear layers on Q8_0 codes" in note and "draft (the rest)" not in note
    # a forward switches matmul paths only where some layer runs on them: the draft's never does
    assert packed_dec.drafter.kernels is None and packed_dec.target.kernels is not None
    assert "target (the rest): prepacked" in note and "LM head on its Q8_0" not in note
    dense = FeatureDrafter(_feature_head(model.config.hidden_size, model.config.vocab_size), _family("llama"))
    assert dense.q8_layers == 0                    # beside a dense target the head stays on its float32 weights
    with torch.inference_mode():                   # and the codes' scores stay near the float32 weights'
        f, e = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
        a = dense.head.sub_scores(dense.head(f, e, torch.arange(6)[None]))
        b = drafter.head.sub_scores(drafter.head(f, e, torch.arange(6)[None]))
    assert torch.allclose(a, b, atol=0.05 * float(a.abs().max()))


def test_beside_a_target_on_8bit_activations_the_head_multiplies_them_too_and_follows_a_change(tmp_path):
    """A target on "q4q8": the head's Q8_0 products run on 8-bit activations as well (its layer in one
    native call), drafting stays exact, and the scores stay near the float32 weights'; the target
    put back on float32 activations takes the head's codes with it."""
    from mcsd.drafting.feature_draft import FeatureDrafter
    model = _on_q4_codes(_family("llama"), tmp_path / "llama.gguf", act8=True)
    dense = FeatureDrafter(_feature_head(model.config.hidden_size, model.config.vocab_size), _family("llama"))
    drafter = FeatureDrafter(_feature_head(model.config.hidden_size, model.config.vocab_size), model)
    coded = [m.__dict__[quant._ATTR] for m in drafter.module.modules() if quant._ATTR in m.__dict__]
    assert drafter.q8_layers == 9 and coded and all(isinstance(w, quant.Q8Linear) and w.act8 for w in coded)
    assert drafter._empty_cache() is not None and drafter._lean.native_layers() is not None
    plain = TreeDecoder(model, None).generate_baseline(PROMPT, max_new_tokens=40).tokens
    out = TreeDecoder(model, drafter, tree="3,2,2,1", policy="static").generate(PROMPT, max_new_tokens=40)
    assert out.tokens == plain and out.stats.draft_forwards > 0
    with torch.inference_mode():
        f, e = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
        a = dense.head.sub_scores(dense.head(f, e, torch.arange(6)[None]))
        b = drafter.head.sub_scores(drafter.head(f, e, torch.arange(6)[None]))
    assert torch.allclose(a, b, atol=0.05 * float(a.abs().max()))
    quant.detach(model)
    quant.attach(model, tmp_path / "llama.gguf", act8=False)
    assert drafter.follow_target_weights() == 9
    coded = [m.__dict__[quant._ATTR] for m in drafter.module.modules() if quant._ATTR in m.__dict__]
    assert coded and not any(w.act8 for w in coded)


def test_a_pairs_profile_is_found_under_one_name_before_and_after_the_codes(tmp_path):
    """--weights auto looks a q4 candidate's costs up before converting the pair, and they are stored
    after (the feature head then on its Q8_0 codes): one file, so a warm start measures nothing."""
    from mcsd.costs.store import profile_path
    from mcsd.drafting.feature_draft import FeatureDrafter
    dense = _family("llama")
    before = profile_path(dense, FeatureDrafter(_feature_head(32, 64), dense), torch.float32, weights="q4")
    model = _on_q4_codes(_family("llama"), tmp_path / "llama.gguf")
    drafter = FeatureDrafter(_feature_head(32, 64), model)
    assert drafter.q8_layers and profile_path(model, drafter) == before
    assert profile_path(dense, FeatureDrafter(_feature_head(32, 64), dense)) != before    # dense: its own


@pytest.mark.parametrize("cached", [5, 37, 300])
def test_attention_does_not_depend_on_where_in_the_block_a_rows_allowed_keys_lie(cached):
    """A tree's second sibling sees the cache and its own key, which sits one index further in the verify
    block than in the step that computes it alone (the first sibling's key masked out between): the
    native attention gives it the same bits either way (its exponentials are summed in key order, not
    in lanes that follow a key's index), so a tree with siblings verifies exactly as plain steps run."""
    gen = torch.Generator().manual_seed(cached)
    heads, kv_heads, dim, cap = 6, 2, 64, cached + 8
    keys = torch.randn(kv_heads, cap, dim, generator=gen)
    values = torch.randn(kv_heads, cap, dim, generator=gen)
    q = torch.randn(1, heads, dim, generator=gen)
    mine = cached + 1                                   # in the block, after a masked-out sibling's key
    mask = torch.zeros(1, cached + 2)
    mask[0, cached] = float("-inf")
    in_block = native.attention(q, keys, values, cached + 2, mask, 0.125)
    alone_keys, alone_values = keys.clone(), values.clone()
    alone_keys[:, cached], alone_values[:, cached] = keys[:, mine], values[:, mine]
    alone = native.attention(q, alone_keys, alone_values, cached + 1, torch.zeros(1, cached + 1), 0.125)
    assert torch.equal(in_block, alone)


@pytest.fixture
def lanes_attention():
    """The native attention's sixteen-lane path (AVX-512), its threshold restored after the test."""
    before = native.attention_lanes()
    if not before:
        pytest.skip("the sixteen-lane attention needs AVX-512, which this CPU (or build) lacks")
    yield before
    native.attention_lanes(before)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (12, 2, 48), (6, 2, 128)])
def test_attention_gives_the_same_bits_one_row_head_at_a_time_and_sixteen_in_the_lanes(lanes_attention, heads,
                                                                                      kv_heads, dim):
    """Every (row, head) is computed in one fixed order on either path (see mcsd_attention), so which one
    runs a block (by its rows) changes no bit: blocks of 1-33 rows over 1-301 positions, masks with
    keys hidden from some rows and not others (the mixed case the lanes path weighs key by key), some
    rows seeing a single key, each on 1 and 2 threads."""
    gen = torch.Generator().manual_seed(heads * dim)
    for rows, length in [(1, 1), (1, 300), (2, 9), (3, 17), (5, 64), (6, 301), (16, 301), (17, 40), (33, 299)]:
        cap = length + 4
        q = torch.randn(rows, heads, dim, generator=gen)
        keys = torch.randn(kv_heads, cap, dim, generator=gen) * 3
        values = torch.randn(kv_heads, cap, dim, generator=gen)
        mask = torch.where(torch.rand(rows, length + 2, generator=gen) < 0.3, float("-inf"), 0.0)
        mask[:, 0] = 0.0
        if rows > 1:
            mask[1, 1:length] = float("-inf")                         # a row that sees one key
        if rows % 2:
            mask = mask[:, :length]                                   # a row stride past the length
        _same_bits_on_both_paths(q, keys, values, length, mask, (rows, length))


def _same_bits_on_both_paths(q, keys, values, length, mask, case=None) -> None:
    """The native attention on the rows path and on the lanes path, on 1 and 2 threads: finite, and the
    same bits every way."""
    outs = []
    for threads in (1, 2):
        with torch_threads(threads):
            for lanes in (1, 10 ** 6):
                native.attention_lanes(lanes)
                outs.append(native.attention(q, keys, values, length, mask, 0.125))
    assert outs[0].isfinite().all()
    for other in outs[1:]:
        assert torch.equal(outs[0].view(torch.int32), other.view(torch.int32)), case


@pytest.mark.parametrize("rows,prefix,hidden", [(40, 0, float("-inf")), (33, 7, torch.finfo(torch.float32).min),
                                               (64, 200, torch.finfo(torch.float32).min)])
def test_a_prompts_causal_rows_give_the_same_bits_on_both_paths(lanes_attention, rows, prefix, hidden):
    """A prompt's block: row r sees the cached keys and its own block's up to itself, so the keys after a
    task's last row are masked for every row it holds (the lanes path stops there), on 1 and 2 threads;
    masked by -inf or by float32's most negative value (`additive_mask`'s)."""
    gen = torch.Generator().manual_seed(rows + prefix)
    heads, kv_heads, dim, length = 9, 3, 64, prefix + rows
    q = torch.randn(rows, heads, dim, generator=gen)
    keys = torch.randn(kv_heads, length + 3, dim, generator=gen) * 3
    values = torch.randn(kv_heads, length + 3, dim, generator=gen)
    seen = torch.arange(length)[None, :] <= prefix + torch.arange(rows)[:, None]
    _same_bits_on_both_paths(q, keys, values, length, torch.where(seen, 0.0, hidden))


def test_attention_lanes_threshold_is_checked():
    with pytest.raises(ValueError, match="positive"):
        native.attention_lanes(0)


def test_attention_that_cannot_allocate_its_scratch_fails_as_the_products_do():
    """A length whose score row no allocation can hold (2^61 floats) leaves every thread without its
    scratch: the call reports it and the caller raises MemoryError, rather than returning rows it
    skipped (the scratch is asked for before any key is read)."""
    q, keys = torch.randn(3, 4, 16), torch.randn(2, 8, 16)
    before = native.attention_lanes()
    try:
        for lanes in ((1, 10 ** 6) if before else (None,)):      # both paths where the lanes one is here
            native.attention_lanes(lanes)
            with pytest.raises(MemoryError, match="attention"):
                native.attention(q, keys, keys.clone(), 2 ** 61, torch.zeros(3, 8), 0.25)
            assert native.attention(q, keys, keys.clone(), 8, torch.zeros(3, 8), 0.25).isfinite().all()
    finally:
        if before:
            native.attention_lanes(before)


def test_a_feature_heads_layer_on_its_q8_0_codes_runs_as_one_native_call_and_predicts_as_operation_by_operation(
        tmp_path, monkeypatch):
    """Its q / k / v and gate / up share one Q8_0 product each (the codes are per row: each layer's
    own), so the head's decoder layer runs as the target's do; its predictions are those of the same
    codes run operation by operation."""
    from mcsd.drafting.feature_draft import FeatureDrafter
    model = _on_q4_codes(_family("llama"), tmp_path / "llama.gguf")
    drafter = FeatureDrafter(_feature_head(model.config.hidden_size, model.config.vocab_size), model)
    body = drafter.head.body.layers[0]
    q8 = quant.native_rows(body.self_attn.q_proj)
    assert isinstance(q8[0], quant.Q8Linear) and q8[0] is quant.native_rows(body.self_attn.v_proj)[0]
    assert drafter._lean.native_layers() is not None            # one call a layer
    feats, tokens = torch.randn(7, 32), torch.randint(0, 64, (7,))

    def predict():
        drafter.reset()
        with torch.inference_mode():
            return drafter._run(feats, tokens, torch.arange(7), causal_allowed(7))

    one_call = predict()
    monkeypatch.setattr(llama.LeanForward, "native_layers", lambda self: None)
    by_op = predict()
    assert torch.allclose(one_call, by_op, rtol=1e-5, atol=1e-5 * float(by_op.abs().max()))
    separate = [layer.weight for layer in (body.self_attn.q_proj, body.self_attn.k_proj, body.self_attn.v_proj)]
    joined_codes = q8[0].codes                                      # the rows of each layer's own codes
    assert joined_codes.shape[0] == sum(w.shape[0] for w in separate)
    assert torch.equal(joined_codes[:separate[0].shape[0]], quant.quantize_q8_0(separate[0])[0])
