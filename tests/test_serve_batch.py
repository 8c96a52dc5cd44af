"""`mcsd-serve --max-batch B`: several requests decoded together, each answer the lone decoder's.

The server runs in a process of its own on the tiny pair (`test_serve.ServerProcess`)."""

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_serve import KEY, ServerProcess, _post, _slow_stream, _sse, pair, serve_models  # noqa: F401

from mcsd.serve.processors import FAULT_MARKER


@pytest.fixture(scope="module")
def batched(serve_models, tmp_path_factory):  # noqa: F811
    srv = ServerProcess(serve_models, tmp_path_factory.mktemp("serve-batch"), "--max-batch", "4", "--fault-injection")
    yield srv
    assert srv.stop() == 0                        # SIGTERM: every slot's answer completed, exit 0


def _metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_concurrent_clients_get_the_lone_decoders_answers(batched, pair):  # noqa: F811
    from mcsd import TreeDecoder
    target, draft, tokenizer = pair
    decoder = TreeDecoder(target, draft, tokenizer=tokenizer, tree="3,2,1", policy="static")
    prompts = [f"w{3 + i:02d} w{20 + i:02d} w{40 + i % 7:02d}" + " w05" * (i % 4) for i in range(8)]
    asks = [(p, 0.0 if i % 2 == 0 else 0.8, 11 + i, 6 + 3 * i) for i, p in enumerate(prompts)]
    want = [decoder.generate(p, max_new_tokens=n, temperature=t, seed=s).text for p, t, s, n in asks]

    def ask(job):
        prompt, temperature, seed, n = job
        body = {"model": batched.model, "prompt": prompt, "max_tokens": n, "temperature": temperature,
                "seed": seed}
        with httpx.Client(timeout=300) as client:
            if n % 2:
                r = client.post(batched.url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            with client.stream("POST", batched.url + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                events = _sse(r)
            return "".join(c["text"] for e in events[:-1] for c in e["choices"])

    rounds_before = _metric(batched, "mcsd_batch_rounds_total")
    forwards_before = _metric(batched, "mcsd_target_forwards_total")
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, asks * 2))
    assert got == want * 2
    rounds = _metric(batched, "mcsd_batch_rounds_total") - rounds_before
    forwards = _metric(batched, "mcsd_target_forwards_total") - forwards_before
    assert 0 < rounds < forwards                  # some rounds answered several requests in one forward
    assert _metric(batched, "mcsd_batch_rows_total") >= _metric(batched, "mcsd_batch_rounds_total")
    assert batched.health()["queue_depth"] == 0


def test_n_choices_take_slots_of_their_own_and_answer_as_one_at_a_time(batched, serve_models, tmp_path):  # noqa: F811
    body = {"model": batched.model, "prompt": "w07 w08 w09", "max_tokens": 10, "temperature": 0.9, "n": 3,
            "seed": 4}
    answer = _post(batched, "/v1/completions", body).json()
    got = answer["choices"]
    lone = ServerProcess(serve_models, tmp_path)               # --max-batch auto, no costs: one at a time
    try:
        alone = _post(lone, "/v1/completions", body).json()
        want = alone["choices"]
    finally:
        assert lone.stop() == 0
    # the three choices shared their forwards: each had a part of their rows
    assert 0 < answer["mcsd"]["batch_share"] <= 1 and 1 < answer["mcsd"]["batch_size"] <= 3
    assert answer["mcsd"]["batch_exact"] is False            # dense float32: equal here, not promised
    assert "batch_share" not in alone["mcsd"] and "batch_exact" not in alone["mcsd"]
    assert [c["text"] for c in sorted(got, key=lambda c: c["index"])] == \
        [c["text"] for c in sorted(want, key=lambda c: c["index"])]


