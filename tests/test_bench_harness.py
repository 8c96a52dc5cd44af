"""The speed harness runs what was selected, and only that."""

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
