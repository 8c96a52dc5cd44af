"""Aggregate tokens/s and request latency of `mcsd-serve` against the number of concurrent clients.

For each server configuration (`--max-batch 1`, the server one sequence at a time, and each batched
size asked for, `auto` included) the script starts `python -m mcsd.serve` in a process of its own
with the given flags, waits for /health, and then, for each client count C, sends the same chat
requests (`--requests` times the largest C: held-out Spec-Bench prompts in rotation, greedy,
`--max-tokens` each) from C clients at once, each sending its share one after another. It reports
per (server, clients): the aggregate completion tokens/s over the wall time of the whole level, and
the p50 / p95 request latency (request sent to answer read). The server is stopped with SIGTERM
between configurations. With `--llama-server PATH`, llama.cpp's own server (built from the source
`tools/build_llama_cpp.py --server` builds) runs the same levels on the preset's GGUF in a process
of its own, with `--llama-parallel` slots (continuous batching). A benchmark, not a test: run it on
a quiet machine.

    python benchmarks/serve_concurrency.py --max-batch 1,auto --clients 1,2,4,8,16 --requests 4 \
        --out serve_concurrency.json [--plot serve_concurrency.png] [--llama-server PATH] [-- server flags ...]

Flags after `--` go to every mcsd server (e.g. `-- --target PATH --draft PATH --dtype float32`);
without them the servers run the embedded pair with their defaults.
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


def _ints(text: str, auto: bool = False) -> list:
    values = [v.strip() for v in text.split(",") if v.strip()]
    try:
        values = [v if auto and v == "auto" else int(v) for v in values]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers{' or auto' if auto else ''}, "
                                         f"got {text!r}") from None
    if not values or min((v for v in values if v != "auto"), default=1) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m mcsd.serve FLAGS --port P` (or another server's command line ending with its port) in
    its own process, ready once /health answers."""

    def __init__(self, flags: list[str], log: Path, timeout_s: float = 900, command: list[str] | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = command or [sys.executable, "-m", "mcsd.serve"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*command, *flags, "--port", str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=dict(os.environ, TQDM_DISABLE="1"))
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{command[-1]} exited with {self.proc.returncode}; see {log}")
            try:
                health = httpx.get(self.url + "/health", timeout=2)
                if health.status_code == 200:
                    self.model = health.json().get("model", "default")
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{command[-1]} did not answer /health in {timeout_s:.0f} s; see {log}")
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


def run_level(server: Server, prompts: list[str], clients: int, total: int, max_tokens: int) -> dict:
    """The same `total` requests at every level (the first held-out prompts, in rotation), sent by C
    clients at once, client i the i-th of every C in turn; aggregate tokens/s and latencies."""
    def client(i: int) -> list[tuple[float, int]]:
        done = []
        with httpx.Client(timeout=3600) as http:
            for k in range(i, total, clients):
                body = {"model": server.model, "max_tokens": max_tokens, "temperature": 0,
                        "messages": [{"role": "user", "content": prompts[k % len(prompts)]}]}
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


def llama_server(path: str, slots: int, threads: int, max_tokens: int, log: Path) -> Server:
    """llama.cpp's server on the default preset's GGUF: `slots` parallel slots (continuous batching),
    each with room for a prompt and `max_tokens` more."""
    from mcsd.loading.models import fetch_preset_gguf
    from mcsd.loading.presets import DEFAULT_PRESET, PRESETS
    gguf = fetch_preset_gguf(PRESETS[DEFAULT_PRESET])
    flags = ["-m", str(gguf), "-np", str(slots), "-c", str(slots * (2048 + max_tokens)), "-t", str(threads),
             "-tb", str(threads), "--host", "127.0.0.1", "--no-webui"]
    return Server(flags, log, command=[path])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-batch", type=lambda t: _ints(t, auto=True), default=[1, "auto"],
                   help="mcsd server configurations (default 1,auto)")
    p.add_argument("--clients", type=_ints, default=[1, 2, 4, 8, 16], help="concurrency levels")
    p.add_argument("--requests", type=int, default=4,
                   help="requests per client at the most clients: every level sends this times the largest "
                        "client count, the same requests (default 4)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    p.add_argument("--prompts", default=None, help="a Spec-Bench style JSONL (default: the shipped file)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary: run the same levels against it too")
    p.add_argument("--llama-parallel", type=int, default=8, help="llama-server's slots (default 8)")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1,
                   help="llama-server's threads (default: every core)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="plot tokens/s against clients into this image (matplotlib)")
    args = p.parse_args(argv)
    prompts = held_out_prompts(args.prompts)
    results = []
    configs = [(f"mcsd --max-batch {b}", b) for b in args.max_batch]
    if args.llama_server:
        configs.append((f"llama.cpp -np {args.llama_parallel}", None))
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, batch) in enumerate(configs):
            log = Path(tmp) / f"server-{i}.log"
            if batch is None:
                server = llama_server(args.llama_server, args.llama_parallel, args.llama_threads,
                                      args.max_tokens, log)
            else:
                server = Server([*server_flags, "--max-batch", str(batch), "--max-queue",
                                 str(4 * max(args.clients))], log)
            try:
                for clients in args.clients:
                    level = {"server": name, "max_batch": batch,
                             **run_level(server, prompts, clients, args.requests * max(args.clients),
                                         args.max_tokens)}
                    results.append(level)
                    print(f"{name:<24} clients {clients:>2}  {level['tokens_per_s']:8.2f} tokens/s  "
                          f"p50 {level['p50_s']:7.2f} s  p95 {level['p95_s']:7.2f} s", flush=True)
            finally:
                code = server.stop()
            if code != 0 and batch is not None:
                print(f"mcsd-serve --max-batch {batch} did not exit 0", file=sys.stderr)
                return 1
    if args.out:
        Path(args.out).write_text(json.dumps({"server_flags": server_flags, "results": results}, indent=2) + "\n")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, _ in configs:
            rows = [r for r in results if r["server"] == name]
            ax.plot([r["clients"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("aggregate tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
