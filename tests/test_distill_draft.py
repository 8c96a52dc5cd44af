"""tools/distill_draft.py end to end on a tiny target: a draft built on the target's hidden-state basis,
trained on generation runs with and without stored hidden states, exported as a plain causal LM with
its basis, continued with --init, and the refusals."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, word_tokenizer

from mcsd.train import data as td
from mcsd.train import distill as dd
from mcsd.train import engine


def _store_run(data_dir: Path, target, run: str, n_prompts: int, seed: int, store_hidden: bool):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (4,), generator=g).tolist() for _ in range(n_prompts)]
    outs = engine.generate_batch(target, prompts, max_new_tokens=24, eos_ids=(1,), pad_id=0, topk=4,
                                 store_hidden=store_hidden)
    split = "heldout" if run == "held" else "fit"
    td.start_run(data_dir, "runs", run, {"split": split, "store_hidden": store_hidden})
    records = [{"key": f"{run}-{i}/0", "prompt_id": f"{run}-{i}", "category": "qa",
                "prompt": torch.tensor(p, dtype=torch.int32), **o} for i, (p, o) in enumerate(zip(prompts, outs))]
    td.save_shard(data_dir, "runs", run, records,
                  {"n_sequences": len(records), "n_tokens": sum(len(r["response"]) for r in records)})
    return sum(len(r["response"]) for r in records)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))   # checkpoints stay in the test's folder
    target = tiny_llama(0, hidden=48)
    target.save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    data = tmp_path / "data"
    n_hidden = _store_run(data, target, "with-hidden", 12, seed=1, store_hidden=True)
    n_plain = _store_run(data, target, "plain", 6, seed=2, store_hidden=False)
    _store_run(data, target, "held", 4, seed=3, store_hidden=False)
    common = ["--target", str(tmp_path / "target"), "--data-dir", str(data), "--heldout-run", "held",
              "--hidden-size", "16", "--num-hidden-layers", "1", "--num-attention-heads", "2",
              "--num-key-value-heads", "1", "--intermediate-size", "32", "--tokens-per-batch", "256",
              "--max-len", "64", "--threads", "1", "--warmup-steps", "1", "--negatives", "8"]
    return tmp_path, common, target, n_hidden, n_plain


def test_hidden_basis_keeps_the_directions_the_hidden_states_use():
    g = torch.Generator().manual_seed(0)
    # hidden states in a 3-dimensional subspace of a 10-dimensional space
    directions = torch.linalg.qr(torch.randn(10, 3, generator=g))[0].T  # (3, 10)
    hidden = torch.randn(500, 3, generator=g) @ directions
    basis = dd.hidden_basis(hidden, 3)
    assert basis.shape == (3, 10)
    torch.testing.assert_close(basis @ basis.T, torch.eye(3), atol=1e-5, rtol=0)
    # projecting on the basis and back loses nothing
    torch.testing.assert_close(hidden @ basis.T @ basis, hidden, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="at least 3"):
        dd.hidden_basis(hidden[:2], 3)


def test_basis_top1_is_exact_on_a_full_basis_and_drops_on_a_poor_one():
    g = torch.Generator().manual_seed(2)
    E, hidden = torch.randn(40, 8, generator=g), torch.randn(100, 8, generator=g)
    top1 = (hidden @ E.T).argmax(-1)
    assert dd.basis_top1(E, torch.eye(8), hidden, top1) == 1.0
    assert dd.basis_top1(E, torch.eye(8)[:1], hidden, top1) < 0.5


def test_hidden_loss_is_zero_at_the_projection_and_scale_free():
    g = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(10, 4, generator=g))[0].T  # (4, 10)
    target_hidden = torch.randn(6, 10, generator=g)
    goal = target_hidden @ basis.T
    assert dd.hidden_loss(goal, target_hidden, basis).item() == pytest.approx(0.0, abs=1e-10)
    assert dd.hidden_loss(torch.zeros(6, 4), target_hidden, basis).item() == pytest.approx(1.0)
    assert dd.hidden_loss(torch.zeros(6, 4), 7 * target_hidden, basis).item() == pytest.approx(1.0)


def test_collate_places_hidden_states_of_the_sequences_that_have_them():
    def seq(R, hidden):
        return {"input_ids": torch.arange(R + 2), "label_start": 2, "topk_ids": torch.zeros(R, 2, dtype=torch.long),
                "topk_probs": torch.ones(R, 2), "next_ids": torch.arange(R),
                "hidden": torch.full((R, 5), float(R)) if hidden else None}
    batch = dd.collate([seq(3, True), seq(2, False), seq(4, True)], pad_id=0)
    assert batch["rows"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert batch["hidden_at"].tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert batch["hidden"][:, 0].tolist() == [3, 3, 3, 4, 4, 4, 4]
    assert "hidden" not in dd.collate([seq(2, False)], pad_id=0)


def test_train_export_and_continue(setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_path, common, target, n_hidden, n_plain = setup
    out = tmp_path / "draft"
    dd.main(common + ["--runs", "with-hidden", "plain", "--out", str(out), "--max-steps", "4",
                      "--basis-positions", "64"])
    card = json.loads((out / "card.json").read_text())
    assert card["training"]["response_tokens"] == n_hidden + n_plain
    assert card["training"]["positions_with_target_hidden"] == n_hidden
    assert card["training"]["steps"] == 4
    kept = card["training"]["basis_check"]["target_top1_kept"]
    assert set(kept) == {"this draft's basis", "top singular directions of the embedding"}
    assert all(0.0 <= v <= 1.0 for v in kept.values())
    assert [e["step"] for e in card["training"]["evals"]] == [0, 4]
    assert "hidden states" in card["architecture"]["init"] and "hidden state" in card["training"]["labels"]
    assert card["command"].startswith("python tools/distill_draft.py ")

    draft = AutoModelForCausalLM.from_pretrained(out)           # a plain causal LM, as HF assisted decoding needs
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(tmp_path / "target").get_vocab()
    assert draft.config.hidden_size == 16 and draft.config.vocab_size == target.config.vocab_size
    basis = dd.load_basis(out / dd.BASIS_FILE)
    assert basis.shape == (16, 48)
    torch.testing.assert_close(basis @ basis.T, torch.eye(16), atol=1e-4, rtol=0)

    # going on from the exported draft keeps its basis and trains further
    more = tmp_path / "more"
    dd.main(common + ["--runs", "with-hidden", "plain", "--out", str(more), "--max-steps", "2",
                      "--init", str(out), "--ckpt-dir", str(tmp_path / "ckpt2")])
    assert torch.equal(dd.load_basis(more / dd.BASIS_FILE), basis)
    card = json.loads((more / "card.json").read_text())
    assert card["training"]["continued_from"]["model"] == str(out)
    a = AutoModelForCausalLM.from_pretrained(more).model.embed_tokens.weight
    assert not torch.equal(a, draft.model.embed_tokens.weight)


def test_refusals(setup):
    tmp_path, common, _, _, _ = setup
    with pytest.raises(SystemExit, match="no run given has stored hidden states"):
        dd.main(common + ["--runs", "plain", "--out", str(tmp_path / "x"), "--max-steps", "1"])
    with pytest.raises(SystemExit, match="held-out"):
        dd.main(common + ["--runs", "held", "--out", str(tmp_path / "x"), "--max-steps", "1"])
    # an embedding-basis draft needs no hidden states; it ships its basis too
    old = tmp_path / "old"
    dd.main(common + ["--runs", "plain", "--out", str(old), "--max-steps", "1", "--embed-basis", "embedding",
                      "--hidden-weight", "0", "--ckpt-dir", str(tmp_path / "ckpt-old")])
    assert "singular directions of the target's embedding" in json.loads((old / "card.json").read_text())[
        "architecture"]["init"]
    # a draft saved without its basis cannot go on with the hidden-state term
    (old / dd.BASIS_FILE).unlink()
    with pytest.raises(SystemExit, match="--hidden-weight 0"):
        dd.main(common + ["--runs", "with-hidden", "--out", str(tmp_path / "y"), "--max-steps", "1",
                          "--init", str(old), "--ckpt-dir", str(tmp_path / "ckpt-y")])
    with pytest.raises(SystemExit):
        dd.main(common + ["--runs", "plain", "--out", str(tmp_path / "z"), "--embed-basis", "nonsense"])


def test_select_layers_renumbers_the_kept_layers():
    state = {"model.embed_tokens.weight": torch.zeros(1), "model.norm.weight": torch.ones(1),
             **{f"model.layers.{i}.mlp.up_proj.weight": torch.full((1,), float(i)) for i in range(4)}}
    kept = dd.select_layers(state, [0, 1, 3], 4)
    assert sorted(k for k in kept if k.startswith("model.layers.")) == [
        f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)]
    assert [kept[f"model.layers.{i}.mlp.up_proj.weight"].item() for i in range(3)] == [0.0, 1.0, 3.0]
    assert kept["model.norm.weight"] is state["model.norm.weight"]
    for bad in ([], [0, 0], [4], [-1]):
        with pytest.raises(ValueError, match="distinct indices in 0..3"):
            dd.select_layers(state, bad, 4)


def test_shallower_draft_from_a_deeper_one(setup):
    from transformers import AutoModelForCausalLM

    tmp_path, common, _, _, _ = setup
    deep = tmp_path / "deep"
    dd.main(common + ["--runs", "with-hidden", "--out", str(deep), "--max-steps", "2", "--basis-positions", "64",
                      "--num-hidden-layers", "2", "--ckpt-dir", str(tmp_path / "ckpt-deep")])
    shallow_args = common + ["--runs", "with-hidden", "--init", str(deep), "--num-hidden-layers", "1"]
    with pytest.raises(SystemExit, match="pass --init-layers"):
        dd.main(shallow_args + ["--out", str(tmp_path / "x"), "--ckpt-dir", str(tmp_path / "ckpt-x")])
    with pytest.raises(SystemExit, match="--init-layers: layers to keep"):
        dd.main(shallow_args + ["--out", str(tmp_path / "x"), "--init-layers", "2",
                                "--ckpt-dir", str(tmp_path / "ckpt-x")])
    shallow = tmp_path / "shallow"
    dd.main(shallow_args + ["--out", str(shallow), "--init-layers", "1", "--max-steps", "0",
                            "--ckpt-dir", str(tmp_path / "ckpt-shallow")])
    a, b = (AutoModelForCausalLM.from_pretrained(p) for p in (deep, shallow))
    assert b.config.num_hidden_layers == 1
    for name, value in b.model.layers[0].state_dict().items():
        assert torch.equal(value, a.model.layers[1].state_dict()[name]), name
    assert torch.equal(b.model.embed_tokens.weight, a.model.embed_tokens.weight)
    assert torch.equal(dd.load_basis(shallow / dd.BASIS_FILE), dd.load_basis(deep / dd.BASIS_FILE))
    assert "keeping its layers [1]" in json.loads((shallow / "card.json").read_text())["architecture"]["init"]
