"""The profile store: one cached profile per (machine, pair, dtype, device, attention, threads) as JSON
under `<cache>/profiles/`, measured on first use, flagged stale or provisional and measured again only
where that cannot land inside a generation.

Processes that share a cache measure a profile one at a time (an exclusive lock on a file beside
it, which names the process holding it): a second process that wanted the same profile waits, then
reads the first one's, so that two servers started together on an empty cache run from the same
costs (and choose the same trees). It waits `LOCK_WAIT_S` at most: a holder that is stopped (Ctrl-Z,
a debugger) or hung would otherwise hold every later start; past the deadline the waiter says which
process holds the lock and measures without it. A profile that could not be written (a read-only
cache) is kept for the rest of the process.

Thread counts: the automatic count (`mcsd.forward.threads.auto`) drops below the cores while other
processes keep some busy, and comes back when they stop. A run whose count was lowered that way
finds no profile of its own the first time; rather than measure every candidate again at the
lowered count (on the busy machine), it runs from the profile measured for another count of this
setup, the full count's first (`load_cached`; `borrowed_threads` says so). Where it measures, its
line says why: none cached yet, none for this thread count (and for which there are), flagged, or
asked for.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from ..config import ConfigError
from ..forward import kernels, quant, threads
from ..loading.cache import cache_dir, cache_writes
from ..loading.progress import say
from . import timing
from .profile import MEASURED_SINCE, DeviceProfile, _model_key, _model_name, host_key

CALIBRATION_REPEATS = 4     # the quick measurement a first generation makes: 2 rounds of 2 runs (see measure)
CALIBRATION_BUDGET_S = 30.0  # past this, no further round of that measurement starts (a busy machine): provisional
# a first measurement takes 5-80 s on a 2-core CPU (a busy one, or five candidates' worth, the most): a
# process that has held the lock this long is stopped or hung, not measuring
LOCK_WAIT_S = 180.0
LOCK_POLL_S = 0.2

# profiles measured in this process that the cache could not keep (read-only): path -> profile
_UNWRITTEN: dict[Path, DeviceProfile] = {}
# setups that ran from another thread count's profile in this process: path -> that thread count
_BORROWED: dict[Path, int] = {}


def profile_path(target, draft, dtype=None, weights: str | None = None, threads: int | None = None) -> Path:
    """Cache file for this machine, pair, dtype, device, attention backend and thread count (torch's
    now, or `threads`); `weights="q4"` (or "q4q8") names the target's profile on its 4-bit codes before
    they are attached."""
    dev = next(target.parameters()).device
    dtype = dtype or next(target.parameters()).dtype
    # a drafter's key leaves out its own codes: it runs on them exactly when the target runs on the native
    # q4 kernel (`FeatureDrafter.follow_target_weights`), which the target's key says, before and after
    parts = [_model_key(target, weights=weights), _model_key(draft, codes=False) if draft is not None else "-",
             str(dtype), str(dev),
             str(getattr(target.config, "_attn_implementation", None)), str(threads or torch.get_num_threads()),
             json.dumps(host_key(dev), sort_keys=True)]
    if kernels.switchable(dtype, dev):
        parts.append("onednn-aten-packed")            # profiles timed on every matmul path
    elif kernels.packable(dtype, dev):
        parts.append("default-packed")                # timed with and without prepacked weights
    parts.append(f"measured-{MEASURED_SINCE}")         # profiles measured the way this version measures
    key = "|".join(parts)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir() / "profiles" / f"{digest}.json"


def _readable(path: Path, device) -> DeviceProfile | None:
    """The profile in `path` if it is readable and was measured on this machine (or was measured for
    `path` in this process and could not be written)."""
    if path in _UNWRITTEN:
        return _UNWRITTEN[path]
    try:
        prof = DeviceProfile.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None                                   # unreadable: measure again
    here, host = host_key(device), prof.meta.get("host", {})
    if {k: host.get(k) for k in here} != here:
        return None                                   # measured on another machine
    return prof


def needs_remeasure(prof: DeviceProfile) -> str | None:
    """Why a cached profile should be measured again (provisional: measured on a busy machine;
    stale: later runs' timings disagreed with it), or None."""
    return prof.meta.get("stale") or prof.meta.get("provisional")


def load_cached(target, draft=None, dtype=None, remeasure: bool = True,
                weights: str | None = None) -> DeviceProfile | None:
    """The cached profile for this setup, if there is a readable one measured on this machine.

    With `remeasure`, a profile flagged for measuring again (`needs_remeasure`)
    is passed over (None: the caller measures) when the machine is quiet now;
    on a busy machine it is still returned, since measuring again would only
    measure the noise again.
    """
    dev = next(target.parameters()).device
    path = profile_path(target, draft, dtype, weights)
    prof = _readable(path, dev)
    if prof is None and threads.lowered_by_load(torch.get_num_threads()) is not None:
        prof = _other_threads(target, draft, dtype, weights, path)
    if prof is not None and remeasure and needs_remeasure(prof) and timing.quiet_now():
        return None
    return prof


def _counts_cached(target, draft, dtype, weights) -> dict[int, DeviceProfile]:
    """{thread count: readable profile} of this setup at the thread counts other than torch's now,
    the most threads first."""
    dev, now = next(target.parameters()).device, torch.get_num_threads()
    found = {}
    for n in range(len(threads.allowed_cpus()), 0, -1):
        if n != now:
            prof = _readable(profile_path(target, draft, dtype, weights, threads=n), dev)
            if prof is not None:
                found[n] = prof
    return found


def _other_threads(target, draft, dtype, weights, path: Path) -> DeviceProfile | None:
    """Another thread count's profile of this setup for a run whose count was lowered because other
    processes keep cores busy (the most threads first), remembered in `_BORROWED`; None where there
    is none."""
    found = _counts_cached(target, draft, dtype, weights)
    if not found:
        return None
    n = next(iter(found))
    _BORROWED[path] = n
    return found[n]


def borrowed_counts() -> list[int]:
    """The thread counts whose profiles served setups of other counts in this process (`load_cached`)."""
    return sorted(set(_BORROWED.values()))


def borrowed_threads(target, draft=None, dtype=None, weights: str | None = None) -> int | None:
    """The thread count whose profile this setup ran from in this process (`load_cached`), or None
    where it ran from its own (or none)."""
    return _BORROWED.get(profile_path(target, draft, dtype, weights))


def load_target_costs(target, dtype=None) -> DeviceProfile | None:
    """A cached profile holding this target's verify costs in this setup, measured alone or with any
    drafter (its verify tables are the same either way), without measuring anything; for runs of
    the target alone (`--baseline`). A profile flagged for measuring again serves too."""
    dev = next(target.parameters()).device
    own = _readable(profile_path(target, None, dtype), dev)
    if own is not None:
        return own
    dtype = str(dtype or next(target.parameters()).dtype).replace("torch.", "")
    want = {"target_key": _model_key(target), "dtype": dtype, "device": str(dev),
            "attention": getattr(target.config, "_attn_implementation", None), "threads": torch.get_num_threads()}
    folder = cache_dir() / "profiles"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        prof = _readable(path, dev)
        if prof is not None and all(prof.meta.get(k) == v for k, v in want.items()):
            return prof
    return None


def mark_stale(target, draft, reason: str, dtype=None, ratio: float | None = None) -> bool:
    """Flag the cached profile of this setup for measuring again at the next start (`load_cached`);
    `ratio`: the rounds' measured time over the profile's that flagged it. False where there is none
    or the cache cannot be written."""
    path = profile_path(target, draft, dtype)
    prof = _readable(path, next(target.parameters()).device)
    if prof is None:
        return False
    prof.meta["stale"] = reason
    prof.meta["stale_ratio"] = ratio
    try:
        path.write_text(prof.to_json())
    except OSError:
        return False
    return True


AGREE_RATIO = 1.25           # a new measurement this close to a flagged profile's, size by size, confirms it


def agrees(old: DeviceProfile, new: DeviceProfile, bound: float = AGREE_RATIO) -> float | None:
    """The largest ratio between the two profiles' costs (fastest path, each size both measured)
    when every one is within `bound` (either way), else None."""
    worst = 1.0
    for role in ("verify", "draft"):
        a, b = old.best_ms(role), new.best_ms(role)
        if a.keys() != b.keys():
            return None
        for n in a:
            worst = max(worst, a[n] / b[n], b[n] / a[n])
    return worst if worst <= bound else None


def settle(old: DeviceProfile, new: DeviceProfile) -> DeviceProfile:
    """A flagged profile measured again: where the new figures agree with it (`agrees`), the old
    ones stay (with the flag cleared), so that the kernel paths and the trees they price, and
    with them a bfloat16 run's output, do not move with measuring noise; else the new profile."""
    if new.meta.get("provisional") or old.meta.get("provisional"):
        return new                  # a busy measurement on either side confirms nothing
    worst = agrees(old, new)
    if worst is None:
        return new
    kept = copy.deepcopy(old)
    # the rounds' ratio that flagged it is then how decoding compares with these figures on this
    # machine (the work around a forward that a profile does not time), not a change: expected from now
    kept.meta.update(stale=None, stale_ratio=None, provisional=None,
                     calibration_s=new.meta.get("calibration_s", 0.0),
                     confirmed={"flag": old.meta.get("stale"), "largest_ratio": round(worst, 3),
                                "observed": old.meta.get("stale_ratio")})
    return kept


def load_or_measure(target, draft=None, measure_if_missing: bool = True, force: bool = False,
                    quiet: bool = False, **kwargs) -> DeviceProfile | None:
    """The cached profile for this setup, measured (and cached) on first use, when `force`d, or when
    the cached one is flagged and the machine is quiet now (`load_cached`).

    A measurement says one line (`mcsd.loading.progress.say`: stderr, or the
    server's log) unless `quiet`, and a second when the machine was busy
    meanwhile or it was cut short at `CALIBRATION_BUDGET_S` (the profile is
    then provisional). A cached
    profile flagged stale that the new measurement confirms keeps its figures
    (`settle`). Keyword arguments go to `measure`; the
    default is a quick calibration (`CALIBRATION_REPEATS`).
    """
    path = profile_path(target, draft)
    prof = None if force else load_cached(target, draft)
    if prof is not None or not measure_if_missing:
        return prof
    seen = _written_at(path)
    why = _why_measure(target, draft, path, force)
    with _measuring(path, quiet):
        if not force and _written_at(path) != seen:   # another process measured it while this one waited
            prof = _readable(path, next(target.parameters()).device)
            if prof is not None:
                return prof
        return _measure_and_keep(target, draft, path, quiet, kwargs, why)


def _why_measure(target, draft, path: Path, force: bool) -> str:
    """Why the profile at `path` is measured, for the line that says so."""
    if force:
        return "measured again as asked"
    cached = _readable(path, next(target.parameters()).device)
    if cached is not None and needs_remeasure(cached):
        flag = "measured on a busy machine" if cached.meta.get("provisional") else "contradicted by later runs"
        return f"the cached ones were {flag}, and the machine is quiet now"
    n = torch.get_num_threads()
    others = sorted(_counts_cached(target, draft, None, None))
    if others:
        return f"none cached for {n} thread{'s' if n != 1 else ''}, only for {' and '.join(map(str, others))}"
    return "none cached yet"


def _written_at(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


@contextlib.contextmanager
def _measuring(path: Path, quiet: bool = False):
    """One process at a time measures the profile at `path`: an exclusive lock on `<path>.lock`, which
    holds the holder's process id. Waits `LOCK_WAIT_S` at most, then says which process holds it and
    goes on without it (no lock either where the cache cannot be written or the platform has no
    `fcntl`: each process then measures)."""
    try:
        import fcntl
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        if _lock(fd, fcntl, time.monotonic() + LOCK_WAIT_S):
            _name_holder(fd)
        elif not quiet:
            holder = _holder(fd)
            say(f"the costs at {path} have been locked for measuring for {LOCK_WAIT_S:.0f}s by "
                f"{f'process {holder}' if holder else 'another process'} (stopped or hung?); measuring "
                f"them here without waiting further")
        yield
    finally:
        os.close(fd)                                 # releases the lock where it was taken


def _lock(fd: int, fcntl, deadline: float) -> bool:
    """The exclusive lock on `fd`, waited for until `deadline` (time.monotonic()); False past it."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(LOCK_POLL_S, max(0.0, deadline - time.monotonic())))
        except OSError:
            return True                              # a file system without locks: each process measures


def _name_holder(fd: int) -> None:
    """Write this process's id into the lock file it holds (for a waiter's message)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError:
        pass


def _holder(fd: int) -> int | None:
    """The process id the lock's holder wrote into it, or None."""
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _measure_and_keep(target, draft, path: Path, quiet: bool, kwargs, why: str | None = None) -> DeviceProfile:
    flagged = _readable(path, next(target.parameters()).device)
    if flagged is not None and not flagged.meta.get("stale"):
        flagged = None
    if not quiet:
        dtype = str(next(target.parameters()).dtype).replace("torch.", "")
        if quant.attached(target):
            dtype = f"q4 weights{' on 8-bit activations' if quant.on_8bit_activations(target) else ''}, " \
                    f"{dtype} compute"
        n = torch.get_num_threads()
        say(f"measuring this machine's costs for {_model_name(target)} ({dtype}, {n} thread"
            f"{'s' if n > 1 else ''}; cached in {path.parent}){f': {why}' if why else ''}...")
    unwritable = None                                 # a cache that cannot be written: the costs serve this run
    try:
        with cache_writes(path.parent):
            path.parent.mkdir(parents=True, exist_ok=True)
    except ConfigError as exc:
        unwritable = str(exc)
    kwargs.setdefault("repeats", CALIBRATION_REPEATS)
    kwargs.setdefault("budget_s", CALIBRATION_BUDGET_S)
    prof = timing.measure(target, draft, **kwargs)
    if flagged is not None:
        prof = settle(flagged, prof)
        if prof.meta.get("confirmed") and not quiet:
            say(f"measured again within {prof.meta['confirmed']['largest_ratio'] - 1:.0%} of the cached "
                f"costs, which stay")
    if prof.meta.get("provisional") and not quiet:
        say(f"the machine was busy while measuring ({prof.meta['provisional']}): these costs serve "
            f"until a quieter start measures again")
    if unwritable is None:
        try:
            with cache_writes(path.parent):
                path.write_text(prof.to_json())
        except ConfigError as exc:
            unwritable = str(exc)
    if unwritable is not None:
        _UNWRITTEN[path] = prof                       # measured once a process, not at every load
        if not quiet:
            say(f"{unwritable.split(';')[0]}; these costs serve this process only")
    return prof
