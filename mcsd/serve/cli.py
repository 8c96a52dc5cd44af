"""`mcsd-serve`: the model pair chosen by `mcsd-generate`'s flags, served over OpenAI's API on uvicorn.

Start-up: the flags are checked and the address taken before anything loads (one line and exit 2
for a mistake or a port in use, as `mcsd-generate` does), then the worker thread loads the pair,
builds the decoder (measuring this machine's costs there when no profile is cached, or the cached one
is stale and the machine quiet: never inside a request) and runs one short warm-up generation, and only
then does the server listen. mcsd's own lines (measuring, compiling) go to the server's log. SIGTERM (or Ctrl-C) stops it gracefully:
new requests are refused, those queued and in flight are answered, and it exits with 0.
"""

from __future__ import annotations

import argparse
import copy
import errno
import ipaddress
import logging
import os
import signal
import socket
import sys

from ..cli.args import (
    Parser,
    UsageError,
    add_model_arguments,
    check_args,
    check_hub,
    drafter_kinds,
    join_free_values,
    parse_policy_options,
    settle_policy,
)
from ..cli.generate import build_decoder, load_models
from ..config import ConfigError
from ..errors import ModelLoadError
from ..loading.presets import DEFAULT_PRESET

log = logging.getLogger("mcsd.serve")

API_KEY_ENV = "MCSD_API_KEY"

# What mcsd-generate's own checks and loaders read besides the model flags: its defaults (requests
# bring their own settings).
_GENERATE_DEFAULTS = dict(baseline=False, max_new_tokens=1, prompt=None, prompt_file=None, prompts_file=None,
                          output=None, show_tree=None, chat=True, system=None, temperature=0.0, top_k=0, top_p=1.0,
                          seed=None, stop=[], min_p=None, typical_p=None, repetition_penalty=None,
                          no_repeat_ngram_size=None, min_new_tokens=None, logprobs=False, list_models=False,
                          stream=False, json=False)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mcsd-serve",
                description="Serve lossless tree speculative decoding over OpenAI's API (/v1/chat/completions, "
                            "/v1/completions, /v1/models, /health, /metrics). One model pair per server, chosen "
                            f"as mcsd-generate chooses it; without --target/--draft the embedded pair "
                            f"{DEFAULT_PRESET!r}. Requests are taken in arrival order and decoded together, "
                            f"as many at once as --max-batch allows.")
    add_model_arguments(p)
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the "
                          "network)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} where set, else "
                          f"no key)")
    srv.add_argument("--model-name", default=None,
                     help="the model id clients send (default: the preset name, else --target as given)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests that may wait for the decoder beyond those it takes at once (while batch "
                          "slots are free, or it is idle); one more gets a 429 (default 64)")
    srv.add_argument("--max-batch", type=_max_batch, default=None, metavar="B",
                     help="generations decoded together in one target forward a round (continuous batching: "
                          "requests join at a round boundary, long prompts go in chunks, a request's runs share "
                          "the slots fairly with other requests'); a request alone decodes with the full "
                          "drafter, beside others with context drafting only. Answers are the lone ones bit for "
                          "bit on native q4 / q4q8 weights, not guaranteed on dense, bfloat16 or torch's int4 "
                          "kernel (the answer's mcsd field says batch_exact). 1 decodes one at a time with the "
                          "full drafter; auto (the default) takes the most rows whose forward costs at most two "
                          "lone steps, from this machine's calibrated costs")
    srv.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="a request's time limit, queueing included; past it the generation stops and the "
                          "request gets a 504 (default 600)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20,
                     help="larger request bodies get a 413 (default 1 MiB)")
    srv.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    srv.add_argument("--fault-injection", action="store_true",
                     help="FOR TESTS ONLY: a prompt holding [[mcsd-fault]] raises inside its generation, one "
                          "holding [[mcsd-slow]] is slowed down. Off by default")
    p.set_defaults(**_GENERATE_DEFAULTS)
    return p


def _max_batch(text: str) -> int | None:
    """--max-batch: an integer (>= 1: `_check_server_args`), or auto (None)."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or auto, got {text!r}") from None
    return value


def _check_server_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_batch is not None and args.max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1 or auto, got {args.max_batch}")
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not args.request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.max_body_bytes < 1024:
        raise UsageError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
    if args.model_name is not None and not args.model_name.strip():
        raise UsageError("--model-name is empty: give the model id clients send, or leave the flag out")


def _model_id(args) -> str:
    if args.model_name:
        return args.model_name
    return args.target if args.target is not None else DEFAULT_PRESET


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    """The listening address taken now, before the models load (uvicorn listens on this socket later).

    Raises:
        UsageError: the port is in use or the address cannot be had.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn does: a TIME_WAIT port serves
    # answers go out as written: accepted connections inherit this (Linux), and without it an answer's
    # body waited for the client's delayed ACK of its headers, 40 ms a request on a kept-alive connection
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is in use; choose another with --port") from None
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except (socket.gaierror, UnicodeError) as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


