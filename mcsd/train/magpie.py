"""Prompts without a dataset: the target writes the user's turn (the Magpie recipe).

An instruct model given its chat template up to the start of a user turn
continues with something a user would plausibly write, because that is what
followed such a prefix in its instruction tuning. Sampling that turn many
times (temperature and top-p), and optionally steering it with a short
system message naming a kind of task, gives prompts in the target's own
distribution at no cost but generation. This module holds the pieces that
are not generation: the prefix, the task hints, filters, exact and
near-duplicate removal (MinHash over word 3-grams with LSH banding), and a
diversity report for the data card.

Prompt text is never taken from the evaluation split: the hints name kinds
of task, not examples.
"""

from __future__ import annotations

import hashlib
import re
import statistics
from collections import Counter

import numpy as np

# Kinds of task the benchmark covers, as short system-message hints. The
# hint goes into the system turn; the user turn the target writes is free.
HINTS = {
    "writing": "The user asks for help writing something: a story, an email, a poem, an essay or a speech.",
    "roleplay": "The user asks the assistant to play a character or take part in an imagined scene.",
    "reasoning": "The user asks a puzzle or a question that needs step-by-step reasoning.",
    "math": "The user asks a math question or a word problem with numbers.",
    "coding": "The user asks for help with programming: writing, explaining or fixing code.",
    "extraction": "The user gives a short text and asks for specific information from it.",
    "stem": "The user asks a science, technology or engineering question.",
    "humanities": "The user asks about history, philosophy, art, society or culture.",
    "translation": "The user asks to translate a sentence or a short text into another language.",
    "summarization": "The user pastes a passage and asks for a summary of it.",
    "qa": "The user asks a factual question about the world.",
    "rag": "The user gives some background documents and asks a question about them.",
    "open": None,   # the chat template's own default system message
}


def prefix_ids(tokenizer, hint: str | None) -> list[int]:
    """Token ids of the chat template up to (and including) the opening of a user turn.

    Rendered with a placeholder user message and cut just before it, so it is
    exactly what the template puts there for any model.
    """
    marker = "\u2063MAGPIE\u2063"
    messages = ([{"role": "system", "content": hint}] if hint else []) + [{"role": "user", "content": marker}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    if marker not in rendered:
        raise ValueError("the tokenizer's chat template does not render the user's message verbatim")
    return tokenizer(rendered[: rendered.index(marker)], add_special_tokens=False)["input_ids"]


_WORD = re.compile(r"\w+", re.UNICODE)


def normalise(text: str) -> str:
    """Lower case, words only, single spaces: what exact deduplication compares."""
    return " ".join(_WORD.findall(text.lower()))


def keep_prompt(text: str, finished: bool, n_tokens: int, min_words: int = 4, max_tokens: int = 400) -> str | None:
    """Why a written user turn is dropped, or None to keep it.

    Drops turns that did not end (ran into the token limit), are too short
    to be a request, too long, mostly non-words, or contain chat-template
    markup (the model wrote past its turn).
    """
    if not finished:
        return "unfinished"
    words = _WORD.findall(text)
    if len(words) < min_words:
        return "short"
    if n_tokens > max_tokens:
        return "long"
    if "<|" in text or "|>" in text:
        return "markup"
    letters = sum(c.isalpha() for c in text)
    if letters < 0.5 * len(text.replace(" ", "")):
        return "symbols"
    if len(set(words)) < 0.3 * len(words):
        return "repetitive"
    return None


class NearDuplicates:
    """MinHash with LSH banding over word 3-grams: finds texts that share most of their 3-grams.

    Two texts whose 3-gram sets have Jaccard similarity s land in a common
    band with probability 1 - (1 - s^r)^b (b bands of r rows): with the
    defaults (16 bands of 4) that is 0.98 at s = 0.7 and 0.05 at s = 0.3.
    A candidate found through a band is confirmed by the exact Jaccard
    similarity of the two sets before it counts as a duplicate.
    """

    def __init__(self, threshold: float = 0.6, bands: int = 16, rows: int = 4, ngram: int = 3, seed: int = 0):
        self.threshold, self.bands, self.rows, self.ngram = threshold, bands, rows, ngram
        rng = np.random.default_rng(seed)
        n = bands * rows
        self._a = rng.integers(1, (1 << 61) - 1, size=n, dtype=np.uint64)
        self._b = rng.integers(0, (1 << 61) - 1, size=n, dtype=np.uint64)
        self._buckets: list[dict[bytes, int]] = [{} for _ in range(bands)]
        self._sets: list[frozenset] = []

    def shingles(self, text: str) -> frozenset:
        words = normalise(text).split()
        if len(words) < self.ngram:
            return frozenset([" ".join(words)])
        return frozenset(" ".join(words[i:i + self.ngram]) for i in range(len(words) - self.ngram + 1))

    def _signature(self, shingles: frozenset) -> np.ndarray:
        hashes = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") >> 3
                           for s in shingles], dtype=np.uint64)                 # (S,)
        # universal hashing a*x + b (mod 2^64, wrapping), minimum over the shingles
        return (hashes[None, :] * self._a[:, None] + self._b[:, None]).min(axis=1)   # (bands*rows,)

    def add(self, text: str) -> bool:
        """Add `text` unless it nearly duplicates one already added; True if added."""
        shingles = self.shingles(text)
        signature = self._signature(shingles)
        keys = [signature[i * self.rows:(i + 1) * self.rows].tobytes() for i in range(self.bands)]
        for band, key in enumerate(keys):
            j = self._buckets[band].get(key)
            if j is not None:
                other = self._sets[j]
                if len(shingles & other) / max(1, len(shingles | other)) >= self.threshold:
                    return False
        index = len(self._sets)
        self._sets.append(shingles)
        for band, key in enumerate(keys):
            self._buckets[band].setdefault(key, index)
        return True


def diversity(texts: list[str], lengths: list[int], categories: list[str]) -> dict:
    """What the data card reports about a prompt set: distinct n-gram ratios, lengths, categories."""
    report = {"n": len(texts)}
    for n in (1, 2, 3):
        grams = Counter()
        for t in texts:
            words = normalise(t).split()
            grams.update(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        total = sum(grams.values())
        report[f"distinct_{n}"] = round(len(grams) / total, 4) if total else 0.0
        report[f"unique_{n}grams"] = len(grams)
    if lengths:
        q = statistics.quantiles(lengths, n=10) if len(lengths) > 1 else [lengths[0]] * 9
        report["tokens"] = {"min": min(lengths), "p10": round(q[0]), "median": round(statistics.median(lengths)),
                            "p90": round(q[-1]), "max": max(lengths), "mean": round(statistics.fmean(lengths), 1)}
    report["categories"] = dict(sorted(Counter(categories).items()))
    return report
