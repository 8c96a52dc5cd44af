"""Trace collection and decision-model training end to end on tiny models, then the learned policy using them."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mcsd import TreeDecoder
from mcsd.core.tree import TreeTopology
from mcsd.drafting.policies import AcceptanceModel, LearnedPolicy
from mcsd.drafting.policies.acceptance import FEATURE_NAMES
from mcsd.train import decision_models as train_decision_models
from mcsd.train import traces as collect_traces


def _prompts(path: Path):
    rows = [{"question_id": q, "category": cat, "turns": [" ".join(f"w{(q * 7 + i) % 60 + 2:02d}" for i in range(6))]}
            for q, cat in [(1, "qa"), (2, "rag"), (3, "writing"), (4, "qa"), (5, "qa"), (10, "rag")]]
    path.write_text("\n".join(json.dumps(r) for r in rows))


def collect_fit_and_heldout(model_dirs, tmp_path, target, options: list[str]):
    """Traces of a perturbed copy of the target drafting for it, on the fitting and held-out prompts
    (-> tmp_path/fit, tmp_path/held). Returns the draft and the arguments common to both runs."""
    from conftest import word_tokenizer
    from test_equivalence import perturbed
    noisy = perturbed(target, 0.3)
    noisy.save_pretrained(tmp_path / "noisy")
    word_tokenizer().save_pretrained(tmp_path / "noisy")
    _prompts(tmp_path / "q.jsonl")
    common = ["--target", str(model_dirs / "target"), "--draft", str(tmp_path / "noisy"), "--dtype", "float32",
              "--prompts", str(tmp_path / "q.jsonl"), "--no-chat", "--max-new-tokens", "24", *options]
    assert collect_traces.main(common + ["--split", "fit", "--out", str(tmp_path / "fit")]) == 0
    assert collect_traces.main(common + ["--split", "heldout", "--out", str(tmp_path / "held")]) == 0
    return noisy, common


def test_the_cheaper_model_ships_unless_the_dearer_one_predicts_better():
    results = {"logistic": {"brier": 0.1553, "call_ms": 0.013}, "gbt": {"brier": 0.1551, "call_ms": 0.301}}
    assert train_decision_models.choose(results, 0.01) == "logistic"          # 0.13% better: not worth 20x
    assert train_decision_models.choose(results, 0.0) == "gbt"                # the lowest Brier, whatever it costs
    results["gbt"]["brier"] = 0.140
    assert train_decision_models.choose(results, 0.01) == "gbt"               # 10% better: worth its cost


def test_collect_train_and_use(model_dirs, tmp_path, target):
    noisy, common = collect_fit_and_heldout(model_dirs, tmp_path, target, ["--tree", "3,2,1", "--shard-size", "2"])
    manifest = json.loads((tmp_path / "fit" / "manifest.json").read_text())
    assert sorted(manifest["done"]) == [1, 2, 3, 4] and manifest["features"] == list(FEATURE_NAMES)
    data = train_decision_models.load_traces(tmp_path / "fit")
    n = len(data["label_greedy"])
    assert data["features"].shape == (n, len(FEATURE_NAMES)) and n > 50
    assert set(np.unique(data["label_greedy"])) == {0, 1}          # both accepted and rejected nodes
    assert (data["parent_row"] < np.arange(n)).all()               # parents come first
    # resuming does nothing new
    assert collect_traces.main(common + ["--split", "fit", "--out", str(tmp_path / "fit")]) == 0
    assert len(json.loads((tmp_path / "fit" / "manifest.json").read_text())["shards"]) == len(manifest["shards"])

    out = tmp_path / "dm"
    assert train_decision_models.main(["--fit", str(tmp_path / "fit"), "--heldout", str(tmp_path / "held"),
                                       "--out", str(out)]) == 0
    card = json.loads((out / "acceptance-card.json").read_text())
    assert card["chosen"] in ("logistic", "gbt") and "auc" in card["metrics_heldout"]["logistic"]
    assert (out / "acceptance-calibration.png").stat().st_size > 0
    model = AcceptanceModel.load(out / "acceptance.json")
    # stratified selection, as the benchmark picks prompts: one per category group
    assert collect_traces.main(common + ["--split", "fit", "--per-group", "1", "--out", str(tmp_path / "strat")]) == 0
    assert sorted(json.loads((tmp_path / "strat" / "manifest.json").read_text())["done"]) == [1, 2, 3]
    with pytest.raises(SystemExit, match="no effect with --no-chat"):
        collect_traces.main(common + ["--system", "Be brief.", "--out", str(tmp_path / "sys")])
    prompt = torch.tensor([3, 17, 42, 5, 9, 11])
    ref = TreeDecoder(target, None, attention="sdpa").generate_baseline(prompt, max_new_tokens=40).tokens
    policy = LearnedPolicy(TreeTopology.from_spec("3,2,1"), model=model)
    assert TreeDecoder(target, noisy, policy=policy, attention="sdpa").generate(prompt, max_new_tokens=40).tokens == ref
