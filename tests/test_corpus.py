"""The corpus stage of the data engine: text files and installed packages cut into chunks with
provenance, resumable, refusing evaluation data, then labelled by the teacher stage."""

import pytest
import torch
from conftest import word_tokenizer

from mcsd.train import corpus, engine
from mcsd.train import data as td

CHAT = ("{% for m in messages %}w02 {{ m['content'] }} w03 {% endfor %}"
        "{% if add_generation_prompt %}w04 {% endif %}")


def _text(lines: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return "".join(" ".join(f"w{int(t):02d}" for t in torch.randint(5, 60, (int(n),), generator=g)) + "\n"
                   for n in torch.randint(1, 9, (lines,), generator=g))


def test_chunks_cut_at_line_ends_and_keep_every_token():
    tok = word_tokenizer()
    text = _text(60) + " ".join(["w07"] * 25) + "\n"           # one line longer than a chunk
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    chunks = corpus.chunk_lines(text, encode, chunk_tokens=16)
    assert all(8 <= len(c) <= 16 for c in chunks[:-1])
    assert sum(chunks, []) == encode(text)
    # a chunk ends where a line ends, unless the line itself is longer than a chunk
    line_ends, n = set(), 0
    for line in text.splitlines(keepends=True):
        n += len(encode(line))
        line_ends.add(n)
    ends = [sum(len(c) for c in chunks[:i + 1]) for i in range(len(chunks))]
    assert sum(e in line_ends for e in ends) >= len(ends) - 3


def test_records_in_both_formats():
    tok = word_tokenizer()
    doc = corpus.Document("src:a.txt", "src", "a.txt", "text", _text(40), "MIT")
    plain = corpus.records(doc, tok, 32, "plain")
    assert [r["key"] for r in plain] == [f"src:a.txt#{i}" for i in range(len(plain))]
    assert all(len(r["prompt"]) == 1 and r["prompt"].dtype == torch.int32 for r in plain)
    with pytest.raises(corpus.CorpusError, match="no chat template"):
        corpus.records(doc, tok, 32, "chat")
    tok.chat_template = CHAT
    chat = corpus.records(doc, tok, 32, "chat")
    assert len(chat) == len(plain)
    assert all(r["prompt"][0] == 2 and r["prompt"][-1] == 4 for r in chat)      # w02 ... w04
    assert torch.equal(torch.cat([plain[0]["prompt"], plain[0]["response"]]), chat[0]["response"])
    with pytest.raises(corpus.CorpusError, match="format"):
        corpus.records(doc, tok, 32, "html")


def test_evaluation_data_is_refused(tmp_path):
    bench = tmp_path / "data" / "spec_bench"
    bench.mkdir(parents=True)
    (bench / "question.jsonl").write_text("{}\n")
    for bad in (bench, bench / "question.jsonl", tmp_path / "data", tmp_path):
        with pytest.raises(corpus.CorpusError, match="evaluation data"):
            corpus.refuse_evaluation_data([bad], [bench / "question.jsonl"])
    other = tmp_path / "notes"
    other.mkdir()
    corpus.refuse_evaluation_data([other], [bench / "question.jsonl"])


def test_installed_package_documents_and_licence():
    docs, version = corpus.package_documents("tqdm")
    assert version and docs
    assert any(d.kind == "Python module" and d.name.startswith("tqdm") for d in docs)
    assert all(d.source == "tqdm" and d.licence and d.licence != "unknown" for d in docs)
    with pytest.raises(corpus.CorpusError, match="not installed"):
        corpus.package_documents("no-such-package-mcsd")


def test_dedupe_drops_copies_and_empty_files():
    a = corpus.Document("s:a", "s", "a", "text", "w05 w06\n", "x")
    docs = corpus.dedupe([a, corpus.Document("s:b", "s", "b", "text", "w05 w06\n", "x"),
                          corpus.Document("s:c", "s", "c", "text", "  \n", "x")])
    assert docs == [a]


def test_corpus_stage_resumes_caps_records_provenance_and_feeds_the_teacher(tmp_path, target):
    tok = word_tokenizer()
    tok.chat_template = CHAT
    tok.save_pretrained(tmp_path / "target")
    target.save_pretrained(tmp_path / "target")
    text = tmp_path / "text"
    text.mkdir()
    for i in range(4):
        (text / f"f{i}.txt").write_text(_text(30, seed=i))
    (text / "copy.txt").write_text(_text(30, seed=0))            # a duplicate of f0: stored once
    data = tmp_path / "data"
    common = ["--target", str(tmp_path / "target"), "--data-dir", str(data), "--threads", "1"]
    corpus_args = ["corpus", "--run", "words", "--paths", str(text), "--licence", "CC0-1.0", "--chunk-tokens", "24",
                   "--shard-records", "3"]
    engine.main(common + corpus_args + ["--max-tokens", "100"])
    entry = td.read_manifest(data)["runs"]["words"]
    assert 100 <= entry["n_tokens"] < 100 + 24
    engine.main(common + corpus_args)                                # resumed: the rest, nothing twice
    entry = td.read_manifest(data)["runs"]["words"]
    keys = entry["done"]
    assert len(keys) == len(set(keys))
    files = {k.split(":")[-1].split("#")[0] for k in keys}
    assert files == {"copy.txt", "f1.txt", "f2.txt", "f3.txt"}      # f0.txt has copy.txt's text: stored once
    stored = list(td.iter_records(data, "words"))
    assert sum(len(r["response"]) for r in stored) == entry["n_tokens"]
    prov = entry["provenance"][str(text)]
    assert prov["licence"] == "CC0-1.0" and prov["tokens"] == entry["n_tokens"] and prov["chunks"] == len(keys)
    assert prov["files"] == 4                                        # the copy is not one
    engine.main(common + corpus_args)                                # a third call adds nothing
    assert td.read_manifest(data)["runs"]["words"]["n_tokens"] == entry["n_tokens"]
    from mcsd.train.feature_head import run_provenance
    card = run_provenance(data, ["words"])["words"]
    assert card["sources"][str(text)]["licence"] == "CC0-1.0" and card["tokens"] == entry["n_tokens"]
    engine.main(common + ["teacher", "words", "--store-layers", "1,2"])
    ex = td.load_examples(data, ["words"], with_hidden=True)
    assert len(ex) == len(keys)
    assert all(e["layers"].shape == (len(e["response"]), 2 * target.config.hidden_size) for e in ex)
    with pytest.raises(SystemExit, match="evaluation data"):
        engine.main(common + ["--questions", str(text / "f1.txt"), "corpus", "--run", "bad", "--paths", str(text)])
