"""llama.cpp in a process of its own, for the benchmark's `llama_cpp` method.

Why a second process: llama.cpp and torch each bring an OpenMP runtime, and in one process the two
fight over the cores (on 2 cores llama.cpp ran 6.7 tokens/s beside torch and about 60 alone). So the
benchmark starts this file once per session as a child (`LlamaCppWorker`), the child loads the GGUF,
and each prompt is decoded and timed there; the parent gets the tokens and the child's own seconds
back, so the pipe's round trip is not in the figure. Between requests the child is blocked reading
its pipe, and while it decodes the parent is blocked reading the reply: one engine runs at a time.

The protocol is one JSON object a line. The child first answers `{"ready": true}` (or `{"error":
...}` and exits); then, for each request `{"op": "generate", "ids": [...], "max_new_tokens": n,
"temperature": t, "top_p": p, "seed": s, "stop_ids": [...]}`, it answers `{"tokens": [...],
"seconds": x}` or `{"error": "..."}`; `{"op": "close"}` ends it. The child's standard output is
kept for the protocol alone: whatever llama.cpp prints goes to standard error.

Limitations: one request at a time; a worker that hangs (rather than dies) blocks the caller.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Protocol


class WorkerError(RuntimeError):
    """The worker failed: it died, refused to start, or answered a request with an error."""


class Engine(Protocol):
    def generate(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_ids: list[int] = ()) -> tuple[list[int], float]:
        """The new tokens (a stop id included, as the engine's other methods count it) and the seconds
        the decoding took, prompt processing included."""


# ---- the child ------------------------------------------------------------------------------------

class LlamaCppEngine:
    """llama-cpp-python's `Llama` on a GGUF: greedy (top-1) or sampled, the prompt given as ids; with
    `lookup` N > 0, drafting N tokens a step by its own prompt lookup (`LlamaPromptLookupDecoding`,
    n-grams of the prompt and the output so far), verified by the model."""

    def __init__(self, model_path: str, threads: int, n_ctx: int = 2048, lookup: int = 0):
        from llama_cpp import Llama
        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        # with a draft model llama-cpp-python keeps every position's logits, but sizes their buffer by
        # the logits_all it was given (n_batch rows without): a prompt past n_batch then overflows it
        self.llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False, draft_model=draft, logits_all=bool(lookup))

    def generate(self, ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=None, stop_ids=()):
        llm = self.llm
        stop = {llm.token_eos(), *stop_ids}
        tokens: list[int] = []
        llm.reset()
        t0 = time.perf_counter()
        if temperature:
            llm.set_seed(seed)
        # min_p 0: llama-cpp-python's default (0.05) would cut tokens that the other engines' top-p keeps
        for tok in llm.generate(ids, top_k=0 if temperature else 1, top_p=top_p, min_p=0.0, temp=temperature,
                                repeat_penalty=1.0, reset=True):
            tokens.append(int(tok))
            if tok in stop or len(tokens) >= max_new_tokens:
                break
        return tokens, time.perf_counter() - t0


def serve(engine: Engine, requests: IO[str], replies: IO[str]) -> None:
    """Answer requests, one JSON line each, until "close" or the end of `requests`. Blocking reads:
    between requests the process sleeps on its pipe."""
    for line in requests:
        request = json.loads(line)
        op = request.pop("op", None)
        if op == "close":
            return
        try:
            if op != "generate":
                raise ValueError(f"unknown op {op!r}")
            tokens, seconds = engine.generate(**request)
            reply = {"tokens": tokens, "seconds": seconds}
        except Exception as exc:  # noqa: BLE001 - the caller gets it as a WorkerError
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def protocol_streams() -> tuple[IO[str], IO[str]]:
    """Standard input, and a private copy of standard output for the replies; file descriptor 1 itself
    is pointed at standard error, so a native library's prints cannot corrupt the protocol."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return sys.stdin, replies


def run_worker(make_engine) -> int:
    """A worker's main: build the engine, say ready (or why not), serve."""
    requests, replies = protocol_streams()
    try:
        engine = make_engine()
    except Exception as exc:  # noqa: BLE001 - reported to the parent in one line
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        replies.flush()
        return 1
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    serve(engine, requests, replies)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="llama.cpp worker for the benchmark (speaks JSON lines on stdio)")
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--lookup", type=int, default=0, help="prompt-lookup draft tokens a step (0: none)")
    args = ap.parse_args(argv)
    return run_worker(lambda: LlamaCppEngine(args.model, args.threads, args.n_ctx, args.lookup))


# ---- the parent -----------------------------------------------------------------------------------

class Worker:
    """A worker process and its pipe. Started (and waited for until ready) on construction; `close`
    asks it to exit, and ends it if it does not within `close_timeout` seconds."""

    def __init__(self, argv: list[str], name: str = "worker", close_timeout: float = 10.0,
                 env: dict | None = None):
        self.name, self.close_timeout = name, close_timeout
        self._stderr = tempfile.TemporaryFile()           # a file, not a pipe: it can never fill and block the child
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1, env=env)
        try:
            self._reply("starting")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def generate(self, ids: list[int], max_new_tokens: int, **settings) -> tuple[list[int], float]:
        """Decode in the worker: its tokens and its own timing of the decoding (no pipe time)."""
        self._send({"op": "generate", "ids": list(ids), "max_new_tokens": max_new_tokens, **settings})
        reply = self._reply("generating")
        return [int(t) for t in reply["tokens"]], float(reply["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "close"})
                self.proc.wait(self.close_timeout)
            except (WorkerError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            with contextlib.suppress(OSError):          # a request left in a dead worker's pipe cannot be flushed
                stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, request: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._died("taking a request") from None

    def _reply(self, doing: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise self._died(doing)
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"{self.name} failed {doing}: {reply['error']}")
        return reply

    def _died(self, doing: str) -> WorkerError:
        code = self.proc.wait()
        try:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        except ValueError:
            how = f"signal {-code}"
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-5:]
        return WorkerError(f"{self.name} (pid {self.proc.pid}) died while {doing} ({how})"
                           + (": " + " | ".join(tail) if tail else ""))


class LlamaCppWorker(Worker):
    """llama.cpp on `model_path` in a child process running this file (which imports no torch)."""

    def __init__(self, model_path: str | Path, threads: int, n_ctx: int = 2048, lookup: int = 0):
        super().__init__([sys.executable, str(Path(__file__).resolve()), "--model", str(model_path),
                          "--threads", str(threads), "--n-ctx", str(n_ctx), "--lookup", str(lookup)],
                         name="llama.cpp worker")


if __name__ == "__main__":
    sys.exit(main())
