"""Train the embedded pair's feature head on a GPU in one bounded run, from the token store alone.

On a machine with a GPU and this repository (the committed token store `data/smollm2-135m/`
and the embedded target carried in, see tools/gpu_check.py), the run:

1. reads the chosen response runs out of the store (`target_data.py from-store`),
2. labels them with one teacher-forced pass of the target on the GPU, keeping the layers the
   head reads (`teacher --store-layers 2,15,-1`), and the held-out answers likewise,
3. goes on training the shipped head (`--init`) on every position, for what is left of the
   time budget (several passes over the store where the GPU is fast enough),
4. writes the new head, its card and a JSON of each stage's time into `--out` ($OUT on the
   GPU machine, so that it comes back); a file over what a call brings back (16 MiB) is split
   into parts with a manifest (`<name>.parts/`, by `tools/gpu_carry.py split`; its `join` puts it
   together). A training stage that made no update (its budget spent loading the store) fails the run.

    python tools/gpu_train_head.py --out $OUT/head-gpu --budget-min 8
    python tools/gpu_train_head.py --dry-run          # print the plan

`--runs` picks the runs (default: every greedy and sampled Magpie run in the store).
Nothing here is imported by the package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BACK = 15 * 2**20               # a part's most: a little under the 16 MiB a file may be to come back
STORE = REPO / "data" / "smollm2-135m"
HEAD = REPO / "models" / "smollm2-135m-feature-head"
LAYERS = "2,15,-1"
HELDOUT = "heldout-greedy"


def store_runs() -> list[str]:
    """The Magpie response runs the store holds, greedy and sampled."""
    manifest = json.loads((STORE / "manifest.json").read_text())
    return sorted(r for r in manifest["runs"] if r.startswith("magpie-"))


def plan(runs: list[str], out: Path, train_min: float, batch: int) -> list[tuple[str, list[str]]]:
    """(stage, argv) in order; argv runs from the repository root."""
    data = [sys.executable, "tools/target_data.py", "--dtype", "bfloat16"]
    steps = [(f"from-store {r}", data + ["from-store", "--run", r]) for r in runs]
    steps.append(("held-out answers", data + ["generate", "--run", HELDOUT, "--split", "heldout"]))
    steps.append(("teacher", data + ["teacher", *runs, HELDOUT, "--store-layers", LAYERS,
                                     "--batch-size", "512", "--token-budget", "262144"]))
    steps.append(("train", [sys.executable, "tools/train_feature_drafter.py", "--init", str(HEAD), "--runs", *runs,
                            "--heldout-run", HELDOUT, "--out", str(out), "--time-budget-min", f"{train_min:.2f}",
                            "--lr", "2e-4", "--bf16", "--batch", str(batch), "--resident-positions", "0"]))
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "head-gpu")
    ap.add_argument("--runs", nargs="*", default=None, help="store runs to train on (default: every Magpie run)")
    ap.add_argument("--budget-min", type=float, default=8.0, help="the whole run, loading included")
    ap.add_argument("--train-share", type=float, default=0.6, help="of the budget, at most, for training itself "
                    "(less when the data stages took more than the rest)")
    ap.add_argument("--batch", type=int, default=256, help="training windows a step (large on a GPU)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    runs = args.runs or store_runs()
    steps = plan(runs, args.out, args.budget_min * args.train_share, args.batch)
    if args.dry_run:
        for stage, cmd in steps:
            print(f"{stage}: {' '.join(cmd)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"runs": runs, "budget_min": args.budget_min, "stages": []}
    t0 = time.time()
    env = dict(os.environ)                  # the stages import mcsd from this checkout, installed or not
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for stage, cmd in steps:
        started = time.time()
        if stage == "train":                 # training gets what the data stages left of the budget
            left = args.budget_min - (started - t0) / 60 - 0.75
            if left < 0.5:
                record["stages"].append({"stage": stage, "skipped": f"{left + 0.75:.1f} min of the budget left"})
                (args.out / "gpu_train.json").write_text(json.dumps(record, indent=1) + "\n")
                return 1
            cmd = cmd[:]
            cmd[cmd.index("--time-budget-min") + 1] = f"{min(left, args.budget_min * args.train_share):.2f}"
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        record["stages"].append({"stage": stage, "command": " ".join(cmd), "seconds": round(time.time() - started, 1),
                                 "returncode": result.returncode, "tail": result.stdout[-2000:] + result.stderr[-2000:]})
        (args.out / "gpu_train.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{stage}: {time.time() - started:.0f} s (rc {result.returncode})", flush=True)
        if result.returncode != 0:
            return result.returncode
    record["total_s"] = round(time.time() - t0, 1)
    card = json.loads((args.out / "card.json").read_text())
    record["updates"] = card["training"]["updates"]
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
