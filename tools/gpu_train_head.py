"""Train the embedded pair's feature head on a GPU in one bounded run, from the token store alone.

On a machine with a GPU and this repository (the committed token store `data/smollm2-135m/` and the
embedded target carried in, see tools/gpu_carry.py), one stage goes on training the shipped head
(`--init`) for the time budget: `tools/train_feature_drafter.py --store`, which labels the store's
token runs with the target a chunk at a time on the GPU as it reads them (the layers the head reads
and the target's top-k; no teacher stage, nothing written: a teacher stage's labels for the store's
ten million positions come to ~35 GB, whose writing and reading back took the whole of an earlier
run's window). The held-out run (`specbench-heldout-greedy`, the target's greedy answers to the
held-out Spec-Bench prompts) gives the card's agreement. The new head, its card and a JSON of the
run go into `--out` ($OUT on the GPU machine, so that it comes back); a file over what a call
brings back (16 MiB) is split into parts with a manifest (`<name>.parts/`, by
`tools/gpu_carry.py split`; its `join` puts it together). A run that made no update fails.

    python tools/gpu_train_head.py --out $OUT/head-gpu --budget-min 8
    python tools/gpu_train_head.py --dry-run          # print the plan
    python tools/gpu_train_head.py --out $OUT/head2 --fresh-layers 2   # a new, deeper head instead
    python tools/gpu_train_head.py --out $OUT/head --sample 0.7 --sample-min 3 --budget-min 9
        # first 3 minutes of the target's sampled answers to the Magpie prompts, then training on them too

Files under $OUT come back at most 8 a call: the head's card, config, this run's JSON and the weights in
parts (6), the sampled run's tar (1); a stage's log is removed once its tail is in the JSON.

`--runs` picks the runs (default: every run in the store but the held-out one).
Nothing here is imported by the package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BACK = 15 * 2**20               # a part's most: a little under the 16 MiB a file may be to come back
STORE = REPO / "data" / "smollm2-135m"
HEAD = REPO / "models" / "smollm2-135m-feature-head"
HELDOUT = "specbench-heldout-greedy"


def store_runs() -> list[str]:
    """The store's response runs but the held-out one: Magpie's, greedy and sampled, and Spec-Bench's fitting split."""
    manifest = json.loads((STORE / "manifest.json").read_text())
    return sorted(r for r in manifest["runs"] if r != HELDOUT)


def plan(runs: list[str], out: Path, train_min: float, batch: int, resident: int = 524288,
         fresh_layers: int = 0, sample: float | None = None,
         sample_min: float = 3.0) -> list[tuple[str, list[str], float | None]]:
    """(stage, argv, seconds it may run or None) in order; argv runs from the repository root. fresh_layers > 0: a new head of that many
    decoder layers reading the shipped head's target layers, not the shipped head trained further.
    sample: first the target's answers to the store's Magpie prompts at this temperature (top-p 0.95),
    as run `sampled_run(sample)`, for `sample_min` minutes (stopped then: its shards so far are in the
    store); training then reads it."""
    manifest = json.loads((STORE / "manifest.json").read_text())
    held = ["--heldout-run", HELDOUT] if HELDOUT in manifest["runs"] else []
    if fresh_layers:
        layers = ",".join(str(i) for i in json.loads((HEAD / "feature_head.json").read_text())["feature_layers"])
        start = ["--layers", str(fresh_layers), "--feature-layers", layers, "--sub-vocab", "8192", "--lr", "1e-3"]
    else:
        start = ["--init", str(HEAD), "--lr", "2e-4"]
    steps = []
    if sample is not None:
        prompts = manifest["prompts"]["magpie"]["n_prompts"]          # answer those there are; write none
        steps.append(("sample", [sys.executable, "tools/target_data.py", "--dtype", "bfloat16", "--store", str(STORE),
                                 "campaign", "--prompts", str(prompts), "--step", "8192", "--batch-size", "1024",
                                 "--token-budget", "131072", "--shard-seconds", "60", "--run", sampled_run(sample),
                                 "--temperature", f"{sample:g}", "--top-p", "0.95"], sample_min * 60))
        runs = [*runs, sampled_run(sample)]
    steps.append(("train", [sys.executable, "tools/train_feature_drafter.py", *start, "--store", str(STORE),
                            "--runs", *runs, *held, "--teacher-dtype", "bfloat16", "--resident-positions",
                            str(resident), "--out", str(out), "--time-budget-min", f"{train_min:.2f}", "--bf16",
                            "--batch", str(batch)], None))
    return steps


