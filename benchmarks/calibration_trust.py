"""Whether the engine's self-tuning can be trusted on a real machine: five scenarios, each
running `mcsd-generate` as a user would, on caches of its own (the converted models are shared).

    poisoned   calibrate while CPU-bound processes hold every core, stop them, then run the CLI
               default twice on the quiet machine: tokens/s against a freshly, quietly calibrated
               cache (does a cache measured on a busy machine heal, and how soon)
    repeat     three fresh calibrations: the share of block sizes whose matmul path all three chose
    calibrate  first-use calibration time of the default pair, and --baseline on a fresh cache
    busy       one CPU-bound process holding a core: the CLI default with the threads it picks,
               with --threads 2, and --baseline, interleaved
    same       the Quickstart command ten times back to back: does it print the same text

Run it on an otherwise quiet machine (it makes its own load where a scenario needs one):

    python benchmarks/calibration_trust.py --out trust.json [--dtype auto] [--scenarios poisoned repeat ...]

It prints a table and writes every run's figures to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Explain speculative decoding in one paragraph."


def _cache(shared: Path) -> Path:
    """A fresh cache folder that shares the converted models (and nothing measured) with `shared`."""
    folder = Path(tempfile.mkdtemp(prefix="mcsd-trust-"))
    for name in ("models", "gguf"):
        if (shared / name).exists():
            (folder / name).symlink_to(shared / name)
    return folder


def _run(cache: Path, *extra: str, max_new_tokens: int = 128, dtype: str = "auto") -> dict:
    """One CLI run's --json result, with its wall time."""
    env = {**os.environ, "MCSD_CACHE": str(cache), "TQDM_DISABLE": "1"}
    env.pop("OMP_NUM_THREADS", None)                  # the engine picks its threads, as for a user
    cmd = [sys.executable, "-m", "mcsd.cli", "--chat", "--prompt", PROMPT, "--max-new-tokens", str(max_new_tokens),
           "--dtype", dtype, "--json", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    out["wall_s"] = time.perf_counter() - t0
    return out


class Load:
    """`n` CPU-bound processes (`yes > /dev/null`) for the length of a with-block."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(self.n)]
        time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()
        time.sleep(1.0)


def _tps(out: dict) -> float:
    return out["stats"]["tokens_per_s"]


def poisoned(shared: Path, dtype: str) -> dict:
    clean = _cache(shared)
    _run(clean, max_new_tokens=1, dtype=dtype)                   # quiet calibration
    poisoned_cache = _cache(shared)
    with Load(os.cpu_count() or 2):
        first = _run(poisoned_cache, max_new_tokens=16, dtype=dtype)
    after = [_run(poisoned_cache, dtype=dtype) for _ in range(2)]
    ref = _run(clean, dtype=dtype)
    return {"busy_calibration_s": first["settings"]["calibration_s"],
            "after_tokens_per_s": [_tps(o) for o in after],
            "after_calibration_s": [o["settings"]["calibration_s"] for o in after],
            "clean_tokens_per_s": _tps(ref),
            "ratio_first": _tps(after[0]) / _tps(ref), "ratio_second": _tps(after[1]) / _tps(ref)}


def _paths(cache: Path) -> dict[str, str]:
    """(setup:role:size) -> the matmul path a cache's profiles time fastest, over every profile in it
    (a setup: target, drafter, dtype and threads)."""
    chosen = {}
    for path in sorted((cache / "profiles").glob("*.json")):
        prof = json.loads(path.read_text())
        meta = prof.get("meta", {})
        setup = f"{Path(str(meta.get('target'))).name}+{meta.get('draft')}/{meta.get('dtype')}/{meta.get('threads')}t"
        for role in ("verify", "draft"):
            tables = {p: prof.get(f"{role}{suffix}_ms") or {} for p, suffix in
                      (("onednn", ""), ("aten", "_aten"), ("packed", "_packed"))}
            for n in tables["onednn"]:
                timed = {p: t[n] for p, t in tables.items() if n in t}
                chosen[f"{setup}:{role}:{n}"] = min(timed, key=timed.get)
    return chosen


def repeat(shared: Path, dtype: str) -> dict:
    runs = []
    for _ in range(3):
        cache = _cache(shared)
        _run(cache, max_new_tokens=1, dtype=dtype)
        runs.append(_paths(cache))
    keys = sorted(set(runs[0]).intersection(*runs[1:]))
    same = [k for k in keys if len({r[k] for r in runs}) == 1]
    return {"block_sizes": len(keys), "same_path": len(same), "share": len(same) / max(len(keys), 1),
            "differ": {k: [r[k] for r in runs] for k in keys if k not in same}}


def calibrate(shared: Path, dtype: str) -> dict:
    first = _run(_cache(shared), max_new_tokens=1, dtype=dtype)
    base = _run(_cache(shared), "--baseline", max_new_tokens=16, dtype=dtype)
    return {"first_use_calibration_s": first["settings"]["calibration_s"], "first_use_wall_s": first["wall_s"],
            "baseline_calibration_s": base["settings"]["calibration_s"], "baseline_wall_s": base["wall_s"]}


def busy(shared: Path, dtype: str) -> dict:
    cache = _cache(shared)
    _run(cache, max_new_tokens=1, dtype=dtype)                   # calibrated quietly first
    rows = {"default": [], "threads_2": [], "baseline": []}
    with Load(1):
        for _ in range(2):                                       # interleaved
            rows["default"].append(_run(cache, dtype=dtype))
            rows["threads_2"].append(_run(cache, "--threads", "2", dtype=dtype))
            rows["baseline"].append(_run(cache, "--baseline", dtype=dtype))
    best = {k: max(_tps(o) for o in v) for k, v in rows.items()}
    return {"tokens_per_s": best, "threads_chosen": rows["default"][0]["settings"]["threads_reason"],
            "default_over_threads_2": best["default"] / best["threads_2"],
            "default_over_baseline": best["default"] / best["baseline"]}


def same(shared: Path, dtype: str) -> dict:
    cache = _cache(shared)
    runs = [_run(cache, dtype=dtype) for _ in range(10)]
    texts = [o["text"] for o in runs]
    # a run that measured the machine again (its profile was flagged stale by the run before) grows
    # other trees from other costs: in reduced precision, that alone can change a near-tie
    return {"runs": len(texts), "distinct_texts": len(set(texts)),
            "runs_that_measured": sum(o["settings"]["calibration_s"] > 0 for o in runs)}


SCENARIOS = {"poisoned": poisoned, "repeat": repeat, "calibrate": calibrate, "busy": busy, "same": same}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    shared = Path(os.environ.get("MCSD_CACHE") or Path.home() / ".cache" / "mcsd").expanduser()
    _run(shared, max_new_tokens=1, dtype=args.dtype)             # the models converted once, up front
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    result = {"cpu": cpu, "cores": os.cpu_count(), "dtype": args.dtype,
              "date": time.strftime("%Y-%m-%d")}
    for name in args.scenarios:
        t0 = time.perf_counter()
        result[name] = SCENARIOS[name](shared, args.dtype)
        result[name]["scenario_s"] = round(time.perf_counter() - t0, 1)
        print(f"{name:10s} {json.dumps(result[name])}", flush=True)
    for folder in Path(tempfile.gettempdir()).glob("mcsd-trust-*"):
        shutil.rmtree(folder, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
