"""What a person sees while models load: a line per stage of the one-time setup, bars only in a terminal.

- Loading a ready model (every run after the first) prints nothing:
  transformers' own bars ("Loading weights") are switched off around our loads.
- The one-time download and conversion of a preset's target prints a line per
  stage with its time and, when stderr is a terminal, the bars of pip and of
  transformers' GGUF reader.
- When stderr is not a terminal (a log file, a pipe, CI), no bars at all. The
  GGUF reader's bar has no switch but tqdm's own environment setting, read when
  tqdm is imported, so the command line sets it first (`no_bars_off_terminal`).
  From Python, set TQDM_DISABLE=1 yourself for the same effect.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

_BAR_SWITCHES = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")   # tqdm's and huggingface_hub's own


_logger: list = []          # a logging.Logger that takes `say`'s lines instead of stderr (`log_to`)


def say(message: str) -> None:
    """One line on stderr, prefixed so it reads apart from the generated text; or, in a process
    that logs (`log_to`), one INFO record of its logger, in its format."""
    if _logger:
        _logger[0].info(message)
        return
    print(f"mcsd: {message}", file=sys.stderr, flush=True)


def log_to(logger) -> None:
    """From now on `say`'s lines (measuring, compiling, converting) go to `logger` at INFO; None: back
    to stderr. For a process with a log of its own (the server)."""
    _logger[:] = [logger] if logger is not None else []


def bars_wanted() -> bool:
    """Progress bars only on a terminal, and not when the user switched them off."""
    on_terminal = sys.stderr is not None and sys.stderr.isatty()
    switched_off = any(os.environ.get(name, "").upper() in ("1", "TRUE", "YES", "ON") for name in _BAR_SWITCHES)
    return on_terminal and not switched_off


def no_bars_off_terminal() -> None:
    """When stderr is not a terminal, switch every tqdm bar in this process off. Process-wide and read
    when tqdm and transformers are imported, so it is for the command line's entry point, before those
    imports; a user's own setting of the switches wins."""
    if not bars_wanted():
        for name in _BAR_SWITCHES:
            os.environ.setdefault(name, "1")


@contextmanager
def stage(what: str):
    """One step of the one-time setup: 'mcsd: <what>...' when it starts, its time when it ends."""
    say(f"{what}...")
    t0 = time.perf_counter()
    yield
    say(f"  done in {time.perf_counter() - t0:.1f}s")


@contextmanager
def transformers_bars(enabled: bool):
    """transformers' own progress bars (loading, writing shards) on or off inside the block, as before after."""
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    _set_transformers_bars(hf_logging, enabled)
    try:
        yield
    finally:
        _set_transformers_bars(hf_logging, was)


def _set_transformers_bars(hf_logging, enabled: bool) -> None:
    if enabled != hf_logging.is_progress_bar_enabled():
        (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
