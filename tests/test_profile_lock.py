"""The profile lock: a process that holds it (stopped, hung) delays another's first run by
`store.LOCK_WAIT_S` at most; the waiter says which process holds it and measures without it.
`force=True` measures even where another process wrote the profile while this one waited."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from mcsd.costs import store

HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    print("held", flush=True)
    time.sleep(60)
""")


@pytest.fixture
def held_lock(target, random_draft, fresh_cache):
    """The lock of (target, random_draft)'s profile, held by another process until the test ends."""
    lock = store.profile_path(target, random_draft).with_suffix(".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_held_lock_is_waited_for_until_the_deadline_then_named_and_measured_without(
        target, random_draft, held_lock, monkeypatch):
    said = []
    monkeypatch.setattr(store, "say", said.append)
    monkeypatch.setattr(store, "LOCK_WAIT_S", 0.5)
    start = time.monotonic()
    prof = store.load_or_measure(target, random_draft, sizes=(1, 2), repeats=1)
    assert prof is not None and prof.verify_ms
    assert time.monotonic() - start >= 0.5                 # it waited for the deadline first
    assert any(f"process {held_lock.pid}" in line and "without waiting" in line for line in said), said
    assert store.profile_path(target, random_draft).exists()     # and kept what it measured


def test_the_lock_taken_names_its_holder_and_is_released(target, random_draft, fresh_cache):
    import fcntl
    path = store.profile_path(target, random_draft)
    with store._measuring(path):
        assert path.with_suffix(".lock").read_text() == str(os.getpid())
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR)      # another open file: the lock is exclusive
        try:
            assert not store._lock(fd, fcntl, time.monotonic())
        finally:
            os.close(fd)
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR)
    try:
        assert store._lock(fd, fcntl, time.monotonic())           # released on leaving
    finally:
        os.close(fd)


def test_force_measures_even_where_another_process_wrote_the_profile_meanwhile(
        target, random_draft, fresh_cache, monkeypatch):
    store.load_or_measure(target, random_draft, quiet=True, sizes=(1, 2), repeats=1)
    calls = []
    real = store.timing.measure
    monkeypatch.setattr(store.timing, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(store, "load_cached", lambda *a, **k: None)       # missing when this process looked
    writes = iter([None, 1, None, 1])                                     # ... and written while it waited
    monkeypatch.setattr(store, "_written_at", lambda path: next(writes))
    assert store.load_or_measure(target, random_draft, quiet=True, sizes=(1, 2), repeats=1) is not None
    assert calls == []                                                    # the other's profile, read
    store.load_or_measure(target, random_draft, force=True, quiet=True, sizes=(1, 2), repeats=1)
    assert calls == [1]                                                   # forced: measured
