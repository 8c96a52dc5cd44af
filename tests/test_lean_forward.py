"""The engine's own Llama-family forward (mcsd.forward.llama) against transformers' forward, the reference.

Tiny random models of each family (Llama, Llama with llama3 rope scaling,
Mistral, Qwen2 with q / k / v biases, Qwen3 with q / k norms), float32: logits
within 1e-4 of transformers' forward for the same blocks, greedy output equal
to `generate`, the same hidden states; no weight copied; other models on
transformers' path.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import perturbed, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from mcsd import TreeDecoder
from mcsd.forward import kernels, llama
from mcsd.forward.attention import causal_allowed
from mcsd.forward.lm import CachedLM, forward_path
from mcsd.forward.static_cache import HEADROOM, StaticCache

PROMPT = torch.tensor([3, 17, 42, 5, 9, 11, 23])
TOL = 1e-4


def _randomised(model, seed=0):
    """Norm weights and biases away from their initial ones and zeros, so a forward that skipped or
    misplaced one would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        model.lm_head.weight.mul_(8.0)                     # sharper next-token distributions
    return model.eval()


def _family(name: str, seed: int = 0, layers: int = 2):
    """A tiny random causal LM of one family, float32 (4 query heads, 2 key / value heads)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    if name == "llama":
        return _randomised(tiny_llama(seed, layers=layers))
    if name == "llama3-rope":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        return _randomised(LlamaForCausalLM(LlamaConfig(rope_parameters=rope, attention_bias=True, **common)))
    if name == "mistral":
        return _randomised(MistralForCausalLM(MistralConfig(sliding_window=None, **common)))
    if name == "qwen2":
        return _randomised(Qwen2ForCausalLM(Qwen2Config(**common)))
    if name == "qwen3":
        return _randomised(Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common)))
    raise ValueError(name)


FAMILIES = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, _family(request.param)


# a hand-drawn tree of 5 nodes: 0 the root, 1 and 2 its children, 3 under 1, 4 under 2
TREE = torch.tensor([[1, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0],
                     [1, 0, 1, 0, 0],
                     [1, 1, 0, 1, 0],
                     [1, 0, 1, 0, 1]], dtype=torch.bool)
TREE_DEPTH = torch.tensor([0, 1, 1, 2, 2])


def _script(lm, record):
    """The blocks a decoder runs: a prefill, a causal block, tree blocks whose accepted paths are not
    contiguous in the cache, a tree grown in two forwards (the second sees nodes the first cached),
    and plain tokens after. `record(name, output)` gets every output."""
    lm.reset()
    record("prefill", lm.extend(PROMPT, hidden=(0, 1, -1)))
    record("causal", lm.extend(torch.tensor([8, 30, 2])))
    for r in range(3):
        base = lm.length
        tokens = torch.tensor([40 + r, 12, 13, 14, 15])
        record(f"tree{r}", lm.forward(tokens, base + TREE_DEPTH, TREE))
        lm.commit(base, torch.tensor([0, 2, 4]))                   # root, its second child, that child's child
    base = lm.length
    record("grow-1", lm.forward(torch.tensor([50, 51, 52]), base + TREE_DEPTH[:3], TREE[:3, :3]))
    cols = torch.tensor([0, 1, 2, 3, 4])
    record("grow-2", lm.forward(torch.tensor([53, 54]), base + TREE_DEPTH[3:], TREE[3:][:, cols]))
    lm.commit(base, torch.tensor([0, 1, 3]))
    record("after", lm.extend(torch.tensor([20, 21]), hidden=True))
    return lm.length


def _outputs(lm):
    out = {}
    length = _script(lm, lambda name, value: out.__setitem__(name, value))
    return out, length


def test_logits_and_states_match_transformers_forward_block_by_block(family):
    name, model = family
    lean, ref = CachedLM(model, lean=True), CachedLM(model, lean=False)
    got, n_got = _outputs(lean)
    want, n_want = _outputs(ref)
    assert lean.path == "lean" and ref.path == "transformers" and isinstance(lean.cache, StaticCache)
    assert n_got == n_want == lean.length
    for key in want:
        a, b = (got[key], want[key]) if isinstance(got[key], tuple) else ((got[key],), (want[key],))
        for x, y in zip(a, b):
            assert x.shape == y.shape, key
            assert (x - y).abs().max() <= TOL, (name, key, (x - y).abs().max())


def test_committed_paths_read_as_the_sequence_they_spell(family):
    """After commits of non-contiguous paths, the cache holds exactly the committed sequence: the next
    tokens' logits are those of transformers' forward over the whole sequence without a cache."""
    name, model = family
    lm = CachedLM(model, lean=True)
    lm.reset()
    seq = PROMPT.tolist()
    lm.extend(PROMPT)
    for r in range(4):
        base = lm.length
        tokens = torch.tensor([40 + r, 12, 13, 14, 15])
        lm.forward(tokens, base + TREE_DEPTH, TREE)
        keep = torch.tensor([0, 2, 4]) if r % 2 else torch.tensor([0, 1, 3])
        lm.commit(base, keep)
        seq += tokens[keep].tolist()
    tail = torch.tensor([20, 21, 22])
    got = lm.extend(tail)
    with torch.no_grad():
        want = model(torch.tensor(seq + tail.tolist())[None]).logits[0, -3:]
    assert (got - want).abs().max() <= TOL


def test_hidden_state_indices_are_transformers_own(family):
    name, model = family
    n = model.config.num_hidden_layers
    lm = CachedLM(model, lean=True)
    with torch.no_grad():
        out = model(PROMPT[None], output_hidden_states=True)
    for index in [*range(n + 1), -1, -2, -(n + 1)]:
        lm.reset()
        logits, states = lm.extend(PROMPT, hidden=(index,))
        assert (states - out.hidden_states[index][0]).abs().max() <= TOL, index
    lm.reset()
    _, states = lm.extend(PROMPT, hidden=True)
    assert (states - out.hidden_states[-1][0]).abs().max() <= TOL
    lm.reset()
    _, states = lm.extend(PROMPT, hidden=(0, -1, 1))
    want = torch.cat([out.hidden_states[i][0] for i in (0, -1, 1)], dim=-1)
    assert (states - want).abs().max() <= TOL
    lm.reset()
    with pytest.raises(IndexError):
        lm.extend(PROMPT, hidden=(n + 1,))


def test_last_logits_is_the_last_row(family):
    _, model = family
    lm = CachedLM(model, lean=True)
    lm.reset()
    full = lm.extend(PROMPT)
    lm.reset()
    last = lm.extend(PROMPT, last_logits=True)
    assert last.shape == (1, full.shape[-1]) and torch.allclose(last, full[-1:], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rows_are_the_modules_own_bits(family, dtype):
    """The CPU's rotary table gives, for any positions up to twice the context window, exactly the
    module's cos and signed sin (the sign moved off rotate_half), and is made again when the
    frequencies change; past its reach, an index error."""
    _, model = family
    lean = llama.LeanForward(copy.deepcopy(model))
    x = torch.zeros(1, 1, model.config.hidden_size, dtype=dtype)
    half = lean.head_dim // 2
    sign = torch.cat([-torch.ones(half), torch.ones(lean.head_dim - half)]).to(dtype)
    g = torch.Generator().manual_seed(0)

    def check(positions):
        cos, sin = lean._rotary(x, positions)
        want_cos, want_sin = lean.rotary(x, positions)
        assert cos.dtype == dtype and cos.shape == (*positions.shape, 1, lean.head_dim)
        assert torch.equal(cos[:, :, 0], want_cos) and torch.equal(sin[:, :, 0], want_sin * sign)

    window = model.config.max_position_embeddings
    for rows, reach in ((1, 40), (7, 40), (3, window), (5, 2 * window)):
        check(torch.randint(0, reach, (1, rows), generator=g))
    check(torch.randint(0, 300, (3, 4), generator=g))                       # a batch's (S, R) positions
    length = lean._table[0].shape[0]
    assert length >= 2 * window
    with pytest.raises(IndexError):
        lean._rotary(x, torch.tensor([[length]]))
    with torch.no_grad():
        lean.rotary.inv_freq.mul_(0.5)                                     # new frequencies, new table
    check(torch.randint(0, 300, (1, 6), generator=g))


def test_rotary_rows_of_a_model_made_under_inference_mode(family):
    """A model whose buffers were made under `torch.inference_mode` (no version counter) gets its table,
    and a new one when its frequencies are edited in place there."""
    _, model = family
    with torch.inference_mode():
        lean = llama.LeanForward(copy.deepcopy(model))
        lean.rotary.inv_freq = lean.rotary.inv_freq.clone()
        assert lean.rotary.inv_freq.is_inference()
        x = torch.zeros(1, 1, model.config.hidden_size)
        positions = torch.arange(5)[None]
        for _ in range(2):
            cos, _ = lean._rotary(x, positions)
            assert torch.equal(cos[:, :, 0], lean.rotary(x, positions)[0])
            lean.rotary.inv_freq.mul_(0.5)


@pytest.mark.parametrize("tree,policy", [("4,2,2", "static"), (None, "auto")])
def test_greedy_output_equals_generate(family, tree, policy):
    name, model = family
    prompt = PROMPT[:6]
    want = model.generate(prompt[None], max_new_tokens=40, do_sample=False,
                          attention_mask=torch.ones(1, prompt.numel()))[0, prompt.numel():].tolist()
    for draft in (model, perturbed(model, 0.3)):
        dec = TreeDecoder(model, copy.deepcopy(draft), tree=tree, policy=policy)
        out = dec.generate(prompt, max_new_tokens=40)
        assert dec.target.path == "lean" and dec.drafter.lm.path == "lean"
        assert out.tokens == want, (name, policy)


def test_the_cache_grows_past_its_first_capacity():
    model = _family("llama")
    lean, ref = CachedLM(model, lean=True), CachedLM(model, lean=False)
    for lm in (lean, ref):
        lm.reset()
        lm.extend(PROMPT)
    first = lean.cache.capacity
    assert first == PROMPT.numel() + HEADROOM
    for r in range(100):                                      # 3 positions a round: past the first capacity
        base = lean.length
        tokens = torch.tensor([40 + r % 9, 12, 13, 14, 15])
        a, b = (lm.forward(tokens, base + TREE_DEPTH, TREE) for lm in (lean, ref))
        assert (a - b).abs().max() <= TOL
        for lm in (lean, ref):
            lm.commit(base, torch.tensor([0, 2, 4]))
    assert lean.cache.capacity > first and lean.length == ref.length == PROMPT.numel() + 300
    buffers = lean.cache.keys.data_ptr()
    lean.reset()                                               # a new sequence reuses the buffers
    lean.extend(PROMPT)
    assert lean.cache.keys.data_ptr() == buffers


def test_truncate_and_commit_through_kv_cache_helpers():
    from mcsd.forward import kv_cache
    model = _family("qwen2")
    lean, ref = CachedLM(model, lean=True), CachedLM(model, lean=False)
    outs = []
    for lm in (lean, ref):
        lm.reset()
        lm.extend(PROMPT)
        kv_cache.truncate(lm.cache, 4)                         # as the drafters and PEARL do
        assert kv_cache.cache_length(lm.cache) == lm.length == 4
        lm.truncate(3)
        outs.append(lm.extend(PROMPT[3:]))
    assert (outs[0] - outs[1]).abs().max() <= TOL


class _Reads(TorchDispatchMode):
    """Every tensor an op reads that no earlier op of the block made, by storage."""

    def __init__(self):
        super().__init__()
        self.made, self.foreign = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def storages(tree):
            flat, _ = torch.utils._pytree.tree_flatten(tree)
            return {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        self.foreign |= storages((args, kwargs)) - self.made
        out = func(*args, **(kwargs or {}))
        self.made |= storages(out)
        return out


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_no_weight_is_copied(name):
    """The forward reads the transformers model's own parameter tensors, and nothing made before the
    block apart from them, the model's buffers, the cache, its rotary table and the block's inputs."""
    model = _family(name)
    lm = CachedLM(model, lean=True)
    lm.reset()
    lm.extend(PROMPT)
    tokens, positions = torch.tensor([5, 6]), torch.tensor([7, 8])
    allowed = causal_allowed(2)
    lm.cache.reserve(lm.length + 2)                            # no reallocation inside the block
    reads = _Reads()
    with torch.inference_mode(), reads:
        lm.forward(tokens, positions, allowed)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert params <= reads.foreign                             # every weight read where it lives
    allowed_reads = params | {b.untyped_storage().data_ptr() for b in model.buffers()} | {
        lm.cache.keys.untyped_storage().data_ptr(), lm.cache.values.untyped_storage().data_ptr(),
        lm._own._sign.untyped_storage().data_ptr()} | {t.untyped_storage().data_ptr() for t in lm._own._table[:2]}
    extra = reads.foreign - allowed_reads
    # what else is read are the block's own small inputs (tokens, positions, visibility), made outside
    assert len(extra) <= 3
    assert not [v for v in vars(lm._own).values() if isinstance(v, torch.Tensor) and v is not lm._own._sign]


def test_prepacked_and_joined_weights_still_run():
    """The linear layers are called as modules: `mcsd.forward.kernels`' prepacked (joined q / k / v) products run."""
    from torch.profiler import profile
    if not kernels.packable(torch.float32, "cpu"):
        pytest.skip("no oneDNN weight packing on this torch")
    model = copy.deepcopy(_family("llama"))
    assert kernels.pack(model) and kernels.joined(model)
    outs, products = [], []
    for lean in (True, False):
        with kernels.using("packed"), profile() as prof:
            outs.append(_outputs(CachedLM(model, lean=lean))[0])
        products.append(sum(e.name == "mkldnn::_linear_pointwise" for e in prof.events()))
    assert products[0] == products[1] > 0                     # the same packed products on both paths
    for key in outs[1]:
        a, b = outs[0][key], outs[1][key]
        a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
        assert (a - b).abs().max() <= TOL, key


