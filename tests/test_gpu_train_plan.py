"""tools/gpu_train_head.py's plan holds on a machine without a GPU: the runs it names are in the store,
and every flag of every command it would run is one that command takes."""

import re
import runpy
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
tool = runpy.run_path(str(REPO / "tools" / "gpu_train_head.py"), run_name="plan")


def test_the_plan_runs_what_the_store_holds_through_flags_the_tools_take(tmp_path):
    runs = tool["store_runs"]()
    assert "magpie-greedy-cuda" in runs and "magpie-t08" in runs and tool["HELDOUT"] not in runs
    steps = tool["plan"](runs, tmp_path / "head", 4.8, 256)
    assert [s for s, _, _ in steps] == ["train"]
    fresh = tool["plan"](runs, tmp_path / "head2", 4.8, 256, fresh_layers=2)
    assert "--init" not in fresh[0][1] and fresh[0][1][fresh[0][1].index("--feature-layers") + 1] == "2,15,-1"
    sampled = tool["plan"](runs, tmp_path / "head3", 4.8, 256, sample=0.7)
    assert [s for s, _, _ in sampled] == ["sample", "train"]
    assert "magpie-t07-cuda" in sampled[0][1] and "magpie-t07-cuda" in sampled[1][1]       # written, then read
    steps = steps + fresh + sampled
    assert steps[0][1][steps[0][1].index("--heldout-run") + 1] == tool["HELDOUT"]     # the store holds it
    helps: dict[tuple, str] = {}

    def help_text(*words: str) -> str:
        """A tool's (or a subcommand's) --help, run once each."""
        if words not in helps:
            helps[words] = subprocess.run([sys.executable, *words, "--help"], cwd=REPO, capture_output=True,
                                          text=True, timeout=300).stdout
        return helps[words]

    for _, cmd, _ in steps:
        script = cmd[1]
        sub = next((w for w in cmd[2:] if w in ("campaign", "from-store", "teacher", "generate")), None)
        text = help_text(script) + (help_text(script, sub) if sub else "")
        for flag in (w for w in cmd[2:] if w.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", text), f"{script} {sub or ''} takes no {flag}"


def test_a_file_too_large_to_come_back_is_split_into_parts_that_join_to_it(tmp_path):
    folder = tmp_path / "head-gpu"
    folder.mkdir()
    big = bytes(range(256)) * 40                       # 10,240 bytes
    (folder / "feature_head.safetensors").write_bytes(big)
    (folder / "card.json").write_text("{}")
    assert tool["split_large"](folder, limit=4096) == ["feature_head.safetensors"]
    parts = folder / "feature_head.safetensors.parts"
    sizes = sorted(p.stat().st_size for p in parts.glob("part*"))
    assert not (folder / "feature_head.safetensors").exists() and (folder / "card.json").exists()
    assert len(sizes) == 3 and max(sizes) <= 4096
    carry = runpy.run_path(str(REPO / "tools" / "gpu_carry.py"), run_name="carry")
    assert carry["join"](parts, tmp_path / "back").read_bytes() == big


def test_a_sampled_run_comes_back_as_a_tar_that_extracts_into_a_store(tmp_path):
    import tarfile

    from mcsd.train.shards import ShardStore
    run = tool["HELDOUT"]                                       # any run the store holds
    packed = tool["pack_run"](run, tmp_path)
    assert tool["_shards"](run) >= 1 and tool["_shards"]("no-such-run") == 0
    with tarfile.open(packed) as tar:
        tar.extractall(tmp_path / "store", filter="data")
    want = [(r.key, r.prompt, r.response) for r in ShardStore(REPO / "data" / "smollm2-135m").records([run])]
    assert [(r.key, r.prompt, r.response) for r in ShardStore(tmp_path / "store").records([run])] == want
