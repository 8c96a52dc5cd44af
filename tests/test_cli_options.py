"""The command line's generation options, prompt files, logprobs, and the defects each fixed with one line."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mcsd.cli import args as cli_args
from mcsd.cli import generate as cli_run
from mcsd.cli import main
from mcsd.loading import sources

ROOT = Path(__file__).resolve().parent.parent


def _pair(model_dirs):
    return ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"), "--dtype", "float32",
            "--tree", "3,2", "--policy", "static"]


def _one_error_line(capsys, fragment):
    err = capsys.readouterr().err
    assert err.startswith("mcsd-generate: error: ") and err.count("\n") == 1, err
    assert fragment in err, err


def test_json_logprobs_and_a_repetition_penalty_match_hf(model_dirs, target, capsys):
    args = _pair(model_dirs) + ["--prompt", "w03 w17 w42 w05", "--max-new-tokens", "16", "--json", "--logprobs",
                                "--repetition-penalty", "1.3", "--no-repeat-ngram-size", "3"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    prompt = torch.tensor([[3, 17, 42, 5]])
    ref = target.generate(prompt, max_new_tokens=16, do_sample=False, repetition_penalty=1.3,
                          no_repeat_ngram_size=3, attention_mask=torch.ones_like(prompt))[0, 4:].tolist()
    assert out["tokens"] == ref and len(out["logprobs"]) == 16
    assert out["settings"]["repetition_penalty"] == 1.3
    assert all(lp <= 0.0 for lp in out["logprobs"])


def test_prompts_file_writes_one_result_a_line(model_dirs, tmp_path, capsys):
    rows = [{"prompt": "w03 w17"}, {"text": "w05 w06 w07"}, {"question_id": 5, "turns": ["w09 w10", "w11"]}]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    dest = tmp_path / "out.jsonl"
    assert main(_pair(model_dirs) + ["--prompts-file", str(src), "--max-new-tokens", "6", "--output", str(dest),
                                     "--logprobs"]) == 0
    results = [json.loads(line) for line in dest.read_text().splitlines()]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert all(len(r["tokens"]) == 6 == len(r["logprobs"]) for r in results)
    # each equals the single-prompt run
    assert main(_pair(model_dirs) + ["--prompt", "w09 w10", "--max-new-tokens", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == results[2]["tokens"]
    # to stdout without --output
    assert main(_pair(model_dirs) + ["--prompts-file", str(src), "--max-new-tokens", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


@pytest.mark.parametrize("content, fragment", [
    ('{"prompt": "w03"}\nnot json\n', ":2: not JSON"),
    ('{"other": 1}\n', "expected an object"),
    ("\n", "holds no prompts"),
])
def test_bad_prompts_files(model_dirs, tmp_path, capsys, content, fragment):
    src = tmp_path / "p.jsonl"
    src.write_text(content)
    assert main(_pair(model_dirs) + ["--prompts-file", str(src)]) == 2
    _one_error_line(capsys, fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--target", "/nonexistent"], "--target /nonexistent: model path does not exist"),
    (["--target", "/nonexistent", "--draft", "/also/missing"], "--target /nonexistent: model path does not exist"),
    (["--target", "TARGET", "--draft", "./missing-draft"], "--draft ./missing-draft: model path does not exist"),
    (["--draft", "DRAFT"], "a draft is checked against the target"),
    (["--output", "x.jsonl"], "--output writes --prompts-file results"),
    (["--policy", "pearl", "--tree", "1,1", "--repetition-penalty", "1.2"], "need the exact tree loop"),
    (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--weights", "q4", "--dtype", "float16"], "--weights q4 computes in "),
    (["--target", "TARGET", "--baseline", "--dtype", "bfloat16", "--weights", "q4"], "read from a Q4_1 GGUF file"),
])
def test_cli_defects_exit_2_with_one_line(model_dirs, capsys, args, fragment):
    args = [str(model_dirs / "target") if a == "TARGET" else str(model_dirs / "draft") if a == "DRAFT" else a
            for a in args]
    if "--target" not in args and "--draft" not in args:
        args = _pair(model_dirs) + args
    assert main(args + ["--prompt", "w03"]) == 2
    _one_error_line(capsys, fragment)


def test_a_hub_id_without_network_fails_at_once(monkeypatch, tmp_path, capsys):
    """No network (the connection attempt is refused here, nothing leaves the machine) and a model
    not in the local cache: one line within two seconds, before anything is loaded."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    attempts = []

    def refuse(address, timeout=None):
        attempts.append((address, timeout))
        raise OSError("network unreachable")

    monkeypatch.setattr(sources.socket, "create_connection", refuse)
    monkeypatch.setattr(cli_run, "load_models", lambda args: pytest.fail("loaded a model"))
    t0 = time.perf_counter()
    assert main(["--target", "no-such-org/no-such-model", "--baseline", "--prompt", "w03"]) == 2
    assert time.perf_counter() - t0 < 2.0
    _one_error_line(capsys, "--target no-such-org/no-such-model: not a local path, not in the Hugging Face cache")
    assert attempts and attempts[0][1] <= 1.0


def test_a_cached_hub_id_without_network_loads_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (tmp_path / "models--org--model").mkdir()
    monkeypatch.setattr(sources.socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(OSError("down")))
    args = cli_args.build_parser().parse_args(["--target", "org/model", "--baseline"])
    constants = sys.modules.get("huggingface_hub.constants")
    was = getattr(constants, "HF_HUB_OFFLINE", None)
    try:
        cli_args.check_hub(args)
        import os
        assert os.environ["HF_HUB_OFFLINE"] == "1"
    finally:
        if constants is not None:
            constants.HF_HUB_OFFLINE = was


def interrupt_after(monkeypatch, tokens: int) -> None:
    """Make `TreeDecoder.generate` raise KeyboardInterrupt (as Ctrl-C would) once `tokens` are streamed."""
    from mcsd.decoding.decoder import TreeDecoder
    real = TreeDecoder.generate

    def interrupted(self, prompt, *args, streamer=None, **kwargs):
        seen = []

        def relay(new):
            streamer(new)
            seen.extend(new)
            if len(seen) >= tokens:
                raise KeyboardInterrupt
        return real(self, prompt, *args, streamer=relay, **kwargs)

    monkeypatch.setattr(TreeDecoder, "generate", interrupted)


def test_ctrl_c_without_stream_prints_the_text_so_far(model_dirs, monkeypatch, capsys):
    interrupt_after(monkeypatch, 5)
    assert main(_pair(model_dirs) + ["--prompt", "w03 w17", "--max-new-tokens", "40"]) == 130
    captured = capsys.readouterr()
    words = captured.out.split()
    assert len(words) >= 5 and all(w.startswith("w") for w in words)
    assert "interrupted after" in captured.err


@pytest.mark.parametrize("tool", ["corpus.py", "length_policy_data.py"])
def test_library_tools_answer_help(tool):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr


def test_stats_label_the_expected_rate_as_a_ranking(model_dirs, monkeypatch, capsys):
    """--dtype auto's reason quotes a cost model's expected tokens/s; --stats says it is no forecast."""
    monkeypatch.setattr(cli_run, "_auto_dtype", lambda t, d, a: (t, d, "float32",
                                                              "float32: 59.1 expected tokens/s with chains of 2"))
    assert main(["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"), "--tree", "2",
                 "--policy", "static", "--prompt", "w03", "--max-new-tokens", "4", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "59.1 expected tokens/s" in err and "not a forecast of this run" in err
