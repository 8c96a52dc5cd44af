"""How many threads torch runs with: the cores this process may use that nothing else keeps busy.

torch's OpenMP threads meet at a barrier after every parallel kernel. Where
another process holds one of the cores, the thread the OS parks there makes
every small kernel wait for it: a decoding step of a few milliseconds of
work then takes as long as the scheduler's time slices. One thread on a
free core is far faster than two on one free and one busy core, so the
default is as many threads as there are free cores, at least one.

What counts as busy: CPU time spent by other processes on the cores this
process may run on (`os.sched_getaffinity`), read from `/proc/stat` over a
window (the command line's start-up, a second or two of imports), less this
process's own time. A core a quarter busy or more elsewhere counts as
taken. Without `/proc/stat` the one-minute load average stands in (it may
count this process too).

No torch here: the command line calls this before torch is imported.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

TAKEN_FRACTION = 0.25            # a core this busy elsewhere (or more) is not free for a torch thread
MIN_WINDOW_S = 0.1               # the shortest window the busy share is read over


@dataclass(frozen=True)
class ThreadChoice:
    """Threads for torch and why.

    Attributes:
        threads: the count (>= 1).
        reason: one line for `--stats`.
        allowed: cores this process may run on.
        busy: cores' worth of CPU time other processes used during the window (None: not read).
        clamped: a count asked for was above `allowed` and was lowered to it.
    """

    threads: int
    reason: str
    allowed: int = 0
    busy: float | None = None
    clamped: bool = False        # a count asked for was more than the cores allowed


def choose_threads(allowed: int, busy: float) -> ThreadChoice:
    """Threads for `allowed` cores of which `busy` cores' worth is used by other processes.

    Pure: the cores taken are `busy` rounded up past `TAKEN_FRACTION` of a core
    (0.2 -> 0 taken, 0.3 -> 1, 1.0 -> 1, 1.3 -> 2), never more than `allowed`;
    the rest are the threads, at least 1.

    Args:
        allowed: cores this process may run on (>= 1).
        busy: other processes' CPU use in cores (>= 0; 1.0 = one core fully busy).
    Returns:
        ThreadChoice.
    """
    allowed = max(1, int(allowed))
    busy = max(0.0, float(busy))
    taken = min(allowed, math.floor(busy + 1.0 - TAKEN_FRACTION))
    threads = max(1, allowed - taken)
    cores = f"{allowed} core{'s' if allowed != 1 else ''}"
    if taken == 0:
        reason = f"{threads}: all {cores} free"
    else:
        reason = (f"{threads}: {taken} of {cores} busy with other processes ({busy:.1f} cores' worth); "
                  f"threads on busy cores make every kernel wait")
    return ThreadChoice(threads, reason, allowed, busy)


# ---------------------------------------------------------------------------- reading the machine

def allowed_cpus() -> list[int]:
    """The CPU ids this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Snapshot:
    """Counters at one moment: per-CPU (busy, total) ticks, this process's ticks, a clock."""

    cpus: dict[int, tuple[int, int]]
    own: int
    at: float


def parse_proc_stat(text: str) -> dict[int, tuple[int, int]]:
    """`/proc/stat` -> {cpu id: (busy ticks, total ticks)}; idle and iowait count as not busy."""
    cpus = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        ticks = [int(v) for v in rest.split()[:8]]           # user nice system idle iowait irq softirq steal
        total = sum(ticks)
        cpus[int(name[3:])] = (total - ticks[3] - (ticks[4] if len(ticks) > 4 else 0), total)
    return cpus


def _own_ticks() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])                  # utime + stime, every thread of the process


def snapshot() -> Snapshot | None:
    """Now's counters, or None where /proc is not there."""
    try:
        with open("/proc/stat") as f:
            cpus = parse_proc_stat(f.read())
        return Snapshot(cpus, _own_ticks(), time.monotonic())
    except (OSError, ValueError, IndexError):
        return None


def busy_elsewhere(before: Snapshot, after: Snapshot, cpus: list[int]) -> float | None:
    """Cores' worth of CPU time spent on `cpus` between two snapshots by other processes.

    Pure. Returns None when the window holds no ticks (too short to tell).
    """
    busy = total = 0
    for c in cpus:
        if c in before.cpus and c in after.cpus:
            busy += after.cpus[c][0] - before.cpus[c][0]
            total += after.cpus[c][1] - before.cpus[c][1]
    n = sum(1 for c in cpus if c in before.cpus and c in after.cpus)
    if n == 0 or total <= 0:
        return None
    window = total / n                                          # ticks one CPU saw
    return max(0.0, (busy - (after.own - before.own)) / window)


def fit_threads(since: Snapshot | None = None, sleep=time.sleep) -> ThreadChoice:
    """The thread count for this machine now: `choose_threads` over the cores this process may
    use and their use by other processes since `since` (a `snapshot()` taken earlier; waits
    `MIN_WINDOW_S` when it is missing or more recent)."""
    cpus = allowed_cpus()
    before = since or snapshot()
    if before is not None and time.monotonic() - before.at < MIN_WINDOW_S:
        sleep(MIN_WINDOW_S - (time.monotonic() - before.at))
    after = snapshot() if before is not None else None
    busy = busy_elsewhere(before, after, cpus) if after is not None else None
    if busy is None:
        try:
            busy = os.getloadavg()[0]                           # may include this process
        except (AttributeError, OSError):
            busy = 0.0
    return choose_threads(len(cpus), busy)


def explicit(threads: int, how: str) -> ThreadChoice:
    """A thread count the user chose (`how`: "--threads", "OMP_NUM_THREADS"), at most the cores this
    process may run on: more only makes every kernel wait for threads that share a core (2,000
    threads on 2 cores did not finish a calibration in a quarter of an hour). `clamped` then says so."""
    allowed = len(allowed_cpus())
    if int(threads) > allowed:
        return ThreadChoice(allowed, f"{allowed}: {how} asked for {int(threads)}, more than the {allowed} "
                                     f"core{'s' if allowed != 1 else ''} this process may use", allowed, None,
                            clamped=True)
    return ThreadChoice(int(threads), f"{int(threads)}: as set by {how}", allowed, None)


_applied: list[ThreadChoice] = []     # the choice `apply` last gave torch: why torch runs the threads it does


def apply(choice: ThreadChoice) -> ThreadChoice:
    """Set torch's (process-wide) thread count to `choice`'s and remember why (`lowered_by_load`)."""
    import torch
    torch.set_num_threads(choice.threads)
    _applied[:] = [choice]
    return choice


def lowered_by_load(current: int) -> ThreadChoice | None:
    """The automatic choice that set torch's `current` thread count, where it is below the cores this
    process may use only because other processes kept some busy; None for a count somebody chose
    (--threads, OMP_NUM_THREADS), all cores, or a count set since by other code. What the cost store
    reads to serve another thread count's costs rather than measure (`mcsd.costs.store.load_cached`)."""
    choice = _applied[0] if _applied else None
    if choice is None or choice.threads != current or choice.busy is None or choice.threads >= choice.allowed:
        return None
    return choice


def auto(since: Snapshot | None = None) -> ThreadChoice:
    """The thread count nobody chose: OMP_NUM_THREADS where set to a positive number, else
    `fit_threads` (the free cores). What the command line and `TreeDecoder` use alike."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return explicit(int(env), "OMP_NUM_THREADS")
    return fit_threads(since)
