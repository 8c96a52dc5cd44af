"""The data campaign's library: token shards, Magpie prompt filters and deduplication, batched
sampling on a cache written in place, and the resumable answer stage."""

import json

import numpy as np
import pytest
import torch
from conftest import tiny_llama, word_tokenizer

from mcsd.train import campaign
from mcsd.train.generation import sample_batch, sample_nucleus, top_p_filter
from mcsd.train.magpie import NearDuplicates, diversity, keep_prompt, normalise, prefix_ids
from mcsd.train.shards import Record, ShardStore, read_shard, write_shard

CHAT = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_shards_round_trip_and_pick_their_id_width(tmp_path):
    small = [Record("a/0", "qa", [1, 2, 3], [4, 5], True), Record("b/1", "math", [], [65535], False)]
    write_shard(tmp_path / "s.npz", small)
    assert read_shard(tmp_path / "s.npz") == small
    with np.load(tmp_path / "s.npz") as z:
        assert z["prompt"].dtype == np.uint16 and z["response"].dtype == np.uint16
    wide = [Record("c/0", "qa", [70000, 1], [2], True)]
    write_shard(tmp_path / "w.npz", wide)
    assert read_shard(tmp_path / "w.npz") == wide
    with np.load(tmp_path / "w.npz") as z:
        assert z["prompt"].dtype == np.int32


def test_a_corrupt_shard_is_named_in_a_clear_error(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="bad.npz: not a readable token shard"):
        read_shard(tmp_path / "bad.npz")


def test_store_resumes_and_refuses_other_settings(tmp_path):
    store = ShardStore(tmp_path)
    assert store.start_run("r", {"temperature": 0.0}) == set()
    store.add_shard("r", [Record("p1/0", "qa", [1], [2, 3], True)], seconds=2.0)
    store.add_shard("r", [Record("p2/0", "qa", [1], [4], False)], seconds=1.0)
    assert store.start_run("r", {"temperature": 0.0}) == {"p1/0", "p2/0"}
    entry = store.manifest()["runs"]["r"]
    assert (entry["n_sequences"], entry["n_tokens"], entry["seconds"], entry["tokens_per_s"]) == (2, 3, 3.0, 1.0)
    assert [r.key for r in store.records(["r"])] == ["p1/0", "p2/0"]
    with pytest.raises(ValueError, match="exists with other settings"):
        store.start_run("r", {"temperature": 0.8})
    with pytest.raises(KeyError, match="no run 'x'"):
        list(store.records(["x"]))
    assert "2 distinct prompts, 2 responses, 3 response tokens" in store.status()


def test_prompt_filters_say_why():
    assert keep_prompt("What is the capital of France?", True, 8) is None
    assert keep_prompt("What is the capital of France?", False, 8) == "unfinished"
    assert keep_prompt("Hi there", True, 2) == "short"
    assert keep_prompt("Explain <|im_start|> tokens to me please", True, 9) == "markup"
    assert keep_prompt("12 34 56 78 90 11 22 33 #### ++++ a", True, 20) == "symbols"
    assert keep_prompt("go go go go go go go go go go", True, 10) == "repetitive"
    assert keep_prompt("Explain how tides work on the coast", True, 500) == "long"


def test_near_duplicates_are_caught_and_distinct_texts_kept():
    near = NearDuplicates()
    base = "Write a short story about a lighthouse keeper who finds a message in a bottle on the beach"
    assert near.add(base)
    assert not near.add(base.replace("short", "brief"))                 # one word changed: most 3-grams shared
    assert not near.add(base.upper() + "!")                             # case and punctuation do not count
    assert near.add("Translate the following sentence into German: the weather is nice today")
    assert near.add("What is the derivative of x squared times the sine of x with respect to x")
    assert normalise("Hello,  World!") == "hello world"


def test_diversity_report():
    report = diversity(["a b c", "a b d"], [3, 5], ["qa", "math"])
    assert report["n"] == 2 and report["unique_1grams"] == 4 and report["distinct_1"] == round(4 / 6, 4)
    assert report["categories"] == {"math": 1, "qa": 1} and report["tokens"]["max"] == 5