# ---------------------------------------------------------------- models that stay on transformers' path

def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=1024, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=None, eos_token_id=None)).eval()


def _sliding_mistral():
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                                            max_position_embeddings=128)).eval()


def _sliding_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=16, max_window_layers=1)).eval()


def _dynamic_rope_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)).eval()


@pytest.mark.parametrize("make", [_gpt2, _sliding_mistral, _sliding_qwen2, _dynamic_rope_llama])
def test_other_models_run_on_transformers_forward(make):
    model = make()
    assert not llama.supports(model) and llama.unsupported_reason(model)
    lm = CachedLM(model)
    lm.reset()
    assert lm.path == "transformers" and not isinstance(lm.cache, StaticCache)
    logits = lm.extend(PROMPT)
    with torch.no_grad():
        assert torch.allclose(logits, model(PROMPT[None]).logits[0], atol=TOL)
    with pytest.raises(ValueError, match="cannot run"):
        CachedLM(model, lean=True)


def test_greedy_output_of_an_unsupported_model_equals_generate():
    model = _gpt2()
    want = model.generate(PROMPT[None], max_new_tokens=20, do_sample=False,
                          attention_mask=torch.ones(1, PROMPT.numel()))[0, PROMPT.numel():].tolist()
    dec = TreeDecoder(model, copy.deepcopy(model), tree="2,2", policy="static")
    assert dec.generate(PROMPT, max_new_tokens=20).tokens == want
    assert dec.target.path == "transformers"


