"""The server's pieces in process: request checking and the field mapping, streamed text, OpenAI's
penalties as an exact processor, the logprobs recorder, the metrics text, the command line's mistakes,
the engine's queue as it stops."""

import sys
import time

import pytest
import torch
from conftest import perturbed

from mcsd import TreeDecoder
from mcsd.serve import protocol
from mcsd.serve.processors import Penalties, TokenLogprobs
from mcsd.serve.protocol import APIError

MODEL = ("tiny",)


def _chat(**fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": "w03 w17"}], **fields}


def test_defaults_follow_openai():
    req = protocol.parse("chat", _chat(), MODEL)
    assert (req.temperature, req.top_p, req.n, req.stream, req.max_tokens) == (1.0, 1.0, 1, False, None)
    options = protocol.generate_options(req, prompt_len=10, choice=0, context_window=256)
    assert options["max_new_tokens"] == 246                    # chat: the room left in the context window ...
    roomy = protocol.generate_options(req, prompt_len=10, choice=0, context_window=8192)
    assert roomy["max_new_tokens"] == protocol.CHAT_DEFAULT_MAX_TOKENS == 256     # ... or 256, whichever is less
    assert protocol.generate_options(req, 10, 0, None)["max_new_tokens"] == 256
    comp = protocol.parse("completion", {"model": "tiny", "prompt": "w03"}, MODEL)
    assert protocol.generate_options(comp, 1, 0, 256)["max_new_tokens"] == 16   # completions: OpenAI's 16


def test_one_mapping_of_fields_onto_the_decoder():
    req = protocol.parse("chat", _chat(max_completion_tokens=7, temperature=0, top_p=0.5, seed=11, n=2,
                                       stop=["w05"], logprobs=True, top_logprobs=3, frequency_penalty=0.5,
                                       user="someone"), MODEL)
    options = protocol.generate_options(req, prompt_len=4, choice=1, context_window=256)
    processors = options.pop("logits_processor")
    assert options == dict(max_new_tokens=7, temperature=0.0, top_p=0.5, seed=12, stop_strings=("w05",),
                           return_logprobs=True)
    assert isinstance(processors[0], Penalties) and isinstance(processors[-1], TokenLogprobs)
    assert protocol.recorder({"logits_processor": processors}) is processors[-1]


def test_messages_are_normalised():
    req = protocol.parse("chat", {"model": "tiny", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "w03 "}, {"type": "text", "text": "w17"}]},
        {"role": "assistant", "content": "w04", "name": None}]}, MODEL)
    assert req.prompts == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "w03 w17"},
                            {"role": "assistant", "content": "w04"}]]


