"""tools/train_feature_drafter.py end to end on a tiny target: data from the data engine's generation
stage (hidden states stored as it generates), prompt subsets, going on from a saved head, and the card."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from mcsd.drafting.feature_draft import FeatureHead
from mcsd.train import data as td
from mcsd.train import engine
from mcsd.train import feature_head as tfd


def _store_run(data_dir: Path, target, run: str, n_prompts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (4,), generator=g).tolist() for _ in range(n_prompts)]
    outs = engine.generate_batch(target, prompts, max_new_tokens=20, eos_ids=(1,), pad_id=0, topk=4,
                                 store_hidden=True)
    td.start_run(data_dir, "runs", run, {"split": "fit" if run == "fit" else "heldout", "store_hidden": True})
    records = [{"key": f"{run}-{i}/0", "prompt_id": f"{run}-{i}", "category": "qa",
                "prompt": torch.tensor(p, dtype=torch.int32), **o} for i, (p, o) in enumerate(zip(prompts, outs))]
    td.save_shard(data_dir, "runs", run, records,
                  {"n_sequences": len(records), "n_tokens": sum(len(r["response"]) for r in records)})
    return sum(len(r["response"]) for r in records)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))   # checkpoints stay in the test's folder
    target = tiny_llama(0)
    target.save_pretrained(tmp_path / "target")
    data = tmp_path / "data"
    n_fit = _store_run(data, target, "fit", 10, seed=1)
    _store_run(data, target, "held", 3, seed=2)
    common = ["--target", str(tmp_path / "target"), "--data-dir", str(data), "--runs", "fit",
              "--heldout-run", "held", "--window", "16", "--sub-vocab", "40", "--max-updates", "3", "--threads", "1"]
    return tmp_path, common, n_fit


def test_subset_then_continue_with_a_data_size_curve(setup):
    tmp_path, common, n_fit = setup
    small, full = tmp_path / "small-head", tmp_path / "full-head"
    assert tfd.main(common + ["--subset", "0.5", "--out", str(small)]) == 0
    card = json.loads((small / "card.json").read_text())
    assert card["data"]["subset"] == 0.5 and card["data"]["responses"] == 5
    assert 0 < card["data"]["positions"] < n_fit
    assert card["data"]["runs"]["fit"]["tokens"] == n_fit                  # provenance from the manifest
    assert [m["step"] for m in card["heldout_agreement"]] == [1, 2, 3]

    assert tfd.main(common + ["--init", str(small), "--out", str(full), "--curve-from", str(small)]) == 0
    card = json.loads((full / "card.json").read_text())
    assert card["continued_from"]["data"]["subset"] == 0.5
    assert card["data"]["positions"] == n_fit
    assert [p["positions"] for p in card["data_size_curve"]] == sorted(p["positions"] for p in card["data_size_curve"])
    # the subset head counts twice here: as --curve-from and as the --init head
    assert [p["head"] for p in card["data_size_curve"]] == [str(small), "--init head", "this head"]
    # the continued head kept its starting point's architecture and sub-vocabulary
    a, b = FeatureHead.load(small), FeatureHead.load(full)
    assert a.cfg == b.cfg and torch.equal(a.vocab_ids, b.vocab_ids)
    assert not torch.equal(a.reduce.weight, b.reduce.weight)              # and went on training


def test_init_from_a_head_for_another_target_is_refused(setup):
    tmp_path, common, _ = setup
    other = tiny_llama(0, hidden=48)
    other.save_pretrained(tmp_path / "other")
    head_dir = tmp_path / "head"
    assert tfd.main(common + ["--out", str(head_dir)]) == 0
    args = common.copy()
    args[args.index("--target") + 1] = str(tmp_path / "other")
    with pytest.raises(SystemExit, match="another target"):
        tfd.main(args + ["--init", str(head_dir), "--out", str(tmp_path / "x")])


def test_v2_head_end_to_end_from_the_teacher_stage(setup):
    """teacher --store-layers, then --feature-layers trains and saves a v2 head; runs without the
    layers are named."""
    tmp_path, common, _ = setup
    with pytest.raises(SystemExit, match="--store-layers 1,2"):
        tfd.main(common + ["--feature-layers", "1,2", "--out", str(tmp_path / "x")])
    data = Path(common[common.index("--data-dir") + 1])
    from conftest import word_tokenizer
    word_tokenizer().save_pretrained(tmp_path / "target")       # the teacher stage pads with its tokenizer
    for run in ("fit", "held"):
        engine.main(["--target", str(tmp_path / "target"), "--data-dir", str(data), "--threads", "1",
                     "teacher", run, "--store-layers", "1,2"])
    head_dir = tmp_path / "v2-head"
    assert tfd.main(common + ["--feature-layers", "1,2", "--out", str(head_dir)]) == 0
    head = FeatureHead.load(head_dir)
    assert head.cfg.feature_layers == (1, 2) and head.fuse.weight.shape == (32, 64)
    with pytest.raises(SystemExit, match="stores target layers \\[1, 2\\], not \\[0, 2\\]"):
        tfd.main(common + ["--feature-layers", "0,2", "--out", str(tmp_path / "y")])


def test_wider_soft_labels_are_stored_recorded_and_trained_on(setup):
    """teacher --topk 16 keeps the target's 16 likeliest tokens a position (the manifest says so), and the
    trainer's loss takes them as they come."""
    tmp_path, common, _ = setup
    data = Path(common[common.index("--data-dir") + 1])
    from conftest import word_tokenizer

    from mcsd.train.data import load_examples, read_manifest
    word_tokenizer().save_pretrained(tmp_path / "target")
    for run in ("fit", "held"):
        engine.main(["--target", str(tmp_path / "target"), "--data-dir", str(data), "--threads", "1",
                     "teacher", run, "--store-layers", "1,2", "--topk", "16"])
    assert read_manifest(data)["teacher"]["fit"]["settings"]["topk"] == 16
    example = load_examples(data, ["fit"], with_hidden=True)[0]
    assert example["topk_ids"].shape[1] == 16 and example["topk_probs"].shape[1] == 16
    assert tfd.main(common + ["--feature-layers", "1,2", "--out", str(tmp_path / "wide")]) == 0


