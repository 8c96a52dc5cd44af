"""Token shards: target-written data kept in the repository.

What is expensive to make and small to keep is the token ids of prompts and
the target's responses; hidden states and top-k labels are recomputed from
them by a teacher-forced pass whenever a trainer needs them. A store is one
folder (default `data/<target-name>/` in the repository):

    manifest.json            runs: settings, commands, shards, counts, seconds
    responses/<run>/NNNNN.npz
    prompts/<source>.jsonl   prompt texts written by the target (magpie, ...)

A shard is one `numpy.savez_compressed` file of flat arrays:

    keys          (n,) str      "<prompt_id>/<sample>"
    categories    (n,) str
    prompt        (sum P,) uint16|int32   prompt ids, concatenated
    prompt_len    (n,) int32
    response      (sum R,) uint16|int32   response ids (EOS included when reached)
    response_len  (n,) int32
    finished      (n,) bool     the response reached EOS

uint16 is used when every id fits (vocabularies under 65,536 entries, such
as SmolLM2's 49,152), which halves the size. A shard is written to a temporary
name and renamed, and the manifest is replaced atomically after it, so a
killed job loses at most the batch it was working on; the keys a run has
finished are read back from the manifest on restart.

Limitations: one writer per run at a time (the manifest is locked while
written, but two processes generating the same run would do the same keys).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Record:
    """One target-written response to one prompt."""
    key: str
    category: str
    prompt: list[int]
    response: list[int]
    finished: bool

    @property
    def prompt_id(self) -> str:
        return self.key.rsplit("/", 1)[0]


def _pack(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(s) for s in seqs], dtype=np.int32)
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lengths.sum()))
    dtype = np.uint16 if flat.size == 0 or (flat.min() >= 0 and flat.max() < 2 ** 16) else np.int32
    return flat.astype(dtype), lengths


def _unpack(flat: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(lengths)
    return [flat[e - n:e].astype(np.int64).tolist() for e, n in zip(ends, lengths)]


def write_shard(path: Path, records: list[Record]) -> None:
    """Write records as one compressed shard (atomically: temporary name, then rename)."""
    prompt, prompt_len = _pack([r.prompt for r in records])
    response, response_len = _pack([r.response for r in records])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(
        tmp, keys=np.array([r.key for r in records]), categories=np.array([r.category for r in records]),
        prompt=prompt, prompt_len=prompt_len, response=response, response_len=response_len,
        finished=np.array([r.finished for r in records], dtype=bool),
    )
    os.replace(tmp, path)


def read_shard(path: Path) -> list[Record]:
    """The records of one shard. Raises ValueError naming the file if it is not a token shard."""
    try:
        with np.load(path, allow_pickle=False) as z:   # never unpickle: shards hold plain arrays only
            prompts = _unpack(z["prompt"], z["prompt_len"])
            responses = _unpack(z["response"], z["response_len"])
            return [Record(str(k), str(c), p, r, bool(f))
                    for k, c, p, r, f in zip(z["keys"], z["categories"], prompts, responses, z["finished"])]
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: not a readable token shard ({e})") from e


def read_keys(path: Path) -> list[str]:
    """The keys of one shard, without decompressing its token arrays."""
    with np.load(path, allow_pickle=False) as z:
        return [str(k) for k in z["keys"]]


class ShardStore:
    """A folder of token shards with one manifest."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    # -- manifest ---------------------------------------------------------------

    def manifest(self) -> dict:
        path = self.root / "manifest.json"
        if not path.exists():
            return {"format": 1, "runs": {}, "prompts": {}}
        return json.loads(path.read_text())

    @contextlib.contextmanager
    def _update(self):
        """Yield the freshly read manifest; write it back atomically when the block ends."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            manifest = self.manifest()
            yield manifest
            tmp = self.root / "manifest.json.tmp"
            tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.root / "manifest.json")

    def start_run(self, run: str, settings: dict, command: str | None = None) -> set[str]:
        """Create the run's entry (or check its settings match) and return the keys already done.

        Raises:
            ValueError: the run exists with other settings (resuming must not mix them).
        """
        with self._update() as manifest:
            entry = manifest["runs"].setdefault(
                run, {"settings": settings, "shards": [], "n_sequences": 0, "n_tokens": 0, "seconds": 0.0})
            if entry["settings"] != settings:
                raise ValueError(f"run {run!r} exists with other settings:\n{entry['settings']}\nvs\n{settings}")
            if command and command not in entry.setdefault("commands", []):
                entry["commands"].append(command)
        return self.done_keys(run)

    def done_keys(self, run: str) -> set[str]:
        entry = self.manifest()["runs"].get(run)
        return {k for shard in (entry or {}).get("shards", []) for k in read_keys(self.root / shard["file"])}

    def add_shard(self, run: str, records: list[Record], seconds: float) -> Path:
        """Write a shard of `records` to `run` and account for it in the manifest."""
        with self._update() as manifest:
            entry = manifest["runs"][run]
            rel = f"responses/{run}/{len(entry['shards']):05d}.npz"
            write_shard(self.root / rel, records)
            n_tokens = sum(len(r.response) for r in records)
            entry["shards"].append({"file": rel, "n": len(records), "tokens": n_tokens,
                                    "seconds": round(seconds, 1),
                                    "written": time.strftime("%Y-%m-%dT%H:%M:%S")})
            entry["n_sequences"] += len(records)
            entry["n_tokens"] += n_tokens
            entry["seconds"] = round(entry["seconds"] + seconds, 1)
            if entry["seconds"] > 0:
                entry["tokens_per_s"] = round(entry["n_tokens"] / entry["seconds"], 1)
        return self.root / rel

    def set_prompts(self, source: str, info: dict) -> None:
        with self._update() as manifest:
            manifest.setdefault("prompts", {})[source] = info

    def set_info(self, **info) -> None:
        with self._update() as manifest:
            manifest.update(info)

    # -- reading ----------------------------------------------------------------

    def records(self, runs: list[str] | None = None):
        """Iterate the records of `runs` (all runs when None), shard by shard."""
        manifest = self.manifest()
        for run in runs if runs is not None else sorted(manifest["runs"]):
            if run not in manifest["runs"]:
                raise KeyError(f"no run {run!r} in {self.root} (runs: {', '.join(sorted(manifest['runs'])) or 'none'})")
            for shard in manifest["runs"][run]["shards"]:
                yield from read_shard(self.root / shard["file"])

    def prompt_file(self, source: str) -> Path:
        return self.root / "prompts" / f"{source}.jsonl"

    def read_prompts(self, source: str) -> list[dict]:
        path = self.prompt_file(source)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def status(self) -> str:
        """A table of what the store holds: prompts, runs, sequences, tokens, time, throughput."""
        manifest = self.manifest()
        lines = [f"store: {self.root}"]
        for source, info in sorted(manifest.get("prompts", {}).items()):
            lines.append(f"prompts {source:12s} {info.get('n_prompts', 0):7d} kept of {info.get('n_generated', 0):7d} written"
                         f"  {info.get('seconds', 0) / 60:7.1f} min")
        total_seq = total_tok = 0
        prompts = set()
        for run, e in sorted(manifest["runs"].items()):
            tps = e.get("tokens_per_s", 0)
            lines.append(f"run     {run:24s} seqs {e['n_sequences']:7d}  tokens {e['n_tokens']:9d}  shards "
                         f"{len(e['shards']):4d}  {e['seconds'] / 60:7.1f} min  {tps:6.1f} tok/s")
            total_seq += e["n_sequences"]
            total_tok += e["n_tokens"]
            prompts |= {k.rsplit("/", 1)[0] for s in e["shards"] for k in read_keys(self.root / s["file"])}
        lines.append(f"total   {len(prompts)} distinct prompts, {total_seq} responses, {total_tok} response tokens")
        return "\n".join(lines)
