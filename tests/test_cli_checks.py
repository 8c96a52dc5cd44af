"""The command line's smaller promises: flag values refused before any model loads, flags that cannot
work together refused rather than ignored, the help and version, --baseline on the default run's
weights and dtype, and the Python API's own messages."""

import json

import pytest
from test_cli_options import _pair

import mcsd
from mcsd.cli import main
from mcsd.config import ConfigError


@pytest.fixture
def no_loading(monkeypatch):
    import mcsd.cli.generate as generate
    monkeypatch.setattr(generate, "load_models", lambda args: pytest.fail("loaded a model"))


@pytest.mark.parametrize("flags, fragment", [
    (["--logprobs"], "--logprobs is printed in the JSON result"),
    (["--stream", "--json"], "--stream prints the text as it comes, --json one object"),
    (["--policy", "nonsense"], "unknown policy 'nonsense' (--policy)"),
    (["--policy", "static", "--policy-option", "bogus=1"], "--policy-option bogus: policy 'static' has no such"),
])
def test_mistakes_are_found_before_any_model_loads(model_dirs, capsys, no_loading, flags, fragment):
    assert main(_pair(model_dirs)[:-2] + ["--prompt", "w03", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcsd-generate: error: ") and err.count("\n") == 1 and fragment in err, err


def test_a_bad_draft_file_is_named_by_its_flag(model_dirs, tmp_path, capsys, no_loading):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a model")
    assert main(["--target", str(model_dirs / "target"), "--draft", str(bad), "--prompt", "w03"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcsd-generate: error: --draft: ") and str(bad) in err


def test_help_shows_the_defaults_and_the_version(capsys):
    from mcsd.cli.args import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-new-tokens MAX_NEW_TOKENS new tokens at most (default 128)" in text
    assert "--seed SEED sampling: the same seed" in text
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mcsd-generate {mcsd.__version__}"


def test_the_package_shows_only_its_names():
    names = dir(mcsd)
    assert "annotations" not in names and "importlib" not in names and "TreeDecoder" in names


def test_an_unknown_draft_says_what_is_accepted(target):
    from mcsd import TreeDecoder
    with pytest.raises(ConfigError, match='"context"') as err:
        TreeDecoder(target, "garbage", calibrate=False)
    assert "'garbage'" in str(err.value)


def test_baseline_before_any_costs_are_cached_says_the_fixed_rule_chose(q4_gguf_file, tmp_path, monkeypatch,
                                                                        capsys):
    """--baseline measures nothing unless asked: with no cached costs it runs the uncalibrated rule's
    choice and says so, rather than claiming to run as the default run chooses."""
    monkeypatch.setattr("mcsd.costs.store.cache_dir", lambda: tmp_path)        # no profile cached
    assert main(["--target", str(q4_gguf_file), "--drafter", "context", "--prompt", "ABCABC",
                 "--max-new-tokens", "4", "--json", "--baseline"]) == 0
    reason = json.loads(capsys.readouterr().out)["settings"]["dtype_reason"]
    assert "fixed rule" in reason and "not cached" in reason and "as the default run chooses it" not in reason


def test_baseline_runs_the_weights_and_dtype_the_default_run_chooses(q4_gguf_file, monkeypatch, capsys):
    """--baseline is chosen as the default run chooses (with its drafter), not as the target alone would
    run fastest: here a choice that answers q4 for a drafting run and float32 for plain steps."""
    from mcsd.decoding import choice
    from mcsd.forward import quant
    if not quant.kernel_available():
        pytest.skip("no q4 kernel here")
    asked = []

    def choose(target, draft, drafting=True, **kwargs):
        asked.append(drafting)
        if drafting:
            return choice.DtypeChoice(quant.compute_dtype(), "q4 weights: faster with chains", {}, weights="q4")
        return choice.DtypeChoice("float32", "float32: faster for plain steps", {})
    monkeypatch.setattr(choice, "choose_dtype", choose)
    run = ["--target", str(q4_gguf_file), "--drafter", "context", "--prompt", "ABCABC", "--max-new-tokens", "4",
           "--json"]
    assert main(run) == 0
    default = json.loads(capsys.readouterr().out)["settings"]
    assert main(run + ["--baseline"]) == 0
    baseline = json.loads(capsys.readouterr().out)["settings"]
    assert asked == [True, True]
    assert (baseline["weights"], baseline["dtype"]) == (default["weights"], default["dtype"]) == \
        ("q4", quant.compute_dtype())
    assert "as the default run chooses it" in baseline["dtype_reason"]
