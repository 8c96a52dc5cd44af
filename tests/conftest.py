"""Shared fixtures: tiny random Llama models and a word-level tokenizer, built in-process."""

from __future__ import annotations

import os

import pytest
import torch

# Tiny models are dominated by per-op overhead; extra threads only contend. (TreeDecoder's
# default thread choice reads OMP_NUM_THREADS too.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

VOCAB = 64


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


@pytest.fixture(scope="session", autouse=True)
def private_profile_cache(tmp_path_factory):
    """Cost profiles measured by tests go to a temporary folder, never the user's cache."""
    mp = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("mcsd-cache")
    mp.setattr("mcsd.costs.store.cache_dir", lambda: folder)
    # whether the machine looks quiet right now must not decide whether a test measures again
    # (a profile measured on a busy machine is kept); tests of that patch it themselves
    mp.setattr("mcsd.costs.timing.quiet_now", lambda threads_used=None: False)
    yield folder
    mp.undo()


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