def test_magpie_prefix_is_the_template_up_to_the_users_words():
    tok = word_tokenizer()
    tok.chat_template = "{% for m in messages %}w05 {{ m['role'] }} {{ m['content'] }} w01 {% endfor %}"
    tok.add_special_tokens({"additional_special_tokens": []})
    ids = prefix_ids(tok, None)
    assert tok.decode(ids).split() == ["w05", "user"] or ids == tok("w05 user", add_special_tokens=False)["input_ids"]
    assert len(prefix_ids(tok, "w07 w08")) == len(ids) + 5       # w05 system w07 w08 w01


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = top_p_filter(logits, 0.8).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    assert top_p_filter(logits, 0.81).isfinite().tolist() == [[True, True, True, False]]
    assert top_p_filter(logits, 1.0) is logits


@pytest.mark.parametrize("candidates", [(3,), (2, 8), (1024,)])   # (3,): the flat row sorts every token
def test_nucleus_sampling_draws_the_top_p_distribution(candidates):
    from scipy.stats import chisquare
    g = torch.Generator().manual_seed(3)
    sharp = torch.randn(1, 40, generator=g) * 3.0            # nucleus of a few tokens
    flat = torch.randn(1, 40, generator=g) * 0.3             # nucleus of most of the vocabulary
    n = 6000
    logits = torch.cat([sharp.expand(n, -1), flat.expand(n, -1)])
    drawn = sample_nucleus(logits, 0.8, 0.9, torch.Generator().manual_seed(1), candidates=candidates)
    for row, block in ((sharp, drawn[:n]), (flat, drawn[n:])):
        kept = top_p_filter(row / 0.8, 0.9)
        target = kept.softmax(-1)[0]                             # the nucleus, renormalised
        assert kept[0, block].isfinite().all()                   # nothing outside the nucleus
        counts = torch.bincount(block, minlength=40).double()
        support = target > 0
        expected = target[support].double() / target[support].double().sum() * n
        assert chisquare(counts[support], expected).pvalue > 1e-3
    again = sample_nucleus(logits, 0.8, 0.9, torch.Generator().manual_seed(1), candidates=candidates)
    assert torch.equal(drawn, again)


@pytest.mark.parametrize("max_new", [1, 12])
def test_batched_sampling_is_plain_greedy_per_row(max_new):
    model = tiny_llama(seed=4, sharpness=3.0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (3, 9, 5, 2)]
    eos = (12, 30)                                   # some rows finish early and leave the batch
    outs = sample_batch(model, prompts, max_new, 0.0, eos_ids=eos, pad_id=0)
    finished = 0
    for p, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=list(eos),
                             pad_token_id=0)[0, len(p):]
        assert out["response"].tolist() == ref.tolist()
        assert out["finished"] == (ref[-1].item() in eos)
        finished += out["finished"]
    if max_new == 12:
        assert 0 < finished < len(prompts)           # the test exercises rows leaving mid-batch


def test_sampling_is_seeded_and_follows_the_tempered_distribution():
    model = tiny_llama(seed=2)
    prompt = [5, 9, 11]
    a = sample_batch(model, [prompt] * 4, 6, 0.9, 0.95, (1,), 0, torch.Generator().manual_seed(7))
    b = sample_batch(model, [prompt] * 4, 6, 0.9, 0.95, (1,), 0, torch.Generator().manual_seed(7))
    assert [x["response"].tolist() for x in a] == [x["response"].tolist() for x in b]
    # first tokens of many rows follow softmax(logits / T), checked with a chi-square test
    from scipy.stats import chisquare
    n = 4000
    out = sample_batch(model, [prompt] * n, 1, 0.9, 1.0, (), 0, torch.Generator().manual_seed(1))
    first = torch.tensor([o["response"][0].item() for o in out])
    with torch.no_grad():
        probs = (model(torch.tensor([prompt])).logits[0, -1] / 0.9).softmax(-1)
    counts = torch.bincount(first, minlength=probs.numel()).double()
    expected = probs.double() * n
    big = expected >= 5                              # pool the rare tokens into one cell
    obs, exp = counts[big], expected[big]
    if (~big).any():
        obs, exp = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


