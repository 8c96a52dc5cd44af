"""A complete cache that cannot be written serves every default: the command line, the Python API and the
server's start-up read the converted model, the 4-bit codes, the native kernel and the profile and write
nothing; and the tests themselves write nothing into the user's cache.

Read-only is made two ways at once: the folder's write bits are cleared (which stops a normal user,
not root) and a Python audit hook refuses every write under it (which stops root too, for writes
made through Python's own calls)."""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import USER_CACHE

from mcsd.cli import main

_guarded: list[str] = []                         # folders the audit hook keeps read-only
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_WRITE_EVENTS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.symlink", "os.link", "os.truncate",
                 "os.chmod", "os.chown", "os.utime", "shutil.rmtree", "shutil.move"}
_refused: list[str] = []


def _inside(path) -> str | None:
    if path is None or isinstance(path, int):
        return None
    full = os.path.abspath(os.fsdecode(path))
    return full if any(full == g or full.startswith(g + os.sep) for g in _guarded) else None


def _audit(event: str, args: tuple) -> None:
    if not _guarded:
        return
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        writing = bool(flags & _WRITE_FLAGS) if isinstance(flags, int) else \
            isinstance(mode, str) and any(c in mode for c in "wax+")
        paths = [path] if writing else []
    elif event in _WRITE_EVENTS:
        paths = list(args[:2]) if event in ("os.rename", "os.link", "os.symlink", "shutil.move") else [args[0]]
    else:
        return
    for path in paths:
        full = _inside(path)
        if full is not None:
            _refused.append(f"{event} {full}")
            raise PermissionError(errno.EACCES, "Permission denied (a read-only cache)", full)


sys.addaudithook(_audit)        # inert while nothing is guarded


@contextmanager
def read_only(folder: Path):
    """`folder` and everything under it read-only for the block; yields the writes that were refused."""
    entries = [folder, *folder.rglob("*")]
    modes = {p: p.lstat().st_mode for p in entries if not p.is_symlink()}
    for p, mode in modes.items():
        p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    _guarded.append(os.path.abspath(folder))
    _refused.clear()
    try:
        yield _refused
    finally:
        _guarded.remove(os.path.abspath(folder))
        for p, mode in modes.items():
            p.chmod(mode)


def snapshot(folder: Path) -> dict:
    """Every entry under `folder`: its kind, size and modification time."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.is_symlink(), p.is_dir(), p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in folder.rglob("*")}


def test_the_audit_hook_stops_writes_even_for_root(tmp_path):
    (tmp_path / "kept").write_text("x")
    with read_only(tmp_path) as refused:
        with pytest.raises(PermissionError):
            (tmp_path / "new").write_text("y")
        with pytest.raises(PermissionError):
            (tmp_path / "sub").mkdir()
        with pytest.raises(PermissionError):
            os.replace(tmp_path / "kept", tmp_path / "moved")
        assert (tmp_path / "kept").read_text() == "x"                  # reading goes on
        assert len(refused) == 3
    (tmp_path / "new").write_text("y")                                 # and writing again after


def _q4_run(q4_gguf_file, *extra):
    return ["--target", str(q4_gguf_file), "--drafter", "context", "--weights", "q4", "--prompt", "ABCABCAB",
            "--max-new-tokens", "6", "--json", *extra]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MCSD_CACHE", str(folder))
    return folder


def test_a_complete_read_only_cache_serves_the_command_lines_defaults(q4_gguf_file, cache, capsys):
    from mcsd.forward import native, quant
    native.reset()                              # the kernel library is looked up in this cache
    assert main(_q4_run(q4_gguf_file)) == 0     # fills the cache: codes, kernel library, profile
    first = json.loads(capsys.readouterr().out)
    assert list((cache / "q4").iterdir()) and list((cache / "profiles").iterdir())
    native.reset()
    before = snapshot(cache)
    with read_only(cache) as refused:
        assert main(_q4_run(q4_gguf_file)) == 0
        captured = capsys.readouterr()
        # the Python API: the same pair, the decoder's default calibration
        from mcsd import TreeDecoder
        from mcsd.drafting.pair import load_model
        model = load_model(str(q4_gguf_file), dtype=quant.compute_dtype(), weights="q4")
        out = TreeDecoder(model, "context").generate([3, 4, 5, 3, 4, 5], max_new_tokens=6)
    assert not refused, refused
    assert "cannot write" not in captured.err, captured.err
    assert json.loads(captured.out)["tokens"] == first["tokens"] and len(out.tokens) == 6
    assert snapshot(cache) == before
    native.reset()


def test_codes_read_into_a_cache_that_cannot_be_written_serve_the_run(q4_gguf_file, cache, capsys):
    from mcsd.forward import quant
    cache.mkdir()
    with read_only(cache) as refused:
        found, cached = quant.codes(q4_gguf_file, 4, 2)
    assert found and not cached and refused
    err = capsys.readouterr().err
    assert err.count("the 4-bit codes serve this run only") == 1 and "MCSD_CACHE" not in err.split("only")[-1]


def test_the_tests_write_into_a_cache_of_their_own(q4_gguf_file):
    """Work that fills a cache (codes, a profile, a stale flag) lands in the session's cache, never under
    the user's ($MCSD_CACHE as the session found it, else ~/.cache/mcsd)."""
    from conftest import tiny_llama

    from mcsd.costs import store
    from mcsd.forward import quant
    from mcsd.loading.cache import cache_dir
    here = cache_dir()
    assert Path(os.environ["MCSD_CACHE"]) == here and not here.resolve().is_relative_to(USER_CACHE.resolve())
    model, draft = tiny_llama(5, layers=3), tiny_llama(6, layers=1)
    quant.codes(q4_gguf_file, 4, 2)
    assert store.load_or_measure(model, draft, quiet=True) is not None
    assert store.mark_stale(model, draft, "a test")
    written = [quant._cache_file(q4_gguf_file.resolve()), store.profile_path(model, draft)]
    assert all(p.is_file() and p.is_relative_to(here) for p in written)