def test_transformers_path_on_request():
    model = _family("llama")
    assert CachedLM(model).path == "transformers"             # nothing chosen before the first reset
    lm = CachedLM(model)
    lm.reset()
    assert lm.path == "lean"
    with forward_path(False):
        lm.reset()
        assert lm.path == "transformers"
        forced = CachedLM(model, lean=True)
        forced.reset()
        assert forced.path == "lean"                          # an explicit choice wins
    lm.reset()
    assert lm.path == "lean"
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    lm = CachedLM(eager)
    lm.reset()
    assert lm.path == "transformers"                          # eager attention: the reference path
    with forward_path(False):
        dec = TreeDecoder(model, copy.deepcopy(model), tree="2,2", policy="static")
        dec.generate(PROMPT, max_new_tokens=4)
        assert dec.target.path == "transformers" and dec.drafter.lm.path == "transformers"


def test_q4_weights_keep_their_prefill_rule(q4_gguf_file, tmp_path, monkeypatch):
    """On torch's int4 kernel (`mcsd.forward.quant`) a long first block reads the dense weights where oneDNN runs
    bfloat16, every later block the int4 codes, as a call of the model would; the logits are transformers'
    path's."""
    from mcsd.drafting.pair import load_model
    from mcsd.forward import native, quant
    from mcsd.forward.attention import set_backend
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MCSD_NATIVE", "0")
    native.reset()
    monkeypatch.setattr(native, "_state", {})            # forgotten again when the test ends
    if not quant.kernel_available():
        pytest.skip("this torch has no CPU int4 kernel")
    model = load_model(str(q4_gguf_file), dtype="bfloat16", weights="q4")
    set_backend(model, "gqa")
    long_prompt = (torch.arange(quant.PREFILL_ROWS + 8) * 7 + 3) % 61
    real = torch.ops.aten._weight_int4pack_mm_for_cpu
    outs: dict[str, list] = {}
    for lean in (True, False):
        lm = CachedLM(model, lean=lean)
        lm.reset()
        rows: list[list[int]] = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(quant.torch.ops.aten, "_weight_int4pack_mm_for_cpu",
                       lambda *a: rows[-1].append(a[0].shape[0]) or real(*a), raising=False)
            rows.append([])
            first = lm.extend(long_prompt)
            rows.append([])
            second = lm.extend(torch.tensor([5, 6]))
        outs["lean" if lean else "transformers"] = [first, second, rows]
    lean, ref = outs["lean"], outs["transformers"]
    assert lean[2] == ref[2] and lean[2][1]                        # the same products on the codes, the second block's
    if kernels.switchable(torch.bfloat16, "cpu"):
        assert lean[2][0] == []                                    # the prompt on the dense weights
    for a, b in zip(lean[:2], ref[:2]):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert not quant._local.stack


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", FAMILIES)
def test_on_cuda_the_blocks_match_and_greedy_output_equals_generate(name):
    model = _family(name)
    draft = perturbed(model, 0.3).to("cuda")
    model.to("cuda")
    got, _ = _outputs(CachedLM(model, lean=True))
    want, _ = _outputs(CachedLM(model, lean=False))
    for key in want:
        a, b = (got[key][0], want[key][0]) if isinstance(got[key], tuple) else (got[key], want[key])
        assert (a - b).abs().max() <= TOL, key
    prompt = PROMPT[:6].cuda()
    reference = model.generate(prompt[None], max_new_tokens=30, do_sample=False,
                               attention_mask=torch.ones_like(prompt)[None])[0, 6:].tolist()
    dec = TreeDecoder(model, draft, tree="4,2,2", policy="static")
    assert dec.generate(prompt, max_new_tokens=30).tokens == reference and dec.target.path == "lean"
