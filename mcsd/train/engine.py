"""Target-generated training data for draft models.

A draft model is only useful if it predicts what *the target* will say, so
we train it on text the target writes itself, labelled with the target's own
next-token distribution (self-distillation). This module builds that data in
resumable stages, all recorded in one `manifest.json`:

    selfinstruct  the target writes new instructions in the style of the
                  fitting split's categories (more varied prompts than the
                  384 we have) -> prompts/selfinstruct.jsonl; the lists it
                  writes are kept as the response run "selfinstruct-meta"
    generate      batched target responses (greedy or sampled) to a prompt
                  source -> responses/<run>/NNNNN.pt
    prompttext    the prompts themselves as a run (no generation), so the
                  teacher can label the target's predictions over them
    corpus        text files, or the source and documentation of installed
                  packages, cut into chunks (chat-formatted by default) as a
                  run, with per-source provenance (mcsd.train.corpus)
    teacher       teacher-forced target pass over prompt + response, storing
                  the target's top-k next-token distribution (and optionally
                  its last hidden state) per response position
                  -> teacher/<run>/NNNNN.pt
    status        print what is there

Each record is keyed "<prompt_id>/<sample>". Prompt ids are "sb-<question_id>"
for Spec-Bench and "si-<n>" for self-instruct prompts. The split is by
Spec-Bench question id: `question_id % 5 == 0` is held out, the rest is the
fitting split; self-instruct prompts are written only from fitting examples,
so they belong to the fitting split too.

`generate` also keeps the target's top-k at every generated position (the
logits are computed anyway, so this is free). For those runs the `teacher`
stage is only needed when hidden states are wanted; `load_examples` takes the
teacher's labels when present and the generation-time ones otherwise. In
float32 the two agree exactly (checked); in bfloat16 up to rounding, as
padding and KV-cache order differ.

Layout (default root `~/.cache/mcsd`, or `$MCSD_CACHE`):

    <root>/data/<target-name>/manifest.json
    <root>/data/<target-name>/prompts/selfinstruct.jsonl
    <root>/data/<target-name>/responses/<run>/00000.pt   list of records
    <root>/data/<target-name>/teacher/<run>/00000.pt     list of records

Kill any stage and rerun the same command: finished keys are skipped.

Limitations: one process at a time per stage and run (the manifest is
locked while written, but two runs of the same stage would both do the same
pending prompts). Records of an interrupted batch are lost and redone.

Example:
    python tools/target_data.py generate --run fit-greedy --split fit
    python tools/target_data.py generate --run fit-t08 --split fit --temperature 0.8 --samples 2
    python tools/target_data.py selfinstruct --count 2000
    python tools/target_data.py generate --run si-t07 --source selfinstruct --temperature 0.7
    python tools/target_data.py status
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mcsd.loading.data import chat_ids
from mcsd.train import campaign
from mcsd.train.campaign import length_batches, seed_for, seeded_generator
from mcsd.train.data import (
    DEFAULT_TARGET,
    DataError,
    default_data_dir,
    iter_records,
    load_prompts,
    load_spec_bench,
    load_target,
    manifest_update,
    pick_dtype,
    read_manifest,
    response_run,
    save_shard,
    start_run,
)
from mcsd.train.generation import sample_batch
from mcsd.train.shards import ShardStore

DEFAULT_STORE = Path(__file__).resolve().parents[2] / "data"   # token shards kept in the repository
DEFAULT_QUESTIONS = None                 # mcsd.loading.data.default_spec_bench()
TOPK = 8  # the target's top-8 holds ~92% of its mass on its own responses


# -----------------------------------------------------------------------------
# Batched generation with the target


def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    eos_ids: tuple[int, ...] = (2,),
    pad_id: int = 2,
    topk: int = TOPK,
    generator: torch.Generator | None = None,
    store_hidden: bool = False,
) -> list[dict]:
    """Continue a batch of prompts with the target, keeping its top-k at every response
    position (`mcsd.train.generation.sample_batch` with labels)."""
    return sample_batch(model, prompts, max_new_tokens, temperature, 1.0, eos_ids, pad_id, generator,
                        topk=topk, store_hidden=store_hidden)


def run_generate(args):
    """Stage `generate`: responses to every pending (prompt, sample) of a source."""
    data_dir = Path(args.data_dir)
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    prompts = load_prompts(data_dir, args.source, args.split, args.questions)
    settings = {
        "source": args.source, "split": args.split, "temperature": args.temperature,
        "samples": args.samples, "max_new_tokens": args.max_new_tokens, "topk": TOPK,
        "target": Path(args.target).name, "dtype": str(pick_dtype(args.dtype)).removeprefix("torch."),
    }
    if args.source == "selfinstruct":
        settings.pop("split")  # self-instruct prompts all come from the fitting split
    if args.store_hidden:
        settings["store_hidden"] = True
    done = start_run(data_dir, "runs", args.run, settings, args.command)

    jobs = []  # (key, prompt dict, prompt ids)
    for p in prompts:
        if args.categories and p["category"] not in args.categories:
            continue
        ids = chat_ids(tokenizer, p["text"])
        if len(ids) > args.max_prompt_len:
            continue
        for s in range(args.samples):
            key = f"{p['id']}/{s}"
            if key not in done:
                jobs.append((key, p, ids))
    if args.limit is not None:
        # jobs run shortest prompt first, so a limit reproduces a run that was stopped early
        jobs = sorted(jobs, key=lambda job: len(job[2]))[: max(0, args.limit - len(done))]
    print(f"[generate {args.run}] {len(done)} done, {len(jobs)} pending", flush=True)

    eos_ids = tuple({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    lengths = [len(ids) for _, _, ids in jobs]
    bar = tqdm(total=len(jobs), desc=f"generate {args.run}", unit="seq", dynamic_ncols=True)
    t0, n_tok = time.time(), 0
    for batch in length_batches(lengths, args.batch_size, args.token_budget):
        t_batch = time.time()
        keys = [jobs[i][0] for i in batch]
        generator = seeded_generator(model.device, args.run, keys[0])
        outs = generate_batch(
            model, [jobs[i][2] for i in batch], args.max_new_tokens, args.temperature,
            eos_ids, tokenizer.pad_token_id, TOPK, generator, args.store_hidden,
        )
        records = []
        for i, out in zip(batch, outs):
            key, p, ids = jobs[i]
            records.append({"key": key, "prompt_id": p["id"], "category": p["category"],
                            "prompt": torch.tensor(ids, dtype=torch.int32), **out})
        tokens = sum(len(r["response"]) for r in records)
        save_shard(data_dir, "runs", args.run, records,
                   {"n_sequences": len(records), "n_tokens": tokens, "seconds": round(time.time() - t_batch, 1)})
        n_tok += tokens
        bar.update(len(batch))
        bar.set_postfix(tok=n_tok, tok_s=f"{n_tok / (time.time() - t0):.0f}")
    bar.close()


# -----------------------------------------------------------------------------
# The campaign's stages: token shards in the repository (mcsd.train.campaign)


def store_for(args) -> ShardStore:
    return ShardStore(Path(args.store) if args.store else DEFAULT_STORE / Path(args.target).name)


def run_magpie(args):
    """Stage `magpie`: the target writes user turns until `--count` distinct ones are kept."""
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    store = store_for(args)
    store.set_info(target=Path(args.target).name, dtype=str(model.dtype).removeprefix("torch."))
    info = campaign.write_prompts(model, tokenizer, store, args.count, batch_size=args.batch_size,
                                  temperature=args.temperature, top_p=args.top_p,
                                  max_new_tokens=args.max_new_tokens)
    print(json.dumps({k: info[k] for k in ("n_prompts", "n_generated", "dropped", "tokens_per_s")}), flush=True)


def run_answer(args):
    """Stage `answer`: target responses to a prompt source, as token shards of `--run`."""
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    store = store_for(args)
    if args.source == "magpie":
        prompts = store.read_prompts("magpie")
    else:
        prompts = load_prompts(Path(args.data_dir), args.source, args.split, args.questions)
    settings = {"source": args.source, "temperature": args.temperature, "top_p": args.top_p,
                "samples": args.samples, "max_new_tokens": args.max_new_tokens,
                "target": Path(args.target).name, "dtype": str(model.dtype).removeprefix("torch.")}
    if args.source == "specbench":
        settings["split"] = args.split
    entry = campaign.answer(model, tokenizer, store, args.run, prompts, settings, chat_ids,
                            batch_size=args.batch_size, token_budget=args.token_budget,
                            shard_seconds=args.shard_seconds, command=args.command, limit=args.limit)
    print(f"[answer {args.run}] {entry['n_sequences']} responses, {entry['n_tokens']} tokens, "
          f"{entry.get('tokens_per_s', 0)} tok/s", flush=True)


def run_campaign(args):
    """Stage `campaign`: alternate `magpie` and `answer` in steps of `--step` prompts until the
    store holds `--prompts` prompts, every one answered (greedy) in run `--run`."""
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    store = store_for(args)
    store.set_info(target=Path(args.target).name, dtype=str(model.dtype).removeprefix("torch."))
    settings = {"source": "magpie", "temperature": args.temperature, "top_p": args.top_p, "samples": 1,
                "max_new_tokens": args.max_new_tokens, "target": Path(args.target).name,
                "dtype": str(model.dtype).removeprefix("torch.")}
    have = len(store.read_prompts("magpie"))
    while True:
        skip = set().union(*(store.done_keys(run) for run in args.skip_answered_by))
        goal = min(args.prompts, max(have, len(store.done_keys(args.run) | skip)) + args.step)
        campaign.write_prompts(model, tokenizer, store, goal, batch_size=args.batch_size)
        have = len(store.read_prompts("magpie"))
        campaign.answer(model, tokenizer, store, args.run, store.read_prompts("magpie"), settings, chat_ids,
                        batch_size=args.batch_size, token_budget=args.token_budget,
                        shard_seconds=args.shard_seconds, command=args.command, skip=skip)
        print(store.status(), flush=True)
        if have >= args.prompts:
            break


def run_from_store(args):
    """Stage `from-store`: a store run's token records as a response run in the data dir, for the
    `teacher` stage to label (hidden states and top-k are recomputed, never stored in the repository)."""
    data_dir, store = Path(args.data_dir), store_for(args)
    name = args.as_run or args.run
    settings = {"from_store": str(store.root), "run": args.run}
    done = start_run(data_dir, "runs", name, settings, args.command)
    batch = []
    for r in store.records([args.run]):
        if r.key in done:
            continue
        batch.append({"key": r.key, "prompt_id": r.prompt_id, "category": r.category, "finished": r.finished,
                      "prompt": torch.tensor(r.prompt, dtype=torch.int32),
                      "response": torch.tensor(r.response, dtype=torch.int32)})
        if len(batch) == 1024:
            save_shard(data_dir, "runs", name, batch, {"n_sequences": len(batch),
                                                       "n_tokens": sum(len(b["response"]) for b in batch)})
            batch = []
    if batch:
        save_shard(data_dir, "runs", name, batch, {"n_sequences": len(batch),
                                                   "n_tokens": sum(len(b["response"]) for b in batch)})
    print(f"[from-store] {name}: {len(read_manifest(data_dir)['runs'][name]['done'])} records; "
          f"label them with: python tools/target_data.py teacher {name} --store-layers ...", flush=True)


def run_store_status(args):
    print(store_for(args).status())


def run_coverage(args):
    """Sub-vocabulary coverage of the target's argmax, from the store's greedy runs, into the manifest."""
    from mcsd.train import coverage
    store = store_for(args)
    runs = args.runs or [name for name, e in sorted(store.manifest()["runs"].items())
                         if e["settings"].get("temperature", 0.0) == 0.0]
    for name in runs:
        if store.manifest()["runs"][name]["settings"].get("temperature", 0.0) != 0.0:
            raise SystemExit(f"coverage: run {name!r} is sampled; its tokens are not the target's argmax")
    head_ids = None
    if args.head:
        from safetensors import safe_open
        with safe_open(str(Path(args.head) / "feature_head.safetensors"), "pt") as f:
            head_ids = f.get_tensor("vocab_ids").tolist()
    result = coverage.report(store.records(runs), head_ids)
    result["runs"] = runs
    if args.head:
        result["head"]["path"] = args.head
    store.set_info(coverage=result)
    print(json.dumps(result, indent=1))


# -----------------------------------------------------------------------------
# Self-instruct: the target writes new prompts from fitting-split examples

# Long-context categories are asked for the short kind of task they contain;
# copying a 700-token passage into the meta prompt would be slow and the
# 135M target cannot write a coherent one anyway.
SELFINSTRUCT_TEMPLATE = (
    "Here are some example requests a user sent to an AI assistant:\n\n{examples}\n\n"
    "Write {n_new} new requests of the same kind, each on a different topic, as a numbered list."
)


def selfinstruct_meta_prompt(examples: list[str], n_new: int = 5, max_chars: int = 300) -> str:
    shown = [e if len(e) <= max_chars else e[:max_chars].rsplit(" ", 1)[0] + " ..." for e in examples]
    listed = "\n\n".join(f"{i + 1}. {e}" for i, e in enumerate(shown))
    return SELFINSTRUCT_TEMPLATE.format(examples=listed, n_new=n_new)


def parse_instructions(text: str, finished: bool) -> list[str]:
    """The items of a generated numbered list that look like requests.
    Asking for a list gives several prompts per generation (the 135M target
    keeps to the list format well); an unfinished last item is dropped."""
    items = re.split(r"(?:^|\n)\s*\d+[\.\)]\s+", "\n" + text)[1:]
    if not finished and items:
        items = items[:-1]
    keep = []
    for item in items:
        item = re.sub(r"^\*\*[^*]{0,60}\*\*:?\s*", "", item.strip()).strip().strip('"').strip()
        if 15 <= len(item) <= 1200 and not item.lower().startswith(("sure", "here is", "here are")):
            keep.append(item)
    return keep


def run_selfinstruct(args):
    """Stage `selfinstruct`: write new prompts until `--count` are stored."""
    data_dir = Path(args.data_dir)
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    fit = load_spec_bench(args.questions, "fit")
    by_category = {}
    for p in fit:
        by_category.setdefault(p["category"], []).append(p["text"])
    categories = sorted(by_category)

    path = data_dir / "prompts" / "selfinstruct.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = [json.loads(line) for line in open(path)] if path.exists() else []
    seen = {e["text"].lower() for e in existing} | {p["text"].lower() for p in fit}
    n_rounds = max([e["round"] for e in existing], default=-1) + 1
    print(f"[selfinstruct] {len(existing)} prompts stored, target {args.count}", flush=True)

    eos_ids = tuple({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    bar = tqdm(total=args.count, initial=len(existing), desc="selfinstruct", unit="prompt", dynamic_ncols=True)
    while len(existing) < args.count:
        t_round = time.time()
        # a round: one meta prompt per slot, categories cycled so all get a share
        rng = random.Random(seed_for("selfinstruct", n_rounds))
        metas = []
        for j in range(args.batch_size):
            category = categories[(n_rounds * args.batch_size + j) % len(categories)]
            examples = rng.sample(by_category[category], k=min(3, len(by_category[category])))
            metas.append((category, chat_ids(tokenizer, selfinstruct_meta_prompt(examples))))
        generator = seeded_generator(model.device, "selfinstruct-gen", n_rounds)
        outs = generate_batch(
            model, [m for _, m in metas], args.max_new_tokens, args.temperature,
            eos_ids, tokenizer.pad_token_id, TOPK, generator, args.store_hidden,
        )
        # the lists the target wrote are target text too: keep them as a
        # response run ("selfinstruct-meta") so no generated token is wasted
        records = [
            {"key": f"meta-{n_rounds}/{j}", "prompt_id": f"meta-{n_rounds}-{j}", "category": category,
             "prompt": torch.tensor(ids, dtype=torch.int32), **out}
            for j, ((category, ids), out) in enumerate(zip(metas, outs))
        ]
        start_run(data_dir, "runs", "selfinstruct-meta", {"source": "selfinstruct-meta", "temperature": args.temperature,
                  "max_new_tokens": args.max_new_tokens, "topk": TOPK, "target": Path(args.target).name,
                  "dtype": str(pick_dtype(args.dtype)).removeprefix("torch.")}, args.command)
        save_shard(data_dir, "runs", "selfinstruct-meta", records,
                   {"n_sequences": len(records), "n_tokens": sum(len(r["response"]) for r in records),
                    "seconds": round(time.time() - t_round, 1)})
        new = []
        for (category, _), out in zip(metas, outs):
            text = tokenizer.decode(out["response"], skip_special_tokens=True)
            for item in parse_instructions(text, out["finished"]):
                if item.lower() not in seen:
                    seen.add(item.lower())
                    new.append({"id": f"si-{len(existing) + len(new)}", "category": category,
                                "text": item, "round": n_rounds})
        with open(path, "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in new)
        existing += new
        n_rounds += 1
        with manifest_update(data_dir) as manifest:
            manifest["selfinstruct"] = {
                "file": "prompts/selfinstruct.jsonl", "n_prompts": len(existing), "rounds": n_rounds,
                "settings": {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                             "examples_per_prompt": 3, "new_per_prompt": 5, "template": SELFINSTRUCT_TEMPLATE},
            }
        bar.update(len(new))
    bar.close()


# -----------------------------------------------------------------------------
# Prompt text as a run: the target's labels on the user's words


def run_prompttext(args):
    """Stage `prompttext`: store the prompts themselves as a response run
    (no generation), for the teacher stage to label.

    The record's "prompt" is the shared chat-template prefix (system message
    and user header) and its "response" the user text and the template tail,
    so the labels are the target's predictions over the prompt's own words.
    Teacher-forcing costs a fraction of generating, and the long documents
    of the summarisation and RAG prompts are the text the target quotes when
    it answers them.
    """
    data_dir = Path(args.data_dir)
    from mcsd.loading.models import load_tokenizer

    tokenizer = load_tokenizer(args.target)                # a preset name, directory, .gguf or hub id
    prompts = load_prompts(data_dir, args.source, args.split, args.questions)
    settings = {"source": args.source, "split": args.split, "kind": "prompt text", "target": Path(args.target).name}
    if args.source == "selfinstruct":
        settings.pop("split")
    done = start_run(data_dir, "runs", args.run, settings, args.command)
    ids = {p["id"]: chat_ids(tokenizer, p["text"]) for p in prompts}
    first = next(iter(ids.values()))
    n_prefix = 0  # the prefix all prompts share: system message and user header
    while all(len(v) > n_prefix and v[n_prefix] == first[n_prefix] for v in ids.values()):
        n_prefix += 1
    records = [
        {"key": f"{p['id']}/0", "prompt_id": p["id"], "category": p["category"], "finished": True,
         "prompt": torch.tensor(ids[p["id"]][:n_prefix], dtype=torch.int32),
         "response": torch.tensor(ids[p["id"]][n_prefix:], dtype=torch.int32)}
        for p in prompts
        if f"{p['id']}/0" not in done
    ]
    for i in range(0, len(records), 256):
        chunk = records[i : i + 256]
        save_shard(data_dir, "runs", args.run, chunk,
                   {"n_sequences": len(chunk), "n_tokens": sum(len(r["response"]) for r in chunk)})
    print(f"[prompttext {args.run}] stored {len(records)} prompts (prefix {n_prefix} tokens)")


# -----------------------------------------------------------------------------
# Text corpora as runs: code, documentation and prose for the teacher to label


def run_corpus(args):
    """Stage `corpus`: text files (paths the user names, or the source and
    documentation of installed packages) cut into chunks and stored as a
    run, for the teacher stage to label. Per source, the manifest keeps its
    version, the licence it declares and what was stored (files, chunks,
    tokens). Resumable like the other stages; rerunning with more sources
    adds them to the run; `--max-tokens` caps the run's total."""
    from mcsd.loading.data import default_spec_bench
    from mcsd.loading.models import load_tokenizer
    from mcsd.train import corpus

    data_dir = Path(args.data_dir)
    if not args.paths and not args.packages:
        sys.exit("corpus needs --paths and/or --packages")
    try:
        corpus.refuse_evaluation_data(args.paths, [args.questions or default_spec_bench()])
        docs, versions = [], {}
        for name in args.packages:
            found, versions[name] = corpus.package_documents(name, tuple(args.suffixes))
            docs += found
        for path in args.paths:
            docs += corpus.path_documents(path, args.licence, tuple(args.suffixes))
    except corpus.CorpusError as exc:
        sys.exit(f"corpus: {exc}")
    docs = corpus.dedupe(docs)
    tokenizer = load_tokenizer(args.target)
    settings = {"kind": "corpus", "format": args.format, "chunk_tokens": args.chunk_tokens,
                "target": Path(args.target).name}
    done = start_run(data_dir, "runs", args.run, settings, args.command)
    total = read_manifest(data_dir)["runs"][args.run].get("n_tokens", 0)
    print(f"[corpus {args.run}] {len(docs)} documents, {len(done)} chunks and {total} tokens stored", flush=True)

    def flush(pending: list[dict], prov: dict) -> None:
        save_shard(data_dir, "runs", args.run, pending,
                   {"n_sequences": len(pending), "n_tokens": sum(len(r["response"]) for r in pending)})
        with manifest_update(data_dir) as manifest:
            table = manifest["runs"][args.run].setdefault("provenance", {})
            for source, add in prov.items():
                entry = table.setdefault(source, {**add, "files": 0, "chunks": 0, "tokens": 0})
                for k in ("files", "chunks", "tokens"):
                    entry[k] += add[k]

    pending, prov = [], {}
    bar = tqdm(docs, desc=f"corpus {args.run}", unit="file", dynamic_ncols=True)
    for doc in bar:
        if args.max_tokens and total >= args.max_tokens:
            break
        try:
            new = [r for r in corpus.records(doc, tokenizer, args.chunk_tokens, args.format) if r["key"] not in done]
        except corpus.CorpusError as exc:
            sys.exit(f"corpus: {exc}")
        if args.max_tokens:
            keep, room = [], args.max_tokens - total
            for r in new:
                if room <= 0:
                    break
                keep.append(r)
                room -= len(r["response"])
            new = keep
        if not new:
            continue
        n_tok = sum(len(r["response"]) for r in new)
        total += n_tok
        p = prov.setdefault(doc.source, {"version": versions.get(doc.source), "licence": doc.licence,
                                         "files": 0, "chunks": 0, "tokens": 0})
        p["files"] += any(r["key"].endswith("#0") for r in new)    # counted once, with its first chunk
        p["chunks"] += len(new)
        p["tokens"] += n_tok
        pending += new
        if len(pending) >= args.shard_records:
            flush(pending, prov)
            pending, prov = [], {}
        bar.set_postfix(tokens=total)
    if pending:
        flush(pending, prov)
    bar.close()
    print(f"[corpus {args.run}] {total} tokens stored; label them with: "
          f"python tools/target_data.py teacher {args.run} --store-layers ...", flush=True)


