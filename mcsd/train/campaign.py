"""The data campaign: target-written prompts (Magpie) and responses, as token shards.

Two stages, both resumable and both writing into one `ShardStore`:

    write_prompts   the target writes user turns from its chat template's
                    prefix (optionally with a task hint), filtered and
                    deduplicated -> prompts/magpie.jsonl
    answer          the target answers a list of prompts (greedy or sampled),
                    length-bucketed batches on the fastest many-row kernels
                    -> responses/<run>/NNNNN.npz

Every random draw is seeded from the stage, the round or the batch's first
key, so a resumed stage continues the sequence a straight run would have made.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mcsd.forward import kernels
from mcsd.train.generation import sample_batch
from mcsd.train.magpie import HINTS, NearDuplicates, diversity, keep_prompt, normalise, prefix_ids
from mcsd.train.shards import Record, ShardStore


def seed_for(*parts) -> int:
    """A stable seed from strings, so a resumed stage samples what a straight run would have."""
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def seeded_generator(device, *parts) -> torch.Generator:
    """A generator on `device` (where the sampling happens) seeded from `parts` (`seed_for`)."""
    return torch.Generator(device=device).manual_seed(seed_for(*parts))


def eos_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end an assistant's (or user's) turn: EOS and the chat template's end-of-turn."""
    ids = {tokenizer.eos_token_id}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        ids.add(end)
    return tuple(sorted(i for i in ids if i is not None))


def fast_kernels(model):
    """The block's products on oneDNN with prepacked weights where this CPU has them (the fastest
    path for many-row blocks, see mcsd.forward.kernels), else a no-op context."""
    p = next(model.parameters())
    if p.device.type == "cpu" and kernels.packable(p.dtype, p.device):
        kernels.pack(model)
        return kernels.using("packed")
    return contextlib.nullcontext()