def test_answer_stage_writes_shards_and_resumes(tmp_path):
    model = tiny_llama(seed=1)
    tok = word_tokenizer()
    chat_ids = lambda tokenizer, text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [{"id": f"mp-{i}", "category": "qa", "text": " ".join(f"w{3 + (i * 7 + j) % 60:02d}" for j in range(2 + i))}
               for i in range(5)]
    store = ShardStore(tmp_path)
    settings = {"source": "magpie", "temperature": 0.0, "max_new_tokens": 6, "samples": 1}
    entry = campaign.answer(model, tok, store, "run", prompts[:3], settings, chat_ids, batch_size=2,
                            shard_seconds=0.0, log=lambda *_: None)
    assert entry["n_sequences"] == 3 and len(entry["shards"]) == 2
    entry = campaign.answer(model, tok, store, "run", prompts, settings, chat_ids, batch_size=2,
                            shard_seconds=0.0, log=lambda *_: None)
    records = {r.key: r for r in store.records(["run"])}
    assert sorted(records) == [f"mp-{i}/0" for i in range(5)] and entry["n_sequences"] == 5
    for p in prompts:
        ids = chat_ids(tok, p["text"])
        ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=[tok.eos_token_id],
                             pad_token_id=0)[0, len(ids):]
        assert records[f"{p['id']}/0"].prompt == ids and records[f"{p['id']}/0"].response == ref.tolist()
    assert json.loads((tmp_path / "manifest.json").read_text())["runs"]["run"]["n_tokens"] == entry["n_tokens"]


def _two_word_prompts(n: int):
    """A tiny model and tokenizer, `n` two-word prompts and greedy 4-token answering settings."""
    chat_ids = lambda tokenizer, text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [{"id": f"mp-{i}", "category": "qa", "text": f"w{10 + i:02d} w{20 + i:02d}"} for i in range(n)]
    settings = {"source": "magpie", "temperature": 0.0, "max_new_tokens": 4, "samples": 1}
    return tiny_llama(seed=1), word_tokenizer(), chat_ids, prompts, settings


def test_an_interrupted_answer_stage_keeps_what_it_finished(tmp_path, monkeypatch):
    model, tok, chat_ids, prompts, settings = _two_word_prompts(6)
    store = ShardStore(tmp_path)
    calls = []

    def stopping_after_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return sample_batch(*args, **kwargs)

    monkeypatch.setattr(campaign, "sample_batch", stopping_after_two)
    with pytest.raises(KeyboardInterrupt):                 # no shard is due before the stop
        campaign.answer(model, tok, store, "run", prompts, settings, chat_ids, batch_size=2,
                        shard_seconds=1e9, log=lambda *_: None)
    entry = store.manifest()["runs"]["run"]
    assert entry["n_sequences"] == 4 and len(entry["shards"]) == 1
    monkeypatch.setattr(campaign, "sample_batch", sample_batch)
    entry = campaign.answer(model, tok, store, "run", prompts, settings, chat_ids, batch_size=2,
                            shard_seconds=1e9, log=lambda *_: None)
    assert sorted(r.key for r in store.records(["run"])) == [f"mp-{i}/0" for i in range(6)]
    assert entry["n_sequences"] == 6


def test_prompts_another_run_answered_are_left_out(tmp_path):
    model, tok, chat_ids, prompts, settings = _two_word_prompts(4)
    store = ShardStore(tmp_path)
    campaign.answer(model, tok, store, "first", prompts[:2], settings, chat_ids, batch_size=2, shard_seconds=0.0,
                    log=lambda *_: None)
    entry = campaign.answer(model, tok, store, "second", prompts, settings, chat_ids, batch_size=2, shard_seconds=0.0,
                            skip=store.done_keys("first"), log=lambda *_: None)
    assert sorted(r.key for r in store.records(["second"])) == ["mp-2/0", "mp-3/0"] and entry["n_sequences"] == 2


def test_a_store_run_becomes_a_teacher_labelled_run(tmp_path, target):
    from mcsd.train import data as td
    from mcsd.train import engine

    store = ShardStore(tmp_path / "store")
    store.start_run("mp", {"temperature": 0.0})
    store.add_shard("mp", [Record("mp-0/0", "qa", [5, 6, 7], [8, 9], True),
                           Record("mp-1/0", "math", [4, 5], [10, 11, 12], False)], seconds=1.0)
    data = tmp_path / "cache"
    common = ["--data-dir", str(data), "--store", str(store.root)]
    engine.main(common + ["from-store", "--run", "mp"])
    engine.main(common + ["from-store", "--run", "mp"])                 # resumed: nothing twice
    records = list(td.iter_records(data, "mp"))
    assert [r["key"] for r in records] == ["mp-0/0", "mp-1/0"]
    assert records[1]["prompt"].tolist() == [4, 5] and records[1]["response"].tolist() == [10, 11, 12]
    # the teacher labels them like any response run (what the trainers read)
    outs = engine.teacher_batch(target, records, topk=4, pad_id=0)
    assert [o["topk_ids"].shape for o in outs] == [(2, 4), (3, 4)]
