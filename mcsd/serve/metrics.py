"""The server's figures in Prometheus' text exposition format (version 0.0.4), written by hand: a
few counters, gauges and one histogram, updated from the HTTP side and the engine's worker thread.

    mcsd_requests_total{endpoint, status}        requests answered, by HTTP status (499: the client left)
    mcsd_prompt_tokens_total, mcsd_completion_tokens_total
    mcsd_generation_seconds_total                 time the decoder spent generating
    mcsd_tokens_per_second                        the last generation's rate
    mcsd_tau                                      the last generation's tokens per target forward
    mcsd_target_forwards_total                    (completion tokens / this = tau over the server's life)
    mcsd_accepted_by_depth_total{depth}, mcsd_offered_by_depth_total{depth}, mcsd_acceptance_by_depth{depth}
    mcsd_queue_depth, mcsd_running                requests waiting for the decoder, and generations being decoded
    mcsd_batch_rounds_total, mcsd_batch_rows_total  batched rounds (`--max-batch` > 1) and the rows they fed
    mcsd_batch_size, mcsd_batch_rows              the last batched round's slots and rows
    mcsd_time_to_first_token_seconds              histogram: arrival to the first token
"""

from __future__ import annotations

import math
import threading

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Metrics:
    """Thread-safe counters; `render` writes them out. `gauges` is called at render time for values
    owned elsewhere (the queue depth)."""

    def __init__(self, gauges=None):
        self._lock = threading.Lock()
        self._gauges = gauges or dict
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.completion_tokens = self.target_forwards = 0
        self.generation_s, self.generations = 0.0, 0
        self.tokens_per_s = self.tau = 0.0
        self.offered: list[int] = []
        self.accepted: list[int] = []
        self.ttft_counts = [0] * len(TTFT_BUCKETS)
        self.ttft_sum, self.ttft_n = 0.0, 0
        self.batch_rounds = self.batch_rows_total = self.batch_size = self.batch_rows = 0

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def prompt(self, tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += tokens

    def generation(self, stats) -> None:
        """One finished generation's `GenerationStats`."""
        with self._lock:
            self.completion_tokens += stats.new_tokens
            self.target_forwards += stats.target_forwards
            self.generation_s += stats.wall_s
            self.generations += 1
            self.tokens_per_s, self.tau = stats.tokens_per_s, stats.mean_accepted
            for d, (o, a) in enumerate(zip(stats.offered_by_depth, stats.accepted_by_depth)):
                if d >= len(self.offered):
                    self.offered.append(0)
                    self.accepted.append(0)
                self.offered[d] += o
                self.accepted[d] += a

    def round(self, slots: int, rows: int) -> None:
        """One batched round: how many slots it fed, and how many rows."""
        with self._lock:
            self.batch_rounds += 1
            self.batch_rows_total += rows
            self.batch_size, self.batch_rows = slots, rows

    def mean_generation_s(self) -> float:
        """Seconds a generation has taken on average (1.0 before the first)."""
        with self._lock:
            return self.generation_s / self.generations if self.generations else 1.0

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_n += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self.ttft_counts[i] += 1

    def render(self) -> str:
        """The exposition text."""
        gauges = self._gauges()
        with self._lock:
            out = []

            def family(name, kind, help_text, samples):
                out.append(f"# HELP {name} {help_text}")
                out.append(f"# TYPE {name} {kind}")
                for labels, value in samples:
                    label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                    out.append(f"{name}{{{label_text}}} {_number(value)}" if labels else f"{name} {_number(value)}")

            family("mcsd_requests_total", "counter", "Requests answered, by endpoint and status (499: the client "
                   "disconnected; an error after a stream began counts under the error's status).",
                   [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.requests.items())])
            family("mcsd_prompt_tokens_total", "counter", "Prompt tokens read.", [({}, self.prompt_tokens)])
            family("mcsd_completion_tokens_total", "counter", "Tokens generated.", [({}, self.completion_tokens)])
            family("mcsd_generation_seconds_total", "counter", "Seconds the decoder spent generating.",
                   [({}, self.generation_s)])
            family("mcsd_tokens_per_second", "gauge", "The last generation's tokens per second.",
                   [({}, self.tokens_per_s)])
            family("mcsd_tau", "gauge", "The last generation's tokens per target forward.", [({}, self.tau)])
            family("mcsd_target_forwards_total", "counter", "Target forwards (prefill included).",
                   [({}, self.target_forwards)])
            family("mcsd_offered_by_depth_total", "counter", "Rounds whose tree could accept this depth.",
                   [({"depth": str(d + 1)}, n) for d, n in enumerate(self.offered)])
            family("mcsd_accepted_by_depth_total", "counter", "Rounds that accepted this depth.",
                   [({"depth": str(d + 1)}, n) for d, n in enumerate(self.accepted)])
            family("mcsd_acceptance_by_depth", "gauge", "P(depth d accepted | depth d-1 accepted), since start.",
                   [({"depth": str(d + 1)}, a / o if o else 0.0)
                    for d, (a, o) in enumerate(zip(self.accepted, self.offered))])
            family("mcsd_queue_depth", "gauge", "Requests waiting for the decoder.",
                   [({}, gauges.get("queue_depth", 0))])
            family("mcsd_running", "gauge", "Generations being decoded (at most --max-batch).",
                   [({}, gauges.get("running", 0))])
            family("mcsd_batch_rounds_total", "counter", "Batched rounds (one target forward over every slot).",
                   [({}, self.batch_rounds)])
            family("mcsd_batch_rows_total", "counter", "Rows the batched rounds fed (prompt chunks and trees).",
                   [({}, self.batch_rows_total)])
            family("mcsd_batch_size", "gauge", "Slots the last batched round fed.", [({}, self.batch_size)])
            family("mcsd_batch_rows", "gauge", "Rows the last batched round fed.", [({}, self.batch_rows)])
            name = "mcsd_time_to_first_token_seconds"
            out.append(f"# HELP {name} Seconds from a request's arrival to its first generated token.")
            out.append(f"# TYPE {name} histogram")
            for bound, n in zip(TTFT_BUCKETS, self.ttft_counts):
                out.append(f'{name}_bucket{{le="{bound:g}"}} {n}')
            out.append(f'{name}_bucket{{le="+Inf"}} {self.ttft_n}')
            out.append(f"{name}_sum {_number(self.ttft_sum)}")
            out.append(f"{name}_count {self.ttft_n}")
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
