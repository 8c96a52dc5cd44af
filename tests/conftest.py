"""Shared fixtures: tiny random Llama models and a word-level tokenizer, built in-process."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

# Tiny models are dominated by per-op overhead; extra threads only contend. (TreeDecoder's
# default thread choice reads OMP_NUM_THREADS too.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

VOCAB = 64


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's thread count (the native kernel's too) at `n` within, the suite's one after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_llama(seed: int, vocab: int = VOCAB, layers: int = 2, sharpness: float = 1.0, eos: int | None = None,
               hidden: int = 32):
    """A randomly initialised LlamaForCausalLM in float32 (GQA: 4 heads, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)      # sharper next-token distributions
    model.generation_config.eos_token_id = eos
    return model


def word_tokenizer(vocab: int = VOCAB, eos: str = "w01", extra: str | None = None):
    """A whitespace word-level tokenizer over tokens w00..w63 (w01 = EOS, w00 = unknown)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i:02d}": i for i in range(vocab)}
    if extra is not None:                          # a variant vocabulary for mismatch tests
        words[extra] = words.pop(f"w{vocab - 1:02d}")
    tok = Tokenizer(models.WordLevel(words, unk_token="w00"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w00", eos_token=eos)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty profile cache for one test (its tmp_path): nothing an earlier test measured is found."""
    monkeypatch.setattr("mcsd.costs.store.cache_dir", lambda: tmp_path)
    return tmp_path


def user_cache() -> Path:
    """The cache mcsd would use outside the tests: $MCSD_CACHE, else ~/.cache/mcsd."""
    return Path(os.environ.get("MCSD_CACHE") or Path.home() / ".cache" / "mcsd").expanduser()


USER_CACHE = user_cache()          # read before the session fixture below points $MCSD_CACHE elsewhere
LINKED = ("gguf", "models", "q4", "native")    # read-only inputs the tests may reuse; profiles never


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Everything the tests write goes to a temporary cache ($MCSD_CACHE for this process and the
    servers and commands it starts), never the user's. What the user's cache already holds of the
    read-only inputs (the downloaded GGUF, the converted preset, q4 codes, the native kernel) is
    linked in, so the embedded-model tests do not fetch and convert it again; its cost profiles are
    not (tests fix their costs: `fixed_costs`)."""
    folder = tmp_path_factory.mktemp("mcsd-cache")
    for sub in LINKED:
        source = USER_CACHE / sub
        if source.is_dir():
            (folder / sub).mkdir()
            for entry in source.iterdir():
                if not entry.name.startswith("."):
                    (folder / sub / entry.name).symlink_to(entry.resolve())
    mp = pytest.MonkeyPatch()
    mp.setenv("MCSD_CACHE", str(folder))
    # whether the machine looks quiet right now must not decide whether a test measures again
    # (a profile measured on a busy machine is kept); tests of that patch it themselves
    mp.setattr("mcsd.costs.timing.quiet_now", lambda threads_used=None: False)
    yield folder
    mp.undo()


# Made-up costs every profile a test measures gets (`fixed_costs`): a verify of n rows 10 + n ms, a draft
# level of width w 2 + 0.2 w ms, on torch's default path alone (no matmul path is chosen).
FIXED_VERIFY_MS = lambda n: 10.0 + n           # noqa: E731
FIXED_DRAFT_MS = lambda w: 2.0 + 0.2 * w       # noqa: E731


def fixed_measure(target, draft=None, sizes=None, prefix_len: int = 200, repeats: int = 20, draft_sizes=None,
                  busy_check=None, budget_s=None):
    """`mcsd.costs.timing.measure` with nothing timed: the same costs on every machine, however busy."""
    from mcsd.costs import timing
    from mcsd.costs.profile import DeviceProfile, _model_key, _model_name, machine_info
    sizes, draft_sizes = sizes or timing.DEFAULT_SIZES, draft_sizes or timing.DEFAULT_DRAFT_SIZES
    weight = target.get_input_embeddings().weight
    meta = {"target": _model_name(target), "draft": _model_name(draft) if draft is not None else None,
            "target_key": _model_key(target), "dtype": str(weight.dtype).replace("torch.", ""),
            "device": str(weight.device), "attention": getattr(target.config, "_attn_implementation", None),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": repeats,
            "host": machine_info(str(weight.device)), "spread": {}, "remeasured": [], "lowered": [],
            "provisional": None, "calibration_s": 0.0, "fixed_for_tests": True}
    return DeviceProfile(verify_ms={n: FIXED_VERIFY_MS(n) for n in sizes},
                         draft_ms={w: FIXED_DRAFT_MS(w) for w in draft_sizes} if draft is not None else {},
                         prefix_len=prefix_len, meta=meta)


@pytest.fixture(autouse=True)
def fixed_costs(request, monkeypatch):
    """No test's outcome may hang on how busy the machine is: every profile measured in a test has
    the costs of `fixed_measure` (so the same trees, and the plain weights on torch's default matmul
    path, wherever it runs). Tests of the measuring itself carry `@pytest.mark.measures`."""
    if request.node.get_closest_marker("measures") is None:
        monkeypatch.setattr("mcsd.costs.timing.measure", fixed_measure)
        monkeypatch.setattr("mcsd.decoding.round_prices.measure", lambda decoder, costs: dict(FIXED_ROUND_PRICES))


# Made-up figures of what a drafted round, a graft, an empty lookup and a round of the root and its graft cost beyond the
# forwards (`round_prices.measure`), and what a drafted round was worth (none: the draft gate starts open).
FIXED_ROUND_PRICES = {"round_ms": 0.4, "round_ms_sampled": 0.6, "graft_ms": 0.05, "lookup_ms": 0.02,
                      "context_round_ms": 0.3, "context_round_ms_sampled": 0.5,
                      "draft_value": 0.0, "draft_value_sampled": 0.0}


def write_tiny_gguf(path, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    q4: bool = False):
    """A random Llama GGUF with a byte-level tokenizer over the characters '!'..'`' (one token each):
    float32 tensors, or with `q4` the decoder layers' linear weights as Q4_1 blocks and the LM head
    (`output`) as Q8_0 blocks, as llama.cpp's Q4_1 files hold them."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(33 + i) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
                       f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
                       f"blk.{i}.ffn_gate.weight": (2 * hidden, hidden), f"blk.{i}.ffn_up.weight": (2 * hidden, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, 2 * hidden)})
    for name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32) * 0.1
        if q4 and name.startswith("blk.") and len(shape) == 2:
            qtype = gguf.GGMLQuantizationType.Q4_1
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        elif q4 and name == "output.weight":
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def q4_gguf_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-q4") / "tiny-q4_1.gguf", q4=True)


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def random_draft():
    return tiny_llama(1, layers=1)


