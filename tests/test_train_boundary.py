"""The training library stays at the edge: the runtime package never imports `mcsd.train`, tools/ are
front ends nothing imports, and every tool answers `--help`."""

import ast
import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = sorted(p for p in (ROOT / "mcsd").rglob("*.py") if "train" not in p.relative_to(ROOT / "mcsd").parts)
TOOLS = sorted((ROOT / "tools").glob("*.py"))


def _imports(path: Path) -> list[str]:
    """Every module a file imports, at any depth (lazy imports inside functions included), as absolute names."""
    return _imports_of(path.read_text(), ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1]))


def _imports_of(source: str, package: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                           # relative: resolve against the file's package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_walk_sees_lazy_and_relative_imports():
    """The checks below can fail: a function-level import and a relative one are both found."""
    found = _imports_of("def f():\n    from ...train import engine\n    import mcsd.train.data\n", "mcsd.drafting.policies")
    assert "mcsd.train.engine" in found and "mcsd.train.data" in found


def test_no_runtime_module_imports_the_training_library():
    assert len(RUNTIME) > 20
    bad = {_module(p): n for p in RUNTIME for n in _imports(p) if n == "mcsd.train" or n.startswith("mcsd.train.")}
    assert not bad, f"runtime modules importing mcsd.train: {bad}"


def test_importing_every_runtime_module_loads_no_training_code():
    names = [_module(p) for p in RUNTIME]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'mcsd.train' or m.startswith('mcsd.train.')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_nothing_imports_a_tool():
    """tools/ import `mcsd` only; neither the package, the tests, the benchmarks nor another tool imports them."""
    tool_names = {p.stem for p in TOOLS}
    files = RUNTIME + sorted((ROOT / "mcsd" / "train").glob("*.py")) + TOOLS
    files += sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    bad = {str(p.relative_to(ROOT)): n for p in files for n in _imports(p)
           if n.split(".")[0] in tool_names | {"tools"}}
    assert not bad, f"modules importing tools: {bad}"


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.name)
def test_every_tool_is_a_thin_front_end_that_answers_help(tool, monkeypatch):
    assert len(tool.read_text().splitlines()) <= 200, f"{tool.name} holds library code: move it into mcsd.train"
    monkeypatch.setattr(sys, "argv", [str(tool), "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(tool), run_name="__main__")
    assert exit_.value.code in (0, None)
    assert "usage:" in out.getvalue()
