"""The Spec-Bench prompts ship with the project: a clone finds them with nothing beside it."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mcsd.config import ConfigError
from mcsd.loading.data import SHIPPED_SHA256, SHIPPED_SPEC_BENCH, default_spec_bench, load_prompts

ROOT = Path(__file__).resolve().parent.parent


def test_the_shipped_file_is_the_published_one():
    assert SHIPPED_SPEC_BENCH == ROOT / "benchmarks" / "data" / "spec_bench" / "question.jsonl"
    assert hashlib.sha256(SHIPPED_SPEC_BENCH.read_bytes()).hexdigest() == SHIPPED_SHA256
    assert "Apache License" in (SHIPPED_SPEC_BENCH.parent / "LICENSE").read_text()


def test_default_is_the_shipped_copy_and_the_variable_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv("MCSD_SPEC_BENCH", raising=False)
    assert default_spec_bench() == SHIPPED_SPEC_BENCH
    held, fit = load_prompts(split="heldout"), load_prompts(split="fit")
    assert len(held) == 96 and len(fit) == 384
    assert all(p.question_id % 5 == 0 for p in held) and all(p.question_id % 5 for p in fit)
    other = tmp_path / "q.jsonl"
    other.write_text('{"question_id": 5, "category": "qa", "turns": ["hello"]}\n')
    monkeypatch.setenv("MCSD_SPEC_BENCH", str(other))
    assert [p.text for p in load_prompts()] == ["hello"]


def test_a_clone_without_a_shared_folder_finds_the_prompts(tmp_path):
    """The package and the benchmark data copied alone into an empty folder: the default prompt
    resolution (what the benchmark harness calls) reads the shipped file, from any working directory."""
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "mcsd", clone / "mcsd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "benchmarks" / "data", clone / "benchmarks" / "data")
    assert not (tmp_path / "shared").exists()
    env = {k: v for k, v in os.environ.items() if k != "MCSD_SPEC_BENCH"}
    env["PYTHONPATH"] = str(clone)
    code = ("import mcsd.loading.data as d; ps = d.load_prompts(split='heldout'); "
            "print(d.default_spec_bench()); print(len(ps))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    path, count = done.stdout.split()
    assert Path(path) == clone / "benchmarks" / "data" / "spec_bench" / "question.jsonl"
    assert count == "96"


def test_a_modified_shipped_copy_is_refused(monkeypatch, tmp_path):
    fake = tmp_path / "question.jsonl"
    fake.write_text('{"question_id": 5, "category": "qa", "turns": ["changed"]}\n')
    monkeypatch.setattr("mcsd.loading.data.SHIPPED_SPEC_BENCH", fake.resolve())
    monkeypatch.setenv("MCSD_SPEC_BENCH", str(fake))
    with pytest.raises(ConfigError, match="not the published Spec-Bench file"):
        load_prompts()