def _build(args):
    """On the worker thread: the pair, the decoder, one warm-up generation."""
    target, draft, tokenizer = load_models(args)
    decoder, dtype_reason = build_decoder(args, target, draft, tokenizer)
    log.info("decoder: policy %s, tree %s, dtype %s, weights %s, threads %d (%s), attention %s", args.policy,
             args.tree, dtype_reason or args.dtype, args.weights, args.thread_choice.threads,
             args.thread_choice.reason, decoder.attention)
    decoder.generate("Hello", max_new_tokens=4)          # first-call set-up, off the first request's clock
    return decoder


def serve(args) -> int:
    import uvicorn  # noqa: F401  (the serve extra: missing, it says so before anything loads)

    from ..forward.threads import snapshot
    from ..loading.progress import log_to

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_server_args(args)
    api_key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    args.load_since = snapshot()
    from ..drafting import pearl  # noqa: F401  (registers the "pearl" execution mode)
    parse_policy_options(args.policy_option)
    settle_policy(args, drafting=not drafter_kinds(args)[2])
    check_args(args)
    check_hub(args)
    sock = _bind(args.host, args.port)
    log_to(logging.getLogger("mcsd"))                # measuring and compiling lines, in this log's format
    try:
        return _run(args, sock, api_key)
    finally:
        log_to(None)
        sock.close()


def _run(args, sock: socket.socket, api_key: str | None) -> int:
    """Load, build and warm the decoder, then answer requests on `sock` until stopped."""
    import uvicorn

    from .app import Settings, create_app
    from .engine import Engine
    from .metrics import Metrics

    port = sock.getsockname()[1]
    # the gauges read `engine` when /metrics is rendered, by then assigned below
    metrics = Metrics(lambda: {"queue_depth": engine.queue_depth, "running": engine.running})
    if args.max_batch is None or args.max_batch > 1:
        from .batching import BatchEngine
        engine = BatchEngine(lambda: _build(args), args.max_batch, args.max_queue, metrics)
    else:
        engine = Engine(lambda: _build(args), args.max_queue, metrics)
    log.info("loading %s", _model_id(args))
    engine.start()
    decoder = engine.decoder
    settings = Settings(model_ids=(_model_id(args),), tokenizer=copy.deepcopy(decoder.tokenizer),
                        context_window=decoder.context_window,
                        vocab_size=decoder.target.model.get_input_embeddings().weight.shape[0],
                        api_key=api_key, max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout,
                        fault_injection=args.fault_injection)
    app = create_app(engine, settings, metrics)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not engine.draining:
                n = engine.queue_depth + engine.running
                log.info("%s: finishing %d request%s in flight and queued, refusing new ones",
                         signal.Signals(sig).name, n, "" if n == 1 else "s")
            engine.drain()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, log_level=args.log_level,
                            access_log=False, lifespan="off", timeout_graceful_shutdown=None)
    server = Server(config)
    # uvicorn raises the signal it stopped for once it is done; a handler that ignores it lets us exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    if args.fault_injection:
        log.warning("--fault-injection is on: prompts can fail or slow their generation on purpose (tests only)")
    if not _is_loopback(args.host):
        log.warning("listening on %s: reachable from other machines%s", args.host,
                    "" if api_key else "; no API key is set (--api-key or $" + API_KEY_ENV + ")")
    log.info("serving %r on http://%s:%d (OpenAI API under /v1; %s)", settings.model_ids[0], args.host, port,
             "API key required" if api_key else "no API key")
    server.run(sockets=[sock])
    engine.stop(timeout=5)
    if not server.started:                           # uvicorn could not start
        return 1
    log.info("stopped")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(join_free_values(list(sys.argv[1:] if argv is None else argv)))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        return serve(args)
    except (UsageError, ConfigError, ModelLoadError) as exc:
        print(f"mcsd-serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                        # Ctrl-C while the models load
        return 130


def entry() -> None:
    """The `mcsd-serve` command."""
    from ..loading.progress import no_bars_off_terminal
    no_bars_off_terminal()
    sys.exit(main())


if __name__ == "__main__":
    entry()
