"""mcsd-generate through main([...]): a run, --json, streaming, and every bad-input case (exit 2, no traceback)."""

import json

import pytest

from mcsd.cli import main


def _pair(model_dirs):
    return ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"), "--dtype", "float32"]


def test_run_prints_text(model_dirs, capsys):
    assert main(_pair(model_dirs) + ["--prompt", "w03 w17 w42", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.strip() and all(w.startswith("w") for w in out.split())


def test_json_output_matches_baseline(model_dirs, capsys):
    common = ["--prompt", "w03 w17 w42 w05", "--max-new-tokens", "24", "--json"]
    assert main(_pair(model_dirs) + ["--tree", "3,2,1"] + common) == 0
    tree = json.loads(capsys.readouterr().out)
    assert main(["--target", str(model_dirs / "target"), "--dtype", "float32", "--baseline"] + common) == 0
    base = json.loads(capsys.readouterr().out)
    assert tree["tokens"] == base["tokens"] and len(tree["tokens"]) == 24
    assert tree["finish_reason"] == "length"
    assert base["stats"]["mean_accepted"] == 1.0
    for key in ("mean_accepted", "accept_by_depth", "target_forwards", "draft_forwards", "tokens_per_s",
                "draft_s", "verify_s", "wall_s"):
        assert key in tree["stats"]
    assert tree["settings"]["attention"] == "sdpa"


def test_stream_and_stats(model_dirs, capsys):
    assert main(_pair(model_dirs) + ["--prompt", "w03 w17", "--max-new-tokens", "10", "--stream", "--stats"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 10
    assert "tokens/s" in captured.err and "acceptance by depth" in captured.err


def test_prompt_from_file_and_stdin(model_dirs, tmp_path, capsys, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("w03 w17")
    assert main(_pair(model_dirs) + ["--prompt-file", str(f), "--max-new-tokens", "5", "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)["tokens"]
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("w03 w17"))
    assert main(_pair(model_dirs) + ["--max-new-tokens", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == from_file


def test_list_models(capsys):
    assert main(["--list-models"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out


@pytest.mark.parametrize("extra, fragment", [
    (["--tree", "4,x"], "malformed tree spec"),
    (["--tree", "2,0"], "malformed tree spec"),
    (["--prompt", "   "], "prompt is empty"),
    (["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
    (["--max-new-tokens", "400"], "exceeds the target's context window of 256"),
    (["--device", "gpu7"], "unknown device"),
    (["--attention", "xformers"], "xformers"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--policy", "oracle"], "unknown policy 'oracle'"),
    (["--prompt-file", "/no/such/file.txt"], "cannot read --prompt-file"),
])
def test_bad_input_exits_2_with_a_clear_message(model_dirs, capsys, extra, fragment):
    args = _pair(model_dirs) + ["--prompt", "w03 w17", "--max-new-tokens", "8"] + extra
    if "--prompt-file" in extra:
        args.remove("--prompt"); args.remove("w03 w17")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, fragment", [
    (["--target", "./missing/target", "--draft", "./missing/draft"], "model path does not exist"),
    (["--target", "TARGET"], "needs a --draft"),
    (["--draft", "DRAFT"], "--draft needs --target"),
    (["--dtype", "float8"], "invalid choice"),
    (["--attention", "flash"], "invalid choice"),
])
def test_bad_model_arguments(model_dirs, capsys, args, fragment):
    args = [str(model_dirs / "target") if a == "TARGET" else str(model_dirs / "draft") if a == "DRAFT" else a
            for a in args]
    assert main(args + ["--prompt", "w03"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_tokenizer_mismatch_exits_2(model_dirs, tmp_path, capsys):
    import shutil
    from conftest import word_tokenizer
    other = tmp_path / "draft"
    shutil.copytree(model_dirs / "draft", other)
    word_tokenizer(eos="w02").save_pretrained(other)
    assert main(["--target", str(model_dirs / "target"), "--draft", str(other), "--prompt", "w03"]) == 2
    assert "tokenizers are not the same" in capsys.readouterr().err


def test_show_tree_writes_a_png(model_dirs, tmp_path, capsys):
    png = tmp_path / "tree.png"
    assert main(_pair(model_dirs) + ["--prompt", "w03 w17", "--max-new-tokens", "8", "--tree", "3,2",
                                     "--show-tree", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tree drawn to" in capsys.readouterr().err


def test_tree_graph_marks_the_accepted_path():
    import torch
    from mcsd.tree import DraftTree, TreeTopology
    from mcsd.verify import Acceptance
    from mcsd.viz import tree_graph
    tree = DraftTree.root_only(TreeTopology.from_spec("2"), torch.tensor(5))
    tree.append_level(torch.tensor([7, 8]), torch.tensor([0, 0]), torch.log(torch.tensor([0.6, 0.3])),
                      torch.tensor([1, 2]))
    g = tree_graph(tree, Acceptance(torch.tensor([0, 2]), torch.tensor(9)))
    assert [n for n in g.nodes if g.nodes[n]["accepted"]] == [0, 2, "next"]
    assert g.nodes[1]["label"] == "7\n0.60" and g.nodes["next"]["label"] == "9\n(target)"
    assert list(g.successors(2)) == ["next"]
