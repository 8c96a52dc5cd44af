"""The data engine's folder: the manifest, response and teacher shards, prompt
sources, the target's loading, and reading labelled examples back.

The layout under `<root>/data/<target-name>/` is described in
`mcsd.train.engine`, whose stages write it; the trainers read it back with
`load_examples`.

Limitations: one process at a time per stage and run (the manifest is locked
while written, but two runs of the same stage would both do the same pending
prompts).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
from pathlib import Path

import torch

from mcsd.loading.cache import cache_dir
from mcsd.loading.data import load_prompts as load_prompts_file

DEFAULT_TARGET = "smollm2-135m"          # the embedded preset; any model source works


class DataError(ValueError):
    """The data folder lacks what was asked of it, or holds it with other settings; the message says
    which run and, where one does, the command that makes it. The stages' and trainers' `main`s turn
    it into one line and exit status 1."""


# -----------------------------------------------------------------------------
# Paths, target loading, prompts


def default_data_dir(target_path: str) -> Path:
    """Cache folder for one target's data, outside the repository."""
    return cache_dir() / "data" / Path(target_path).name


def pick_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(name: str = "auto") -> torch.dtype:
    """"auto" is bfloat16 on CUDA and float32 on CPU: a CPU without AVX512-BF16
    (AVX2 only, like the one this was built on) runs *batched* bfloat16 matmuls
    3-5x slower than float32, so bulk data generation is faster in float32.
    The bfloat16 target is the float32 checkpoint rounded, and its next-token
    distribution is the same up to that rounding."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def load_target(source: str, device: str | None = None, dtype=torch.bfloat16):
    """The target and its tokenizer through the package's loader (preset, directory, .gguf or hub id)."""
    from mcsd.drafting.pair import load_model
    from mcsd.loading.models import load_tokenizer

    device = device or pick_device()
    dtype = pick_dtype(dtype) if isinstance(dtype, str) else dtype
    return load_model(source, dtype, device, role="target"), load_tokenizer(source)


def load_spec_bench(path: str | None = None, split: str = "fit") -> list[dict]:
    """Spec-Bench first turns as prompt dicts {id, category, text} (split as in mcsd.loading.data)."""
    return [{"id": f"sb-{p.question_id}", "category": p.category, "text": p.text}
            for p in load_prompts_file(path, split)]


def load_prompts(data_dir: Path, source: str, split: str, questions: str) -> list[dict]:
    """Prompt dicts from a source: "specbench" (with split) or "selfinstruct"."""
    if source == "specbench":
        return load_spec_bench(questions, split)
    if source == "selfinstruct":
        path = data_dir / "prompts" / "selfinstruct.jsonl"
        return [json.loads(line) for line in open(path)] if path.exists() else []
    raise ValueError(f"unknown prompt source {source!r}")


# -----------------------------------------------------------------------------
# Manifest: one JSON file, updated under a lock, written atomically


def read_manifest(data_dir: Path) -> dict:
    path = data_dir / "manifest.json"
    if not path.exists():
        return {"runs": {}, "teacher": {}, "selfinstruct": {}}
    return json.loads(path.read_text())


