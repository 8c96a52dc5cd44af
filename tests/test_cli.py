"""mcsd-generate through main([...]): a run, --json, streaming, and every bad-input case (exit 2, no traceback)."""

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    assert tree["settings"]["attention"] == "mcsd_gqa"              # auto on a CPU
    # the learned policy's acceptance model: the generic one (this draft's folder ships none)
    assert tree["settings"]["acceptance_model"].endswith("decision-models/acceptance.json")
    assert base["settings"]["acceptance_model"] is None
    # what a drafted round and a graft cost beyond the forwards, measured on the decoder's own rounds
    assert tree["settings"]["round_prices"].startswith("a drafted round ")
    assert base["settings"]["round_prices"] is None


def test_stream_and_stats(model_dirs, capsys):
    assert main(_pair(model_dirs) + ["--prompt", "w03 w17", "--max-new-tokens", "10", "--stream", "--stats",
                                     "--policy", "static"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 10
    assert "tokens/s" in captured.err and "acceptance by depth" in captured.err
    assert "attention: torch SDPA over the cache as it is, query heads grouped" in captured.err
    assert "round: loop (the fixed round is CUDA's default; on a CPU the loop is faster)" in captured.err
    assert "round prices: a drafted round " in captured.err


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
    (["--tree", "100,100,100"], "tree spec '100,100,100' has 1,010,100 draft nodes; the limit is 1,024"),
    (["--tree", "100,100,100", "--policy", "static"], "has 1,010,100 draft nodes; the limit is 1,024"),
    (["--tree", "9" * 30], "has about 10^30 draft nodes; the limit is 1,024"),
    (["--tree", ",".join(["1"] * 80)], "is 80 levels deep; the limit is 64"),
    (["--tree", "1,,2"], "malformed tree spec"),
    (["--tree", "1.5"], "malformed tree spec"),
    (["--tree", "-1"], "every branching factor must be >= 1"),
    (["--top-k", "-1"], "top_k must be an integer >= 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--temperature", "inf"], "temperature must be >= 0 and finite"),
    (["--temperature", "nan"], "temperature must be >= 0 and finite"),
    (["--stop", ""], "stop_strings must be non-empty strings"),
    (["--seed", str(2**70)], "seed must be an integer between"),
    (["--lossy-target-roots", "-1"], "--lossy-target-roots must be >= 0"),
    (["--lossy-target-roots", "100"], "between 1 and the vocabulary size (64)"),
    (["--lossy-target-roots", "2", "--temperature", "1"], "greedy decoding only"),
    (["--show-tree", "/no/such/dir/tree.png"], "cannot write --show-tree /no/such/dir/tree.png"),
    (["--show-tree", "tree.txt"], "--show-tree writes a PNG image: name it FILE.png, not tree.txt"),
])
def test_bad_input_exits_2_with_a_clear_message(model_dirs, capsys, extra, fragment):
    args = _pair(model_dirs) + ["--prompt", "w03 w17", "--max-new-tokens", "8"] + extra
    if "--prompt-file" in extra:
        args.remove("--prompt"); args.remove("w03 w17")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcsd-generate: error: ") and err.count("\n") == 1   # one line, nothing else
    assert fragment in err


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

    from mcsd.core.tree import DraftTree, TreeTopology
    from mcsd.core.verify import Acceptance
    from mcsd.core.viz import tree_graph
    tree = DraftTree.root_only(TreeTopology.from_spec("2"), torch.tensor(5))
    tree.append_level(torch.tensor([7, 8]), torch.tensor([0, 0]), torch.log(torch.tensor([0.6, 0.3])),
                      torch.tensor([1, 2]))
    g = tree_graph(tree, Acceptance(torch.tensor([0, 2]), torch.tensor(9)))
    assert [n for n in g.nodes if g.nodes[n]["accepted"]] == [0, 2, "next"]
    assert g.nodes[1]["label"] == "7\n0.60" and g.nodes["next"]["label"] == "9\n(target)"
    assert list(g.successors(2)) == ["next"]


