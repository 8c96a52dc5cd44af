"""Aggregate tokens/s and request latency of `mcsd-serve` against the number of concurrent clients.

For each server configuration (`--max-batch 1`, the server one sequence at a time, and each batched
size asked for) the script starts `python -m mcsd.serve` in a process of its own with the given
flags, waits for /health, and then, for each client count C, runs C clients at once, each sending
`--requests` chat requests one after another (held-out Spec-Bench prompts in rotation, greedy,
`--max-tokens` each). It reports per (server, clients): the aggregate completion tokens/s over the
wall time of the whole level, and the p50 / p95 request latency (request sent to answer read). The
server is stopped with SIGTERM between configurations. A benchmark, not a test: run it on a quiet
machine.

    python benchmarks/serve_concurrency.py --max-batch 1,4,8 --clients 1,2,4,8,16 --requests 4 \\
        --out serve_concurrency.json [--plot serve_concurrency.png] [-- server flags ...]

Flags after `--` go to every server (e.g. `-- --target PATH --draft PATH --dtype float32`); without
them the servers run the embedded pair with their defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m mcsd.serve FLAGS --port P` in its own process, ready once /health answers."""

    def __init__(self, flags: list[str], log: Path, timeout_s: float = 900):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "mcsd.serve", *flags, "--port", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=dict(os.environ, TQDM_DISABLE="1"))
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mcsd-serve exited with {self.proc.returncode}; see {log}")
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                if health.status_code == 200:
                    self.model = health.json()["model"]
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mcsd-serve did not answer /health in {timeout_s:.0f} s; see {log}")
            time.sleep(0.5)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return self.proc.returncode


def run_level(server: Server, prompts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    """C clients at once, each sending `requests` requests in turn; aggregate tokens/s and latencies."""
    def client(i: int) -> list[tuple[float, int]]:
        done = []
        with httpx.Client(timeout=3600) as http:
            for k in range(requests):
                body = {"model": server.model, "max_tokens": max_tokens, "temperature": 0,
                        "messages": [{"role": "user", "content": prompts[(i * requests + k) % len(prompts)]}]}
                t0 = time.perf_counter()
                r = http.post(server.url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                done.append((time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]))
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for per_client in pool.map(client, range(clients)) for x in per_client]
    wall = time.perf_counter() - t0
    latencies = sorted(s for s, _ in results)
    tokens = sum(n for _, n in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "p50_s": statistics.median(latencies),
            "p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]}


def held_out_prompts(path: str | None) -> list[str]:
    from mcsd.loading.data import load_prompts
    return [p.text for p in load_prompts(path, "heldout")]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-batch", type=_ints, default=[1, 4], help="server configurations (default 1,4)")
    p.add_argument("--clients", type=_ints, default=[1, 2, 4, 8, 16], help="concurrency levels")
    p.add_argument("--requests", type=int, default=4, help="requests each client sends (default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    p.add_argument("--prompts", default=None, help="a Spec-Bench style JSONL (default: the shipped file)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="plot tokens/s against clients into this image (matplotlib)")
    args = p.parse_args(argv)
    prompts = held_out_prompts(args.prompts)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.max_batch:
            server = Server([*server_flags, "--max-batch", str(batch), "--max-queue", str(4 * max(args.clients))],
                            Path(tmp) / f"server-{batch}.log")
            try:
                for clients in args.clients:
                    level = {"max_batch": batch, **run_level(server, prompts, clients, args.requests,
                                                             args.max_tokens)}
                    results.append(level)
                    print(f"max-batch {batch:>2}  clients {clients:>2}  {level['tokens_per_s']:8.2f} tokens/s  "
                          f"p50 {level['p50_s']:7.2f} s  p95 {level['p95_s']:7.2f} s", flush=True)
            finally:
                if server.stop() != 0:
                    print(f"mcsd-serve --max-batch {batch} did not exit 0", file=sys.stderr)
                    return 1
    if args.out:
        Path(args.out).write_text(json.dumps({"server_flags": server_flags, "results": results}, indent=2) + "\n")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for batch in args.max_batch:
            rows = [r for r in results if r["max_batch"] == batch]
            ax.plot([r["clients"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o",
                    label=f"--max-batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("aggregate tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
