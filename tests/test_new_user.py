"""What a new user runs into on a fresh clone: bounded threads, unwritable outputs, a read-only cache
at another path, JSON when interrupted, fast and specific errors for bad models, conflicting prompts."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from test_cli_options import _one_error_line, _pair, interrupt_after

from mcsd import TreeDecoder
from mcsd.cli import args as cli
from mcsd.cli import main
from mcsd.config import ConfigError
from mcsd.errors import ModelLoadError
from mcsd.loading import sources


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------- threads

def test_threads_past_the_cores_are_clamped_and_said_once(model_dirs, capsys, keep_threads):
    from mcsd.forward.threads import allowed_cpus
    cores = len(allowed_cpus())
    assert main(_pair(model_dirs) + ["--prompt", "w03", "--max-new-tokens", "4", "--threads", "999",
                                     "--no-calibrate", "--json"]) == 0
    captured = capsys.readouterr()
    assert torch.get_num_threads() == cores
    assert captured.err.count("asked for 999") == 1 and f"using {cores}" in captured.err
    json.loads(captured.out)


def test_the_python_api_chooses_threads_as_the_command_line_does(target, monkeypatch, keep_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(2)
    dec = TreeDecoder(target, "context", attention="sdpa", calibrate=False)
    assert torch.get_num_threads() == 1 and "OMP_NUM_THREADS" in dec.threads.reason
    monkeypatch.delenv("OMP_NUM_THREADS")
    dec = TreeDecoder(target, "context", attention="sdpa", calibrate=False)
    assert dec.threads.threads == torch.get_num_threads() >= 1 and dec.threads.reason
    assert TreeDecoder(target, "context", attention="sdpa", calibrate=False, threads=999).threads.clamped
    torch.set_num_threads(1)
    assert TreeDecoder(target, "context", attention="sdpa", calibrate=False, threads=None).threads is None
    assert torch.get_num_threads() == 1                                  # left alone
    with pytest.raises(ConfigError, match="threads"):
        TreeDecoder(target, "context", attention="sdpa", calibrate=False, threads="many")


# ---------------------------------------------------------------------------- output and prompts

@pytest.mark.parametrize("path", ["/nonexistent/dir/out.jsonl", "/proc/out.jsonl", "{tmp}"])
def test_an_output_that_cannot_be_written_fails_before_loading(model_dirs, tmp_path, capsys, monkeypatch, path):
    import mcsd.drafting.pair
    monkeypatch.setattr(mcsd.drafting.pair, "load_model_pair", lambda *a, **k: pytest.fail("loaded a model"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w03"}\n')
    t0 = time.perf_counter()
    assert main(_pair(model_dirs) + ["--prompts-file", str(prompts), "--output", path.format(tmp=tmp_path)]) == 2
    assert time.perf_counter() - t0 < 5
    _one_error_line(capsys, "cannot write --output")


def test_a_writable_output_is_not_left_behind_by_the_check(tmp_path):
    out = tmp_path / "out.jsonl"
    cli.check_writable(str(out), "--output")
    assert not out.exists()


def test_prompt_and_prompt_file_together_are_refused(model_dirs, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("w05")
    assert main(_pair(model_dirs) + ["--prompt", "w03", "--prompt-file", str(f)]) == 2
    _one_error_line(capsys, "--prompt and --prompt-file")


def test_a_tree_that_starts_with_a_minus_reaches_its_own_check(model_dirs, capsys):
    assert main(_pair(model_dirs)[:-4] + ["--tree", "-1,2", "--prompt", "w03"]) == 2
    err = capsys.readouterr().err
    assert "expected one argument" not in err and "tree" in err


def test_a_prompt_with_a_lone_surrogate_is_a_config_error(target, tokenizer):
    dec = TreeDecoder(target, "context", tokenizer=tokenizer, attention="sdpa", calibrate=False)
    with pytest.raises(ConfigError, match="lone surrogate"):
        dec.generate("w03 \udc80 w05", max_new_tokens=2)


def test_json_interrupted_is_still_json(model_dirs, monkeypatch, capsys):
    interrupt_after(monkeypatch, 3)
    assert main(_pair(model_dirs) + ["--prompt", "w03 w17", "--max-new-tokens", "40", "--json"]) == 130
    result = json.loads(capsys.readouterr().out)
    assert result["finish_reason"] == "interrupted" and len(result["tokens"]) >= 3
    assert result["text"].split()[0].startswith("w")


# ---------------------------------------------------------------------------- bad models, named

def test_an_unknown_hub_id_fails_fast_from_python(monkeypatch, tmp_path):
    from mcsd import load_model_pair
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources.socket, "create_connection",
                        lambda *a, **k: (_ for _ in ()).throw(OSError("unreachable")))
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model: not a local path"):
        load_model_pair("no-such-org/no-such-model", "no-such-org/other")
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        load_model_pair("no-such-org/no-such-model")
    assert time.perf_counter() - t0 < 5


@pytest.fixture
def broken_targets(model_dirs, tmp_path):
    notmodel = tmp_path / "notmodel"
    notmodel.mkdir()
    torn = tmp_path / "torn"
    shutil.copytree(model_dirs / "target", torn)
    weights = torn / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    jsonl = tmp_path / "good.jsonl"
    jsonl.write_text('{"prompt": "x"}\n')
    return {"missing": (str(tmp_path / "nonexistent" / "x"), "does not exist"),
            "no config": (str(notmodel), "without config.json"),
            "torn": (str(torn), "cut short"),
            "a prompts file": (str(jsonl), "not a .gguf checkpoint")}


@pytest.mark.parametrize("case", ["missing", "no config", "torn", "a prompts file"])
def test_a_bad_target_without_a_draft_is_named_for_what_it_is(broken_targets, capsys, case):
    source, fragment = broken_targets[case]
    assert main(["--target", source, "--prompt", "w03"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "needs a --draft" not in err, err
    from mcsd import load_model_pair
    with pytest.raises(ModelLoadError, match=fragment):
        load_model_pair(target=source)


def test_an_unknown_name_without_a_draft_says_it_is_no_model(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources.socket, "create_connection",
                        lambda *a, **k: (_ for _ in ()).throw(OSError("unreachable")))
    assert main(["--target", "smollm2-9000", "--prompt", "w03"]) == 2
    _one_error_line(capsys, "smollm2-9000: not a local path")


# ---------------------------------------------------------------------------- the profile cache

def _measure_in(cache, target_dir, draft_dir, monkeypatch, calibrate):
    from mcsd.costs.store import load_or_measure
    from mcsd.drafting.pair import load_model
    monkeypatch.setattr("mcsd.costs.store.cache_dir", lambda: cache)
    t, d = load_model(str(target_dir), "float32"), load_model(str(draft_dir), "float32", role="draft")
    return load_or_measure(t, d, measure_if_missing=calibrate, quiet=True, sizes=(1, 2), repeats=2)


def test_a_complete_cache_serves_from_another_path(model_dirs, tmp_path, monkeypatch):
    first = tmp_path / "cache-a"
    assert _measure_in(first, model_dirs / "target", model_dirs / "draft", monkeypatch, True) is not None
    moved = tmp_path / "elsewhere"
    shutil.copytree(model_dirs, moved)
    second = tmp_path / "cache-b"
    shutil.copytree(first, second)
    assert _measure_in(second, moved / "target", moved / "draft", monkeypatch, False) is not None


def test_a_profile_that_cannot_be_written_serves_the_run_and_is_said_once(model_dirs, tmp_path, monkeypatch,
                                                                            capsys):
    from mcsd.costs.store import load_or_measure
    from mcsd.drafting.pair import load_model
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr("mcsd.costs.store.cache_dir", lambda: blocker / "cache")    # under a file: nothing is made
    t = load_model(str(model_dirs / "target"), "float32")
    d = load_model(str(model_dirs / "draft"), "float32", role="draft")
    prof = load_or_measure(t, d, sizes=(1, 2), repeats=2)
    assert prof is not None and prof.verify_ms
    err = capsys.readouterr().err
    assert err.count("these costs serve this process only") == 1
    # kept for the rest of the process: asked again (as a second decoder would), nothing is measured
    monkeypatch.setattr("mcsd.costs.timing.measure", lambda *a, **k: pytest.fail("measured twice"))
    assert load_or_measure(t, d, sizes=(1, 2), repeats=2) is prof
    assert capsys.readouterr().err == ""


_MEASURE_IN_A_CHILD = """
import json, sys, time
import torch
from mcsd.costs import store, timing
from mcsd.drafting.pair import load_model
real = timing.measure
def slow(*args, **kwargs):          # long enough that the two processes overlap when started together
    time.sleep(1.5)
    prof = real(*args, **kwargs)
    prof.meta["measured_by"] = sys.argv[2]
    return prof