def test_a_request_alone_drafts_with_the_model_drafter_and_says_so(batched, pair):  # noqa: F811
    """Alone in the batched engine a request runs the lone round: the draft model drafts its trees (the
    `mcsd` field counts its nodes), the answer is the lone decoder's, and no batched forward ran."""
    from mcsd import TreeDecoder
    target, draft, tokenizer = pair
    decoder = TreeDecoder(target, draft, tokenizer=tokenizer, tree="3,2,1", policy="static")
    prompt = "w03 w17 w42 w05 w03 w17"
    want = decoder.generate(prompt, max_new_tokens=24, temperature=0)
    answer = _post(batched, "/v1/completions", {"model": batched.model, "prompt": prompt, "max_tokens": 24,
                                                "temperature": 0}).json()
    assert answer["choices"][0]["text"] == want.text
    mcsd = answer["mcsd"]
    assert mcsd["draft_forwards"] > 0 and mcsd["drafted_nodes"] > 0 and "batch_share" not in mcsd


def test_a_client_that_disconnects_frees_its_slot_and_a_fault_fails_its_request_alone(batched):
    client, context, _lines = _slow_stream(batched)
    body = {"model": batched.model, "prompt": "w03 w17 w42", "max_tokens": 20, "temperature": 0}
    before = _post(batched, "/v1/completions", body).json()["choices"][0]["text"]   # beside the slow one
    assert batched.health()["busy"]
    context.__exit__(None, None, None)
    client.close()
    left = time.monotonic()
    while batched.health()["busy"]:
        assert time.monotonic() - left < 5, "a slot still decodes for a client that left"
        time.sleep(0.02)
    assert re.search(r"POST /v1/completions 499: the client disconnected", batched.log())
    results = {}

    def ask(name, prompt):
        results[name] = _post(batched, "/v1/completions", {**body, "prompt": prompt})

    threads = [threading.Thread(target=ask, args=("fault", f"w03 {FAULT_MARKER} w42")),
               threading.Thread(target=ask, args=("fine", "w03 w17 w42"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["fault"].status_code == 500
    assert results["fault"].json()["error"]["code"] == "generation_failed"
    assert results["fine"].status_code == 200 and results["fine"].json()["choices"][0]["text"] == before


def test_requests_beyond_the_slots_wait_in_the_queue_and_one_more_gets_a_429(serve_models, tmp_path):  # noqa: F811
    srv = ServerProcess(serve_models, tmp_path, "--max-batch", "2", "--max-queue", "1", "--fault-injection")
    try:
        slow = [_slow_stream(srv), _slow_stream(srv)]                      # both slots
        queued = {}
        body = {"model": srv.model, "prompt": "w03", "max_tokens": 4, "temperature": 0}
        waiter = threading.Thread(target=lambda: queued.update(r=_post(srv, "/v1/completions", body)))
        waiter.start()
        deadline = time.monotonic() + 30
        while srv.health()["queue_depth"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = _post(srv, "/v1/completions", body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        for client, context, _ in slow:
            context.__exit__(None, None, None)
            client.close()
        waiter.join(60)
        assert queued["r"].status_code == 200
    finally:
        assert srv.stop() == 0


def test_max_batch_below_one_is_a_usage_error(capsys):
    from mcsd.serve.cli import main
    assert main(["--max-batch", "0", "--target", "x"]) == 2
    assert "--max-batch must be >= 1 or auto, got 0" in capsys.readouterr().err


def test_the_concurrency_benchmark_runs_on_the_tiny_pair(serve_models, tmp_path):  # noqa: F811
    """A smoke run of benchmarks/serve_concurrency.py (its figures mean nothing on these models)."""
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_concurrency.py"
    spec = importlib.util.spec_from_file_location("serve_concurrency", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": 5 * i, "category": "writing", "turns": [f"w{10 + i:02d} w03"]})
                               + "\n" for i in range(3)))
    out = tmp_path / "bench.json"
    flags = ["--target", str(serve_models / "target"), "--draft", str(serve_models / "draft"), "--dtype", "float32",
             "--no-calibrate", "--threads", "1"]
    assert bench.main(["--max-batch", "2,auto", "--clients", "1,2", "--requests", "2", "--max-tokens", "4",
                       "--prompts", str(prompts), "--out", str(out), "--", *flags]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["server"], r["clients"], r["requests"]) for r in results] == \
        [("mcsd --max-batch 2", 1, 4), ("mcsd --max-batch 2", 2, 4), ("mcsd --max-batch auto", 1, 4),
         ("mcsd --max-batch auto", 2, 4)]                      # the same requests at every level
    assert all(r["tokens"] > 0 and r["p95_s"] >= r["p50_s"] > 0 for r in results)


def test_a_request_past_its_time_limit_leaves_its_slot_with_a_504(serve_models, tmp_path):  # noqa: F811
    from mcsd.serve.processors import SLOW_MARKER
    srv = ServerProcess(serve_models, tmp_path, "--max-batch", "2", "--fault-injection", "--request-timeout", "1.5")
    try:
        body = {"model": srv.model, "prompt": f"w03 {SLOW_MARKER} w17", "max_tokens": 200, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:                   # both slots, both past their limit
            answers = list(pool.map(lambda _: _post(srv, "/v1/completions", body), range(2)))
        for r in answers:
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert not srv.health()["busy"]
        assert _post(srv, "/v1/completions", {**body, "prompt": "w03", "max_tokens": 3}).status_code == 200
    finally:
        assert srv.stop() == 0


# ---------------------------------------------------------------------------------------------- failures


def test_a_failure_while_reporting_one_request_fails_it_alone_and_the_worker_goes_on(batched):
    """`[[mcsd-fault-report]]` raises in the engine's reporting of the request's tokens (outside the
    decoder's round): that request gets its 500 with its message, the one beside it its answer, the
    next request is answered and /health stays honest (ok: the worker lives)."""
    from mcsd.serve.processors import REPORT_FAULT_MARKER
    body = {"model": batched.model, "prompt": "w03 w17 w42", "max_tokens": 12, "temperature": 0}
    want = _post(batched, "/v1/completions", body).json()["choices"][0]["text"]
    with ThreadPoolExecutor(2) as pool:
        fault, fine = pool.map(lambda prompt: _post(batched, "/v1/completions", {**body, "prompt": prompt}),
                               [f"w03 {REPORT_FAULT_MARKER} w42", "w03 w17 w42"])
    assert fault.status_code == 500 and fault.json()["error"]["code"] == "generation_failed"
    assert "fault injected while reporting tokens" in fault.json()["error"]["message"]
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"] == want
    assert _post(batched, "/v1/completions", body).json()["choices"][0]["text"] == want
    health = httpx.get(batched.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert "fault injected while reporting tokens" in batched.log()


def test_a_client_that_drops_while_sending_its_body_is_a_clean_499(batched):
    import socket
    port = int(batched.url.rsplit(":", 1)[1])
    start = len(batched.log())
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.3)                                   # the server is reading the body when the client goes
    deadline = time.monotonic() + 10
    while "while sending its request" not in batched.log():
        assert time.monotonic() < deadline, batched.log()
        time.sleep(0.05)
    time.sleep(0.2)                                       # anything else it would log about it
    log = batched.log()[start:]
    assert re.search(r"POST /v1/completions 499: the client disconnected after \S+ while sending its request", log)
    assert "Traceback" not in log and " 500" not in log, log
    assert 'mcsd_requests_total{endpoint="completion",status="499"}' in httpx.get(batched.url + "/metrics").text
    assert batched.health()["status"] == "ok"


# ---------------------------------------------------------------------------------------------- the queue


def test_max_queue_refuses_nothing_while_batch_slots_are_free(serve_models, tmp_path):  # noqa: F811
    srv = ServerProcess(serve_models, tmp_path, "--max-batch", "4", "--max-queue", "1")
    try:
        body = {"model": srv.model, "prompt": "w03 w17", "max_tokens": 8, "temperature": 0}
        for _ in range(3):                                # three at once on an idle server, three times
            with ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(lambda _: _post(srv, "/v1/completions", body), range(3)))
            assert [r.status_code for r in answers] == [200] * 3
    finally:
        assert srv.stop() == 0


def test_an_empty_model_name_is_a_usage_error(capsys):
    from mcsd.serve.cli import main
    assert main(["--model-name", "", "--target", "x"]) == 2
    assert "--model-name is empty" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- in process


def _jobs(runs_each, loop=None):
    """Jobs of `runs_each[i]` runs each; their events collected in `events[i]` (on the worker thread)."""
    import asyncio

    from mcsd.serve.engine import Job, Run
    loop = loop or asyncio.new_event_loop()
    jobs, events = [], []
    for i, runs in enumerate(runs_each):
        job = Job([Run([3 + i, 4 + r, 5], {"max_new_tokens": 6, "ignore_eos": True}, r) for r in range(runs)], loop,
                  arrived=time.monotonic(), timeout_s=3600.0)
        got = []
        job.emit = lambda *event, got=got, i=i: got.append(event) or ORDER.append((i, event[0]))
        jobs.append(job)
        events.append(got)
    return jobs, events


ORDER: list = []            # (job, event kind) as the worker emitted them, every job together


class _Rounds:
    """A `Metrics` stand-in that keeps each batched round's slots, and the engine's running gauge then."""

    def __init__(self):
        self.rounds, self.engine = [], None

    def round(self, slots, rows):
        self.rounds.append((slots, self.engine.running))

    def generation(self, stats):
        pass

    def first_token(self, seconds):
        pass


def _engine(max_batch, max_queue=8):
    from conftest import tiny_llama

    from mcsd import TreeDecoder
    from mcsd.drafting.context import ContextDrafter
    from mcsd.serve.batching import BatchEngine
    decoder = TreeDecoder(tiny_llama(3), ContextDrafter(), attention="sdpa", calibrate=False, threads=None)
    metrics = _Rounds()
    engine = BatchEngine(lambda: decoder, max_batch, max_queue, metrics)
    metrics.engine = engine
    return engine, metrics


def _wait(events, timeout=60):
    deadline = time.monotonic() + timeout
    while not all(e and e[-1][0] in ("end", "error", "cancelled", "timeout") for e in events):
        assert time.monotonic() < deadline, events
        time.sleep(0.01)


def _answer_queued(engine, jobs, events):
    """The jobs queued before the worker starts (so no timing decides what it takes at once), answered."""
    for job in jobs:
        engine.submit(job)
    engine.start()
    try:
        _wait(events)
    finally:
        engine.stop(10)
    assert all(e[-1] == ("end",) for e in events)


def test_a_burst_queued_at_once_joins_the_batch_in_one_round():
    engine, metrics = _engine(max_batch=4, max_queue=1)
    jobs, events = _jobs([1, 1, 1])
    _answer_queued(engine, jobs, events)                   # an idle engine: none waits, none is refused
    assert metrics.rounds[0][0] == 3                       # the three prompts prefilled in one forward


def test_one_job_of_many_runs_shares_the_slots_and_the_running_gauge_counts_slots():
    engine, metrics = _engine(max_batch=3)
    jobs, events = _jobs([12, 1])
    ORDER.clear()
    _answer_queued(engine, jobs, events)
    assert max(running for _, running in metrics.rounds) == 3 and all(s <= 3 for s, _ in metrics.rounds)
    assert sum(e[0] == "done" for e in events[0]) == 12
    # the second job took a slot in the first round beside the big one's first two runs (first come,
    # first served would have started it after nine of the twelve)
    order = [job for job, kind in ORDER if kind == "done"]
    assert order.index(1) <= 3, order
    assert engine.running == 0


def test_a_worker_that_dies_fails_its_jobs_and_health_answers_503(caplog):
    from starlette.testclient import TestClient

    from mcsd.serve.app import Settings, create_app
    from mcsd.serve.metrics import Metrics
    engine, _ = _engine(max_batch=2)
    jobs, events = _jobs([1, 1])

    take = engine._take

    def broken(block):
        take(block)                     # the job arrives (the worker waits for it) ...
        raise SystemError("the worker's own bug")    # ... and the worker dies with it in hand

    engine._take = broken
    engine.start()
    engine.submit(jobs[0])
    engine._thread.join(10)
    _wait(events[:1])
    assert events[0][-1][0] == "error" and not engine.alive
    assert "the decoder's worker stopped: SystemError: the worker's own bug" in caplog.text
    app = create_app(engine, Settings(model_ids=("m",), tokenizer=None, context_window=None, vocab_size=64), Metrics())
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and "the worker's own bug" in health.json()["error"]
        refused = client.post("/v1/completions", json={"model": "m", "prompt": [3, 4], "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "decoder_stopped"
