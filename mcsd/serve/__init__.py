"""`mcsd-serve`: the engine behind OpenAI's HTTP API.

    protocol   requests checked field by field, mapped onto `TreeDecoder.stream`; answers, chunks, errors
    processors the logits processors a request adds (OpenAI's penalties, the logprobs recorder, test faults)
    engine     the worker thread that owns the decoder, its bounded FIFO queue, cancellation, time limits
    metrics    Prometheus text exposition
    app        the Starlette routes: auth, body limit, server-sent events
    cli        flags (mcsd-generate's model flags and the server's own), start-up, graceful shutdown

Needs the `serve` extra (starlette, uvicorn); nothing else in mcsd imports this package.
"""
