"""Training examples labelled as training reads them: the target's teacher-forced pass run a chunk
at a time on the device that trains the head, nothing written to disk.

On a GPU that pass costs less than reading stored labels back: the store's ten million response
positions come to ~35 GB of stored target layers (three layers of a 576-wide target in float16), which
a teacher stage writes and the trainer reads back, against a few seconds of the target's forward a
chunk. `OnlineExamples` reads the token runs of a shard store (`mcsd.train.shards`, the repository's
`data/<target>/`) and answers the feature trainer the way `data.ShardedExamples` does (`chunks`,
`load`, `by_prompt`, `responses`, `positions`); its labels are `engine.teacher_batch`'s, left on the
device.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from mcsd.train.campaign import length_batches
from mcsd.train.data import run_summary
from mcsd.train.engine import TOPK, teacher_batch
from mcsd.train.shards import ShardStore


class OnlineExamples:
    """The records of `runs` in the shard store at `root`, labelled by `model` when loaded.

    A unit is one record (its index); `chunks` cuts an epoch's shuffled order into chunks of about
    `resident_positions` response positions, and `load` labels a chunk in length-sorted batches of at
    most `batch_size` sequences and about `token_budget` padded tokens. Loaded examples carry what a
    labelled record of `data.load_examples` carries (key, prompt_id, category, prompt, response,
    topk_ids, topk_probs, hidden and, with `layers`, the layers a v2 head reads), the labels and the
    response on the model's device.
    """

    def __init__(self, root: str | Path, runs: list[str], model, pad_id: int, layers: tuple[int, ...] = (),
                 topk: int = TOPK, batch_size: int = 128, token_budget: int = 65536):
        self.store = ShardStore(root)
        manifest = self.store.manifest()
        missing = [r for r in runs if r not in manifest["runs"]]
        if missing:
            there = ", ".join(sorted(manifest["runs"])) or "none"
            raise ValueError(f"no token run {', '.join(map(repr, missing))} in {self.store.root} (runs there: {there})")
        self.runs, self.model, self.pad_id = list(runs), model, pad_id
        self.layers, self.topk = tuple(layers), topk
        self.batch_size, self.token_budget = batch_size, token_budget
        self.records: list[dict] = []
        self.by_prompt: dict = {}                       # prompt id -> [responses, positions]
        for r in self.store.records(self.runs):
            if len(r.response) < 2:                     # nothing a head could learn from
                continue
            self.records.append({"key": r.key, "prompt_id": r.prompt_id, "category": r.category,
                                 "prompt": torch.tensor(r.prompt, dtype=torch.int32),
                                 "response": torch.tensor(r.response, dtype=torch.int32)})
            counts = self.by_prompt.setdefault(r.prompt_id, [0, 0])
            counts[0] += 1
            counts[1] += len(r.response)
        if not self.records:
            raise ValueError(f"runs {runs} in {self.store.root} hold no response of two tokens or more")
        self.units = list(range(len(self.records)))
        self.responses = len(self.records)
        self.positions = sum(len(r["response"]) for r in self.records)

    def chunks(self, resident_positions: int, epoch: int, seed: int = 0) -> list[list[int]]:
        """Every record once, in an order drawn from (seed, epoch), cut into chunks of about
        `resident_positions` response positions each."""
        order = list(self.units)
        random.Random(f"{seed}/{epoch}").shuffle(order)
        out, chunk, size = [], [], 0
        for i in order:
            chunk.append(i)
            size += len(self.records[i]["response"])
            if size >= resident_positions:
                out.append(chunk)
                chunk, size = [], 0
        return out + ([chunk] if chunk else [])

    def load(self, units: list[int]) -> list[dict]:
        """The records `units`, labelled by the target (in length-sorted batches, not in `units`' order)."""
        device = next(self.model.parameters()).device
        records = [self.records[i] for i in units]
        lengths = [len(r["prompt"]) + len(r["response"]) for r in records]
        out = []
        for batch in length_batches(lengths, self.batch_size, self.token_budget):
            part = [records[i] for i in batch]
            labels = teacher_batch(self.model, part, self.topk, store_hidden=True, pad_id=self.pad_id,
                                   store_layers=self.layers, host=False)
            out.extend({**r, **lab, "response": r["response"].to(device)} for r, lab in zip(part, labels))
        return out

    def provenance(self) -> dict:
        """Per run: its settings, size, generation time and commands (the store's manifest)."""
        runs = self.store.manifest()["runs"]
        return {run: {**run_summary(runs[run]), "store": str(self.store.root)} for run in self.runs}
