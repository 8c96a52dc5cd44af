"""Loading pairs from disk, and refusing bad ones with a message that names the problem."""

import json
import shutil

import pytest
import torch
from conftest import tiny_llama, word_tokenizer

from mcsd import ModelLoadError, TokenizerMismatchError, load_model_pair
from mcsd.config import ConfigError
from mcsd.drafting.pair import load_model
from mcsd.loading.models import _cache_is_valid, _write_marker, check_tokenizers


def test_load_pair_from_directories(model_dirs, target):
    t, d, tok = load_model_pair(str(model_dirs / "target"), str(model_dirs / "draft"), dtype="float32")
    assert not t.training and not d.training
    assert t.dtype == torch.float32 and len(tok) == 64
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(t(ids).logits, target(ids).logits)


def test_dtype_is_applied(model_dirs):
    t, d, _ = load_model_pair(str(model_dirs / "target"), str(model_dirs / "draft"), dtype="bfloat16")
    assert t.dtype == d.dtype == torch.bfloat16


def test_tokenizer_vocabulary_mismatch_is_named(model_dirs, tmp_path):
    other = tmp_path / "draft"
    shutil.copytree(model_dirs / "draft", other)
    word_tokenizer(extra="zebra").save_pretrained(other)
    with pytest.raises(TokenizerMismatchError, match="first at token 'w63'|first at token 'zebra'"):
        load_model_pair(str(model_dirs / "target"), str(other), dtype="float32")


def test_special_token_mismatch_is_named():
    with pytest.raises(TokenizerMismatchError, match="eos_token_id is 1 for the target, 2 for the draft"):
        check_tokenizers(word_tokenizer(), word_tokenizer(eos="w02"))


def test_vocab_size_mismatch(model_dirs, tmp_path):
    small = tiny_llama(3, vocab=48)
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(TokenizerMismatchError, match="64 vs 48"):
        load_model_pair(str(model_dirs / "target"), str(tmp_path / "small"), dtype="float32")


@pytest.mark.parametrize("source, fragment", [
    ("./no/such/model", "model path does not exist"),
    ("/definitely/missing/model.gguf", "GGUF file not found"),
])
def test_missing_paths(source, fragment):
    with pytest.raises(ModelLoadError, match=fragment):
        load_model(source, "float32")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(str(tmp_path), "float32")


def test_corrupt_weights_are_reported(model_dirs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dirs / "target", broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="could not load target model from"):
        load_model(str(broken), "float32")


def test_unknown_dtype_and_device(model_dirs):
    with pytest.raises(ConfigError, match="unknown dtype 'float8'"):
        load_model(str(model_dirs / "target"), "float8")
    with pytest.raises(ConfigError, match="unknown device"):
        load_model(str(model_dirs / "target"), "float32", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            load_model(str(model_dirs / "target"), "float32", device="cuda")


def test_no_draft_for_a_non_preset_target(model_dirs):
    with pytest.raises(ConfigError, match="no draft given"):
        load_model_pair(str(model_dirs / "target"), None)


def test_converted_cache_detects_damage(model_dirs, tmp_path):
    cached = tmp_path / "cached"
    shutil.copytree(model_dirs / "target", cached)
    assert not _cache_is_valid(cached)                    # no completion marker: a partial conversion
    _write_marker(cached, source="test")
    assert _cache_is_valid(cached)
    weights = next(cached.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-10:] = b"\x00" * 10                                # flipped bytes at the end
    weights.write_bytes(bytes(data))
    assert not _cache_is_valid(cached)
    marker = json.loads((cached / "mcsd-complete.json").read_text())
    assert weights.name in marker["files"]