# -----------------------------------------------------------------------------
# Teacher-forced pass


@torch.inference_mode()
def teacher_batch(model, records: list[dict], topk: int = TOPK, store_hidden: bool = False,
                  pad_id: int = 2, store_layers: tuple[int, ...] = (), host: bool = True) -> list[dict]:
    """The target's next-token distribution at every response position,
    teacher-forced on prompt + response (right padding).

    Position t of a response (predicting response[t]) reads the model output
    at sequence index len(prompt) - 1 + t.

    Returns per record: topk_ids (R, k) int32, topk_probs (R, k) float16 and,
    with store_hidden, hidden (R, H) float16: the final normed hidden state
    that the LM head reads (what feature-level drafters such as EAGLE use);
    with store_layers (indices into transformers' `hidden_states`: 0 =
    embeddings, i = after decoder layer i, -1 = final), layers (R, L*H)
    float16: those states concatenated, what a v2 feature head reads.
    With host=False every tensor stays on the model's device (labels made as training goes).
    """
    device = next(model.parameters()).device
    keep = (lambda t: t.cpu()) if host else (lambda t: t)
    seqs = [torch.cat([r["prompt"], r["response"]]).long() for r in records]
    B, L = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    for b, s in enumerate(seqs):
        input_ids[b, : len(s)] = s
        attention_mask[b, : len(s)] = 1
    body = model.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                       output_hidden_states=bool(store_layers))
    hidden = body.last_hidden_state
    results = []
    for b, r in enumerate(records):
        P, R = len(r["prompt"]), len(r["response"])
        h = hidden[b, P - 1 : P - 1 + R]  # (R, H) only the positions we need go through the LM head
        probs = model.lm_head(h).float().softmax(-1)  # (R, V)
        top_p, top_i = probs.topk(topk, dim=-1)
        out = {"key": r["key"], "topk_ids": keep(top_i.int()), "topk_probs": keep(top_p.half())}
        if store_hidden:
            out["hidden"] = keep(h.half())
        if store_layers:
            out["layers"] = keep(torch.cat([body.hidden_states[i][b, P - 1 : P - 1 + R] for i in store_layers],
                                           dim=-1).half())
        results.append(out)
    return results


