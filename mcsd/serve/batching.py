"""The engine behind `mcsd-serve --max-batch B` (B > 1): one worker thread decodes up to B generations
together (`mcsd.decoding.batch.BatchDecoder`), continuously.

It answers the same jobs as `mcsd.serve.engine.Engine` (the HTTP side cannot tell them apart) from
the same bounded queue: a job is taken off the queue at a round boundary while a slot is free for
it (so the queue, and its 429 when full, holds what waits beyond the running generations); each of
its runs (prompts times `n` choices) takes a slot of its own. A long prompt goes in chunks under
the round's prompt budget, so the others' rounds go on. After every round each advanced run's
tokens go to its job's channel; a job whose client left or whose time ran out is cancelled before
the next round, its slots free for that round. A run whose own part of a round raises fails its job
alone; an exception in the shared forward fails every job in flight (their slots' states are
unknown), and the worker goes on with the next.

Every answer is the one the lone decoder gives (see `mcsd.decoding.batch`).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from .engine import Engine, Job, _log_failure
from .protocol import recorder as logprobs_recorder

log = logging.getLogger("mcsd.serve")


class _Flight:
    """A job in the batch: its runs' requests and what each has streamed."""

    def __init__(self, job: Job):
        self.job = job
        self.requests: dict = {}                     # Request -> (Run, TokenLogprobs or None, emitted tokens)
        self.open = len(job.runs)                    # runs whose "done" is not sent yet (several finish in a round)


class BatchEngine(Engine):
    """A worker thread that decodes up to `max_batch` generations together, and its bounded FIFO queue
    (starting, queueing, draining and stopping as `Engine` does; the worker is its own).

    With `max_batch` None (`--max-batch auto`) the slots come from the decoder's calibrated costs once
    it is built (`mcsd.decoding.row_budget.max_batch`); where that is one, or the decoder cannot decode
    in a batch (a target off the engine's own forward), the worker answers one job at a time with the
    whole decoder, as `Engine` does, and says why in the log.

    Args:
        build: called once on the worker thread; returns the `TreeDecoder`.
        max_batch: generations decoded together (slots), or None: from the costs.
        max_queue: jobs that may wait beyond the running ones; one more is refused.
        metrics: a `mcsd.serve.metrics.Metrics`, or None.
        batch: builds the `BatchDecoder` from the decoder and `max_batch` (default: `BatchDecoder` itself).
    """

    def __init__(self, build: Callable[[], object], max_batch: int | None, max_queue: int, metrics=None,
                 batch: Callable | None = None):
        super().__init__(build, max_queue, metrics)
        self.max_batch, self._make_batch = max_batch, batch
        self.batch = None
        self.flights: list[_Flight] = []

    @property
    def running(self) -> int:
        """Generations in the batch (decoding, or waiting there for a slot)."""
        if self.batch is None:
            return super().running
        return len(self.batch.active) + len(self.batch.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.flights) or super().busy

    # ------------------------------------------------------------------ the worker thread

    def _work(self) -> None:
        if not self._built():
            return
        if self.batch is None:
            self._one_at_a_time()
        else:
            self._batched()

    def _prepare(self) -> None:
        self.batch = self._batch_decoder()

    def _batch_decoder(self):
        """The `BatchDecoder` of `max_batch` slots, or None: one at a time (auto only)."""
        from ..config import ConfigError
        from ..decoding.batch import BatchDecoder
        from ..decoding.row_budget import max_batch
        auto = self.max_batch is None
        if auto:
            decoder = self.decoder
            self.max_batch, why = max_batch(decoder.context_costs or decoder.calibration.costs())
            log.info("--max-batch auto: %d (%s)", self.max_batch, why)
            if self.max_batch == 1:
                return None
        try:
            return (self._make_batch or BatchDecoder)(self.decoder, self.max_batch)
        except ConfigError as exc:
            if not auto:
                raise
            log.info("--max-batch auto: one at a time (%s)", exc)
            self.max_batch = 1
            return None

    def _batched(self) -> None:
        """The worker's loop: a round over every slot at a time, jobs joining as slots free."""
        stopping = False
        while not (stopping and not self.flights and self._queue.empty()):
            stopping = self._take(block=not self.flights) or stopping
            self._drop_ended()
            if not self.flights:
                continue
            try:
                advanced = self.batch.step()
            except Exception as exc:                  # the shared forward: every job in flight fails
                log.error("batched round failed: %s: %s", type(exc).__name__, exc, exc_info=True)
                for flight in list(self.flights):
                    self._end(flight, "error", exc)
                continue
            if self.batch.last_batch:
                log.debug("batched round: %d slots, %d rows", self.batch.last_batch, self.batch.last_rows)
                if self.metrics is not None:
                    self.metrics.round(self.batch.last_batch, self.batch.last_rows)
            for request in advanced:
                self._report(request)

    def _take(self, block: bool) -> bool:
        """Move queued jobs into the batch while a slot is free for them (waiting for one when the
        batch is empty). Returns True where the stop sentinel came."""
        while not self.batch.waiting and len(self.batch.active) < self.max_batch:
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                return False
            block = False
            if job is None:
                return True
            if ended := job.ended():
                job.emit(ended)
                continue
            flight = _Flight(job)
            job.started = time.monotonic()
            try:
                for run in job.runs:
                    request = self.batch.submit(run.prompt_ids, **run.options)
                    flight.requests[request] = (run, logprobs_recorder(run.options), [])
            except Exception as exc:                  # a setting the decoder refuses: this job alone
                for request in flight.requests:
                    self.batch.cancel(request)
                _log_failure(exc)
                job.emit("error", exc)
                continue
            self.flights.append(flight)
        return False

    def _drop_ended(self) -> None:
        """Jobs whose client left or whose time ran out leave the batch before the next round."""
        for flight in list(self.flights):
            if ended := flight.job.ended():
                self._end(flight, ended)

    def _end(self, flight: _Flight, *event) -> None:
        for request in flight.requests:
            if not request.done:
                self.batch.cancel(request)
        self.flights.remove(flight)
        flight.job.emit(*event)

    def _report(self, request) -> None:
        flight = next((f for f in self.flights if request in f.requests), None)
        if flight is None:
            return
        job = flight.job
        if request.error is not None:
            exc = request.error
            _log_failure(exc)
            self._end(flight, "error", exc)
            return
        run, recorder, emitted = flight.requests[request]
        self._send_tokens(job, run, recorder, emitted, request.new)
        if request.output is not None:
            self._send_done(job, run, request.output)
            flight.open -= 1
            if flight.open == 0:
                self.flights.remove(flight)
                job.emit("end")
