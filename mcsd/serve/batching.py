"""The engine behind `mcsd-serve --max-batch B` (B > 1): one worker thread decodes up to B generations
together (`mcsd.decoding.batch.BatchDecoder`), continuously.

It answers the same jobs as `mcsd.serve.engine.Engine` (the HTTP side cannot tell them apart) from
the same queue. At each round boundary the worker takes queued jobs into the batch while fewer than
B jobs are in it, every one at once (a burst joins in one round, its prompts prefilled together);
each of a job's runs (prompts times `n` choices) takes a slot of its own as slots free, the job
holding the fewest slots first, so one job of many runs cannot keep the others out. Jobs the worker
would take at once do not count as waiting: `--max-queue` bounds the jobs beyond them (then a 429).
A long prompt goes in chunks under the round's prompt budget, so the others' rounds go on. A job
alone in the batch runs the lone round (its drafter's trees: `mcsd.decoding.batch`).

After every round each advanced run's tokens go to its job's channel; a job whose client left or
whose time ran out is cancelled before the next round, its slots free for that round. A run whose
own part of a round raises fails its job alone, and so does an exception while its tokens,
log-probabilities or figures are reported; an exception in the shared forward fails every job in
flight (their slots' states are unknown), and the worker goes on with the next.

Whether an answer is the one the lone decoder gives: see `mcsd.decoding.batch` (bit for bit on the
native q4 layers; the `mcsd` field's `batch_exact` says so per answer).
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
        max_queue: jobs that may wait beyond those in the batch and those it takes at its next round
            (while fewer than `max_batch` jobs are in it); one more is refused.
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
        """Generations being decoded: those holding a slot (at most `max_batch`)."""
        if self.batch is None:
            return super().running
        return sum(1 for r in list(self.batch.slots) if r is not None)

    @property
    def busy(self) -> bool:
        return bool(self.flights) or super().busy

    def _room(self) -> int:
        """Queued jobs the worker takes into the batch at its next round: while fewer than `max_batch`
        jobs are in it (one at a time as `Engine` where it answers so)."""
        if self.batch is None and (self.max_batch is None or self._ready.is_set()):
            return super()._room()
        return max(0, self.max_batch - len(self.flights))

    def _in_flight(self) -> list[Job]:
        return [flight.job for flight in list(self.flights)] + super()._in_flight()

    # ------------------------------------------------------------------ the worker thread

    def _serve(self) -> None:
        if self.batch is None:
            self._one_at_a_time()
        else:
            self._batched()

    def _prepare(self) -> None:
        self.batch = self._batch_decoder()
        if self.batch is not None:
            cache, exact = self.batch.cache, self.batch.exact
            bound = "no bound: the model states no context window" if cache.bound_bytes is None else \
                f"at most {cache.bound_bytes / 2**20:.0f} MiB ({cache.slots} slots x {cache.limit} positions)"
            log.info("batched: %d slots, their cache %s; a batched answer is %s", self.max_batch, bound,
                     "bit for bit the lone one (native q4 layers)" if exact else
                     "not guaranteed the lone one (see docs/server.md)")

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
        """The worker's loop: a round over every slot at a time, jobs joining as slots free. Whatever a
        job's reporting raises fails that job alone; the loop goes on."""
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
                    try:
                        self.metrics.round(self.batch.last_batch, self.batch.last_rows)
                    except Exception as exc:          # the figures are not worth a request
                        log.error("batch metrics failed: %s: %s", type(exc).__name__, exc, exc_info=True)
            for request in advanced:
                try:
                    self._report(request)
                except Exception as exc:              # this request's reporting: its job fails alone
                    _log_failure(exc)
                    flight = self._flight_of(request)
                    if flight is not None:
                        self._end(flight, "error", exc)

    def _take(self, block: bool) -> bool:
        """Move queued jobs into the batch while fewer than `max_batch` are in it (waiting for one when
        the batch is empty), each with all its runs: they take slots as slots free, the job holding the
        fewest first. Returns True where the stop sentinel came."""
        while len(self.flights) < self.max_batch:
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
                    request = self.batch.submit(run.prompt_ids, group=job, **run.options)
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
        if flight in self.flights:
            self.flights.remove(flight)
        flight.job.emit(*event)

    def _flight_of(self, request) -> _Flight | None:
        return next((f for f in self.flights if request in f.requests), None)

    def _report(self, request) -> None:
        flight = self._flight_of(request)
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