@pytest.mark.parametrize("endpoint, fields, param", [
    ("chat", {"tools": [{"type": "function"}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("chat", {"frobnicate": 1}, "frobnicate"),
    ("completion", {"echo": True}, "echo"),
    ("completion", {"suffix": "w09"}, "suffix"),
    ("completion", {"best_of": 3}, "best_of"),
])
def test_unsupported_fields_are_named(endpoint, fields, param):
    body = _chat(**fields) if endpoint == "chat" else {"model": "tiny", "prompt": "w03", **fields}
    with pytest.raises(APIError) as err:
        protocol.parse(endpoint, body, MODEL)
    assert err.value.status == 400 and err.value.param == param and param in err.value.message


def test_nulls_count_as_absent():
    req = protocol.parse("chat", _chat(tools=None, temperature=None, stop=None, seed=None), MODEL)
    assert req.temperature == 1.0 and req.stop == () and req.seed is None


def test_context_window_is_checked_with_the_prompt():
    req = protocol.parse("completion", {"model": "tiny", "prompt": "w03", "max_tokens": 200}, MODEL)
    with pytest.raises(APIError, match="exceeds the model's context window of 256") as err:
        protocol.generate_options(req, prompt_len=100, choice=0, context_window=256)
    assert err.value.param == "max_tokens"
    with pytest.raises(APIError, match="the prompt is 300 tokens"):
        protocol.generate_options(req, prompt_len=300, choice=0, context_window=256)


def test_text_stream_holds_back_partial_characters_and_stop_strings(tokenizer):
    class Bytes:                      # each "token" is one byte of UTF-8; decode replaces broken characters
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    stream = protocol.TextStream(Bytes(), ("END",))
    word = list("héllo E".encode())
    assert stream.push(word[:2]) == "h"                       # the first byte of é is held back
    assert stream.push(word[2:]) == "éllo "                   # "E" may start "END"
    assert stream.push(list(b"ND tail")) == ""               # the stop string: nothing past it
    assert stream.finish(protocol.cut_at_stop("héllo END tail", ("END",))) == ""
    assert stream.sent == "héllo "
    plain = protocol.TextStream(tokenizer, ())
    assert plain.push([3, 17]) == "w03 w17" and plain.push([5]) == " w05"


@pytest.fixture(scope="module")
def decoder(target, tokenizer):
    return TreeDecoder(target, perturbed(target, 0.3), tokenizer=tokenizer, tree="3,2,1", policy="static")


def _greedy_with_penalties(model, prompt, n, frequency, presence):
    """Plain greedy decoding with OpenAI's penalty written out, to EOS (w01): the reference."""
    ids = prompt.clone()
    counts = torch.zeros(model.config.vocab_size)
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids[None]).logits[0, -1]
            token = int((logits - counts * frequency - (counts > 0).float() * presence).argmax())
            counts[token] += 1
            ids = torch.cat([ids, torch.tensor([token])])
            if token == 1:
                break
    return ids[prompt.numel():].tolist()


@pytest.mark.parametrize("frequency, presence", [(1.5, 0.0), (0.0, 2.0), (-0.5, 0.7)])
def test_penalties_are_exact_through_the_tree(decoder, target, frequency, presence):
    prompt = torch.tensor([3, 17, 42, 5])
    out = decoder.generate(prompt, max_new_tokens=40, temperature=0.0,
                           logits_processor=[Penalties(4, frequency, presence)])
    assert out.tokens == _greedy_with_penalties(target, prompt, 40, frequency, presence)
    assert out.stats.rounds < len(out.tokens) - 1              # the tree did accept drafts


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.8, 0.9)])
def test_recorded_logprobs_are_the_decoders(decoder, temperature, top_p):
    from mcsd.config import SamplingConfig
    sampling = SamplingConfig() if temperature == 0 else SamplingConfig(temperature=temperature, top_p=top_p)
    recorder = TokenLogprobs(3, sampling, top=4)
    rounds = decoder.stream(torch.tensor([3, 17, 42]), max_new_tokens=30, temperature=temperature, top_p=top_p,
                            seed=5, return_logprobs=True, logits_processor=[recorder])
    emitted, rows = [], []
    while True:
        try:
            new = next(rounds)
        except StopIteration as done:
            out = done.value
            break
        rows += recorder.take(emitted + new, len(emitted))
        emitted += new
    assert emitted == out.tokens and len(rows) == len(out.tokens)
    assert [lp for lp, _ in rows] == pytest.approx(out.logprobs, abs=1e-5)
    for (lp, alternatives), token in zip(rows, out.tokens):
        assert len(alternatives) == 4 and alternatives[0][1] >= lp - 1e-6
        assert [a for a, _ in alternatives].count(token) <= 1
        if temperature == 0:
            assert alternatives[0][0] == token                # greedy: the chosen token is the top one


