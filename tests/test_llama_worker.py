"""The benchmark's llama.cpp worker: its protocol, with a fake engine in place of llama.cpp (no
llama-cpp-python needed), a crash that gives a clear error, and the `llama_cpp` method's requests."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
from llama_worker import Worker, WorkerError  # noqa: E402

sys.path.remove(str(BENCH))

FAKE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {bench!r})
    from llama_worker import run_worker

    MODE = sys.argv[1]

    class Fake:
        def generate(self, ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=None, stop_ids=()):
            if MODE == "crash":
                print("about to crash", file=sys.stderr, flush=True)
                os._exit(3)
            if MODE == "kill":
                os.kill(os.getpid(), 9)
            if MODE == "noisy":
                os.write(1, b"a native library printing to stdout\\n")
            if ids == [13]:
                raise ValueError("unlucky prompt")
            # the new tokens: the prompt reversed; the time: what the engine measured, not the caller
            return ids[::-1][:max_new_tokens] + [int(temperature * 10), seed or 0, *stop_ids], 1.25

    def make():
        if MODE == "no-model":
            raise FileNotFoundError("no such GGUF: missing.gguf")
        return Fake()

    sys.exit(run_worker(make))
""")


@pytest.fixture
def fake_worker(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE.format(bench=str(BENCH)))
    started = []

    def start(mode="ok"):
        worker = Worker([sys.executable, str(script), mode], name="fake worker")
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def test_requests_are_answered_with_the_engines_own_timing(fake_worker):
    worker = fake_worker()
    assert worker.generate([1, 2, 3], 2) == ([3, 2, 0, 0], 1.25)
    tokens, seconds = worker.generate([4, 5], 8, temperature=0.7, top_p=0.9, seed=11, stop_ids=[99])
    assert (tokens, seconds) == ([5, 4, 7, 11, 99], 1.25)     # the engine's seconds: no pipe time added
    worker.close()
    assert worker.proc.returncode == 0                         # asked to close, it exits by itself


def test_a_native_library_printing_to_stdout_does_not_break_the_protocol(fake_worker):
    assert fake_worker("noisy").generate([1, 2], 4)[0] == [2, 1, 0, 0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_worker_sleeps_on_its_pipe_between_requests(fake_worker):
    worker = fake_worker()
    worker.generate([1], 1)

    def state_and_cpu_ticks():
        fields = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])     # state; utime + stime

    _, before = state_and_cpu_ticks()
    time.sleep(0.5)
    state, after = state_and_cpu_ticks()
    assert state == "S" and after == before                    # blocked on read, using no CPU


def test_an_engine_error_is_raised_and_the_worker_goes_on(fake_worker):
    worker = fake_worker()
    with pytest.raises(WorkerError, match="fake worker failed generating: ValueError: unlucky prompt"):
        worker.generate([13], 4)
    assert worker.generate([1, 2], 1)[0] == [2, 0, 0]


def test_a_worker_that_cannot_start_says_why(fake_worker):
    with pytest.raises(WorkerError, match="failed starting: FileNotFoundError: no such GGUF: missing.gguf"):
        fake_worker("no-model")


@pytest.mark.parametrize("mode, how, said", [("crash", "exit 3", "about to crash"), ("kill", "signal SIGKILL", "")])
def test_a_crashed_worker_gives_a_clear_error(fake_worker, mode, how, said):
    worker = fake_worker(mode)
    with pytest.raises(WorkerError, match=rf"fake worker \(pid \d+\) died while generating \({how}\)") as err:
        worker.generate([1, 2], 4)
    assert said in str(err.value)
    with pytest.raises(WorkerError, match="died while taking a request"):    # and stays dead, clearly
        worker.generate([1, 2], 4)
    worker.close()                                                            # closing a dead worker is fine


@pytest.fixture
def methods(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_methods", BENCH / "methods.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_methods", module)      # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _Recorder:
    def __init__(self):
        self.requests = []

    def generate(self, ids, max_new_tokens, **settings):
        self.requests.append((ids, max_new_tokens, settings))
        return [7, 8], 0.5


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_llama_cpp_method_sends_the_benchs_settings_and_reports_the_workers_time(methods, temperature):
    worker, ids = _Recorder(), torch.tensor([5, 6, 7])
    bench = SimpleNamespace(workers={"llama_cpp": worker}, max_new_tokens=16, seed_for=lambda i: 42,
                            tokenizer=SimpleNamespace(convert_tokens_to_ids=lambda t: 2),
                            sampling={"temperature": temperature, "top_p": 0.95} if temperature else {})
    run = methods._llama_cpp(bench, ids)
    assert (run.tokens, run.seconds, run.target_forwards) == ([7, 8], 0.5, 2)
    want = {"temperature": temperature, "top_p": 0.95 if temperature else 1.0,
            "seed": 42 if temperature else None, "stop_ids": [2]}
    assert worker.requests == [([5, 6, 7], 16, want)]


def test_llama_cpp_with_prompt_lookup_runs_in_a_worker_of_its_own_told_how_many_tokens_to_draft(methods,
                                                                                                 monkeypatch):
    import llama_worker
    started = []
    monkeypatch.setattr(llama_worker.Worker, "__init__", lambda self, argv, name="", **kw: started.append(argv))
    monkeypatch.setattr(llama_worker.Worker, "generate", lambda self, ids, n, **settings: ([9], 0.25))
    monkeypatch.setattr("mcsd.loading.models.fetch_preset_gguf", lambda preset: Path("/m.gguf"))
    plain = _Recorder()
    bench = SimpleNamespace(workers={"llama_cpp": plain}, max_new_tokens=16, seed_for=lambda i: 42,
                            tokenizer=SimpleNamespace(convert_tokens_to_ids=lambda t: 2), sampling={},
                            target_preset="p", prompts=[(0, torch.tensor([1, 2]))])
    method = next(m for m in methods.all_methods() if m.name == "llama_cpp_lookup")
    assert method.family == "llama_cpp"
    run = method.run(bench, torch.tensor([5, 6]))
    assert run.tokens == [9] and plain.requests == []               # not the plain llama.cpp worker
    [argv] = started
    assert argv[argv.index("--lookup") + 1] == str(methods.LLAMA_LOOKUP_TOKENS) and "/m.gguf" in argv
    assert set(bench.workers) == {"llama_cpp", f"llama_cpp_lookup{methods.LLAMA_LOOKUP_TOKENS}"}


def test_llama_cpp_not_installed_is_one_clear_line(methods, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    reason = methods.llama_cpp_unavailable(SimpleNamespace(target_preset=object(), device="cpu"))
    assert reason.startswith("llama-cpp-python is not installed") and "\n" not in reason
