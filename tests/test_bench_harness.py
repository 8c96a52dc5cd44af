"""The speed harness runs what was selected, and only that; its report says what ran."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_interleaved_run_covers_only_the_selected_methods(tmp_path):
    # Methods outside the selection must not join the interleaved run: they cost time and some
    # cannot run with every drafter (a SpecDec++ head trained for the feature head, say).
    (tmp_path / "show_selection.py").write_text(
        "def pytest_collection_finish(session):\n"
        "    print('SELECTED', ','.join(sorted(session.config.selected_methods)))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/test_speed.py", "--collect-only", "-q",
                          "-p", "show_selection", "--bench-smoke", "-k", "baseline and not aten or chain_k2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(row for row in out.stdout.splitlines() if row.startswith("SELECTED"))
    assert line.split()[1].split(",") == ["baseline", "baseline_mcsd", "chain_k2"]


def _report():
    import runpy
    return runpy.run_path(str(ROOT / "tools" / "bench_report.py"))   # as `python tools/bench_report.py` runs it


def test_the_report_names_the_weights_dtype_and_decoding_first(tmp_path):
    import json
    report = _report()
    row = {"method": "baseline", "family": "baseline", "tokens_per_s": 50.0, "tau": 1.0, "speedup": 1.0,
           "interleaved": True, "equal_to_baseline": True}
    env = {"weights": "q4", "dtype": "float32", "temperature": 0.7, "top_p": 0.95, "llama_cpp": "in its own process"}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"benchmarks": [{"extra_info": {**row, "environment": env}},
                                               {"extra_info": {**row, "method": "llama_cpp", "family": "llama_cpp",
                                                               "environment": env}}]}))
    text = report["markdown"](*report["load"](path))
    assert text.splitlines()[0] == ("## q4 weights, float32, sampled at T 0.7, top-p 0.95, interleaved prompt by "
                                    "prompt; llama.cpp in its own process")
    # a JSON from before the weights were recorded (dense then) and before llama.cpp had its own process
    old = report["header"]([{**row, "family": "llama_cpp", "interleaved": False}], {"dtype": "bfloat16"})
    assert old == ("## dense weights, bfloat16, greedy, one method after another; llama.cpp in the benchmark "
                   "process (before it had its own)")
    same = report["_same"]
    assert (same({"equal_to_baseline": True}), same({"mismatched_prompts": [3, 5]}), same({})) == \
        ("yes", "no (2 prompts)", "-")                                # "-": no baseline ran to compare with