def run_teacher(args):
    """Stage `teacher`: label every stored response of the given runs."""
    data_dir = Path(args.data_dir)
    manifest = read_manifest(data_dir)
    for run in args.runs:
        response_run(manifest, run, data_dir)      # before the target loads or a teacher entry is made
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    for run in args.runs:
        settings = {"topk": args.topk, "store_hidden": args.store_hidden, "target": Path(args.target).name,
                    "dtype": str(pick_dtype(args.dtype)).removeprefix("torch.")}
        if args.store_layers:
            settings["store_layers"] = list(args.store_layers)
        done = start_run(data_dir, "teacher", run, settings, args.command)
        records = [r for r in iter_records(data_dir, run) if r["key"] not in done]
        lengths = [len(r["prompt"]) + len(r["response"]) for r in records]
        print(f"[teacher {run}] {len(done)} done, {len(records)} pending", flush=True)
        bar = tqdm(total=sum(lengths), desc=f"teacher {run}", unit="tok", dynamic_ncols=True)
        for batch in length_batches(lengths, args.batch_size, args.token_budget):
            t_batch = time.time()
            outs = teacher_batch(model, [records[i] for i in batch], args.topk, args.store_hidden,
                                 padding_id(tokenizer), tuple(args.store_layers))
            tokens = sum(len(records[i]["response"]) for i in batch)
            save_shard(data_dir, "teacher", run, outs, {"n_sequences": len(outs), "n_tokens": tokens,
                                                        "seconds": round(time.time() - t_batch, 1)})
            bar.update(sum(lengths[i] for i in batch))
        bar.close()


