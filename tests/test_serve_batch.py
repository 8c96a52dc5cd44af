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
    assert "batch_share" not in alone["mcsd"]
    assert [c["text"] for c in sorted(got, key=lambda c: c["index"])] == \
        [c["text"] for c in sorted(want, key=lambda c: c["index"])]


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
