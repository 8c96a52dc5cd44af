"""mcsd-serve as a real subprocess on a free loopback port, with tiny models saved to disk.

The official `openai` client for chat and completions, streamed and not; greedy answers token for
token equal to `mcsd-generate` and `TreeDecoder.generate`; 16 concurrent clients x 4 requests equal
to their sequential answers; a client that disconnects, a full queue, SIGTERM with a request in
flight, an exception inside one generation; 30+ bad requests; the API key; /metrics parsed.

The fault and slow-down cases use the server's test-only `--fault-injection` markers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import perturbed, word_tokenizer
from serving import running_server

from mcsd.serve.cli import API_KEY_ENV
from mcsd.serve.processors import FAULT_MARKER, SLOW_MARKER

REPO = Path(__file__).resolve().parent.parent
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")
KEY = "test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m mcsd.serve` on the tiny pair, its log in a file; ready once /health answers."""

    def __init__(self, models: Path, folder: Path, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / f"server-{self.port}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONUNBUFFERED="1",
                   MCSD_CACHE=str(folder / "cache"))
        env.pop(API_KEY_ENV, None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mcsd.serve", "--target", str(models / "target"), "--draft",
                 str(models / "draft"), "--dtype", "float32", "--no-calibrate", "--threads", "1",
                 "--port", str(self.port), *extra], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.model = str(models / "target")
        deadline = time.monotonic() + 240
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mcsd-serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mcsd-serve did not answer /health:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self, **headers) -> dict:
        return httpx.get(self.url + "/health", timeout=10, headers=headers).json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -9
        return self.proc.returncode