def test_metrics_text_parses():
    from prometheus_client.parser import text_string_to_metric_families

    from mcsd.core.output import GenerationStats
    from mcsd.serve.metrics import Metrics
    metrics = Metrics(lambda: {"queue_depth": 3, "running": 1})
    metrics.request("chat", 200)
    metrics.request("chat", 400)
    stats = GenerationStats(new_tokens=10, target_forwards=4, wall_s=0.5, offered_by_depth=[4, 2],
                            accepted_by_depth=[3, 1])
    metrics.generation(stats)
    metrics.first_token(0.12)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("mcsd_requests_total", (("endpoint", "chat"), ("status", "400")))] == 1
    assert samples[("mcsd_acceptance_by_depth", (("depth", "1"),))] == 0.75
    assert samples[("mcsd_queue_depth", ())] == 3 and samples[("mcsd_tau", ())] == 2.5
    assert samples[("mcsd_time_to_first_token_seconds_bucket", (("le", "0.2"),))] == 1
    assert samples[("mcsd_time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 0


@pytest.mark.parametrize("args, fragment", [
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--port", "70000"], "--port must be between 0 and 65535"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--tree", "4,x"], "malformed tree spec"),
    (["--target", "./missing/target", "--draft", "./missing/draft"], "model path does not exist"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_server_flag_mistakes_exit_2_in_one_line(capsys, args, fragment):
    from mcsd.serve.cli import main
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcsd-serve: error: ") and err.count("\n") == 1 and fragment in err


def test_a_port_in_use_is_one_line_and_exit_2_before_anything_loads(capsys, monkeypatch, model_dirs):
    import socket

    from mcsd.serve import cli
    monkeypatch.setattr(cli, "load_models", lambda args: pytest.fail("loaded the models"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert cli.main(["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"),
                         "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"mcsd-serve: error: port {port} on 127.0.0.1 is in use; choose another with --port\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="accepted sockets inherit TCP_NODELAY on Linux")
def test_the_servers_connections_send_answers_as_written():
    """Without TCP_NODELAY an answer's body waited for the client's delayed ACK of its headers: 40 ms a
    request on a kept-alive connection (44 ms for /health). The listening socket sets it and every
    connection accepted from it has it."""
    import socket

    from mcsd.serve.cli import _bind
    with _bind("127.0.0.1", 0) as sock:
        sock.listen(1)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with socket.create_connection(sock.getsockname()) as client:
            accepted, _ = sock.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                client.sendall(b"x")
                assert accepted.recv(1) == b"x"


def test_loopback_addresses():
    from mcsd.serve.cli import _is_loopback
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("192.168.1.4")


def test_an_empty_unimplemented_field_asks_for_nothing_and_a_filled_one_is_refused():
    for name, empty, filled in (("tools", [], [{"type": "function", "function": {"name": "f"}}]),
                                ("logit_bias", {}, {"5": 10})):
        assert protocol.parse("chat", _chat(**{name: empty}), MODEL).max_tokens is None
        with pytest.raises(protocol.APIError, match=f"unsupported field.*{name}"):
            protocol.parse("chat", _chat(**{name: filled}), MODEL)


def test_the_server_reference_states_the_defaults_and_the_refused_fields():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    facts = (f"`max_tokens`: {protocol.CHAT_DEFAULT_MAX_TOKENS}",
             f"{protocol.COMPLETIONS_DEFAULT_MAX_TOKENS} for `/v1/completions`",
             f"`temperature`: {protocol.DEFAULT_TEMPERATURE:g}")
    for fact in facts:
        assert fact in text, fact
    for name in protocol.UNSUPPORTED:
        assert f"`{name}`" in text, name


def test_a_job_submitted_while_the_engine_stops_is_answered_or_refused_never_stranded():
    """The race: a submit has checked that the engine takes jobs, and stop() puts its marker on the
    queue before the job lands. The job must then be refused (Draining: the HTTP side's 503) or land
    before the marker and be answered; never behind it, where nobody answers it."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from mcsd.serve.engine import Draining, Engine, Job, Run

    class Decoder:
        def stream(self, prompt_ids, **options):
            yield [7]
            return SimpleNamespace(tokens=[7], stats=None)

    engine = Engine(lambda: Decoder(), max_queue=4)
    engine.start()
    events = []
    job = Job([Run([1, 2], {})], asyncio.new_event_loop(), arrived=time.monotonic(), timeout_s=3600.0)
    job.emit = lambda *event: events.append(event)
    real_put = engine._queue.put_nowait

    def put_as_stop_runs(item):                     # stop() runs between the submit's check and its put
        stopper = threading.Thread(target=engine.stop)
        stopper.start()
        stopper.join(1.0)                           # it ends, or it waits for the submit to finish
        real_put(item)

    engine._queue.put_nowait = put_as_stop_runs
    try:
        engine.submit(job)
    except Draining:
        refused = True
    else:
        refused = False
    engine._thread.join(5.0)
    assert not engine._thread.is_alive()
    assert refused or events[-1:] == [("end",)], f"queued behind the stop marker, unanswered: {events}"
    with pytest.raises(Draining):                     # and once stopped, a job is refused at once
        engine.submit(job)


def test_the_server_reference_names_every_server_flag_and_says_n_choices_run_together():
    from pathlib import Path

    from mcsd.serve.cli import build_parser
    text = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    group = next(g for g in build_parser()._action_groups if g.title == "server")
    flags = [a.option_strings[0] for a in group._group_actions]
    assert {"--model-name", "--log-level", "--fault-injection", "--max-batch", "--max-queue"} <= set(flags)
    for flag in flags:
        assert f"`{flag}" in text, flag
    assert "one after another" not in text and "decode together" in text