@pytest.mark.parametrize("args, fragment", [
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
    (["--drafter", "big"], "argument --drafter: invalid choice: 'big'"),
    (["--max-new-tokens", "many"], "argument --max-new-tokens: invalid int value: 'many'"),
    (["--top-p", "high"], "argument --top-p: invalid float value: 'high'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_argument_mistakes_are_one_line(capsys, args, fragment):
    assert main(args + ["--prompt", "w03"]) == 2
    err = capsys.readouterr().err
    assert err == f"mcsd-generate: error: {err.split('error: ', 1)[1]}" and err.count("\n") == 1
    assert fragment in err and "usage:" not in err


def test_help_is_complete(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mcsd-generate")
    for flag in ("--target", "--drafter", "--list-models", "--dtype", "--prompt-file", "--tree", "--policy",
                 "--baseline", "--lossy-target-roots", "--stats", "--json", "--show-tree"):
        assert flag in out
    words = " ".join(out.split())                     # argparse wraps lines
    assert "0 = no drafting" in words and "at most 1024 draft nodes and 64 levels" in words


def test_tree_0_is_plain_decoding_and_stats_show_no_empty_acceptance_line(model_dirs, capsys):
    common = ["--prompt", "w03 w17 w42", "--max-new-tokens", "10", "--json"]
    assert main(["--target", str(model_dirs / "target"), "--dtype", "float32", "--baseline"] + common) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(_pair(model_dirs) + ["--tree", "0", "--stats"] + common) == 0
    captured = capsys.readouterr()
    run = json.loads(captured.out)
    assert run["tokens"] == base["tokens"] and run["stats"]["draft_forwards"] == 0
    assert run["stats"]["tree_nodes"] == 0 and run["settings"]["tree"] == "0"
    assert "tokens/s" in captured.err and "acceptance by depth" not in captured.err


def test_baseline_json_reports_what_ran(model_dirs, capsys):
    common = ["--prompt", "w03 w17", "--max-new-tokens", "4", "--json"]
    assert main(["--target", str(model_dirs / "target"), "--dtype", "float32", "--baseline"] + common) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert settings["baseline"] is True
    assert settings["tree"] is None and settings["policy"] is None and settings["drafter"] is None
    assert main(_pair(model_dirs) + ["--tree", "2,1", "--policy", "static"] + common) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert (settings["tree"], settings["policy"], settings["drafter"]) == ("2,1", "static", "model+context")
    assert main(_pair(model_dirs) + ["--tree", "2,1", "--policy", "static", "--drafter", "model"] + common) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert settings["drafter"] == "model" and settings["context"] is None


class _Stdin(io.TextIOWrapper):
    """A piped stdin holding raw bytes."""

    def isatty(self):
        return False


@pytest.mark.parametrize("source", ["stdin", "file", "argument"])
def test_non_utf8_prompt_names_the_source_and_byte_offset(model_dirs, tmp_path, capsys, monkeypatch, source):
    data = b"w03 \xff w17"
    args = _pair(model_dirs) + ["--max-new-tokens", "4"]
    if source == "stdin":
        monkeypatch.setattr("sys.stdin", _Stdin(io.BytesIO(data)))
        where = "stdin"
    elif source == "file":
        (tmp_path / "p.txt").write_bytes(data)
        args += ["--prompt-file", str(tmp_path / "p.txt")]
        where = f"--prompt-file {tmp_path / 'p.txt'}"
    else:                                  # how Python hands over undecodable argv bytes
        args += ["--prompt", data.decode("utf-8", "surrogateescape")]
        where = "--prompt"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mcsd-generate: error: {where} is not UTF-8 text: byte 0xff at offset 4")
    assert err.count("\n") == 1


def test_utf8_stdin_bytes_are_read_as_text(model_dirs, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", _Stdin(io.BytesIO("w03 w17 \u00e9".encode())))
    assert main(_pair(model_dirs) + ["--max-new-tokens", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 4


def test_list_models_names_both_drafters_and_the_default(capsys):
    from mcsd.loading.presets import PRESETS
    assert main(["--list-models"]) == 0
    out = capsys.readouterr().out
    preset = PRESETS["smollm2-135m"]
    assert "smollm2-135m (default)" in out and "Q4_1" in out
    assert f"--drafter {preset.default_drafter} (default)" in out and preset.default_drafter == "feature"
    assert "--drafter model:" in out and preset.draft_dir in out and preset.feature_dir in out


def test_the_flag_reference_names_the_default_drafter():
    from pathlib import Path

    from mcsd.loading.presets import DEFAULT_PRESET, PRESETS
    readme = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `--drafter` |"))
    default = PRESETS[DEFAULT_PRESET].default_drafter
    assert f"`{default}` (default" in row and row.count("default") == 1


def test_the_flag_reference_names_every_flag():
    """docs/cli.md says it lists every flag: each of the parser's, --help aside, has a row."""
    from pathlib import Path

    from mcsd.cli.args import build_parser
    rows = [line for line in (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text().splitlines()
            if line.startswith("| ")]
    flags = {flag for action in build_parser()._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"}
    missing = sorted(f for f in flags if not any(f"`{f}`" in row or f"`{f} " in row for row in rows))
    assert not missing, f"flags without a row in docs/cli.md: {missing}"


_numbers = st.one_of(st.integers(-3, 300).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                     st.text("0123456789.-e", max_size=6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.text("0123456789,-. x", max_size=12), top_k=_numbers, top_p=_numbers, temperature=_numbers,
       max_new=_numbers, seed=_numbers, stop=st.text(max_size=3))
def test_fuzzed_flags_either_run_or_fail_in_one_line(model_dirs, capsys, tree, top_k, top_p, temperature, max_new,
                                                     seed, stop):
    args = _pair(model_dirs) + ["--prompt", "w03 w17", "--tree", tree, "--top-k", top_k, "--top-p", top_p,
                                "--temperature", temperature, "--max-new-tokens", max_new, "--seed", seed,
                                "--stop", stop]
    code = main(_as_option_pairs(args))
    err = capsys.readouterr().err
    assert code in (0, 2)
    if code == 2:
        assert err.startswith("mcsd-generate: error: ") and err.count("\n") == 1, err


def _as_option_pairs(args):
    """['--flag', 'value', ...] as ['--flag=value', ...]: values that start with '-' stay values."""
    return [f"{flag}={value}" for flag, value in zip(args[::2], args[1::2])]


def test_a_prompt_past_the_context_window_fails_before_anything_is_measured(model_dirs, fresh_cache, capsys):
    # nothing cached (fresh_cache): a run would measure
    args = _pair(model_dirs) + ["--prompt", "w03 w17", "--max-new-tokens", "400", "--calibrate"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exceeds the target's context window of 256" in err
    assert not list(fresh_cache.rglob("*.json"))                           # no profile was measured


def test_a_text_ended_at_once_without_chat_says_to_add_it(model_dirs, tmp_path, capsys):
    """A chat model given a bare prompt often ends at once: the empty output comes with a note."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig
    common = ["--prompt", "w03 w17", "--max-new-tokens", "6", "--baseline", "--dtype", "float32"]
    assert main(["--target", str(model_dirs / "target"), "--json"] + common) == 0
    first = json.loads(capsys.readouterr().out)["tokens"][0]
    target = tmp_path / "target"
    shutil.copytree(model_dirs / "target", target)
    gen = GenerationConfig.from_pretrained(target)
    gen.eos_token_id = first                                     # the target's first token now ends its text
    gen.save_pretrained(target)
    assert main(["--target", str(target)] + common) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) <= 1 and "note" not in captured.err   # no chat template: nothing to suggest
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(target)
    assert main(["--target", str(target)] + common) == 0
    assert "add --chat" in capsys.readouterr().err
