"""The prepared GPU run's scripts, on the CPU: the GGUF carried in parts comes back whole, and
tools/gpu_check.py runs every stage on a tiny random pair and writes its JSON."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_and_join_give_back_the_same_file(tmp_path):
    carry = tool("gpu_carry")
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 4099 + b"tail")
    manifest = carry.split(source, tmp_path / "parts", parts=2)
    sizes = [p["size"] for p in manifest["parts"]]
    assert sum(sizes) == source.stat().st_size and max(sizes) - min(sizes) <= 1
    joined = carry.join(tmp_path / "parts", tmp_path / "cache")
    assert joined.name == "model.gguf" and carry.sha256(joined) == carry.sha256(source)
    with pytest.raises(ValueError, match="sha256"):          # not the preset's file
        carry.join(tmp_path / "parts", tmp_path / "cache", expected=carry.PRESET_SHA256)


def test_join_refuses_a_missing_or_damaged_part(tmp_path):
    carry = tool("gpu_carry")
    source = tmp_path / "m.gguf"
    source.write_bytes(b"x" * 1000)
    carry.split(source, tmp_path / "parts")
    (tmp_path / "parts" / "part1").write_bytes(b"y" * 500)
    with pytest.raises(ValueError, match="sha256"):
        carry.join(tmp_path / "parts", tmp_path / "cache")
    (tmp_path / "parts" / "part1").unlink()
    with pytest.raises(ValueError, match="part1"):
        carry.join(tmp_path / "parts", tmp_path / "cache")


def test_tree_bytes_counts_the_tracked_files_present_less_those_left_out(tmp_path):
    import subprocess
    carry = tool("gpu_carry")
    files = {"a.py": 100, "data/store.bin": 7000, "database.txt": 30,      # "database" is not under data/
             "models/smollm2-135m-draft/model.safetensors": 900, "models/head/w.bin": 50, "gone.txt": 11}
    for name, size in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    (tmp_path / "gone.txt").unlink()                 # tracked, not in the checkout: nothing to carry
    (tmp_path / "untracked.bin").write_bytes(b"x" * 5000)
    assert carry.tree_bytes(tmp_path, leave_out=()) == 100 + 7000 + 30 + 900 + 50
    assert carry.tree_bytes(tmp_path) == 100 + 30 + 50


def test_gpu_check_runs_every_stage_on_a_tiny_pair(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_run import main as gpu_main
    out = tmp_path / "check.json"
    rc = gpu_main(["--tiny", "--device", "cpu", "--dtype", "float32", "--no-pytest", "--prompts", "2",
                                 "--max-new-tokens", "12", "--batch-prompts", "3", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and "error" not in report, report.get("traceback")
    assert report["environment"]["torch"]
    bench = report["stages"]["bench"]
    assert set(bench["settings"]["greedy"]) == {"hf_static", "hf_greedy", "plain_loop", "context", "cli_default",
                                                "fixed_round", "learned"}
    assert bench["rounds"]["learned"].startswith("fixed (round='fixed'")
    # which round ran comes from the runs themselves: on a CPU the default is the loop, round="fixed" fixed
    assert bench["rounds"]["fixed_round"].startswith("fixed (round='fixed'")
    assert bench["rounds"]["cli_default"].startswith("loop (") and "hf_static" in bench["first_call_s"]
    head = bench["graphs"]["fixed_round"]["head"]
    assert head["built"] > 0 and head["captured"] == 0 and head["failure"] is None     # eager on a CPU
    assert bench["graphs"]["fixed_round"]["target"]["built"] >= bench["graphs_after_warm_up"]["fixed_round"][
        "target"]["built"] > 0 and "SDPA" in bench["attention"]["fixed_round"]
    assert len(report["stages"]["sync_profile"]["fixed_round/greedy"]["syncs_per_round"]) == 16
    assert report["stages"]["sync_profile"]["fixed_round/greedy"]["captures_per_round"] == [0] * 16   # eager
    batch = report["stages"]["batch"]
    assert batch["prompts"] == 3 and set(batch) == {"prompts"} | {f"{m}/{b}" for m in ("plain", "context")
                                                                 for b in (1, 4, 8, 16)}
    for size in (1, 4, 8, 16):          # float32 on a CPU: every batched answer is its lone run's
        assert batch[f"plain/{size}"]["same_as_lone"] == 3 and batch[f"plain/{size}"]["rounds"] > 0
        assert batch[f"plain/{size}"]["forward"] == "SlotForward"          # a CPU runs the flat batch
