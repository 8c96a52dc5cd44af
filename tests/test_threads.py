"""Threads that fit the machine: as many as the cores other processes leave free, at least one,
read from simulated loads; an explicit --threads is kept and reported."""

import json

import pytest

from mcsd.forward import threads
from mcsd.forward.threads import Snapshot, busy_elsewhere, choose_threads, parse_proc_stat


@pytest.mark.parametrize("allowed,busy,expected", [
    (2, 0.0, 2),          # quiet
    (2, 0.1, 2),          # a little background noise takes no core
    (2, 0.4, 1),          # a core well used elsewhere is not free
    (2, 1.0, 1),          # one `yes > /dev/null`
    (2, 2.3, 1),          # everything busy: still one thread
    (8, 2.9, 5),
    (1, 0.0, 1),
])
def test_threads_are_the_free_cores(allowed, busy, expected):
    choice = choose_threads(allowed, busy)
    assert choice.threads == expected
    assert str(expected) in choice.reason and (("busy" in choice.reason) == (expected < allowed or busy > 0.25))


STAT = """cpu  {u} 0 0 {i} 0 0 0 0 0 0
cpu0 {u0} 0 0 {i0} 0 0 0 0 0 0
cpu1 {u1} 0 0 {i1} 0 0 0 0 0 0
intr 1 2 3
"""


def stat(u0, i0, u1, i1):
    return parse_proc_stat(STAT.format(u=u0 + u1, i=i0 + i1, u0=u0, i0=i0, u1=u1, i1=i1))


def test_busy_cores_are_read_from_proc_stat_less_this_process():
    assert stat(5, 7, 1, 2) == {0: (5, 12), 1: (1, 3)}
    before = Snapshot(stat(0, 0, 0, 0), own=0, at=0.0)
    # 100 ticks per CPU: CPU 0 fully busy, CPU 1 half busy, this process used 50 of those ticks
    after = Snapshot(stat(100, 0, 50, 50), own=50, at=1.0)
    assert busy_elsewhere(before, after, [0, 1]) == pytest.approx(1.0)
    assert choose_threads(2, busy_elsewhere(before, after, [0, 1])).threads == 1
    quiet = Snapshot(stat(40, 60, 0, 100), own=40, at=1.0)           # only this process ran
    assert busy_elsewhere(before, quiet, [0, 1]) == pytest.approx(0.0)
    assert busy_elsewhere(before, quiet, [0]) == pytest.approx(0.0)
    assert busy_elsewhere(before, before, [0, 1]) is None             # no ticks yet: cannot tell


def test_fit_threads_under_a_simulated_load(monkeypatch):
    snaps = iter([Snapshot(stat(0, 0, 0, 0), 0, 0.0), Snapshot(stat(100, 0, 10, 90), 10, 5.0)])
    monkeypatch.setattr(threads, "snapshot", lambda: next(snaps))
    monkeypatch.setattr(threads, "allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(threads.time, "monotonic", lambda: 5.0)
    choice = threads.fit_threads()
    assert (choice.threads, choice.allowed, choice.busy) == (1, 2, pytest.approx(1.0))


def test_cli_reports_and_keeps_an_explicit_thread_count(model_dirs, capsys):
    import torch

    from mcsd.cli import main
    before = torch.get_num_threads()
    pair = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    common = ["--prompt", "w03 w17", "--max-new-tokens", "4", "--dtype", "float32", "--baseline"]
    try:
        assert main(pair + common + ["--threads", "1", "--json"]) == 0
        settings = json.loads(capsys.readouterr().out)["settings"]
        assert settings["threads"] == 1 and "--threads" in settings["threads_reason"]
        assert main(pair + common + ["--threads", "1", "--stats"]) == 0
        assert "threads: 1: as set by --threads" in capsys.readouterr().err
        assert main(pair + common + ["--threads", "0"]) == 2
        assert "--threads must be >= 1" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
