"""The data engine's two ways of labelling target text agree: what batched generation stores
(left-padded, KV-cached, rows leaving at EOS) is what a teacher-forced pass over the same text computes."""

import pytest
import torch

from mcsd.train import data as td
from mcsd.train import engine


def test_generation_labels_match_a_teacher_pass(target):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (3, 7, 5, 9)]
    eos = (12,)  # rows 2 and 4 write it early and leave the batch (and the KV cache) mid-run
    outs = engine.generate_batch(target, prompts, max_new_tokens=12, temperature=0.0, eos_ids=eos,
                                 pad_id=0, topk=4, store_hidden=True)
    assert [o["finished"] for o in outs] == [False, True, False, True]
    assert [len(o["response"]) for o in outs] == [12, 4, 12, 2]
    records = [{"key": str(i), "prompt": torch.tensor(p, dtype=torch.int32), "response": o["response"]}
               for i, (p, o) in enumerate(zip(prompts, outs))]
    teacher = engine.teacher_batch(target, records, topk=4, store_hidden=True, pad_id=0)
    for o, t in zip(outs, teacher):
        R = len(o["response"])
        assert o["hidden"].shape == t["hidden"].shape == (R, target.config.hidden_size)
        torch.testing.assert_close(o["hidden"].float(), t["hidden"].float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(o["topk_probs"].float(), t["topk_probs"].float(), atol=2e-3, rtol=2e-3)
        assert torch.equal(o["topk_ids"][:, 0], t["topk_ids"][:, 0])
        # greedy: every response token is the target's own top-1 there
        assert torch.equal(o["response"].long(), o["topk_ids"][:, 0].long())


def test_generation_without_hidden_stores_none(target):
    outs = engine.generate_batch(target, [[3, 4, 9]], max_new_tokens=4, eos_ids=(1,), pad_id=0, topk=4)
    assert "hidden" not in outs[0] and outs[0]["topk_ids"].shape == (len(outs[0]["response"]), 4)


@pytest.mark.parametrize("with_hidden", [False, True])
def test_load_examples_reads_hidden_from_generation_runs(tmp_path, target, with_hidden):
    out = engine.generate_batch(target, [[3, 4, 9]], max_new_tokens=4, eos_ids=(1,), pad_id=0, topk=4,
                                store_hidden=True)[0]
    td.start_run(tmp_path, "runs", "r", {"store_hidden": True})
    td.save_shard(tmp_path, "runs", "r", [{"key": "a/0", "prompt": torch.tensor([3, 4, 9]), **out}],
                  {"n_sequences": 1, "n_tokens": len(out["response"])})
    (ex,) = td.load_examples(tmp_path, ["r"], with_hidden=with_hidden)
    assert ("hidden" in ex) == with_hidden


def test_load_examples_names_a_run_without_hidden(tmp_path, target):
    out = engine.generate_batch(target, [[3, 4, 9]], max_new_tokens=4, eos_ids=(1,), pad_id=0, topk=4)[0]
    td.start_run(tmp_path, "runs", "plain", {})
    td.save_shard(tmp_path, "runs", "plain", [{"key": "a/0", "prompt": torch.tensor([3, 4, 9]), **out}],
                  {"n_sequences": 1, "n_tokens": len(out["response"])})
    with pytest.raises(ValueError, match="plain.*--store-hidden"):
        td.load_examples(tmp_path, ["plain"], with_hidden=True)


def test_teacher_stores_the_chosen_layers(target):
    records = [{"key": "a", "prompt": torch.tensor([3, 4, 9]), "response": torch.tensor([5, 6, 7, 8])}]
    out = engine.teacher_batch(target, records, topk=4, store_hidden=True, pad_id=0, store_layers=(0, 2, -1))[0]
    with torch.no_grad():
        hs = target(torch.tensor([[3, 4, 9, 5, 6, 7, 8]]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[0][0, 2:6], hs[2][0, 2:6], hs[-1][0, 2:6]], dim=-1).half()
    assert out["layers"].shape == (4, 96)
    assert torch.allclose(out["layers"].float(), want.float(), atol=1e-2)
    assert torch.allclose(out["hidden"].float(), hs[-1][0, 2:6], atol=1e-2)


MAKE_IT = r"no response run 'fit-greedy' in .*make it first: python tools/target_data\.py generate --run fit-greedy"


def test_a_missing_run_names_the_command_that_makes_it(tmp_path, monkeypatch):
    """A fresh cache holds no runs: each reader says which command makes the one it was asked for."""
    for read in (lambda: list(td.iter_records(tmp_path, "fit-greedy")),
                 lambda: td.load_examples(tmp_path, ["fit-greedy"]),
                 lambda: td.ShardedExamples(tmp_path, ["fit-greedy"])):
        with pytest.raises(td.DataError, match=MAKE_IT):       # an error to catch, not an exit
            read()
    # the teacher stage says so before it loads the target or records a teacher entry for the run
    monkeypatch.setattr(engine, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(SystemExit, match=MAKE_IT):
        engine.main(["--data-dir", str(tmp_path), "teacher", "fit-greedy", "--store-layers", "2,15,27"])
    assert td.read_manifest(tmp_path)["teacher"] == {}