def test_v1_head_widened_to_v2_goes_on_from_where_it_was(setup):
    """--init V1 --feature-layers 1,-1: a v2 head that starts out drafting as the v1 head did (with a zero
    learning rate its held-out agreement is the v1 head's, to the position), then trains its fusion."""
    tmp_path, common, _ = setup
    data = Path(common[common.index("--data-dir") + 1])
    from conftest import word_tokenizer
    word_tokenizer().save_pretrained(tmp_path / "target")
    for run in ("fit", "held"):
        engine.main(["--target", str(tmp_path / "target"), "--data-dir", str(data), "--threads", "1",
                     "teacher", run, "--store-layers", "1,-1"])
    v1 = tmp_path / "v1"
    assert tfd.main(common + ["--out", str(v1)]) == 0
    same = tmp_path / "same"
    assert tfd.main(common + ["--init", str(v1), "--feature-layers", "1,-1", "--lr", "0", "--out", str(same)]) == 0
    before = json.loads((v1 / "card.json").read_text())["heldout_agreement"]
    after = json.loads((same / "card.json").read_text())["heldout_agreement"]
    assert after == before and before[0]["positions"] > 0
    assert FeatureHead.load(same).cfg.feature_layers == (1, -1)

    trained = tmp_path / "trained"
    assert tfd.main(common + ["--init", str(v1), "--feature-layers", "1,-1", "--out", str(trained)]) == 0
    fuse = FeatureHead.load(trained).fuse.weight
    assert fuse[:, :32].abs().sum() > 0                                     # it learned to read layer 1 too
    with pytest.raises(SystemExit, match="include -1"):
        tfd.main(common + ["--init", str(v1), "--feature-layers", "1,2", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="reads target layers \\[1, -1\\], not \\[1, 2\\]"):
        tfd.main(common + ["--init", str(trained), "--feature-layers", "1,2", "--out", str(tmp_path / "y")])


def test_bfloat16_autocast_trains_and_says_so_on_the_card(setup):
    tmp_path, common, _ = setup
    out = tmp_path / "bf16-head"
    start = tmp_path / "start"
    assert tfd.main(common + ["--max-updates", "0", "--time-budget-min", "0", "--out", str(start)]) == 0
    assert tfd.main(common + ["--init", str(start), "--bf16", "--out", str(out)]) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["training"]["autocast"] == "bfloat16" and card["training"]["updates"] == 3
    head = FeatureHead.load(out)
    assert head.reduce.weight.dtype == torch.float32                      # master weights stay float32
    assert not torch.equal(head.reduce.weight, FeatureHead.load(start).reduce.weight)


def _store_run_in_shards(data_dir: Path, target, run: str, n_prompts: int, seed: int, per_shard: int):
    """Like _store_run, a few records per shard."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (4,), generator=g).tolist() for _ in range(n_prompts)]
    outs = engine.generate_batch(target, prompts, max_new_tokens=20, eos_ids=(1,), pad_id=0, topk=4,
                                 store_hidden=True)
    td.start_run(data_dir, "runs", run, {"split": "fit", "store_hidden": True})
    records = [{"key": f"{run}-{i}/0", "prompt_id": f"{run}-{i}", "category": "qa",
                "prompt": torch.tensor(p, dtype=torch.int32), **o} for i, (p, o) in enumerate(zip(prompts, outs))]
    for s in range(0, len(records), per_shard):
        part = records[s:s + per_shard]
        td.save_shard(data_dir, "runs", run, part,
                      {"n_sequences": len(part), "n_tokens": sum(len(r["response"]) for r in part)})
    return sum(len(r["response"]) for r in records)


def _same_examples(a: list[dict], b: list[dict]):
    assert sorted(e["key"] for e in a) == sorted(e["key"] for e in b)
    by_key = {e["key"]: e for e in b}
    for e in a:
        f = by_key[e["key"]]
        assert e.keys() == f.keys()
        assert all(torch.equal(e[k], f[k]) for k in e if isinstance(e[k], torch.Tensor))


def test_sharded_examples_cover_every_record_once_per_epoch(setup):
    tmp_path, common, _ = setup
    data = Path(common[common.index("--data-dir") + 1])
    n = _store_run_in_shards(data, tiny_llama(0), "many", 12, seed=3, per_shard=2)
    stream = td.ShardedExamples(data, ["many", "fit"], with_hidden=True)
    whole = td.load_examples(data, ["many", "fit"], with_hidden=True)
    assert stream.responses == len(whole) == 22
    assert stream.positions == sum(len(e["response"]) for e in whole) and stream.positions > n
    assert len(stream.units) == 7
    orders = []
    for epoch in (0, 1):
        chunks = stream.chunks(stream.positions // 3, epoch=epoch)
        assert 3 <= len(chunks) <= 4 and sorted(u for c in chunks for u in c) == sorted(stream.units)
        _same_examples([e for c in chunks for e in stream.load(c)], whole)
        orders.append([u for c in chunks for u in c])
    assert orders[0] != orders[1]                                     # a new order every epoch
    assert stream.chunks(stream.positions // 3, epoch=1) == stream.chunks(stream.positions // 3, epoch=1)


def test_teacher_labels_are_read_shard_by_shard_and_hold_the_final_state_once(setup):
    tmp_path, common, _ = setup
    data = Path(common[common.index("--data-dir") + 1])
    from conftest import word_tokenizer
    word_tokenizer().save_pretrained(tmp_path / "target")
    engine.main(["--target", str(tmp_path / "target"), "--data-dir", str(data), "--threads", "1",
                 "teacher", "fit", "--store-layers", "1,-1"])
    stream = td.ShardedExamples(data, ["fit"], with_hidden=True)
    assert all(section == "teacher" for section, _, _ in stream.units)
    streamed = stream.load(stream.units)
    _same_examples(streamed, td.load_examples(data, ["fit"], with_hidden=True))
    for e in streamed:
        assert e["hidden"].untyped_storage().data_ptr() == e["layers"].untyped_storage().data_ptr()
        assert torch.equal(e["hidden"], e["layers"][:, 32:])


def test_runs_sharing_keys_keep_their_own_labels(setup):
    """Two runs may answer the same prompt under the same key; each record is labelled by its own run's
    teacher pass."""
    tmp_path, common, _ = setup
    data = Path(common[common.index("--data-dir") + 1])
    target = tiny_llama(0)                                      # the fixture stored run "fit", keys fit-0/0 ...
    from conftest import word_tokenizer
    word_tokenizer().save_pretrained(tmp_path / "target")
    # a second run with the same keys and other (longer) responses
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 64, (6,), generator=g).tolist() for _ in range(10)]
    outs = engine.generate_batch(target, prompts, max_new_tokens=30, eos_ids=(), pad_id=0, topk=4)
    td.start_run(data, "runs", "again", {"split": "fit"})
    td.save_shard(data, "runs", "again", [{"key": f"fit-{i}/0", "prompt_id": f"fit-{i}", "category": "qa",
                                           "prompt": torch.tensor(p, dtype=torch.int32), **o}
                                          for i, (p, o) in enumerate(zip(prompts, outs))], {"n_sequences": 10})
    for run in ("fit", "again"):
        engine.main(["--target", str(tmp_path / "target"), "--data-dir", str(data), "--threads", "1",
                     "teacher", run, "--store-layers", "1,-1"])
    stream = td.ShardedExamples(data, ["fit", "again"], with_hidden=True)
    streamed = stream.load(stream.units)
    assert len(streamed) == 20
    for e in streamed:
        assert len(e["response"]) == len(e["topk_ids"]) == len(e["hidden"]) == len(e["layers"])
    assert sorted(len(e["response"]) for e in streamed) == sorted(
        len(e["response"]) for e in td.load_examples(data, ["fit", "again"], with_hidden=True))


def test_streamed_training_reads_each_chunk_in_turn(setup, monkeypatch):
    tmp_path, common, n_fit = setup
    loads = []
    original = td.ShardedExamples.load

    def spy(self, units):
        loads.append(list(units))
        return original(self, units)

    monkeypatch.setattr(td.ShardedExamples, "load", spy)
    data = Path(common[common.index("--data-dir") + 1])
    _store_run_in_shards(data, tiny_llama(0), "many", 12, seed=3, per_shard=2)
    args = common.copy()
    args[args.index("--runs") + 1:args.index("--runs") + 2] = ["fit", "many"]
    args[args.index("--max-updates") + 1] = "12"
    out = tmp_path / "streamed"
    assert tfd.main(args + ["--resident-positions", "60", "--batch", "4", "--out", str(out)]) == 0
    card = json.loads((out / "card.json").read_text())
    stream = td.ShardedExamples(data, ["fit", "many"], with_hidden=True)
    assert card["data"]["positions"] == stream.positions and card["data"]["responses"] == 22
    assert card["training"]["updates"] == 12
    first_epoch = stream.chunks(60, epoch=0)
    assert len(loads) > len(first_epoch)                      # went past one epoch
    assert loads[:len(first_epoch)] == first_epoch            # the first chunk was read once, not twice
    assert loads[len(first_epoch)] == stream.chunks(60, epoch=1)[0]