def sampled_run(temperature: float) -> str:
    """The store run the sampling stage writes: magpie-t07-cuda for T 0.7."""
    return f"magpie-t{round(temperature * 10):02d}-cuda"


def _shards(run: str) -> int:
    """Shards the store holds of `run` (0 where the run is not there)."""
    return len(json.loads((STORE / "manifest.json").read_text())["runs"].get(run, {}).get("shards", []))


def pack_run(run: str, out: Path) -> Path:
    """The store's manifest and `run`'s shards as one tar in `out`, to come back from the GPU machine
    (`tar -xf <run>.tar -C data/smollm2-135m` puts them into the checkout's store)."""
    with tarfile.open(out / f"{run}.tar", "w") as tar:
        tar.add(STORE / "manifest.json", arcname="manifest.json")
        tar.add(STORE / "responses" / run, arcname=f"responses/{run}")
    return out / f"{run}.tar"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "head-gpu")
    ap.add_argument("--runs", nargs="*", default=None, help="store runs to train on (default: all but the held-out one)")
    ap.add_argument("--budget-min", type=float, default=8.0, help="the whole run, loading included")
    ap.add_argument("--resident-positions", type=int, default=524288, help="positions labelled at a time")
    ap.add_argument("--batch", type=int, default=256, help="training windows a step (large on a GPU)")
    ap.add_argument("--fresh-layers", type=int, default=0,
                    help="train a new head of this many decoder layers from scratch instead (the shipped one, "
                         "trained further over the whole store, gained 0.005 of held-out agreement: docs/results.md)")
    ap.add_argument("--sample", type=float, default=None, metavar="T",
                    help="first have the target answer the store's Magpie prompts at temperature T (top-p 0.95) "
                         "for --sample-min minutes, and train on those answers too (they come back as a tar)")
    ap.add_argument("--sample-min", type=float, default=3.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    runs = args.runs or store_runs()
    sample_min = args.sample_min if args.sample is not None else 0.0
    steps = plan(runs, args.out, args.budget_min - 0.75 - sample_min, args.batch, args.resident_positions,
                 args.fresh_layers, args.sample, sample_min)
    if args.dry_run:
        for stage, cmd, _ in steps:
            print(f"{stage}: {' '.join(cmd)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"runs": runs, "budget_min": args.budget_min, "stages": []}
    t0 = time.time()
    env = dict(os.environ)                  # the stages import mcsd from this checkout, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for stage, cmd, limit in steps:
        started = time.time()
        log = args.out / f"{stage}.log"                  # written as it goes: it comes back from a run cut short
        with open(log, "w") as f:
            try:
                code = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True, env=env,
                                      timeout=limit).returncode
            except subprocess.TimeoutExpired:   # a stage with a time (sampling) stops there, its output kept
                code = 0
        record["stages"].append({"stage": stage, "command": " ".join(cmd), "seconds": round(time.time() - started, 1),
                                 "returncode": code, "tail": log.read_text()[-3000:]})
        (args.out / "gpu_train.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{stage}: {time.time() - started:.0f} s (rc {code})", flush=True)
        if code != 0:
            return code
        log.unlink()                        # its tail is in gpu_train.json: a file fewer to bring back (8 at most)
        if stage == "sample" and not _shards(sampled_run(args.sample)):
            steps[-1][1].remove(sampled_run(args.sample))     # stopped before its first shard: trained without
        elif stage == "sample":
            record["runs"].append(sampled_run(args.sample))
    record["total_s"] = round(time.time() - t0, 1)
    card = json.loads((args.out / "card.json").read_text())
    record["updates"] = card["training"]["updates"]
    if args.sample is not None and _shards(sampled_run(args.sample)):
        record["sampled"] = pack_run(sampled_run(args.sample), args.out).name
    record["split"] = split_large(args.out)
    (args.out / "gpu_train.json").write_text(json.dumps(record, indent=1) + "\n")
    if not record["updates"]:
        print("training made no update: its budget went on loading the store", file=sys.stderr)
        return 1
    return 0


def split_large(folder: Path, limit: int = BACK) -> list[str]:
    """Each file in `folder` over `limit` bytes split into parts under it (`<name>.parts/`, with
    manifest.json), the whole file removed; returns the names split."""
    done = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.stat().st_size > limit:
            parts = -(-path.stat().st_size // limit)
            subprocess.run([sys.executable, str(REPO / "tools" / "gpu_carry.py"), "split", str(path),
                            str(folder / f"{path.name}.parts"), "--parts", str(parts)], check=True,
                           capture_output=True)
            path.unlink()
            done.append(path.name)
    return done


if __name__ == "__main__":
    raise SystemExit(main())