@contextlib.contextmanager
def manifest_update(data_dir: Path):
    """Yield the freshly read manifest; write it back when the block ends.
    The lock serialises writers (a stage and a one-off prompttext, say);
    the atomic replace means a reader never sees half a file."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / ".manifest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = read_manifest(data_dir)
        yield manifest
        tmp = data_dir / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, data_dir / "manifest.json")


def save_shard(data_dir: Path, section: str, run: str, records: list[dict], stats: dict):
    """Write one shard and record it (and its keys) in the manifest."""
    with manifest_update(data_dir) as manifest:
        entry = manifest[section][run]
        rel = f"{section_folder(section)}/{run}/{len(entry['shards']):05d}.pt"
        (data_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        torch.save(records, data_dir / rel)
        entry["shards"].append(rel)
        entry["done"].extend(r["key"] for r in records)
        for name, value in stats.items():
            entry[name] = entry.get(name, 0) + value


def section_folder(section: str) -> str:
    return {"runs": "responses", "teacher": "teacher"}[section]


def start_run(data_dir: Path, section: str, run: str, settings: dict, command: str | None = None) -> set[str]:
    """Create the run's manifest entry (or check its settings match), record
    the command line that (re)started it, and return the keys already done."""
    with manifest_update(data_dir) as manifest:
        entry = manifest[section].setdefault(run, {"settings": settings, "shards": [], "done": []})
        if entry["settings"] != settings:
            raise DataError(f"run {run!r} exists with other settings:\n{entry['settings']}\nvs\n{settings}")
        if command is not None and command not in entry.setdefault("commands", []):
            entry["commands"].append(command)  # a resumed stage with the same command adds none
        return set(entry["done"])


# -----------------------------------------------------------------------------
# Reading the data back (used by the trainers)


def response_run(manifest: dict, run: str, data_dir: Path) -> dict:
    """The manifest entry of response run `run`; DataError naming the command that makes a run that
    is not there."""
    entry = manifest["runs"].get(run)
    if entry is None:
        there = ", ".join(sorted(manifest["runs"])) or "none"
        raise DataError(f"no response run {run!r} in {data_dir} (runs there: {there}); make it first: "
                 f"python tools/target_data.py generate --run {run} --split fit (--split heldout for held-out prompts)")
    return entry


def run_summary(entry: dict) -> dict:
    """A run's manifest entry (a data dir's or a shard store's) as a head's card records it: its
    settings, size, generation time and the commands that wrote it."""
    return {"settings": entry.get("settings"), "sequences": entry.get("n_sequences"), "tokens": entry.get("n_tokens"),
            "minutes": round(entry.get("seconds", 0) / 60, 1), "commands": entry.get("commands", [])}


def iter_records(data_dir: Path, run: str):
    """Yield the stored response records of a run, shard by shard."""
    manifest = read_manifest(Path(data_dir))
    for rel in response_run(manifest, run, data_dir)["shards"]:
        yield from torch.load(Path(data_dir) / rel, weights_only=True)


def _labelled(record: dict, label: dict, with_hidden) -> dict | None:
    """A record merged with its teacher labels, or None while it has none
    (or, with with_hidden=True, no hidden states)."""
    r = {**record, **label}
    if not with_hidden:
        r.pop("hidden", None)  # 1 KB a position that only the feature trainer reads
        r.pop("layers", None)
    if not _usable(r, with_hidden):
        return None
    if "layers" in r and "hidden" in r:
        # A teacher pass storing the final state among its layers writes it twice; keep one copy (a view).
        width = r["hidden"].shape[1]
        for j in range(r["layers"].shape[1] // width):
            part = r["layers"][:, j * width:(j + 1) * width]
            if torch.equal(part, r["hidden"]):
                r["hidden"] = part
                break
    return r


def _usable(record: dict, with_hidden) -> bool:
    """The record has labels (and, with with_hidden=True, hidden states)."""
    return "topk_ids" in record and (with_hidden is not True or "hidden" in record)


def _check_with_hidden(with_hidden):
    if with_hidden not in (False, True, "optional"):
        raise ValueError(f"with_hidden must be False, True or 'optional', not {with_hidden!r}")


def load_examples(data_dir: Path, runs: list[str], with_hidden: bool | str = False) -> list[dict]:
    """All records of `runs`, with the teacher's labels where the teacher
    stage ran and the generation-time labels otherwise.

    with_hidden: False drops stored hidden states, True keeps them and
    requires them (records without are skipped, a run with none is an
    error), "optional" keeps them where stored.

    Records with no labels yet (a prompttext run before its teacher pass)
    are skipped. Returns dicts: key, prompt_id, category, prompt (P,) int32,
    response (R,) int32, topk_ids (R, k) int32, topk_probs (R, k) float16
    [, hidden (R, H) float16, layers (R, L*H) float16 where the teacher stored
    several layers; hidden is then a view of the copy inside layers].
    """
    _check_with_hidden(with_hidden)
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    for run in runs:
        response_run(manifest, run, data_dir)      # every run there before any is read
    examples = []
    for run in runs:
        labels = {}
        if run in manifest["teacher"]:
            for rel in manifest["teacher"][run]["shards"]:
                for t in torch.load(data_dir / rel, weights_only=True):
                    labels[t["key"]] = t
        unlabelled, n_before = 0, len(examples)
        for r in iter_records(data_dir, run):
            r = _labelled(r, labels.get(r["key"], {}), with_hidden)
            if r is None:
                unlabelled += 1  # e.g. a prompttext run whose teacher pass is not finished
                continue
            examples.append(r)
        if with_hidden is True and len(examples) == n_before:
            raise ValueError(f"run {run!r} has no hidden states: generate it with --store-hidden "
                             f"or run `teacher {run} --store-hidden`")
        if unlabelled:
            print(f"[load_examples] {run}: skipped {unlabelled} records without teacher labels")
    return examples


class ShardedExamples:
    """The labelled records of `runs`, read a few shards at a time: for data
    larger than memory (the feature trainer's `--resident-positions`).

    A unit is one teacher shard (its records' labels) or, for a run without a
    teacher pass, one response shard (labels stored at generation); a run
    with a teacher pass contributes the records that pass labelled. The
    response token ids of every run are held (small); labels and hidden
    states are read per unit when `load` asks for it. `positions` counts the
    response positions of the labelled records, `responses` the records,
    `by_prompt` both per prompt id.
    """

    def __init__(self, data_dir: Path, runs: list[str], with_hidden: bool | str = False):
        _check_with_hidden(with_hidden)
        self.data_dir, self.with_hidden = Path(data_dir), with_hidden
        manifest = read_manifest(self.data_dir)
        self.records: dict[tuple[str, str], dict] = {}  # (run, key) -> record: runs may share keys
        self.units: list[tuple[str, str, str]] = []     # (section, run, shard path)
        self.by_prompt: dict = {}                       # prompt id -> [responses, positions]
        for run in runs:
            response_run(manifest, run, self.data_dir)
        for run in runs:
            teacher = manifest["teacher"].get(run)
            if teacher is None:
                self.units.extend(("runs", run, rel) for rel in manifest["runs"][run]["shards"])
                labelled = None
            else:
                self.units.extend(("teacher", run, rel) for rel in teacher["shards"])
                labelled = set(teacher["done"])
            for r in iter_records(self.data_dir, run):
                if labelled is None:
                    usable = _usable(r, with_hidden)
                else:
                    self.records[run, r["key"]] = {k: v for k, v in r.items() if k not in ("hidden", "layers")}
                    usable = r["key"] in labelled
                if usable:
                    counts = self.by_prompt.setdefault(r["prompt_id"], [0, 0])
                    counts[0] += 1
                    counts[1] += len(r["response"])
        if not self.units:
            raise ValueError(f"runs {runs} hold no shards")
        self.responses = sum(n for n, _ in self.by_prompt.values())
        self.positions = sum(n for _, n in self.by_prompt.values())

    def load(self, units: list[tuple[str, str, str]]) -> list[dict]:
        """The labelled examples of these units, in their order."""
        out = []
        for section, run, rel in units:
            for t in torch.load(self.data_dir / rel, weights_only=True):
                if section == "teacher":
                    record = self.records.get((run, t["key"]))
                    r = _labelled(record, t, self.with_hidden) if record is not None else None
                else:
                    r = _labelled(t, {}, self.with_hidden)
                if r is not None:
                    out.append(r)
        return out

    def chunks(self, resident_positions: int, epoch: int, seed: int = 0) -> list[list[tuple[str, str, str]]]:
        """Every unit once, in an order drawn from (seed, epoch), cut into
        chunks of about `resident_positions` positions each."""
        order = list(self.units)
        random.Random(f"{seed}/{epoch}").shuffle(order)
        per = max(1, round(len(order) * resident_positions / max(self.positions, 1)))
        return [order[i:i + per] for i in range(0, len(order), per)]
