"""The feature trainer on token runs labelled as it reads them (`--store`, mcsd.train.online): the labels
are the teacher stage's, each chunk is labelled in turn, and what is missing is named."""

import json

import pytest
import torch
from conftest import tiny_llama, word_tokenizer

from mcsd.drafting.feature_draft import FeatureHead
from mcsd.train import data as td
from mcsd.train import engine
from mcsd.train import feature_head as tfd
from mcsd.train.online import OnlineExamples
from mcsd.train.shards import Record, ShardStore


def _token_run(store: ShardStore, run: str, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    records = [Record(f"{run}-{i}/0", "qa", torch.randint(3, 64, (int(torch.randint(2, 6, (1,), generator=g)),),
                                                          generator=g).tolist(),
                      torch.randint(3, 64, (int(torch.randint(8, 30, (1,), generator=g)),), generator=g).tolist(), True)
               for i in range(n)]
    store.start_run(run, {"temperature": 0.0, "source": "test"})
    store.add_shard(run, records, seconds=1.0)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    tiny_llama(0).save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    store = ShardStore(tmp_path / "store")
    _token_run(store, "mp", 12, seed=1)
    _token_run(store, "held", 3, seed=2)
    common = ["--target", str(tmp_path / "target"), "--store", str(store.root), "--runs", "mp",
              "--heldout-run", "held", "--window", "16", "--sub-vocab", "40", "--threads", "1"]
    return tmp_path, store, common


def test_online_labels_are_the_teacher_stages(setup):
    tmp_path, store, _ = setup
    data = tmp_path / "data"
    common = ["--target", str(tmp_path / "target"), "--data-dir", str(data), "--threads", "1"]
    engine.main(common + ["--store", str(store.root), "from-store", "--run", "mp"])
    engine.main(common + ["teacher", "mp", "--store-layers", "1,-1"])
    stored = {e["key"]: e for e in td.load_examples(data, ["mp"], with_hidden=True)}
    model, tok = td.load_target(str(tmp_path / "target"), device="cpu", dtype="float32")
    online = OnlineExamples(store.root, ["mp"], model, engine.padding_id(tok), layers=(1, -1))
    examples = online.load(online.units)
    assert sorted(e["key"] for e in examples) == sorted(stored) and len(stored) == 12
    for e in examples:
        want = stored[e["key"]]
        assert torch.equal(e["response"], want["response"])
        assert torch.equal(e["topk_ids"], want["topk_ids"])
        for name in ("topk_probs", "hidden", "layers"):
            torch.testing.assert_close(e[name], want[name], atol=2e-3, rtol=0)
    assert online.positions == sum(len(e["response"]) for e in stored.values())


def test_chunks_hold_every_record_once_an_epoch_in_a_new_order(setup):
    _, store, _ = setup
    online = OnlineExamples(store.root, ["mp"], model=None, pad_id=0)
    a, b = online.chunks(40, epoch=0), online.chunks(40, epoch=1)
    assert sorted(sum(a, [])) == sorted(sum(b, [])) == list(range(12)) and sum(a, []) != sum(b, [])
    assert all(sum(len(online.records[i]["response"]) for i in c) >= 40 for c in a[:-1])


def test_training_from_a_store_labels_each_chunk_in_turn(setup, monkeypatch):
    tmp_path, store, common = setup
    loads = []
    original = OnlineExamples.load

    def spy(self, units):
        loads.append(list(units))
        return original(self, units)

    monkeypatch.setattr(OnlineExamples, "load", spy)
    out = tmp_path / "head"
    assert tfd.main(common + ["--resident-positions", "60", "--batch", "4", "--max-updates", "12",
                              "--feature-layers", "1,-1", "--out", str(out)]) == 0
    card = json.loads((out / "card.json").read_text())
    online = OnlineExamples(store.root, ["mp"], model=None, pad_id=0)
    assert card["data"]["positions"] == online.positions and card["data"]["responses"] == 12
    assert card["data"]["teacher"]["online"] and card["data"]["runs"]["mp"]["settings"]["source"] == "test"
    assert card["training"]["updates"] == 12 and [m["step"] for m in card["heldout_agreement"]] == [1, 2, 3]
    first_epoch = online.chunks(60, epoch=0)
    assert loads[0] == first_epoch[0] and loads[1] == [0, 1, 2]      # training's first chunk, then the held-out run
    assert loads[2:2 + len(first_epoch) - 1] == first_epoch[1:]      # each chunk labelled once, in turn
    assert loads[1 + len(first_epoch)] == online.chunks(60, epoch=1)[0]
    head = FeatureHead.load(out)
    assert head.cfg.sub_vocab <= 40 and head.cfg.feature_layers == (1, -1)     # a new v2 head, labelled for it


def test_a_missing_run_or_resident_size_is_named(setup):
    tmp_path, _, common = setup
    args = common.copy()
    args[args.index("--runs") + 1] = "nope"
    with pytest.raises(SystemExit, match="no token run 'nope'.*runs there: held, mp"):
        tfd.main(args + ["--resident-positions", "60", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--resident-positions"):
        tfd.main(common + ["--out", str(tmp_path / "x")])
