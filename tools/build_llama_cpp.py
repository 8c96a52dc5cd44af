"""Build llama-cpp-python from source for the benchmark's `llama_cpp` method, the way a user who
compares against llama.cpp would: natively (`GGML_NATIVE=ON`), then a smoke run on the preset's GGUF
in a child process. A native build that crashes there (the AMX kernels did on one Xeon) is replaced
by one with explicit flags taken from this CPU's /proc/cpuinfo, without AMX.

    python tools/build_llama_cpp.py                       # build, smoke-test, say which build stands
    python tools/build_llama_cpp.py --check               # only the smoke run of what is installed
    python tools/build_llama_cpp.py --server DIR          # llama.cpp's llama-server from the same source

The build takes 15-40 minutes on 2 cores; `--jobs` sets its parallelism (one job keeps a core free).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"

# the x86 features ggml can be told to use, by /proc/cpuinfo flag; AMX stays off in the portable build
_X86_FLAGS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
              "avx512f": "GGML_AVX512", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
              "avx512vbmi": "GGML_AVX512_VBMI"}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def portable_cmake_args(flags: set[str]) -> str:
    """Explicit ggml flags for the features this CPU reports, AMX off: the build that ran where the
    native one crashed."""
    args = ["-DGGML_NATIVE=OFF"]
    args += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _X86_FLAGS.items()]
    args += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return " ".join(args)


def build(cmake_args: str, jobs: int) -> None:
    env = {**os.environ, "CMAKE_ARGS": cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    cmd = [sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-cache-dir",
           "--no-binary", "llama-cpp-python", f"llama-cpp-python=={VERSION}"]
    print(f"building llama-cpp-python {VERSION} with CMAKE_ARGS={cmake_args!r}", flush=True)
    subprocess.run(cmd, env=env, check=True)


def build_server(dest: Path, jobs: int) -> Path:
    """llama.cpp's `llama-server` from the llama.cpp source vendored in llama-cpp-python's sdist of
    VERSION (the library the benchmark's `llama_cpp` method runs), built natively under `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    sdist = dest / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={VERSION}", "-d", str(dest)], check=True)
    source = dest / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not source.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(dest, filter="data")
    build_dir = source / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], check=True)
    return build_dir / "bin" / "llama-server"


_SMOKE = """
import json, sys, time
from llama_cpp import Llama, llama_print_system_info
from mcsd.loading.presets import PRESETS
from mcsd.loading.models import fetch_preset_gguf
llm = Llama(model_path=str(fetch_preset_gguf(PRESETS[sys.argv[1]])), n_ctx=512, n_threads=int(sys.argv[2]), verbose=False)
ids = llm.tokenize(b"The capital of France is")
t0 = time.perf_counter()
out = []
for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
    out.append(int(tok))
    if len(out) == 32:
        break
dt = time.perf_counter() - t0
print(json.dumps({"tokens": len(out), "first_ids": out[:8], "tokens_per_s": round(len(out) / dt, 1),
                  "system_info": llama_print_system_info().decode()}))
"""


class SmokeFailed(RuntimeError):
    """The smoke run failed without crashing (an import error, a missing file): another build would not help."""


def smoke(preset: str, threads: int) -> dict | None:
    """Load the preset's GGUF and decode 32 greedy tokens in a child process (a crashing kernel takes
    the child, not this one). The child's report; None where the child died of a signal (an illegal
    instruction, a segmentation fault: the build does not run on this CPU)."""
    proc = subprocess.run([sys.executable, "-c", _SMOKE, preset, str(threads)], capture_output=True, text=True,
                          check=False)
    if proc.returncode < 0:
        print(f"smoke run crashed (signal {-proc.returncode}): {proc.stderr.strip()[-400:]}", flush=True)
        return None
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        raise SmokeFailed(f"smoke run failed (exit {proc.returncode}): {lines[-1] if lines else 'no message'}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m", help="the preset whose GGUF the smoke run decodes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)),
                    help="parallel compile jobs (default: every core)")
    ap.add_argument("--check", action="store_true", help="only smoke-test the installed build")
    ap.add_argument("--server", type=Path, default=None, metavar="DIR",
                    help="build llama.cpp's llama-server under DIR instead (benchmarks/serve_concurrency.py)")
    args = ap.parse_args(argv)
    if args.server is not None:
        print(build_server(args.server, args.jobs))
        return 0

    try:
        if args.check:
            if importlib.util.find_spec("llama_cpp") is None:
                print("build_llama_cpp: llama-cpp-python is not installed in this environment: build it with "
                      "python tools/build_llama_cpp.py (no --check), or pip install 'mcsd[llama]'", file=sys.stderr)
                return 1
            report = smoke(args.preset, args.threads)
            print(json.dumps(report, indent=1) if report else "the installed llama-cpp-python crashes here")
            return 0 if report else 1
        attempts = [("native", "-DGGML_NATIVE=ON"), ("portable", portable_cmake_args(cpu_flags()))]
        for name, cmake_args in attempts:
            build(cmake_args, args.jobs)
            report = smoke(args.preset, args.threads)
            if report is not None:
                print(json.dumps({"build": name, "cmake_args": cmake_args, **report}, indent=1))
                return 0
            print(f"the {name} build crashes here; trying the next", flush=True)
    except SmokeFailed as exc:
        print(f"build_llama_cpp: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