SHARED_MODELS = ("target", "random_draft")


def _state(model) -> dict:
    """What a test must leave as it found it in a shared model: its parameters (values, dtype, none let
    go), and no prepacked copies or 4-bit codes attached to it."""
    from mcsd.forward import kernels, quant
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()},
            "packed": kernels.is_packed(model), "released": kernels.released(model), "q4": quant.attached(model),
            "forwards": {name for name, m in model.named_modules() if "forward" in m.__dict__}}


@pytest.fixture(autouse=True)
def shared_models_untouched(request):
    """The session's shared models are never changed by a test (packed, let go, cast, attached to codes,
    trained): a test that needs to change one makes its own (`tiny_llama`)."""
    models = {name: request.getfixturevalue(name) for name in SHARED_MODELS if name in request.fixturenames}
    before = {name: _state(model) for name, model in models.items()}
    yield
    for name, model in models.items():
        after = _state(model)
        same = after["params"].keys() == before[name]["params"].keys() and all(
            a.dtype == b.dtype and a.device == b.device and (a.is_meta or torch.equal(a, b))
            for a, b in zip(after["params"].values(), before[name]["params"].values()))
        assert same and {k: v for k, v in after.items() if k != "params"} == \
            {k: v for k, v in before[name].items() if k != "params"}, f"this test changed the shared {name!r} model"


@pytest.fixture(scope="session")
def tokenizer():
    return word_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, target, random_draft, tokenizer):
    """Target and draft saved to disk with the same tokenizer, for loading and CLI tests."""
    root = tmp_path_factory.mktemp("models")
    for name, model in (("target", target), ("draft", random_draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def perturbed(model, scale, seed=7):
    """A copy of `model` with Gaussian noise on every weight: accepts some drafts, rejects others."""
    import copy
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale * p.std())
    return out


def pooled_chi_square_p(counts, exact, n):
    """p-value of a chi-square test of `counts` against `exact` probabilities for n draws,
    cells expected fewer than 5 times pooled into one."""
    from scipy.stats import chisquare
    big = exact * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([exact[big], exact[~big].sum()[None]]) * n
    keep = expected > 0
    return chisquare(observed[keep].numpy(), expected[keep].numpy() * observed.sum().item()
                     / expected[keep].sum().item()).pvalue


def exact_two_token_probs(model, prompt, sampling, vocab):
    """P(first two new tokens = (a, b)) under plain sampling from `model`, by enumeration: (vocab, vocab)."""
    from mcsd.core.sampling import logits_to_probs
    with torch.no_grad():
        p0 = logits_to_probs(model(prompt[None]).logits[0, -1], sampling)
        rows = torch.stack([torch.cat([prompt, torch.tensor([a])]) for a in range(vocab)])
        p1 = logits_to_probs(model(rows).logits[:, -1], sampling)
    return p0[:, None] * p1


def assert_follows_target(decoder, target, sampling, n=1500, prompt=(1, 2, 3)):
    """Chi-square test (reject at p < 0.001) of n seeded generations' first two tokens against
    exact enumeration of the target's distribution; sparse cells are pooled. Returns the counts."""
    prompt = torch.tensor(prompt)
    vocab = target.config.vocab_size
    exact = exact_two_token_probs(target, prompt, sampling, vocab).flatten()
    counts = torch.zeros(vocab * vocab)
    accepted = 0
    for seed in range(n):
        out = decoder.generate(prompt, max_new_tokens=3, temperature=sampling.temperature, top_k=sampling.top_k,
                               top_p=sampling.top_p, seed=seed)
        counts[out.tokens[0] * vocab + out.tokens[1]] += 1
        accepted += out.stats.accepted_per_round[0] > 0
    assert counts[exact == 0].sum() == 0                      # tokens outside top-k / top-p never appear
    p = pooled_chi_square_p(counts, exact, n)
    assert p > 1e-3, f"chi-square p = {p:.2e}"
    return accepted


def require_native(tmp_path_factory):
    """For a module's autouse fixture (`yield from` it): one private cache for the module (the native
    library is built there once) and the native kernel required, the module skipped where it does
    not run; afterwards the environment and the library's state (its instruction set) as before."""
    from mcsd.forward import native, quant
    mp = pytest.MonkeyPatch()
    mp.setenv("MCSD_CACHE", str(tmp_path_factory.mktemp("cache")))
    mp.setenv("MCSD_NATIVE", "1")
    native.reset()
    if quant.kernel_name() != "native":
        mp.undo()
        native.reset()
        pytest.skip(f"the native q4 kernel does not run here ({native.reason()})")
    yield
    mp.undo()
    native.reset()
