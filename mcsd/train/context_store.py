"""Build a context datastore of earlier outputs for `mcsd-generate --context-store FILE`.

    # from mcsd-generate --json outputs (one JSON object per line, "tokens" are used as they are)
    mcsd-generate --json --prompt "..." >> outputs.jsonl
    python tools/build_context_store.py outputs.jsonl --out store.safetensors

    # from text: JSON lines with a "text" field, or plain .txt files (one document each)
    python tools/build_context_store.py answers.jsonl notes.txt --target smollm2-135m --out store.safetensors

The store is a safetensors file (token ids and document offsets, plus the
vocabulary size it was built for); mcsd reads it without unpickling anything
and refuses one built for another vocabulary. Append by passing the old store
as an input (`--append store.safetensors`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_documents(paths: list[Path], tokenizer) -> list[list[int]]:
    docs: list[list[int]] = []
    for path in paths:
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"{path}:{n}: not JSON ({exc.msg})")
                if "tokens" in row:
                    docs.append([int(t) for t in row["tokens"]])
                elif "text" in row:
                    docs.append(tokenizer(row["text"], add_special_tokens=False)["input_ids"])
                else:
                    raise SystemExit(f"{path}:{n}: expected a 'tokens' or 'text' field")
        else:
            docs.append(tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    return [d for d in docs if d]


def main(argv=None) -> int:
    from mcsd.config import ConfigError
    from mcsd.drafting.context import ContextStore
    from mcsd.loading.models import load_tokenizer
    from mcsd.loading.presets import DEFAULT_PRESET

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", type=Path, help=".jsonl ('tokens' or 'text' per line) or text files")
    ap.add_argument("--target", default=DEFAULT_PRESET, help="whose tokenizer (preset, directory or hub id)")
    ap.add_argument("--append", type=Path, help="an existing store whose documents come first")
    ap.add_argument("--out", type=Path, required=True, help="the store to write (.safetensors)")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.inputs if not p.is_file()]
    if missing:
        raise SystemExit(f"no such file: {', '.join(missing)}")
    tokenizer = load_tokenizer(args.target)
    vocab = len(tokenizer)
    docs = []
    if args.append is not None:
        try:
            docs = ContextStore.load(args.append, vocab).documents
        except ConfigError as exc:
            raise SystemExit(str(exc))
    docs += read_documents(args.inputs, tokenizer)
    bad = [t for d in docs for t in d if not 0 <= t < vocab]
    if bad:
        raise SystemExit(f"token id {bad[0]} is outside this tokenizer's vocabulary of {vocab}")
    ContextStore(docs, vocab).save(args.out)
    print(f"wrote {args.out}: {len(docs)} documents, {sum(map(len, docs)):,} tokens", file=sys.stderr)
    return 0
