"""Carry the embedded target to a GPU machine that reaches nothing outside it (see ../shared/GPU.md).

At most 64 MiB travels with a call (the working tree plus carried paths). The embedded target's
Q4_1 GGUF is 93 MB, so it goes in two calls, one part each, into a folder that outlives the call;
the second call joins the parts and checks the whole file's sha256 against the preset's. What the
GPU run does not need (the prompt data store, the standalone draft) leaves the checkout for the
calls and comes back after.

    # here, before the first call
    python tools/gpu_carry.py split ~/.cache/mcsd/gguf/SmolLM2-135M-Instruct.Q4_1.gguf .carry
    python tools/gpu_carry.py stash          # moves data/ and the standalone draft to ../.mcsd-stash
    python tools/gpu_carry.py size .carry/part0   # the bytes that would travel (must be < 64 MiB)
    # call 1 (carry .carry/part0 and .carry/manifest.json):   mkdir -p /tmp/w && cp .carry/* /tmp/w/
    # call 2 at once (carry .carry/part1):  cp .carry/* /tmp/w/ && python tools/gpu_carry.py join /tmp/w
    #     (join writes $MCSD_CACHE/gguf/<name>.gguf, or ~/.cache/mcsd/gguf/, where the preset looks)
    # then in the same call: python tools/gpu_check.py ...
    python tools/gpu_carry.py restore        # here, after

The GPU machine has no `gguf` package (needed to read the GGUF): carry its wheel (0.1 MB) in
`.whl/` and install it there with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`
(then PYTHONPATH=/tmp/site); `tools/gpu_check.py` does that itself when it finds `.whl/`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 64 * 1024 * 1024                       # bytes a call carries, the tree included
LEAVE_OUT = ("data", "models/smollm2-135m-draft")   # tracked, not needed by the GPU run
STASH = ROOT.parent / ".mcsd-stash"
PRESET_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(source: Path, out: Path, parts: int = 2) -> dict:
    """`source` into `parts` files of nearly equal size in `out`, with manifest.json (names, sizes, sha256s)."""
    out.mkdir(parents=True, exist_ok=True)
    size = source.stat().st_size
    step = -(-size // parts)
    manifest = {"name": source.name, "size": size, "sha256": sha256(source), "parts": []}
    with open(source, "rb") as f:
        for i in range(parts):
            part = out / f"part{i}"
            part.write_bytes(f.read(step))
            manifest["parts"].append({"file": part.name, "size": part.stat().st_size, "sha256": sha256(part)})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def join(folder: Path, dest_dir: Path | None = None, expected: str | None = None) -> Path:
    """The parts in `folder` (its manifest.json) joined into dest_dir/<name>; raises ValueError where a
    part is missing or the joined file's sha256 is not the manifest's (or `expected`)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    missing = [p["file"] for p in manifest["parts"] if not (folder / p["file"]).is_file()]
    if missing:
        raise ValueError(f"parts not carried yet: {', '.join(missing)}")
    dest_dir = dest_dir or Path(os.environ.get("MCSD_CACHE") or Path.home() / ".cache" / "mcsd") / "gguf"
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / manifest["name"]
    with open(dest, "wb") as f:
        for p in manifest["parts"]:
            f.write((folder / p["file"]).read_bytes())
    got = sha256(dest)
    if got != manifest["sha256"] or (expected is not None and got != expected):
        dest.unlink()
        raise ValueError(f"joined file's sha256 {got} is not {expected or manifest['sha256']}")
    return dest


def tree_bytes(root: Path = ROOT, leave_out=LEAVE_OUT) -> int:
    """Bytes of the tracked files present in the checkout, those under `leave_out` not counted."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    total = 0
    for name in names.decode().split("\0"):
        if name and not any(name == p or name.startswith(p + "/") for p in leave_out):
            path = root / name
            if path.is_file():
                total += path.stat().st_size
    return total


def move(paths, src: Path, dst: Path) -> list[str]:
    """Move each of `paths` from under src to under dst (where present); returns those moved."""
    moved = []
    for p in paths:
        if (src / p).exists():
            (dst / p).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src / p), str(dst / p))
            moved.append(p)
    return moved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="a file into parts with a manifest")
    s.add_argument("source", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--parts", type=int, default=2)
    j = sub.add_parser("join", help="the parts back into the model cache's gguf folder, sha256 checked")
    j.add_argument("folder", type=Path)
    j.add_argument("--dest", type=Path, default=None)
    j.add_argument("--preset", action="store_true", help="also require the embedded preset's sha256")
    z = sub.add_parser("size", help="bytes that would travel: the tree less what stash moves, plus these paths")
    z.add_argument("carried", nargs="*", type=Path)
    sub.add_parser("stash", help=f"move {', '.join(LEAVE_OUT)} out of the checkout")
    sub.add_parser("restore", help="move them back")
    args = ap.parse_args(argv)
    if args.cmd == "split":
        m = split(args.source, args.out, args.parts)
        print(json.dumps(m, indent=1))
    elif args.cmd == "join":
        print(join(args.folder, args.dest, PRESET_SHA256 if args.preset else None))
    elif args.cmd == "size":
        total = tree_bytes() + sum(p.stat().st_size if p.is_file() else
                                   sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in args.carried)
        print(f"{total} bytes ({total / 2**20:.1f} MiB) of {LIMIT / 2**20:.0f} MiB")
        return 0 if total < LIMIT else 1
    elif args.cmd == "stash":
        print("moved:", move(LEAVE_OUT, ROOT, STASH))
    elif args.cmd == "restore":
        print("restored:", move(LEAVE_OUT, STASH, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