def target_identity(model) -> dict:
    """What the store records of the target that wrote it: name, dtype and, where the model's
    folder has mcsd's conversion record, the sha256 of its weights and tokenizer."""
    folder = Path(getattr(model, "name_or_path", "") or ".")
    info = {"target": folder.name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    record = folder / "mcsd-complete.json"
    if record.is_file():
        files = json.loads(record.read_text()).get("files", {})
        info["target_sha256"] = {k: v for k, v in files.items() if k in ("model.safetensors", "tokenizer.json")}
    return info


def length_batches(lengths: list[int], batch_size: int, token_budget: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (ascending): at most `batch_size` items
    and about `token_budget` padded prompt tokens each."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, batch = [], []
    for i in order:
        if batch and (len(batch) >= batch_size or lengths[i] * (len(batch) + 1) > token_budget):
            batches.append(batch)
            batch = []
        batch.append(i)
    return batches + ([batch] if batch else [])


def write_prompts(model, tokenizer, store: ShardStore, count: int, source: str = "magpie",
                  batch_size: int = 64, temperature: float = 1.0, top_p: float = 0.95,
                  max_new_tokens: int = 160, hints: dict | None = None, log=print) -> dict:
    """Let the target write user turns until `store` holds `count` kept prompts of `source`.

    Each round samples `batch_size` turns, cycling through the task hints;
    turns that fail `keep_prompt`, repeat one already kept (after
    `normalise`) or nearly repeat one (`NearDuplicates`) are dropped, and
    the reasons are counted in the manifest.

    Returns:
        The manifest's entry for `source` (counts, drop reasons, settings, diversity).
    """
    hints = HINTS if hints is None else hints
    store.set_info(**target_identity(model))
    names = sorted(hints)
    prefixes = {name: prefix_ids(tokenizer, hints[name]) for name in names}
    path = store.prompt_file(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = store.read_prompts(source)
    info = store.manifest().get("prompts", {}).get(source, {})
    seen = {normalise(p["text"]) for p in kept}
    near = NearDuplicates()
    for p in kept:
        near.add(p["text"])
    rounds, written = info.get("rounds", 0), info.get("n_generated", 0)
    dropped = dict(info.get("dropped", {}))
    seconds, n_tokens = info.get("seconds", 0.0), info.get("n_tokens", 0)
    settings = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                "batch_size": batch_size, "hints": hints}
    log(f"[{source}] {len(kept)} prompts kept, target {count}")
    ends = eos_ids(tokenizer)
    bar = tqdm(total=count, initial=len(kept), desc=source, unit="prompt", dynamic_ncols=True)
    with fast_kernels(model):
        while len(kept) < count:
            t0 = time.time()
            slots = [names[(rounds * batch_size + j) % len(names)] for j in range(batch_size)]
            generator = seeded_generator(model.device, source, rounds)
            outs = sample_batch(model, [prefixes[s] for s in slots], max_new_tokens, temperature, top_p,
                                ends, tokenizer.pad_token_id or 0, generator)
            new = []
            for hint, out in zip(slots, outs):
                ids = out["response"][:-1] if out["finished"] else out["response"]
                text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                why = keep_prompt(text, out["finished"], len(ids))
                if why is None and normalise(text) in seen:
                    why = "duplicate"
                if why is None and not near.add(text):
                    why = "near-duplicate"
                if why is not None:
                    dropped[why] = dropped.get(why, 0) + 1
                    continue
                seen.add(normalise(text))
                new.append({"id": f"mp-{len(kept) + len(new)}", "category": hint, "text": text,
                            "round": rounds})
            with open(path, "a") as f:
                f.writelines(json.dumps(p) + "\n" for p in new)
            kept += new
            rounds += 1
            written += len(outs)
            n_tokens += sum(len(o["response"]) for o in outs)
            seconds += time.time() - t0
            info = {"file": str(path.relative_to(store.root)), "n_prompts": len(kept), "n_generated": written,
                    "rounds": rounds, "dropped": dict(sorted(dropped.items())), "n_tokens": n_tokens,
                    "seconds": round(seconds, 1), "tokens_per_s": round(n_tokens / max(seconds, 1e-9), 1),
                    "settings": settings}
            store.set_prompts(source, info)
            bar.update(len(new))
            bar.set_postfix(kept=f"{len(kept)}/{written}", tok_s=f"{info['tokens_per_s']:.0f}")
    bar.close()
    if kept:
        lengths = [len(tokenizer(p["text"], add_special_tokens=False)["input_ids"]) for p in kept]
        info["diversity"] = diversity([p["text"] for p in kept], lengths, [p["category"] for p in kept])
        store.set_prompts(source, info)
    return info


def answer(model, tokenizer, store: ShardStore, run: str, prompts: list[dict], settings: dict,
           chat_ids, batch_size: int = 64, token_budget: int = 16384, shard_seconds: float = 300.0,
           command: str | None = None, limit: int | None = None, skip: set[str] = frozenset(),
           log=print) -> dict:
    """Target responses to `prompts` ({id, category, text} dicts), stored as token shards of `run`.

    `settings` holds temperature, top_p, samples and max_new_tokens (and
    anything else that defines the run: resuming with other settings is
    refused). Shards are written at least every `shard_seconds`, so a
    killed job loses little, and one stopped by an interrupt (SIGINT) first
    stores the answers it finished. Prompts whose key is in `skip` (answered by
    another run, e.g. the same greedy answers in another dtype) are left out:
    a second copy of nearly the same answer adds tokens, not information.

    Returns:
        The run's manifest entry.
    """
    store.set_info(**target_identity(model))
    done = store.start_run(run, settings, command)
    jobs = []                                                  # (key, category, prompt ids)
    for p in prompts:
        ids = chat_ids(tokenizer, p["text"])
        if len(ids) > settings.get("max_prompt_len", 1 << 30):
            continue
        for s in range(settings.get("samples", 1)):
            key = f"{p['id']}/{s}"
            if key not in done and key not in skip:
                jobs.append((key, p["category"], ids))
    if limit is not None:
        jobs = jobs[: max(0, limit - len(done))]
    log(f"[answer {run}] {len(done)} done, {len(jobs)} pending" + (f", {len(skip)} answered elsewhere" if skip else ""))
    ends = eos_ids(tokenizer)
    batches = length_batches([len(j[2]) for j in jobs], batch_size, token_budget)
    # stable but mixed order, so a stopped run holds short and long prompts alike
    random.Random(seed_for(run, "order")).shuffle(batches)
    bar = tqdm(total=len(jobs), desc=f"answer {run}", unit="seq", dynamic_ncols=True)
    pending, t_shard, t_work = [], time.time(), 0.0
    n_tok, t0 = 0, time.time()
    with fast_kernels(model):
        try:
            for batch in batches:
                t_batch = time.time()
                first = jobs[batch[0]][0]
                generator = seeded_generator(model.device, run, first)
                outs = sample_batch(model, [jobs[i][2] for i in batch], settings["max_new_tokens"],
                                    settings.get("temperature", 0.0), settings.get("top_p", 1.0), ends,
                                    tokenizer.pad_token_id or 0, generator)
                for i, out in zip(batch, outs):
                    key, category, ids = jobs[i]
                    pending.append(Record(key, category, ids, out["response"].tolist(), out["finished"]))
                    n_tok += len(out["response"])
                t_work += time.time() - t_batch
                bar.update(len(batch))
                bar.set_postfix(tok=n_tok, tok_s=f"{n_tok / (time.time() - t0):.0f}")
                if time.time() - t_shard >= shard_seconds:
                    records, pending = pending, []         # handed over first: a stop inside the write
                    store.add_shard(run, records, t_work)  # cannot store them twice
                    t_shard, t_work = time.time(), 0.0
        except KeyboardInterrupt:
            # a stopped job (Ctrl-C, or `timeout -s INT` around it) keeps the answers it finished
            # since the last shard; only the batch in flight is lost
            if pending:
                store.add_shard(run, pending, t_work)
                log(f"[answer {run}] stopped: {len(pending)} finished answers kept in a last shard")
            raise
        if pending:
            store.add_shard(run, pending, t_work)
    bar.close()
    return store.manifest()["runs"][run]
