"""Tools meet ordinary mistakes with one line, not a traceback: an EAGLE-3 export whose hub target
cannot be reached (docs/eagle3.md's own command, offline) or whose folder holds no head, and
llama.cpp's smoke check where llama-cpp-python is not installed."""

import runpy
from pathlib import Path

import pytest

from mcsd.loading import sources
from mcsd.train import eagle3_export

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)     # an earlier load in this process may have set it
    monkeypatch.setattr(sources.socket, "create_connection",
                        lambda *a, **k: (_ for _ in ()).throw(OSError("unreachable")))


def test_export_with_an_unreachable_hub_target_is_one_line(tmp_path, offline):
    with pytest.raises(SystemExit) as stop:
        eagle3_export.main([str(FIXTURES / "original"), str(tmp_path / "out"), "--layout", "speculators",
                            "--target", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    message = str(stop.value.code)
    assert message.startswith("export_eagle3: ") and "\n" not in message
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in message and "cannot be reached" in message


def test_export_of_a_folder_without_a_head_is_one_line_before_the_target_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("mcsd.drafting.pair.load_model", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(SystemExit, match="export_eagle3: .* holds no EAGLE-3 head"):
        eagle3_export.main([str(tmp_path), str(tmp_path / "out"), "--layout", "original", "--target", "smollm2-135m"])


def test_llama_cpp_check_without_the_library_is_one_line(monkeypatch, capsys):
    tool = runpy.run_path(str(ROOT / "tools" / "build_llama_cpp.py"))
    find_spec = tool["importlib"].util.find_spec
    monkeypatch.setattr(tool["importlib"].util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else find_spec(name, *a))
    assert tool["main"](["--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("build_llama_cpp: llama-cpp-python is not installed") and err.count("\n") == 1
