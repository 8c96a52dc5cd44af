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


def test_an_interleaved_run_moves_each_method_through_every_place_and_neighbour(monkeypatch):
    """`run_order`: over as many prompts as methods, twice, each method runs once in every place of
    each direction, and follows more than one other method (a fixed rotation keeps one predecessor)."""
    import runpy
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    run_order = runpy.run_path(str(ROOT / "benchmarks" / "test_speed.py"))["run_order"]
    methods = ["a", "b", "c", "d", "e"]
    orders = [run_order(methods, i) for i in range(2 * len(methods))]
    assert all(sorted(order) == methods for order in orders)
    for m in methods:
        assert sorted(order.index(m) for order in orders) == sorted(2 * list(range(len(methods))))
        before = {order[order.index(m) - 1] for order in orders if order.index(m) > 0}
        assert len(before) > 1
    assert run_order(["only"], 3) == ["only"] and run_order([], 1) == []
    assert [run_order(["a", "b"], i)[0] for i in range(4)] == ["a", "b", "b", "a"]    # two take turns first
    for n in (2, 4, 5):                                                 # even counts too: every place, both ways
        names = methods[:n]
        orders = [run_order(names, i) for i in range(2 * n)]
        assert all(sorted(order.index(m) for order in orders) == sorted(2 * list(range(n))) for m in names)


def test_turns_keep_each_methods_quickest_and_record_every_one(monkeypatch):
    """`--bench-turns N`: each prompt runs N turns of the rotation; a method's run on it is its
    quickest turn, every turn's time is kept beside it, and a prompt whose turns wrote different text
    is named."""
    import runpy
    import types
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    interleaved_runs = runpy.run_path(str(ROOT / "benchmarks" / "test_speed.py"))["interleaved_runs"]
    seconds = {"a": iter([3.0, 1.0, 2.0, 5.0, 4.0, 6.0]), "b": iter([2.0, 2.5, 1.5, 1.0, 1.2, 0.9])}
    order = []

    def method(name, texts):
        def run(bench, ids):
            order.append(name)
            return types.SimpleNamespace(seconds=next(seconds[name]), tokens=next(texts))
        return types.SimpleNamespace(name=name, run=run)
    same, drifting = iter([[1, 2]] * 6), iter([[1], [1], [1], [7], [7], [7]])
    monkeypatch.setitem(interleaved_runs.__globals__, "METHODS", [method("a", same), method("b", drifting)])
    monkeypatch.setitem(interleaved_runs.__globals__, "skip_reason", lambda bench, m: None)
    prompts = [(types.SimpleNamespace(question_id=q), None) for q in (10, 20)]
    bench = types.SimpleNamespace(interleaved=None, turns=3, prompts=prompts, every_turn={}, turns_differ={})
    runs = interleaved_runs(bench, {"a", "b"})
    assert len(order) == 12 and order[:4] == ["a", "b", "b", "a"]      # a prompt's turns take turns too
    assert {q: r.seconds for q, r in runs["a"].items()} == {10: 1.0, 20: 4.0}
    assert {q: r.seconds for q, r in runs["b"].items()} == {10: 1.5, 20: 0.9}
    assert bench.every_turn == {"a": {10: [3.0, 1.0, 2.0], 20: [5.0, 4.0, 6.0]},
                                "b": {10: [2.0, 2.5, 1.5], 20: [1.0, 1.2, 0.9]}}
    assert bench.turns_differ == {"a": [], "b": []}
    seconds.update(a=iter([1.0] * 6), b=iter([1.0] * 6))
    drifting = iter([[1], [2], [1], [7], [7], [7]])
    monkeypatch.setitem(interleaved_runs.__globals__, "METHODS", [method("a", iter([[1, 2]] * 6)), method("b", drifting)])
    bench.interleaved = None
    interleaved_runs(bench, {"a", "b"})
    assert bench.turns_differ == {"a": [], "b": [10]}


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
    turns = report["header"]([row], {**env, "turns": 2})
    assert "interleaved prompt by prompt, each prompt's quickest of 2 turns" in turns
    # a JSON from before the weights were recorded (dense then) and before llama.cpp had its own process
    old = report["header"]([{**row, "family": "llama_cpp", "interleaved": False}], {"dtype": "bfloat16"})
    assert old == ("## dense weights, bfloat16, greedy, one method after another; llama.cpp in the benchmark "
                   "process (before it had its own)")
    same = report["_same"]
    assert (same({"equal_to_baseline": True}), same({"mismatched_prompts": [3, 5]}), same({})) == \
        ("yes", "no (2 prompts)", "-")                                # "-": no baseline ran to compare with


def test_speedup_is_the_ratio_of_tokens_per_second(monkeypatch):
    import runpy
    from types import SimpleNamespace
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    summary = runpy.run_path(str(ROOT / "benchmarks" / "test_speed.py"))["_summary"]
    # 30 tokens in 1.5 s (20 tokens/s) against a baseline that wrote 10 in 1 s (10 tokens/s): 2x,
    # though the times alone (1 s against 1.5 s) would say 0.67x
    runs = [SimpleNamespace(tokens=[0] * 20, seconds=1.0, target_forwards=10),
            SimpleNamespace(tokens=[0] * 10, seconds=0.5, target_forwards=5)]
    out = summary(runs, (10, 1.0))
    assert out["tokens_per_s"] == 20.0 and out["speedup"] == 2.0 and out["tau"] == 2.0
    assert "speedup" not in summary(runs, None)


def _rows(base_tps: float, other_base_tps: float) -> list[dict]:
    row = {"tau": 1.0, "interleaved": True, "equal_to_baseline": True}
    return [{**row, "method": "baseline", "family": "baseline", "tokens_per_s": base_tps, "speedup": 1.0},
            {**row, "method": "baseline_mcsd", "family": "baseline", "tokens_per_s": other_base_tps,
             "speedup": other_base_tps / base_tps},
            {**row, "method": "tree_422", "family": "tree", "tokens_per_s": 42.3, "speedup": 42.3 / base_tps},
            {**row, "method": "hf_assisted_5", "family": "hf_assisted", "tokens_per_s": 20.0,
             "speedup": 20.0 / base_tps}]


def test_a_smoke_report_says_it_is_no_measurement_and_a_wide_baseline_family_is_flagged():
    report = _report()
    env = {"weights": "q4", "dtype": "float32", "prompts": 1, "max_new_tokens": 16}
    steady = report["markdown"](_rows(30.0, 40.0), env)
    assert "Best mcsd method: tree_422 at 1.41x over baseline" in steady
    assert "not a measurement" not in steady and "Warning" not in steady
    smoke = report["markdown"](_rows(30.0, 40.0), {**env, "smoke": True})
    assert "not a measurement" in smoke and "Best mcsd method" not in smoke and "over baseline" not in smoke
    wide = report["markdown"](_rows(0.5, 40.0), env)
    assert "Warning: the baseline family spreads 80.0x** (baseline 0.5 tokens/s, baseline_mcsd 40.0)" in wide
    assert "Warning" not in report["markdown"](_rows(20.0, 40.0), env)         # 2x exactly: not flagged


def test_q4q8_without_the_native_kernel_is_one_usage_error_before_anything_loads():
    env = dict(os.environ, MCSD_NATIVE="0")
    done = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/", "--benchmark-only", "--bench-smoke",
                           "--bench-weights", "q4q8", "--bench-dtype", "float32", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]      # pytest's usage error
    assert "--bench-weights q4q8 runs on mcsd's native kernel, which is not used here" in done.stderr
    assert "IndexError" not in done.stdout + done.stderr
