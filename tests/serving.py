"""A real `mcsd-serve` in a process of its own, for the tests that talk to it over HTTP."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(flags: list[str], log: Path, timeout_s: float = 600):
    """`python -m mcsd.serve FLAGS --port P` started, waited for until /health answers, yielding P;
    stopped with SIGTERM afterwards, which must end it with status 0 (it drains)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    env.pop("MCSD_API_KEY", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mcsd.serve", *flags, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
