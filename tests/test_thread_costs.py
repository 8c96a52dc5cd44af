"""On a shared machine the automatic thread count drops while other processes keep cores busy: such
a run serves from the costs measured for another thread count of the same setup instead of measuring
every candidate again on the busy machine; a count somebody chose is measured as ever, and a line
that measures says why."""

import pytest
import torch

from mcsd.costs import store
from mcsd.forward import threads

QUICK = dict(sizes=(1, 2), repeats=1)


@pytest.fixture
def two_cores(monkeypatch):
    """Two cores this process may use; torch's thread count and the thread record restored after."""
    monkeypatch.setattr(threads, "allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(threads, "_applied", [])
    monkeypatch.setattr(store, "_BORROWED", {})
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _measure_at(n, target, draft):
    torch.set_num_threads(n)
    return store.load_or_measure(target, draft, quiet=True, **QUICK)


def test_lowered_by_load_is_only_an_automatic_count_lowered_for_other_processes(two_cores):
    busy = threads.choose_threads(2, 1.0)
    assert busy.threads == 1
    threads.apply(busy)
    assert threads.lowered_by_load(1) is busy
    assert threads.lowered_by_load(2) is None               # torch's count set since by other code
    threads.apply(threads.choose_threads(2, 0.0))           # all cores free
    assert threads.lowered_by_load(2) is None
    threads.apply(threads.explicit(1, "--threads"))         # a count somebody chose
    assert threads.lowered_by_load(1) is None


def test_a_run_lowered_by_load_serves_from_the_full_count_s_costs(target, random_draft, fresh_cache, two_cores,
                                                                 monkeypatch):
    full = _measure_at(2, target, random_draft)
    threads.apply(threads.choose_threads(2, 1.0))           # another process keeps a core busy: 1 thread
    monkeypatch.setattr(store.timing, "measure", lambda *a, **k: pytest.fail("measured on the busy machine"))
    prof = store.load_or_measure(target, random_draft, quiet=True, **QUICK)
    assert prof.verify_ms == full.verify_ms
    assert store.borrowed_threads(target, random_draft) == 2
    assert not store.profile_path(target, random_draft).exists()    # nothing written under 1 thread's key


def test_a_chosen_count_is_measured_and_says_why(target, random_draft, fresh_cache, two_cores, monkeypatch):
    _measure_at(2, target, random_draft)
    said = []
    monkeypatch.setattr(store, "say", said.append)
    threads.apply(threads.explicit(1, "--threads"))
    assert store.load_cached(target, random_draft) is None
    store.load_or_measure(target, random_draft, **QUICK)
    assert store.borrowed_threads(target, random_draft) is None
    assert "none cached for 1 thread, only for 2" in said[0], said
    assert store.profile_path(target, random_draft).exists()


def test_a_measuring_line_says_why(target, random_draft, fresh_cache, two_cores, monkeypatch):
    said = []
    monkeypatch.setattr(store, "say", said.append)
    torch.set_num_threads(1)
    store.load_or_measure(target, random_draft, **QUICK)
    store.load_or_measure(target, random_draft, force=True, **QUICK)
    assert said[0].endswith(": none cached yet...") and said[1].endswith(": measured again as asked..."), said