timing.measure = slow
torch.set_num_threads(1)
t = load_model(sys.argv[1], "float32")
prof = store.load_or_measure(t, None, quiet=True, sizes=(1, 2), repeats=1)
print(json.dumps({"by": prof.meta["measured_by"], "verify": prof.verify_ms}))
"""


def test_processes_started_together_on_one_cache_run_from_one_measurement(model_dirs, tmp_path):
    """The second process waits for the first one's measurement and reads it (a lock beside the profile),
    so both run from the same costs; whichever order they reach it in, one measured."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, MCSD_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _MEASURE_IN_A_CHILD, str(model_dirs / "target"), name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for name in ("first", "second")]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0] == results[1]                 # the same profile, measured by one of them


def test_a_gguf_target_is_named_by_its_file(gguf_file):
    from mcsd.drafting.pair import load_model
    assert load_model(str(gguf_file), "float32").name_or_path == str(gguf_file)


def test_bench_report_names_the_fastest_mcsd_method_whatever_its_family():
    import runpy
    report = runpy.run_path(str(Path(__file__).resolve().parents[1] / "tools" / "bench_report.py"))
    rows = [{"method": "default", "family": "policy", "speedup": 1.5},
            {"method": "default_context", "family": "context", "speedup": 1.8},
            {"method": "hf_assisted_n2", "family": "hf_assisted", "speedup": 0.7}]
    assert report["_best"](rows).startswith("Best mcsd method: default_context at 1.80x")
