"""Prompt sets: Spec-Bench (or any JSONL of the same form), its fit / held-out split, chat formatting.

A row is one JSON object with `question_id`, `category` and `turns` (a list of
user turns; the first is used). The split is by question id: rows with
`question_id % 5 == 0` are held out for evaluation, the rest are for fitting
anything that is trained (drafts, decision models, thresholds).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

SPLITS = ("fit", "heldout", "all")
# Spec-Bench's eight MT-bench categories form one group; the other five are groups of their own.
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclass(frozen=True)
class Prompt:
    question_id: int
    category: str
    text: str

    @property
    def group(self) -> str:
        return group_of(self.category)


def group_of(category: str) -> str:
    """A Spec-Bench category's group: the MT-bench categories as one, every other its own."""
    return "mt_bench" if category in MT_BENCH else category


# The Spec-Bench question file shipped with the project (see benchmarks/data/spec_bench/README.md).
SHIPPED_SPEC_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "spec_bench" / "question.jsonl"
SHIPPED_SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"


def default_spec_bench() -> Path:
    """$MCSD_SPEC_BENCH, else the Spec-Bench copy shipped in benchmarks/data/spec_bench/."""
    env = os.environ.get("MCSD_SPEC_BENCH")
    if env:
        return Path(env).expanduser()
    return SHIPPED_SPEC_BENCH


def check_shipped(path: Path) -> None:
    """ConfigError when `path` is the shipped Spec-Bench copy and its bytes are not the published
    file's (a 0.7 MB hash, about a millisecond: checked on every default load)."""
    if path.resolve() != SHIPPED_SPEC_BENCH:
        return
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHIPPED_SHA256:
        raise ConfigError(f"{path} is not the published Spec-Bench file (sha256 {digest[:12]}..., expected "
                          f"{SHIPPED_SHA256[:12]}...); restore it with git checkout, or set MCSD_SPEC_BENCH")


def in_split(question_id: int, split: str) -> bool:
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    return split == "all" or (question_id % 5 == 0) == (split == "heldout")


def load_prompts(path: str | Path | None = None, split: str = "heldout") -> list[Prompt]:
    """Read a Spec-Bench style JSONL file and keep one split (first turn of each row)."""
    path = Path(path) if path is not None else default_spec_bench()
    if not path.is_file():
        raise ConfigError(f"prompt file not found: {path} (set MCSD_SPEC_BENCH or pass a path)")
    check_shipped(path)
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                qid, text = int(row["question_id"]), row["turns"][0]
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise ConfigError(f"{path}:{n}: expected question_id and a non-empty turns list ({exc})") from None
            if in_split(qid, split):
                prompts.append(Prompt(qid, str(row.get("category", "unknown")), text))
    return prompts


def stratified(prompts: list[Prompt], per_group: int = 1) -> list[Prompt]:
    """The first `per_group` prompts of each category group, in file order."""
    taken: dict[str, int] = {}
    out = []
    for p in prompts:
        if taken.get(p.group, 0) < per_group:
            taken[p.group] = taken.get(p.group, 0) + 1
            out.append(p)
    return out


def chat_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of `text` as a user turn in the tokenizer's chat template, ready for the reply."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
