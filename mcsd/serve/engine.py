"""The engine behind the server: one worker thread owns the decoder and answers jobs one at a time,
in arrival order, from a bounded queue.

The decoder is built on the worker thread itself (models loaded, costs calibrated there), so that
whatever torch and mcsd keep per thread (thread count, matmul paths) belongs to the thread that decodes.

A job is a request's generations (its prompts times its `n` choices), run one after another through
`TreeDecoder.stream`. After every round the worker passes the round's tokens to the job's asyncio
queue and checks whether the job was cancelled (its client left) or ran past its time limit; either
closes the generation there, so the decoder is free again within one round. An exception inside a
generation, or while its tokens are reported, ends that job with an "error" event; the worker goes
on with the next job. Should the worker itself end (an error outside any job), every job in flight
and queued gets its "error" at once, new ones are refused, and `/health` says so (503).

Limitations: one sequence at a time (`mcsd.serve.batching.BatchEngine`, `--max-batch`, decodes
several in one forward); a job with many choices holds the decoder until all are done.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .protocol import recorder as logprobs_recorder

log = logging.getLogger("mcsd.serve")


@dataclass
class Run:
    """One generation of a job: prompt ids, `TreeDecoder.stream` keywords, the choice index it answers."""

    prompt_ids: list[int]
    options: dict
    index: int = 0


class Job:
    """A request's runs and the channel its events come back on.

    Events (tuples, put on `events` in the event loop's thread):
        ("tokens", index, new_tokens, logprob rows or None): a round's tokens for choice `index`;
            rows (from a `TokenLogprobs` in the options) are (log-probability, alternatives) per token.
        ("done", index, GenerationOutput): that choice finished.
        ("end",): every run finished.
        ("error", exception), ("timeout",), ("cancelled",): the job ended there.

    Args:
        runs: what to generate.
        loop: the event loop the events are delivered on.
        arrived: when the request arrived (time.monotonic()); the time limit and TTFT count from it.
        timeout_s: the job's time limit, queueing included.
    """

    def __init__(self, runs: list[Run], loop: asyncio.AbstractEventLoop, arrived: float, timeout_s: float):
        self.runs, self.loop, self.arrived = runs, loop, arrived
        self.deadline = arrived + timeout_s
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.started: float | None = None            # when the worker took it
        self.first_token: float | None = None
        self.watch = None                             # the HTTP side's task that ends when the client leaves

    def ended(self) -> str | None:
        """"cancelled" where the client left, "timeout" past the time limit, else None."""
        if self.cancel.is_set():
            return "cancelled"
        return "timeout" if time.monotonic() > self.deadline else None

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:                          # the loop is closed: nobody is listening any more
            pass


class QueueFull(Exception):
    """The queue holds `max_queue` jobs already."""


class Draining(Exception):
    """The server is shutting down and takes no new jobs."""


class WorkerGone(Exception):
    """The decoder's worker thread has ended: no job can be answered."""


class Engine:
    """The decoder's single worker thread and its bounded FIFO queue.

    Args:
        build: called once on the worker thread; returns the `TreeDecoder`.
        max_queue: jobs that may wait (those the worker takes at once not counted: the next one while
            it is idle); one more is refused.
        metrics: a `mcsd.serve.metrics.Metrics` the worker reports generations to, or None.

    Attributes:
        died: why the worker thread ended while serving, or None.
    """

    def __init__(self, build: Callable[[], object], max_queue: int, metrics=None):
        self._build, self.metrics = build, metrics
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue()     # bounded in `submit`, by what may wait
        self.died: str | None = None
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="mcsd-decoder", daemon=True)
        self.decoder = None
        self.current: Job | None = None
        self.draining = False
        # held while a job is checked and queued, and while draining starts: a job is either queued
        # before the stop marker (and answered) or refused, never queued behind the marker unanswered
        self._admit = threading.Lock()

    # ------------------------------------------------------------------ control (any thread)

    def start(self) -> None:
        """Start the worker and wait until the decoder is built; re-raises what building raised."""
        self._thread.start()
        self._ready.wait()
        if self._build_error is not None:
            raise self._build_error

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull, Draining or WorkerGone when it cannot be taken. Jobs the worker
        takes at its next look (`_room`) do not count as waiting."""
        with self._admit:
            if self.draining:
                raise Draining()
            if not self.alive:
                raise WorkerGone()
            if self._queue.qsize() >= self.max_queue + self._room():
                raise QueueFull()
            self._queue.put_nowait(job)

    def _room(self) -> int:
        """Queued jobs the worker takes as soon as it looks: one while it is idle."""
        return 0 if self.busy else 1

    @property
    def alive(self) -> bool:
        """The worker thread is serving (or not started yet)."""
        return self.died is None and (self._thread.is_alive() or not self._ready.is_set())

    def drain(self) -> None:
        """Take no new jobs; those queued and running are answered."""
        with self._admit:
            self.draining = True

    def stop(self, timeout: float | None = None) -> None:
        """Answer what is queued, then end the worker."""
        self.drain()                                  # from here every submit is refused: the marker is last
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self.current is not None

    @property
    def running(self) -> int:
        """Generations being decoded (0 or 1)."""
        return int(self.busy)

    # ------------------------------------------------------------------ the worker thread

    def _work(self) -> None:
        if not self._built():
            return
        try:
            self._serve()
        except BaseException as exc:                  # outside any job: the worker ends, loudly
            self._die(exc)

    def _serve(self) -> None:
        """The worker's loop, until the stop marker."""
        self._one_at_a_time()

    def _die(self, exc: BaseException) -> None:
        """The worker is ending on `exc`: every job in flight and queued gets an "error" event, new
        ones are refused (`alive`), and the log says why."""
        log.critical("the decoder's worker stopped: %s: %s; requests are refused from now on", type(exc).__name__,
                     exc, exc_info=(type(exc), exc, exc.__traceback__))
        error = exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {exc}")
        with self._admit:                             # no job is queued behind this unanswered
            self.died = f"{type(exc).__name__}: {exc}"
            for job in self._in_flight():
                job.emit("error", error)
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.emit("error", error)

    def _in_flight(self) -> list[Job]:
        """The jobs the worker has taken and not answered."""
        return [self.current] if self.current is not None else []

    def _built(self) -> bool:
        """Build the decoder (and what the engine makes of it: `_prepare`) on this thread, then let
        start() return; False where that raised (start() re-raises it on the caller's thread)."""
        try:
            self.decoder = self._build()
            self._prepare()
        except BaseException as exc:
            self._build_error = exc
            return False
        finally:
            self._ready.set()
        return True

    def _prepare(self) -> None:
        """After the decoder is built, before the first job: nothing here."""

    def _one_at_a_time(self) -> None:
        """The worker's loop: each job answered whole before the next is taken, until the stop marker."""
        while True:
            job = self._queue.get()
            if job is None:
                return
            if ended := job.ended():
                job.emit(ended)
                continue
            self.current, job.started = job, time.monotonic()
            try:
                self._answer(job)
            except Exception as exc:                  # this request fails alone; the next one is served
                _log_failure(exc)
                job.emit("error", exc)
            finally:
                self.current = None

    def _answer(self, job: Job) -> None:
        for run in job.runs:
            recorder = logprobs_recorder(run.options)
            rounds = self.decoder.stream(run.prompt_ids, **run.options)
            emitted: list[int] = []
            while True:
                try:
                    new = next(rounds)
                except StopIteration as done:
                    out = done.value
                    break
                self._send_tokens(job, run, recorder, emitted, new)
                if ended := job.ended():
                    rounds.close()                    # the generation ends here; the decoder is free
                    job.emit(ended)
                    return
            self._send_done(job, run, out)
        job.emit("end")

    def _send_tokens(self, job: Job, run: Run, recorder, emitted: list[int], new: list[int]) -> None:
        """A round's tokens of `run` to its job, with their logprob rows where `recorder` keeps them;
        `emitted` (what the run sent before) grows by them."""
        if new:
            self._note_first_token(job)
        rows = recorder.take(emitted + new, len(emitted)) if recorder is not None else None
        emitted += new
        job.emit("tokens", run.index, new, rows)

    def _send_done(self, job: Job, run: Run, out) -> None:
        """`run` finished with `out` (a GenerationOutput): into the metrics and to its job."""
        if self.metrics is not None:
            self.metrics.generation(out.stats)
        job.emit("done", run.index, out)

    def _note_first_token(self, job: Job) -> None:
        """A job's first generated token: its time, and the TTFT histogram's."""
        if job.first_token is None:
            job.first_token = time.monotonic()
            if self.metrics is not None:
                self.metrics.first_token(job.first_token - job.arrived)


def _log_failure(exc: Exception) -> None:
    log.error("generation failed: %s: %s", type(exc).__name__, exc, exc_info=not _expected(exc))


def _expected(exc: Exception) -> bool:
    """Errors that are the request's own (a setting the decoder refuses): no traceback in the log."""
    from ..config import ConfigError
    return isinstance(exc, ConfigError)