@pytest.fixture(scope="session")
def serve_models(tmp_path_factory, target):
    """The tiny target, a perturbed copy of it as the draft (some drafts accepted), a tokenizer with a chat template."""
    root = tmp_path_factory.mktemp("serve-models")
    tok = word_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    for name, model in (("target", target), ("draft", perturbed(target, 0.3))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def server(serve_models, tmp_path_factory):
    srv = ServerProcess(serve_models, tmp_path_factory.mktemp("serve"), "--fault-injection")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(serve_models, tmp_path_factory):
    """An API key and a queue of one, for the 401 and 429 cases; one request decoded at a time (a batch
    would take the queued one in: tests/test_serve_batch.py has its 429)."""
    srv = ServerProcess(serve_models, tmp_path_factory.mktemp("serve-keyed"), "--api-key", KEY, "--max-queue", "1",
                        "--max-batch", "1", "--fault-injection")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pair(serve_models):
    from mcsd import load_model_pair
    return load_model_pair(str(serve_models / "target"), str(serve_models / "draft"), dtype="float32")


def _openai(srv, key="unused"):
    from openai import OpenAI
    return OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _post(srv, path, body, stream=False, **kwargs):
    return httpx.post(srv.url + path, json=body, timeout=120, **kwargs)


def _sse(response) -> list:
    """The JSON events of a server-sent event stream, "[DONE]" as a string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---------------------------------------------------------------------------------------------- answers

def test_models_and_health(server):
    assert server.health()["status"] == "ok"
    models = _openai(server).models.list()
    assert [m.id for m in models.data] == [server.model]


def test_chat_equals_mcsd_generate_streamed_and_not(server, serve_models, capsys):
    from mcsd.cli import main
    prompt = "w03 w17 w42 w05"
    assert main(["--target", str(serve_models / "target"), "--draft", str(serve_models / "draft"), "--dtype",
                 "float32", "--no-calibrate", "--threads", "1", "--chat", "--prompt", prompt, "--max-new-tokens",
                 "40", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    client = _openai(server)
    messages = [{"role": "user", "content": prompt}]
    answer = client.chat.completions.create(model=server.model, messages=messages, max_tokens=40, temperature=0)
    assert answer.choices[0].message.content == expected["text"]
    assert answer.choices[0].finish_reason == {"eos": "stop", "length": "length"}[expected["finish_reason"]]
    assert answer.usage.completion_tokens == len(expected["tokens"])
    assert answer.usage.prompt_tokens == len(word_tokenizer()(f"user {prompt} assistant ")["input_ids"])
    assert answer.model_extra["mcsd"]["tau"] >= 1.0
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model=server.model, messages=messages, max_tokens=40, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == expected["text"]
    assert finish == answer.choices[0].finish_reason and usage == answer.usage


def test_completions_equal_tree_decoder_generate(server, pair):
    from mcsd import TreeDecoder
    target, draft, tokenizer = pair
    decoder = TreeDecoder(target, draft, tokenizer=tokenizer, tree="3,2,1", policy="static")
    client = _openai(server)
    for prompt in ("w03 w17", "w09 w10 w11 w12 w13", "w60"):
        out = decoder.generate(prompt, max_new_tokens=30)
        answer = client.completions.create(model=server.model, prompt=prompt, max_tokens=30, temperature=0, logprobs=0)
        choice = answer.choices[0]
        assert choice.text == out.text
        assert tokenizer.convert_tokens_to_ids(choice.logprobs.tokens) == out.tokens
        assert answer.usage.completion_tokens == len(out.tokens)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=server.model, prompt=prompt, max_tokens=30, temperature=0, stream=True) if c.choices)
        assert streamed == out.text


def test_logprobs_are_the_targets_streamed_and_not(server, pair):
    import torch
    target, _, tokenizer = pair
    body = {"model": server.model, "messages": [{"role": "user", "content": "w03 w17"}], "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = _post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        streamed = [entry for e in _sse(r) if e != "[DONE]" for c in e["choices"]
                    for entry in ((c.get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole] and len(whole) == 12
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=1e-5)
    # the target's own log-softmax at each position, recomputed here
    ids = tokenizer("user w03 w17 assistant ", add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_tokens_to_ids([e["token"] for e in whole])
    with torch.no_grad():
        logp = target(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    assert [e["logprob"] for e in whole] == pytest.approx(logp.gather(1, torch.tensor(tokens)[:, None])
                                                          .squeeze(1).tolist(), abs=1e-4)
    for entry in whole:
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token"] == entry["token"]


def test_stop_strings_are_left_out_streamed_and_not(server):
    base = {"model": server.model, "prompt": "w03 w17", "max_tokens": 30, "temperature": 0}
    full = _post(server, "/v1/completions", base).json()["choices"][0]["text"]
    stop = " ".join(full.split()[3:5])                    # two words from the middle of the greedy answer
    answer = _post(server, "/v1/completions", {**base, "stop": [stop, "zz"]}).json()
    assert answer["choices"][0]["text"] == full[:full.index(stop)]
    assert answer["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", server.url + "/v1/completions", json={**base, "stop": stop, "stream": True},
                      timeout=120) as r:
        events = _sse(r)
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == answer["choices"][0]["text"]
    assert events[-1] == "[DONE]"


def test_n_choices_and_seeds(server):
    client = _openai(server)
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "w03 w17"}], max_tokens=10,
                  temperature=0.9, top_p=0.95, seed=7, n=3)
    first, again = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]          # a seed repeats
    assert len(set(texts)) > 1                                           # each choice its own seed
    assert first.usage.completion_tokens >= sum(len(t.split()) for t in texts)     # (an EOS is counted, not shown)
    streamed = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts
    several = _post(server, "/v1/completions", {"model": server.model, "prompt": ["w03", "w04 w05"], "n": 2,
                                                "max_tokens": 6, "temperature": 0}).json()["choices"]
    assert [c["index"] for c in several] == [0, 1, 2, 3]
    assert several[0]["text"] == several[1]["text"] != several[2]["text"] == several[3]["text"]


def test_penalties_change_the_answer_exactly(server, pair):
    from mcsd import TreeDecoder
    from mcsd.serve.processors import Penalties
    target, draft, tokenizer = pair
    decoder = TreeDecoder(target, draft, tokenizer=tokenizer, tree="3,2,1", policy="static")
    prompt_len = len(tokenizer("w03 w17")["input_ids"])
    expected = decoder.generate("w03 w17", max_new_tokens=40, logits_processor=[Penalties(prompt_len, 1.2, 0.4)])
    answer = _openai(server).completions.create(model=server.model, prompt="w03 w17", max_tokens=40, temperature=0,
                                                frequency_penalty=1.2, presence_penalty=0.4)
    assert answer.choices[0].text == expected.text
    assert answer.choices[0].text != decoder.generate("w03 w17", max_new_tokens=40).text


# ---------------------------------------------------------------------------------------------- concurrency

def test_16_clients_4_requests_each_equal_their_sequential_answers(server):
    prompts = [f"w{3 + i:02d} w{20 + i:02d} w{40 + i % 7:02d}" for i in range(16)]

    def ask(prompt, stream):
        body = {"model": server.model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        with httpx.Client(timeout=300) as client:
            if not stream:
                r = client.post(server.url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            with client.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                events = _sse(r)
            assert events[-1] == "[DONE]"
            return "".join(c["text"] for e in events[:-1] for c in e["choices"])

    sequential = [ask(p, False) for p in prompts]

    def client_run(i):
        return [ask(prompts[(i + k) % 16], stream=k % 2 == 1) for k in range(4)]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(client_run, range(16)))
    assert sum(len(a) for a in answers) == 64
    for i, texts in enumerate(answers):
        assert texts == [sequential[(i + k) % 16] for k in range(4)]
    assert server.health()["queue_depth"] == 0


def _slow_stream(srv, max_tokens=200, headers=None):
    """A slowed-down streamed request, opened and read up to its first piece of text. Returns the client,
    the open stream and its line iterator (closing the iterator would close the connection)."""
    client = httpx.Client(timeout=120, headers=headers or {})
    body = {"model": srv.model, "prompt": f"w03 {SLOW_MARKER} w17", "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    context = client.stream("POST", srv.url + "/v1/completions", json=body)
    response = context.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
            break
    return client, context, lines


def test_a_client_that_disconnects_frees_the_decoder(server):
    client, context, _lines = _slow_stream(server)
    assert server.health()["busy"]
    context.__exit__(None, None, None)
    client.close()
    left = time.monotonic()
    while server.health()["busy"]:
        assert time.monotonic() - left < 5, "the decoder is still generating for a client that left"
        time.sleep(0.02)
    # 200 slowed tokens would take many seconds more; the next request is answered at once
    answer = _post(server, "/v1/completions", {"model": server.model, "prompt": "w03", "max_tokens": 3,
                                               "temperature": 0})
    assert answer.status_code == 200
    assert re.search(r"POST /v1/completions 499: the client disconnected", server.log())


def test_an_exception_inside_a_generation_is_a_500_for_that_request_alone(server):
    body = {"model": server.model, "prompt": "w03 w17 w42", "max_tokens": 20, "temperature": 0}
    before = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    failed = _post(server, "/v1/completions", {**body, "prompt": f"w03 {FAULT_MARKER} w42"})
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error" and failed.json()["error"]["code"] == "generation_failed"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={**body, "prompt": f"w03 {FAULT_MARKER} w42", "stream": True}) as r:
        if r.status_code == 200:                          # it failed after the stream began: an error event
            events = _sse(r)
            assert events[-2]["error"]["code"] == "generation_failed" and events[-1] == "[DONE]"
        else:
            r.read()
            assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
    assert _post(server, "/v1/completions", body).json()["choices"][0]["text"] == before
    assert server.health()["status"] == "ok"


def test_a_full_queue_answers_429_with_retry_after(keyed_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    client, context, _lines = _slow_stream(keyed_server, headers=auth)          # running
    queued = {}
    body = {"model": keyed_server.model, "prompt": "w03", "max_tokens": 4, "temperature": 0}
    waiter = threading.Thread(target=lambda: queued.update(r=_post(keyed_server, "/v1/completions", body,
                                                                    headers=auth)))
    waiter.start()
    deadline = time.monotonic() + 30
    while keyed_server.health()["queue_depth"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = _post(keyed_server, "/v1/completions", body, headers=auth)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    context.__exit__(None, None, None)
    client.close()
    waiter.join(60)
    assert queued["r"].status_code == 200


def test_the_api_key_is_required(keyed_server):
    url = keyed_server.url + "/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(url, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
    r = _post(keyed_server, "/v1/completions", {"model": keyed_server.model, "prompt": "w03"})
    assert r.status_code == 401
    assert httpx.get(keyed_server.url + "/health", timeout=10).status_code == 200      # probes need no key
    answer = _openai(keyed_server, key=KEY).completions.create(model=keyed_server.model, prompt="w03", max_tokens=2,
                                                                 temperature=0)
    assert answer.usage.completion_tokens == 2


def test_sigterm_finishes_the_request_in_flight_and_exits_0(serve_models, tmp_path):
    srv = ServerProcess(serve_models, tmp_path, "--fault-injection")
    try:
        result = {}
        body = {"model": srv.model, "prompt": f"w03 {SLOW_MARKER}", "max_tokens": 40, "temperature": 0}
        flight = threading.Thread(target=lambda: result.update(r=_post(srv, "/v1/completions", body)))
        flight.start()
        deadline = time.monotonic() + 30
        while not srv.health()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:                                              # a new request is refused: no connection, or a 503
            late = httpx.post(srv.url + "/v1/completions", json=body, timeout=10)
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        flight.join(120)
        assert result["r"].status_code == 200
        assert result["r"].json()["usage"]["completion_tokens"] == 40
        assert srv.proc.wait(90) == 0
        assert "SIGTERM: finishing 1 request in flight" in srv.log()
    finally:
        srv.stop()


def test_a_request_past_its_time_limit_gets_a_504(serve_models, tmp_path):
    srv = ServerProcess(serve_models, tmp_path, "--fault-injection", "--request-timeout", "1.5")
    try:
        body = {"model": srv.model, "prompt": f"w03 {SLOW_MARKER} w17", "max_tokens": 200, "temperature": 0}
        queued = {}
        running = threading.Thread(target=lambda: queued.update(first=_post(srv, "/v1/completions", body)))
        running.start()
        while not srv.health()["busy"]:
            time.sleep(0.02)
        second = _post(srv, "/v1/completions", body)         # waits behind the first, past its own limit
        running.join(60)
        for r in (queued["first"], second):
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            events = _sse(r)
        assert events[-2]["error"]["code"] == "timeout" and events[-1] == "[DONE]"
        assert not srv.health()["busy"]
        assert _post(srv, "/v1/completions", {**body, "prompt": "w03", "max_tokens": 3}).status_code == 200
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------- bad input

def _bad_requests(model):
    chat = {"model": model, "messages": [{"role": "user", "content": "w03"}]}
    comp = {"model": model, "prompt": "w03"}
    C, P = "/v1/chat/completions", "/v1/completions"
    return [
        # (path, body (bytes sent as they are, else JSON), status, param)
        (C, b'{"model": "x", "messages": [', 400, None),                       # malformed JSON
        (C, b"", 400, None),                                                   # empty body
        (C, b"[1, 2, 3]", 400, None),                                          # not an object
        (C, b'{"model": "\xff\xfe", "messages": []}', 400, None),              # invalid UTF-8
        (C, b'{"model": "m", "temperature": NaN}', 400, None),                 # NaN is not JSON
        (C, b'{"a": "' + b"x" * (1 << 20) + b'"}', 413, None),                 # over the body limit
        (C, {"messages": chat["messages"]}, 400, "model"),
        (C, {**chat, "model": "gpt-4o"}, 404, "model"),
        (C, {**chat, "model": 7}, 400, "model"),
        (C, {"model": model}, 400, "messages"),
        (C, {**chat, "messages": "w03"}, 400, "messages"),
        (C, {**chat, "messages": []}, 400, "messages"),
        (C, {**chat, "messages": [{"role": "robot", "content": "w03"}]}, 400, "messages[0].role"),
        (C, {**chat, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        (C, {**chat, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
         "messages[0].content"),
        (C, {**chat, "messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages[0].content"),
        (C, {**chat, "max_tokens": 0}, 400, "max_tokens"),
        (C, {**chat, "max_tokens": -5}, 400, "max_tokens"),
        (C, {**chat, "max_tokens": 10**9}, 400, "max_tokens"),
        (C, {**chat, "max_tokens": "10"}, 400, "max_tokens"),
        (C, {**chat, "max_completion_tokens": 2.5}, 400, "max_completion_tokens"),
        (C, {**chat, "temperature": -0.1}, 400, "temperature"),
        (C, {**chat, "temperature": 2.5}, 400, "temperature"),
        (C, {**chat, "temperature": "hot"}, 400, "temperature"),
        (C, {**chat, "top_p": 0}, 400, "top_p"),
        (C, {**chat, "top_p": 1.5}, 400, "top_p"),
        (C, {**chat, "n": 0}, 400, "n"),
        (C, {**chat, "n": 1000}, 400, "n"),
        (C, {**chat, "seed": 2**70}, 400, "seed"),
        (C, {**chat, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (C, {**chat, "stop": [""]}, 400, "stop"),
        (C, {**chat, "stream": "yes"}, 400, "stream"),
        (C, {**chat, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (C, {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        (C, {**chat, "response_format": {"type": "json_object"}}, 400, "response_format"),
        (C, {**chat, "logit_bias": {"3": 5}}, 400, "logit_bias"),
        (C, {**chat, "frobnicate": True}, 400, "frobnicate"),
        (C, {**chat, "top_logprobs": 2}, 400, "top_logprobs"),
        (C, {**chat, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
        (C, {**chat, "frequency_penalty": 3}, 400, "frequency_penalty"),
        (C, {**chat, "presence_penalty": -2.5}, 400, "presence_penalty"),
        (C, {**chat, "messages": [{"role": "user", "content": " ".join(["w03"] * 300)}]}, 400, "messages"),
        (P, {"model": model}, 400, "prompt"),
        (P, {**comp, "prompt": []}, 400, "prompt"),
        (P, {**comp, "prompt": ""}, 400, "prompt"),
        (P, {**comp, "prompt": [3, 17, 999]}, 400, "prompt"),
        (P, {**comp, "prompt": [3, True]}, 400, "prompt"),
        (P, {**comp, "logprobs": 9}, 400, "logprobs"),
        (P, {**comp, "echo": True}, 400, "echo"),
        (P, {**comp, "best_of": 3}, 400, "best_of"),
        (P, {**comp, "suffix": "w09"}, 400, "suffix"),
        (P, {**comp, "max_tokens": 250, "prompt": " ".join(["w03"] * 10)}, 400, "max_tokens"),
        (P, {**comp, "messages": chat["messages"]}, 400, "messages"),
    ]


def test_bad_requests_get_4xx_json_errors_and_the_server_keeps_serving(server):
    table = _bad_requests(server.model)
    assert len(table) >= 30
    log_before = server.log()
    with httpx.Client(timeout=60) as client:
        for path, body, status, param in table:
            if isinstance(body, bytes):
                r = client.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = client.post(server.url + path, content=json.dumps(body), headers={"Content-Type":
                                                                                      "application/json"})
            assert r.status_code == status, (path, body if not isinstance(body, bytes) else body[:60], r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert error["param"] == param, (body if not isinstance(body, bytes) else body[:60], error)
        for method, path, status in (("GET", "/v1/chat/completions", 405), ("GET", "/v1/nothing", 404),
                                     ("DELETE", "/v1/models", 405)):
            r = client.request(method, server.url + path)
            assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert server.health()["status"] == "ok"
    added = server.log()[len(log_before):]
    assert len(re.findall(r"(?m) (?:GET|POST|DELETE) \S+ 4\d\d ", added)) == len(table) + 3   # one line each
    assert "Traceback" not in added
    ok = _post(server, "/v1/completions", {"model": server.model, "prompt": "w03", "max_tokens": 2})
    assert ok.status_code == 200


# ---------------------------------------------------------------------------------------------- metrics

def test_metrics_parse_as_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families
    _post(server, "/v1/completions", {"model": server.model, "prompt": "w03 w17", "max_tokens": 8, "temperature": 0})
    _post(server, "/v1/completions", {"model": "nope", "prompt": "w03"})
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    families = {}
    for family in text_string_to_metric_families(r.text):
        families[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert families["mcsd_time_to_first_token_seconds"] == "histogram"
    for name in ("mcsd_requests", "mcsd_prompt_tokens", "mcsd_completion_tokens", "mcsd_tokens_per_second",
                 "mcsd_tau", "mcsd_acceptance_by_depth", "mcsd_queue_depth"):
        assert name in families
    assert samples[("mcsd_requests_total", (("endpoint", "completion"), ("status", "200")))] >= 1
    assert samples[("mcsd_requests_total", (("endpoint", "completion"), ("status", "404")))] >= 1
    assert samples[("mcsd_completion_tokens_total", ())] >= 8
    assert samples[("mcsd_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("mcsd_tau", ())] >= 1.0
    assert ("mcsd_acceptance_by_depth", (("depth", "1"),)) in samples


# ---------------------------------------------------------------------------------------------- the real pair

@pytest.mark.slow
def test_embedded_pair_chat_equals_mcsd_generate(tmp_path, capsys):
    """The default pair served with its defaults (float32 for an exact comparison): the openai client's
    answer, streamed and not, is mcsd-generate's text."""
    from openai import OpenAI

    from mcsd.cli import main
    flags = ["--dtype", "float32", "--threads", "1"]
    prompt = "Name three rivers."
    assert main(flags + ["--chat", "--prompt", prompt, "--max-new-tokens", "48", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["text"]
    with running_server(flags, tmp_path / "server.log") as port:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        kwargs = dict(model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=48,
                      temperature=0)
        assert client.chat.completions.create(**kwargs).choices[0].message.content == expected
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs,
                                                                                                  stream=True)
                           if c.choices)
        assert streamed == expected

