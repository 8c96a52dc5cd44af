"""The HTTP routes (Starlette): bodies read under a size limit, the API key checked, requests turned
into engine jobs through `mcsd.serve.protocol`, answers and server-sent events written back.

    POST /v1/chat/completions, POST /v1/completions   (need the API key when one is set)
    GET  /v1/models, /v1/models/{id}                   (need the API key when one is set)
    GET  /health, /metrics                             (open: for probes and scrapers)

Every error is OpenAI's shape with a 4xx/5xx status and one log line. A client that disconnects is
noticed within ~0.1 s (between events) and its job cancelled: the worker stops it within one round.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..config import ConfigError
from . import protocol
from .engine import Draining, Engine, Job, QueueFull, Run, WorkerGone
from .metrics import Metrics
from .processors import FAULT_MARKER, REPORT_FAULT_MARKER, SLOW_MARKER, Fault, InjectedFault, ReportFault, Slow
from .protocol import APIError

log = logging.getLogger("mcsd.serve")

DRAIN_CAP_BYTES = 64 << 20       # an oversized body is read (and dropped) up to this, so the 413 arrives


@dataclass
class Settings:
    """What the routes need besides the engine.

    Attributes:
        model_ids: the names this server answers to (the first is the one /v1/models lists).
        tokenizer: the HTTP side's own copy of the target's tokenizer (the worker keeps the other).
        context_window: the target's, or None.
        vocab_size: token ids a prompt may hold.
        api_key: required as `Authorization: Bearer KEY` on /v1/*, or None.
        max_body_bytes: larger request bodies get a 413.
        request_timeout_s: a request's time limit, queueing included.
        fault_injection: test-only markers in a prompt raise inside, or slow down, its generation.
    """

    model_ids: tuple[str, ...]
    tokenizer: object
    context_window: int | None
    vocab_size: int
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 600.0
    fault_injection: bool = False


def _requests(n: int) -> str:
    return f"{n} request" + ("" if n == 1 else "s")


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone: the server's `http.disconnect` (also what a request whose
    answer is complete receives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClientGone(Exception):
    pass


def create_app(engine: Engine, settings: Settings, metrics: Metrics) -> Starlette:
    """The Starlette application over a started engine."""
    api = _API(engine, settings, metrics)
    routes = [Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{model:path}", api.model, methods=["GET"]),
              Route("/health", api.health, methods=["GET"]),
              Route("/metrics", api.metrics_text, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: api.http_error, Exception: api.crash})


class _API:
    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics):
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.created = int(time.time())

    # ------------------------------------------------------------------ small routes

    async def health(self, request: Request) -> Response:
        if self.engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.engine.alive:
            why = self.engine.died or "it ended"
            return JSONResponse({"status": "error", "error": f"the decoder's worker stopped ({why})"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.settings.model_ids[0], "busy": self.engine.busy,
                             "queue_depth": self.engine.queue_depth})

    async def metrics_text(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except APIError as exc:
            return self._error(request, "models", exc, time.monotonic())
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            self._authorize(request)
            if request.path_params["model"] not in self.settings.model_ids:
                raise APIError(404, f"the model {request.path_params['model']!r} does not exist on this server",
                               param="model", code="model_not_found")
        except APIError as exc:
            return self._error(request, "models", exc, started)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.settings.model_ids[0], "object": "model", "created": self.created, "owned_by": "mcsd"}

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own 404 / 405, in OpenAI's shape."""
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
                                                              f"{request.url.path}"}.get(exc.status_code, exc.detail)
        return self._error(request, "other", APIError(exc.status_code, message, code="not_found" if
                                                      exc.status_code == 404 else None), time.monotonic())

    async def crash(self, request: Request, exc: Exception) -> Response:
        log.error("%s %s 500: %s: %s", request.method, request.url.path, type(exc).__name__, exc, exc_info=exc)
        self.metrics.request(_endpoint(request), 500)
        return JSONResponse(protocol.error_payload("internal server error", "server_error"), status_code=500)

    # ------------------------------------------------------------------ generation routes

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def _generate(self, request: Request, endpoint: str) -> Response:
        started = time.monotonic()
        try:
            self._authorize(request)
            req = protocol.parse(endpoint, await self._read_json(request), self.settings.model_ids)
            job, prompt_tokens = self._job(req, started)
            self.engine.submit(job)
        except QueueFull:               # Retry-After: the queue's expected wait at the mean generation time so far
            wait = max(1, round((self.engine.queue_depth + 1) * self.metrics.mean_generation_s()))
            return self._error(request, endpoint, APIError(
                429, f"the server's queue is full ({_requests(self.engine.queue_depth)} waiting); retry later",
                "rate_limit_error", code="queue_full", headers={"Retry-After": str(wait)}), started)
        except Draining:
            return self._error(request, endpoint, APIError(503, "the server is shutting down", "server_error",
                                                           code="shutting_down"), started)
        except WorkerGone:
            return self._error(request, endpoint, APIError(503, "the server's decoder has stopped (see its log)",
                                                           "server_error", code="decoder_stopped"), started)
        except APIError as exc:
            return self._error(request, endpoint, exc, started)
        except ClientDisconnect:        # the client left while sending its body: nothing to answer
            return self._gone(request, endpoint, started, "while sending its request")
        self.metrics.prompt(prompt_tokens)
        try:
            first = await self._next_event(request, job)    # a failure before any token keeps its own status
        except _ClientGone:
            self._unwatch(job)
            return self._gone(request, endpoint, started)
        if first[0] not in ("tokens", "done", "end"):
            self._unwatch(job)
            return self._failed(request, endpoint, first, started)
        if req.stream:
            return StreamingResponse(self._events(request, endpoint, req, job, first, prompt_tokens, started),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(request, endpoint, req, job, first, prompt_tokens, started)

    def _job(self, req: protocol.Request, started: float) -> tuple[Job, int]:
        """The engine job for a request: each prompt tokenised (chat: through the template), times n."""
        runs, prompt_tokens = [], 0
        for p, prompt in enumerate(req.prompts):
            text, ids = self._prompt(req, prompt)
            prompt_tokens += len(ids)
            for choice in range(req.n):
                options = protocol.generate_options(req, len(ids), choice, self.settings.context_window)
                if self.settings.fault_injection and text is not None:
                    extra = [Fault()] if FAULT_MARKER in text else [Slow()] if SLOW_MARKER in text else \
                        [ReportFault()] if REPORT_FAULT_MARKER in text else []
                    if extra:
                        options["logits_processor"] = extra + list(options.get("logits_processor", ()))
                runs.append(Run(ids, options, p * req.n + choice))
        return Job(runs, asyncio.get_running_loop(), started, self.settings.request_timeout_s), prompt_tokens

    def _prompt(self, req: protocol.Request, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids), tokenised as `mcsd-generate` tokenises its prompt (no special tokens
        added: a chat template writes its own)."""
        tokenizer = self.settings.tokenizer
        if req.endpoint == "chat":
            text = protocol.chat_prompt(prompt, tokenizer)
        elif isinstance(prompt, str):
            text = prompt
        else:
            bad = [t for t in prompt if not 0 <= t < self.settings.vocab_size]
            if bad:
                raise protocol.bad(f"prompt token id {bad[0]} is outside the vocabulary [0, "
                                   f"{self.settings.vocab_size})", param="prompt")
            return None, list(prompt)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise protocol.bad("the prompt is empty", param="messages" if req.endpoint == "chat" else "prompt")
        return text, ids

    async def _collect(self, request, endpoint, req, job, event, prompt_tokens, started) -> Response:
        """Wait for every choice; one JSON answer."""
        outputs, rows = {}, {}
        try:
            while True:
                kind = event[0]
                if kind == "tokens" and event[3] is not None:
                    rows.setdefault(event[1], []).extend(event[3])
                elif kind == "done":
                    outputs[event[1]] = event[2]
                elif kind == "end":
                    break
                elif kind != "tokens":
                    return self._failed(request, endpoint, event, started)
                event = await self._next_event(request, job)
        except _ClientGone:
            return self._gone(request, endpoint, started)
        finally:
            self._unwatch(job)
        choices, completion_tokens = [], 0
        for index in sorted(outputs):
            out = outputs[index]
            completion_tokens += len(out.tokens)
            logprobs = None
            if req.logprobs:           # the chosen tokens' from return_logprobs, the alternatives from the recorder
                found = rows.get(index, [])
                alternatives = [alts for _, alts in found] + [[]] * (len(out.tokens) - len(found))
                logprobs = protocol.token_logprobs(endpoint, self.settings.tokenizer, out.tokens,
                                                   list(zip(out.logprobs, alternatives)))
            choices.append({"index": index, "text": protocol.cut_at_stop(out.text, req.stop),
                            "finish_reason": protocol.FINISH_REASONS[out.finish_reason], "logprobs": logprobs})
        body = protocol.response(req, choices, prompt_tokens, completion_tokens, [o.stats for o in outputs.values()])
        body["mcsd"].update(self._timing(job))
        self._done(request, endpoint, 200, started, prompt_tokens, completion_tokens)
        return JSONResponse(body)

    async def _events(self, request, endpoint, req, job, event, prompt_tokens, started):
        """The server-sent events of a streamed answer, `data: [DONE]` last."""
        streams, offsets, completion_tokens, status = {}, {}, 0, 200
        tokenizer = self.settings.tokenizer
        try:
            while True:
                kind = event[0]
                if kind == "tokens":
                    _, index, new, rows = event
                    if index not in streams:
                        streams[index], offsets[index] = protocol.TextStream(tokenizer, req.stop), 0
                        if req.endpoint == "chat":
                            yield _sse(protocol.chunk(req, index, role=True))
                    text = streams[index].push(new)
                    logprobs = None
                    if rows is not None and new:
                        logprobs = protocol.token_logprobs(endpoint, tokenizer, new, rows, offsets[index])
                        if endpoint == "completion":        # the next round's text offset, from this one's
                            offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    if text or logprobs:
                        yield _sse(protocol.chunk(req, index, text, logprobs))
                elif kind == "done":
                    _, index, out = event
                    completion_tokens += len(out.tokens)
                    stream = streams.setdefault(index, protocol.TextStream(tokenizer, req.stop))
                    rest = stream.finish(protocol.cut_at_stop(out.text, req.stop))
                    if rest:
                        yield _sse(protocol.chunk(req, index, rest))
                    stats = protocol.speculation([out.stats])
                    stats.update(self._timing(job))
                    yield _sse(protocol.chunk(req, index, finish_reason=protocol.FINISH_REASONS[out.finish_reason],
                                              stats=stats))
                elif kind == "end":
                    if req.include_usage:
                        yield _sse(protocol.usage_chunk(req, prompt_tokens, completion_tokens))
                    break
                else:                                 # the answer began with status 200: the error is an event
                    error = self._event_error(event)
                    status = error.status
                    self._log_error(request, error, started)
                    yield _sse(error.payload())
                    break
                event = await self._next_event(request, job)
            yield "data: [DONE]\n\n"
        except _ClientGone:
            status = 499
        except (asyncio.CancelledError, GeneratorExit):     # the server stopped sending: the client left
            job.cancel.set()
            self._gone(request, endpoint, started)
            raise
        finally:
            job.cancel.set()                          # whatever ended the stream, the job is over
            self._unwatch(job)
        if status == 200:
            self._done(request, endpoint, 200, started, prompt_tokens, completion_tokens)
        elif status == 499:
            self._gone(request, endpoint, started)
        else:
            self.metrics.request(endpoint, status)

    async def _next_event(self, request: Request, job: Job):
        """The job's next event; _ClientGone (the job cancelled) once the client has disconnected.

        Nothing polls: the wait ends at an event from the worker, at the client's disconnect (a task
        per request waits for the server's `http.disconnect`), or at the job's time limit: waiting
        requests that woke to ask would take the interpreter's lock from the decoding thread."""
        if job.watch is None:
            job.watch = asyncio.ensure_future(_disconnected(request))
        while True:
            get = asyncio.ensure_future(job.events.get())
            left = job.deadline + 1.0 - time.monotonic()
            done, _ = await asyncio.wait({get, job.watch}, timeout=max(left, 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                return get.result()
            get.cancel()
            if job.watch in done:
                job.cancel.set()
                raise _ClientGone()
            # past its time limit and nothing from the worker (still queued, or in one long round):
            # it ends here; the worker drops it or stops it
            job.cancel.set()
            return ("timeout",)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _unwatch(job: Job) -> None:
        if job.watch is not None:
            job.watch.cancel()

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _read_json(self, request: Request):
        """The body as JSON: a 413 past the size limit (the body read and dropped, so the client gets the
        answer), a 400 for an empty body, bytes that are not UTF-8, or malformed JSON."""
        limit = self.settings.max_body_bytes
        data, size = bytearray(), 0
        async for piece in request.stream():
            size += len(piece)
            if size <= limit:
                data += piece
            elif size > DRAIN_CAP_BYTES:
                break
        if size > limit:
            raise APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                           param=None, code="request_too_large")
        if not data.strip():
            raise protocol.bad("the request body is empty: send a JSON object")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise protocol.bad(f"the request body is not UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start}",
                               code="invalid_encoding") from None
        try:
            return json.loads(text, parse_constant=_no_constant)
        except json.JSONDecodeError as exc:
            raise protocol.bad(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                               code="invalid_json") from None
        except (ValueError, RecursionError) as exc:
            raise protocol.bad(f"malformed JSON: {exc}", code="invalid_json") from None

    def _timing(self, job: Job) -> dict:
        """Queueing and time to first token, for the `mcsd` field."""
        out = {}
        if job.started is not None:
            out["queue_s"] = round(job.started - job.arrived, 4)
        if job.first_token is not None:
            out["ttft_s"] = round(job.first_token - job.arrived, 4)
        return out

    def _event_error(self, event) -> APIError:
        kind = event[0]
        if kind == "timeout":
            return APIError(504, f"the request ran past this server's time limit of "
                                 f"{self.settings.request_timeout_s:g} s", "server_error", code="timeout")
        if kind == "cancelled":
            return APIError(499, "the request was cancelled", "server_error", code="cancelled")
        exc = event[1]
        if isinstance(exc, ConfigError):             # a setting the decoder refuses for this model
            return protocol.bad(str(exc))
        if isinstance(exc, InjectedFault):
            return APIError(500, f"the generation failed: {exc}", "server_error", code="generation_failed")
        return APIError(500, f"the generation failed: {type(exc).__name__}", "server_error",
                        code="generation_failed")

    def _failed(self, request, endpoint, event, started) -> Response:
        return self._error(request, endpoint, self._event_error(event), started)

    def _gone(self, request, endpoint, started, when: str = "") -> Response:
        what = f" {when}; nothing was generated" if when else "; its generation stopped"
        log.info("%s %s 499: the client disconnected after %.2fs%s", request.method, request.url.path,
                 time.monotonic() - started, what)
        self.metrics.request(endpoint, 499)
        return Response(status_code=499)

    def _error(self, request: Request, endpoint: str, exc: APIError, started: float) -> Response:
        self._log_error(request, exc, started)
        self.metrics.request(endpoint, exc.status)
        return JSONResponse(exc.payload(), status_code=exc.status, headers=exc.headers)

    def _log_error(self, request: Request, exc: APIError, started: float) -> None:
        level = logging.ERROR if exc.status >= 500 else logging.WARNING
        log.log(level, "%s %s %d %.3fs: %s", request.method, request.url.path, exc.status,
                time.monotonic() - started, exc.message)

    def _done(self, request, endpoint, status, started, prompt_tokens, completion_tokens) -> None:
        self.metrics.request(endpoint, status)
        log.info("%s %s %d %.3fs: %d prompt + %d completion tokens", request.method, request.url.path, status,
                 time.monotonic() - started, prompt_tokens, completion_tokens)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _endpoint(request: Request) -> str:
    path = request.url.path
    return {"/v1/chat/completions": "chat", "/v1/completions": "completion"}.get(path, "other")