def run_status(args):
    data_dir = Path(args.data_dir)
    manifest = read_manifest(data_dir)
    print(f"data dir: {data_dir}")
    si = manifest.get("selfinstruct") or {}
    print(f"selfinstruct prompts: {si.get('n_prompts', 0)} (rounds {si.get('rounds', 0)})")
    total = 0
    for section in ("runs", "teacher"):
        for run, e in manifest[section].items():
            print(f"{section:8s} {run:20s} seqs {e.get('n_sequences', 0):6d}  tokens {e.get('n_tokens', 0):8d}"
                  f"  shards {len(e['shards']):4d}  {e.get('seconds', 0) / 60:6.1f} min  {json.dumps(e['settings'])}")
            total += e.get("n_tokens", 0) if section == "runs" else 0
    print(f"total labelled tokens (response runs): {total}")


# -----------------------------------------------------------------------------


def padding_id(tokenizer) -> int:
    """Right padding under an attention mask: any id will do where the tokenizer names none."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as 2,15,27, got {text!r}")


def answering_options(parser, shard_seconds: float) -> None:
    """The answering stages' batching: rows, padded prompt tokens and shard cadence."""
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=16384,
                        help="padded prompt tokens per answering batch (raise it on a GPU, where rows are cheap)")
    parser.add_argument("--shard-seconds", type=float, default=shard_seconds, help="write a shard at least this often")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target: preset name, directory, .gguf or hub id")
    parser.add_argument("--data-dir", default=None, help="default: $MCSD_CACHE/data/<target-name>")
    parser.add_argument("--store", default=None,
                        help="token store of the magpie/answer stages (default: the repository's data/<target-name>)")
    parser.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench style JSONL (default: benchmarks/data/spec_bench/question.jsonl, or $MCSD_SPEC_BENCH)")
    parser.add_argument("--threads", type=int, default=2,
                        help="CPU threads; use 1 when another job shares a 2-core machine (a 2-thread "
                             "OpenMP pass with a core taken runs ~20x slower)")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                        help="target dtype for the stage (auto: bfloat16 on CUDA, float32 on CPU)")
    sub = parser.add_subparsers(dest="stage", required=True)

    g = sub.add_parser("generate", help="target responses to a prompt source")
    g.add_argument("--run", required=True, help="name of this response set, e.g. fit-greedy")
    g.add_argument("--source", choices=["specbench", "selfinstruct"], default="specbench")
    g.add_argument("--split", choices=["fit", "heldout", "all"], default="fit")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--samples", type=int, default=1, help="responses per prompt")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-len", type=int, default=100_000, help="skip longer prompts (tokens)")
    g.add_argument("--categories", nargs="*", default=None, help="only these categories")
    g.add_argument("--limit", type=int, default=None, help="stop when the run holds this many sequences")
    g.add_argument("--batch-size", type=int, default=96)
    g.add_argument("--token-budget", type=int, default=16384, help="padded prompt tokens per batch")
    g.add_argument("--store-hidden", action="store_true",
                   help="also keep the target's last hidden state at each response position "
                        "(feature-drafter data without a teacher pass)")

    s = sub.add_parser("selfinstruct", help="the target writes new prompts")
    s.add_argument("--count", type=int, default=2000, help="stop when this many are stored")
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--store-hidden", action="store_true", help="as for generate")

    pt = sub.add_parser("prompttext", help="store prompts as a run, for the teacher to label")
    pt.add_argument("--run", required=True)
    pt.add_argument("--source", choices=["specbench", "selfinstruct"], default="specbench")
    pt.add_argument("--split", choices=["fit", "heldout", "all"], default="fit")

    c = sub.add_parser("corpus", help="text files or installed packages' source and docs, as a run to label")
    c.add_argument("--run", required=True)
    c.add_argument("--paths", nargs="*", default=[], help="files or folders of text (not evaluation data)")
    c.add_argument("--packages", nargs="*", default=[],
                   help="installed distributions whose source and documentation to use, e.g. torch transformers")
    c.add_argument("--licence", default="unknown", help="the licence of the text under --paths, for the card")
    c.add_argument("--suffixes", nargs="*", default=[".py", ".md", ".rst", ".txt"])
    c.add_argument("--format", choices=["chat", "plain"], default="chat",
                   help="chat: each chunk is the assistant's answer to a request naming the file")
    c.add_argument("--chunk-tokens", type=int, default=512)
    c.add_argument("--max-tokens", type=int, default=0, help="stop when the run holds this many tokens (0 = all)")
    c.add_argument("--shard-records", type=int, default=256)

    t = sub.add_parser("teacher", help="teacher-forced top-k labels for stored runs")
    t.add_argument("runs", nargs="+")
    t.add_argument("--store-hidden", action="store_true", help="also keep the last hidden state")
    t.add_argument("--store-layers", type=_layer_list, default=(),
                   help="also keep these target hidden states, concatenated (e.g. 2,15,27: low, middle and "
                        "high layers, what a v2 feature head reads; implies --store-hidden)")
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--token-budget", type=int, default=4096, help="padded tokens per batch")
    t.add_argument("--topk", type=int, default=TOPK,
                   help="the target's most likely tokens kept per position with their probabilities, the head's "
                        "soft labels (wider: closer to the whole distribution, which sampled acceptance follows)")

    sub.add_parser("status", help="print what is stored")

    m = sub.add_parser("magpie", help="the target writes user turns (Magpie), into the token store")
    m.add_argument("--count", type=int, default=30000, help="stop when this many distinct prompts are kept")
    m.add_argument("--temperature", type=float, default=1.0)
    m.add_argument("--top-p", type=float, default=0.95)
    m.add_argument("--max-new-tokens", type=int, default=160)
    m.add_argument("--batch-size", type=int, default=64)

    a = sub.add_parser("answer", help="target responses as token shards in the store")
    a.add_argument("--run", required=True, help="name of this response set, e.g. magpie-t08")
    a.add_argument("--source", choices=["magpie", "specbench", "selfinstruct"], default="magpie")
    a.add_argument("--split", choices=["fit", "heldout", "all"], default="fit")
    a.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--samples", type=int, default=1, help="responses per prompt")
    a.add_argument("--max-new-tokens", type=int, default=256)
    a.add_argument("--limit", type=int, default=None, help="stop when the run holds this many responses")
    answering_options(a, shard_seconds=300.0)

    cp = sub.add_parser("campaign", help="alternate magpie and answer until --prompts prompts are answered")
    cp.add_argument("--prompts", type=int, default=30000)
    cp.add_argument("--step", type=int, default=512, help="prompts written before each answering pass")
    cp.add_argument("--run", default="magpie-greedy")
    cp.add_argument("--temperature", type=float, default=0.0, help="of the answers (0 = greedy)")
    cp.add_argument("--top-p", type=float, default=1.0)
    cp.add_argument("--max-new-tokens", type=int, default=256)
    answering_options(cp, shard_seconds=600.0)
    cp.add_argument("--skip-answered-by", action="append", default=[], metavar="RUN",
                    help="leave out prompts this run already answered (repeatable), e.g. the same greedy "
                         "answers in another dtype")

    fs = sub.add_parser("from-store", help="a store run as a response run, for the teacher stage to label")
    fs.add_argument("--run", required=True, help="the store's run")
    fs.add_argument("--as-run", default=None, help="name in the data dir (default: the same)")

    sub.add_parser("store-status", help="what the token store holds: prompts, responses, tokens, time")

    cv = sub.add_parser("coverage", help="how much of the target's held-out argmax a sub-vocabulary covers")
    cv.add_argument("--runs", nargs="*", default=None, help="greedy store runs (default: all greedy runs)")
    cv.add_argument("--head", default=None, help="a feature head folder: also its own sub-vocabulary's coverage")

    args = parser.parse_args(argv)
    if getattr(args, "store_layers", ()):
        args.store_hidden = True          # the final state stays the trainer's regression target
    args.command = "python tools/target_data.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    args.data_dir = args.data_dir or str(default_data_dir(args.target))
    torch.set_num_threads(args.threads)
    stage = {"generate": run_generate, "selfinstruct": run_selfinstruct, "prompttext": run_prompttext,
             "corpus": run_corpus, "teacher": run_teacher, "status": run_status,
             "magpie": run_magpie, "answer": run_answer, "campaign": run_campaign,
             "from-store": run_from_store, "store-status": run_store_status, "coverage": run_coverage}[args.stage]
    try:
        stage(args)
    except DataError as exc:                         # a run missing, or made with other settings: one line
        sys.exit(str(exc))
