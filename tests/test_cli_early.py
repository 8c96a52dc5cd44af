"""What docs/cli.md promises is "checked before any model loads" fails in one line before a model is
read: policy settings' values, xformers on a CPU, more new tokens than the target's context window;
a GGUF target without a draft is asked for one; --calibrate measures each candidate once."""

import shutil

import pytest

from mcsd.cli import generate as cli_run
from mcsd.cli import main


def _pair(model_dirs):
    return ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"), "--dtype", "float32",
            "--prompt", "w03 w17"]


def _one_error_line(capsys, fragment):
    err = capsys.readouterr().err
    assert err.startswith("mcsd-generate: error: ") and err.count("\n") == 1, err
    assert fragment in err, err


@pytest.fixture
def no_loading(monkeypatch):
    """A model load fails the test: what is checked must be checked before."""
    def load(*args, **kwargs):
        pytest.fail("a model was loaded before the mistake was found")
    monkeypatch.setattr(cli_run, "load_models", load)


@pytest.mark.parametrize("extra, fragment", [
    (["--policy", "svip", "--policy-option", "h=abc"], "--policy-option: SVIP's threshold h must be a finite number"),
    (["--policy", "svip", "--policy-option", "min_depth=-1"], "--policy-option: min_depth must be a non-negative"),
    (["--policy", "disco", "--policy-option", "threshold=-5"], "--policy-option: DISCO's threshold must lie in [0, 1]"),
    (["--policy", "confidence", "--policy-option", "threshold=2"], "--policy-option: confidence threshold must be"),
    (["--attention", "xformers"], "--attention xformers runs on CUDA devices only"),
    (["--max-new-tokens", "100000000"], "--max-new-tokens 100000000 plus the prompt exceeds the target's context "
                                        "window of 256 tokens"),
])
def test_values_are_checked_before_any_model_loads(model_dirs, capsys, no_loading, extra, fragment):
    assert main(_pair(model_dirs) + extra) == 2
    _one_error_line(capsys, fragment)


def test_the_preset_s_context_window_is_known_before_it_is_fetched(capsys, no_loading, monkeypatch):
    from mcsd.loading import models
    monkeypatch.setattr(models, "fetch_preset_gguf", lambda preset: pytest.fail("fetched"))
    assert main(["--prompt", "hi", "--max-new-tokens", "100000000"]) == 2
    _one_error_line(capsys, "exceeds the target's context window of 8192 tokens")


def test_a_gguf_s_context_window_is_read_from_its_header(gguf_file, capsys, no_loading):
    from mcsd.loading.sources import context_window
    window = context_window(str(gguf_file))
    assert isinstance(window, int) and window > 0
    assert main(["--target", str(gguf_file), "--baseline", "--prompt", "!", "--max-new-tokens", str(window)]) == 2
    _one_error_line(capsys, f"context window of {window} tokens")


def test_a_gguf_target_without_a_draft_is_asked_for_one_whatever_lies_beside_it(gguf_file, tmp_path, capsys,
                                                                              no_loading):
    folder = tmp_path / "models"
    folder.mkdir()
    target = folder / "model.gguf"
    shutil.copy(gguf_file, target)
    (folder / "unrelated.safetensors").write_bytes(b"not a checkpoint")
    assert main(["--target", str(target), "--prompt", "!"]) == 2
    _one_error_line(capsys, f"--target {target} needs a --draft")


def test_lossy_roots_on_a_one_token_prompt_with_a_feature_head_fail_before_measuring(model_dirs, tmp_path,
                                                                                     target, capsys, fresh_cache):
    from test_python_mistakes import fused_head
    fused_head(target).save(tmp_path / "head")
    args = ["--target", str(model_dirs / "target"), "--draft", str(tmp_path / "head"), "--dtype", "float32",
            "--lossy-target-roots", "2", "--max-new-tokens", "4"]
    assert main(args + ["--prompt", "w03"]) == 2
    _one_error_line(capsys, "needs a prompt of 2 tokens or more, got 1")
    assert not list((fresh_cache / "profiles").glob("*.json"))            # nothing was measured
    assert main(args + ["--prompt", "w03 w17", "--no-calibrate"]) == 0


def test_calibrate_measures_each_candidate_once(model_dirs, capsys, fresh_cache, monkeypatch):
    from mcsd.costs import timing
    measured, real = [], timing.measure
    monkeypatch.setattr(timing, "measure", lambda target, *a, **k: measured.append(
        str(next(target.parameters()).dtype)) or real(target, *a, **k))
    args = _pair(model_dirs)
    args[args.index("--dtype") + 1] = "auto"
    assert main(args + ["--max-new-tokens", "4", "--calibrate", "--stats"]) == 0
    assert measured and len(measured) == len(set(measured)), measured       # the chosen one not again
    assert "costs: this machine's calibrated profile, measured in this run for the dtype choice" in \
        capsys.readouterr().err
