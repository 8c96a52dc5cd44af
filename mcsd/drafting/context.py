"""Draft candidates that cost no forward pass: continuations found in the context and the
target's own recycled predictions, merged into the round's tree.

A model drafter pays a forward per tree level; much of what a chat model writes
repeats its input (summaries, retrieval answers, code edits, translations keeping
names and numbers) or its own earlier output, and those tokens can be proposed
for free. Three sources, each a function of the committed text only:

- ``ngram``: every n-gram (n = 1 .. `max_ngram`) of the prompt and the output so
  far, indexed incrementally. The longest suffix of the committed text that
  occurred before is looked up first (prompt lookup is the n = `max_ngram` case
  with one match); the continuations of its most recent occurrences, and of
  shorter matches when there are few, become a trie: several continuations
  are several branches, siblings ranked by their longest match, then count.
- ``recycle``: for every token, the target's top-k next tokens the last time it
  read that token, taken from logits the verify pass computed anyway (Token
  Recycling, Luo et al. 2024). Expanded from the root as a small tree.
- ``store``: the same n-gram lookup over a datastore of earlier outputs, opt-in,
  from a file the user names (`ContextStore`, safetensors: never unpickled).

`ContextDrafter` merges the sources' candidates into one trie under the
round's target-initialised root (shared prefixes merged, no duplicate
siblings, merged with the model drafter's tree when there is one), estimates
each node's probability of being accepted from each source's *measured*
acceptance (by match length or rank, and depth; updated every round), and
grafts the nodes best first while they pay for their verify time under this
machine's costs. Grafted nodes are deterministic proposals: see
`mcsd.core.verify.accept_sampling` for why sampling stays exact. Sampled with
the target's seeded noise, a candidate's estimate also reads the noise its
token will be drawn with (`given_noise`): which candidates are tried changes,
never what the target draws.

Limitations: one sequence at a time; lookup is over token ids (a repeat that
tokenises differently is not found); the store's index is built in memory when
it is loaded (about a second per 100k tokens on a 2-core CPU).
"""

from __future__ import annotations

import bisect
import copy
import heapq
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import ConfigError
from ..core.sampling import top_indices
from ..core.tree import DraftTree
from ..loading.presets import parse_drafter_spec  # noqa: F401  (the --drafter grammar, re-exported)

SOURCES = ("ngram", "recycle", "store")
MAX_MATCH = 32            # the longest match length measured (a copy in progress)
STORE_FORMAT = "mcsd-context-store"
STORE_VERSION = "1"


# ---------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class ContextConfig:
    max_ngram: int = 6              # longest suffix looked up (prompt lookup's matching window)
    min_ngram: int = 1              # shortest; unigram matches are many and weak, their measured rate decides
    max_matches: int = 8            # occurrences whose continuations are kept (most recent first)
    max_len: int = 16               # longest continuation proposed (tree depth from context)
    recycle_k: int = 4              # target predictions kept per token
    recycle_widths: tuple[int, ...] = (3, 2, 1, 1)   # recycled tree: children per node at each depth
    max_nodes: int = 48             # most context nodes grafted in one round
    max_anchors: int = 16           # drafted nodes (root included) that context is looked up beneath
    min_score: float = 0.005        # a node less likely than this to be accepted is never grafted
    learning_rate: float = 0.05     # how fast a source's measured acceptance moves
    sources: tuple[str, ...] = ("ngram", "recycle")

    def __post_init__(self):
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise ConfigError(f"unknown context source(s) {bad or '(none)'}; choose from {', '.join(SOURCES)}")
        if not 1 <= self.min_ngram <= self.max_ngram <= 32:
            raise ConfigError(f"context n-gram sizes need 1 <= min_ngram <= max_ngram <= 32, "
                              f"got {self.min_ngram}..{self.max_ngram}")
        for name in ("max_matches", "max_len", "recycle_k", "max_nodes", "max_anchors"):
            if getattr(self, name) < 1:
                raise ConfigError(f"context {name} must be >= 1, got {getattr(self, name)}")
        if any(w < 1 for w in self.recycle_widths):
            raise ConfigError(f"context recycle_widths must be positive, got {self.recycle_widths}")
        if not 0.0 <= self.min_score < 1.0 or not 0.0 < self.learning_rate <= 1.0:
            raise ConfigError("context min_score must be in [0, 1) and learning_rate in (0, 1]")


# ---------------------------------------------------------------------------- n-gram index

BULK_EXTEND = 16        # tokens from which `NGramIndex.extend` indexes n by n (a prompt, a document)

class NGramIndex:
    """End positions of every n-gram (n = min_n .. max_n) of a growing token list.

    `extend` is incremental (O(max_n) per new token); `continuations` returns,
    for the longest suffix of the text that occurred before, what followed its
    most recent occurrences. Boundaries (`separator`) keep matches inside one
    document of a multi-document store.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], list[int]]] = [dict() for _ in range(max_n + 1)]
        self._doc_start = 0
        self._doc_starts: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        if len(new) < BULK_EXTEND:
            for t in new:
                toks.append(t)
                i = len(toks) - 1
                for n in range(self.min_n, min(self.max_n, i - self._doc_start + 1) + 1):
                    self.ends[n].setdefault(tuple(toks[i - n + 1:i + 1]), []).append(i)
            return
        # a prompt or a document: each n's grams made by zip over shifted slices, not token by token
        # (the same keys, each dict filled in position order as above)
        start = len(toks)
        toks.extend(new)
        for n in range(self.min_n, self.max_n + 1):
            first = max(start, self._doc_start + n - 1)            # the first end with a whole n-gram
            ends = self.ends[n]
            for i, gram in enumerate(zip(*(toks[first - n + 1 + k:] for k in range(n))), first):
                ends.setdefault(gram, []).append(i)

    def end_document(self) -> None:
        """The next tokens start a new document: no n-gram spans the boundary."""
        self._doc_start = len(self.tokens)
        self._doc_starts.append(self._doc_start)

    def _doc_floor(self, e: int) -> int:
        """The first index of the document holding position e."""
        return self._doc_starts[bisect.bisect_right(self._doc_starts, e) - 1] if self._doc_starts else 0

    def continuations(self, suffix: list[int], max_matches: int, max_len: int, limit: int | None = None,
                      doc_ends: list[int] | None = None) -> list[tuple[list[int], int]]:
        """Continuations of the longest matching suffixes, most recent first.

        Args:
            suffix: the query (its last `max_n` tokens are looked up; a match of `max_n`
                is then extended backwards through the rest, up to `MAX_MATCH` tokens,
                so the match length returned says how long the copy has been going).
            max_matches: occurrences to return at most.
            max_len: tokens per continuation at most.
            limit: only occurrences ending before this index count (the query's own
                position in the indexed text is not a match of itself).
            doc_ends: sorted end offsets of documents, so continuations stop at a boundary.
        Returns:
            [(continuation tokens, match length n)], longer matches first.
        """
        out: list[tuple[list[int], int]] = []
        seen: set[int] = set()
        limit = len(self.tokens) - 1 if limit is None else limit
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            ends = self.ends[n].get(tuple(suffix[-n:]))
            if not ends:
                continue
            for e in reversed(ends):
                if e >= limit or e in seen:
                    continue
                seen.add(e)
                length = n
                if n == self.max_n:                      # how far back does the match really go?
                    toks, floor, longest = self.tokens, self._doc_floor(e), min(len(suffix), MAX_MATCH)
                    while length < longest and e - length >= floor and toks[e - length] == suffix[-length - 1]:
                        length += 1
                stop = e + 1 + max_len
                if doc_ends is not None:
                    j = bisect.bisect_right(doc_ends, e)
                    if j < len(doc_ends):
                        stop = min(stop, doc_ends[j])
                cont = self.tokens[e + 1:stop]
                if cont:
                    out.append((cont, length))
                    if len(out) >= max_matches:
                        return out
            if len(out) >= max_matches // 2:          # enough from long matches; shorter ones add noise
                break
        return out


# ---------------------------------------------------------------------------- the store

class ContextStore:
    """Earlier outputs (token id sequences) as an n-gram datastore, saved as safetensors.

    File layout: tensors "tokens" (int32, all documents concatenated) and
    "offsets" (int64, S+1 document boundaries), metadata {"format",
    "version", "vocab_size"} (the tokenizer's size; a target with fewer rows
    is refused). Loading reads tensors only; nothing is unpickled.
    """

    def __init__(self, documents: list[list[int]], vocab_size: int):
        self.documents = documents
        self.vocab_size = int(vocab_size)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file
        flat = [t for d in self.documents for t in d]
        offsets = [0]
        for d in self.documents:
            offsets.append(offsets[-1] + len(d))
        save_file({"tokens": torch.tensor(flat, dtype=torch.int32), "offsets": torch.tensor(offsets, dtype=torch.int64)},
                  str(path), metadata={"format": STORE_FORMAT, "version": STORE_VERSION,
                                       "vocab_size": str(self.vocab_size)})

    @staticmethod
    def check_file(path: str | Path) -> None:
        """That `path` holds an mcsd context store, from its header alone (no tensor is read): a command
        refuses another file before any model loads.

        Raises:
            ConfigError: naming the path and what it holds instead.
        """
        from safetensors import SafetensorError, safe_open
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"context store {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta, names = f.metadata() or {}, set(f.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigError(f"{path} is not an mcsd context store (not a safetensors file: {exc})") from None
        if meta.get("format") != STORE_FORMAT or not {"tokens", "offsets"} <= names:
            raise ConfigError(f"{path} is not an mcsd context store (format {meta.get('format')!r}; build one "
                              f"with tools/build_context_store.py)")

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> "ContextStore":
        from safetensors import SafetensorError, safe_open
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"context store {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != STORE_FORMAT:
                    raise ConfigError(f"{path} is not an mcsd context store (format {meta.get('format')!r})")
                tokens, offsets = f.get_tensor("tokens").long(), f.get_tensor("offsets").long()
        except (SafetensorError, OSError, KeyError, ValueError) as exc:
            raise ConfigError(f"cannot read context store {path}: {exc}") from None
        stored_vocab = int(meta.get("vocab_size", -1))
        if vocab_size is not None and stored_vocab > vocab_size:
            raise ConfigError(f"context store {path} was built for a vocabulary of {stored_vocab} tokens; "
                              f"this target has {vocab_size} (a different tokenizer)")
        n = tokens.numel()
        if (offsets.dim() != 1 or offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != n
                or bool((offsets[1:] < offsets[:-1]).any())):
            raise ConfigError(f"context store {path} is corrupt: document offsets do not cover its tokens")
        if n and (int(tokens.min()) < 0 or int(tokens.max()) >= stored_vocab):
            raise ConfigError(f"context store {path} is corrupt: token ids outside [0, {stored_vocab})")
        flat, cuts = tokens.tolist(), offsets.tolist()
        return cls([flat[a:b] for a, b in zip(cuts[:-1], cuts[1:])], stored_vocab)

    def index(self, min_n: int, max_n: int) -> tuple[NGramIndex, list[int]]:
        idx, ends = NGramIndex(max(min_n, 2), max_n), []     # unigrams over a whole store are noise
        for d in self.documents:
            idx.end_document()
            idx.extend(d)
            ends.append(len(idx))
        return idx, ends


# ---------------------------------------------------------------------------- candidates

class _Node:
    """A candidate trie node: its token, children by token, and who proposed it with what evidence."""

    __slots__ = ("token", "kids", "cond", "keys", "tree_idx", "pending")

    def __init__(self, token: int):
        self.token = token
        self.kids: dict[int, _Node] = {}
        self.cond = 0.0                          # P(accepted | parent accepted), sources combined
        self.keys: list[tuple] = []             # (source, bucket...) statistics keys that proposed it
        self.tree_idx = -1                       # index in the round's tree once it is there
        # matches through this node whose children are not made yet: (source, [(continuation, match
        # length)], depth of this node beneath the lookup's anchor), one entry a lookup
        self.pending: list[tuple[str, list, int]] | None = None

    def child(self, token: int) -> "_Node":
        node = self.kids.get(token)
        if node is None:
            node = self.kids[token] = _Node(token)
        return node


def given_noise(p: float, g: float) -> float:
    """The probability that a token the target draws with probability `p` wins the Gumbel-max draw, given
    that its own noise at that position is `g`: the other tokens' best key is Gumbel-distributed about
    log(1 - p), so it wins with probability exp(-(1 - p) / p x e^-g). Averaged over g this is p again;
    known before the draw, the noise tells a candidate that will lose from one that will win."""
    if p >= 1.0:
        return 1.0
    return math.exp(-(1.0 - p) / p * math.exp(-g))


def _depth_bucket(depth: int) -> int:
    return min(depth, 4)


def _ngram_bucket(n: int) -> int:
    """Match lengths 1, 2, 3, 4-5, 6-11, 12+: how long the copy has been going."""
    return n if n < 4 else 4 if n < 6 else 6 if n < 12 else 12


_PRIORS = {"ngram": {1: 0.10, 2: 0.25, 3: 0.45, 4: 0.6, 6: 0.7, 12: 0.85},
           "store": {2: 0.15, 3: 0.3, 4: 0.45, 6: 0.6, 12: 0.75},
           "recycle": {0: 0.35, 1: 0.12, 2: 0.06, 3: 0.03}}
_RANK_PRIOR = (1.0, 0.3, 0.15)


@dataclass
class Graft:
    """The nodes a round's context candidates added to a tree.

    Attributes:
        tree: the tree with the grafted nodes appended (parents before children).
        deterministic: (N,) bool, True for grafted nodes (proposals with a point-mass q).
        proposed: tree node index -> statistics keys of the sources that proposed it
            (grafted nodes and model nodes a source also proposed).
        gain: the tokens the grafted nodes are expected to add to the round (the sum of their path
            probabilities).
    """

    tree: DraftTree
    deterministic: torch.Tensor
    proposed: dict[int, list[tuple]]
    gain: float = 0.0


class ContextDrafter:
    """Free tree branches from the context and recycled target predictions.

    Used by `TreeDecoder` alone (no draft model: every node comes from here) or
    together with a model drafter (its tree first, then these nodes merged in).

    Args:
        config: a `ContextConfig` (sources, sizes, budget).
        store: an optional `ContextStore` or a path to one (adds the "store" source).
    """

    def __init__(self, config: ContextConfig | None = None, store: ContextStore | str | Path | None = None, **options):
        if config is not None and options:
            raise ConfigError("pass either a ContextConfig or keyword options, not both")
        cfg = config or ContextConfig(**options)
        if store is not None and "store" not in cfg.sources:
            cfg = replace(cfg, sources=(*cfg.sources, "store"))
        if "store" in cfg.sources and store is None:
            raise ConfigError("the 'store' context source needs a store file (ContextDrafter(store=PATH))")
        self.config = cfg
        self._store_src = store
        self._store: tuple[NGramIndex, list[int]] | None = None
        self.rates: dict[tuple, float] = {}
        self.vocab_size: int | None = None
        self._next: dict[int, list[int]] | None = None   # token -> the target's top-k after it (recycling)
        self.history = NGramIndex(cfg.min_ngram, cfg.max_ngram)
        self.proposed_nodes = 0                     # grafted nodes so far (stats)
        self.accepted_nodes = 0

    # ---------------------------------------------------------------- lifecycle

    def bind(self, vocab_size: int, device) -> None:
        """Called once by the decoder with the target's vocabulary size and device."""
        if self.vocab_size == vocab_size and self._next is not None:
            return
        self.vocab_size = vocab_size
        if "recycle" in self.config.sources:
            self._next = {}
        if self._store_src is not None and self._store is None:
            store = self._store_src if isinstance(self._store_src, ContextStore) else \
                ContextStore.load(self._store_src, vocab_size)
            if store.vocab_size > vocab_size:
                raise ConfigError(f"context store has a vocabulary of {store.vocab_size}; the target {vocab_size} "
                                  f"(a different tokenizer)")
            self._store = store.index(self.config.min_ngram, self.config.max_ngram)

    def sibling(self) -> "ContextDrafter":
        """A drafter with this one's settings, vocabulary and store (read-only, shared) for another
        sequence decoded beside this one's (a batch's slot); nothing it learns reaches this one."""
        other = copy.copy(self)
        other._next = None if self._next is None else {}            # recycled predictions: its own
        other.reset(torch.empty(0, dtype=torch.long))
        return other

    def reset(self, prompt: torch.Tensor) -> None:
        """A new generation: index the prompt, and forget measured acceptance and recycled predictions,
        so that what is proposed for a request (and, in bfloat16, how its verifies round) never depends
        on the requests before it. The store, read-only, stays."""
        self.history = NGramIndex(self.config.min_ngram, self.config.max_ngram)
        self.rates = {}
        if self._next is not None:
            self._next.clear()
        self.history.extend(prompt.tolist())
        self.proposed_nodes = self.accepted_nodes = 0

    def observe_logits(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Record the target's top-k after each of `tokens` (N,) from its logits (N, V) (recycling)."""
        self.observe_rows(tokens.tolist(), logits.reshape(-1, logits.shape[-1]), list(range(tokens.numel())))

    def observe_rows(self, tokens: list[int], logits: torch.Tensor, rows: list[int]) -> None:
        """`observe_logits` for `tokens` (host ints) from the rows `rows` of `logits` (N, V), each read
        where it lies (a verify's accepted path, no gathered copy of its rows)."""
        if self._next is None or not rows:
            return
        k = min(self.config.recycle_k, logits.shape[-1])
        self.recycle(tokens, [top_indices(logits[r:r + 1], k)[0].tolist() for r in rows])

    def recycle(self, tokens: list[int], top: list[list[int]]) -> None:
        """`observe_logits` with what the host already holds: each token's target top-k (host lists)."""
        if self._next is not None:
            for token, row in zip(tokens, top):
                self._next[token] = row[:self.config.recycle_k]

    def extend_history(self, tokens: list[int]) -> None:
        """Committed tokens (host ints) join the n-gram index (the fixed-shape round's `_sync`)."""
        self.history.extend(tokens)

    def _sync(self, sequence: torch.Tensor) -> None:
        n = len(self.history)
        if sequence.numel() > n:
            self.history.extend(sequence[n:].tolist())

    # ---------------------------------------------------------------- proposing

    def _rate(self, key: tuple) -> float:
        r = self.rates.get(key)
        if r is None:
            src, bucket = key[0], key[1]
            r = _PRIORS[src].get(bucket, 0.05) * (0.85 ** (key[2] - 1))
            if len(key) > 3:                         # a match's sibling rank: the runner-up is rarely right
                r *= _RANK_PRIOR[key[3]]
        return r

    def _propose_under(self, anchor: _Node, suffix: list[int], recycle_widths: tuple[int, ...],
                       evidence: dict[int, list[float]], reach: int) -> None:
        """Add every source's candidates beneath `anchor`, the trie node whose path spells the end
        of `suffix` (the committed text, then the drafted path to the anchor), at most `reach` deep."""
        cfg = self.config
        lookups = []
        if "ngram" in cfg.sources:
            lookups.append(("ngram", self.history.continuations(suffix, cfg.max_matches, min(cfg.max_len, reach))))
        if self._store is not None:
            idx, ends = self._store
            lookups.append(("store", idx.continuations(suffix, cfg.max_matches, min(cfg.max_len, reach),
                                                       limit=len(idx), doc_ends=ends)))
        for src, matches in lookups:
            if matches:                  # their trie nodes are made as the graft's choice reaches them
                _defer(anchor, (src, matches, 0))
        if self._next is not None:
            frontier = [anchor]
            for depth, width in enumerate(recycle_widths[:reach], start=1):
                nxt = []
                for node in frontier:
                    for rank, t in enumerate(self._next.get(node.token, ())[:width]):
                        key = ("recycle", min(rank, 3), _depth_bucket(depth))
                        child = node.child(t)
                        _proposes(child, key, self._rate(key), evidence)
                        nxt.append(child)
                frontier = nxt
                if not frontier:
                    break

    def graft(self, tree: DraftTree, sequence: torch.Tensor, expected_tokens: float, round_ms: float,
              costs=None, node_probs: list[float] | None = None, max_nodes: int | None = None,
              noise=None) -> Graft:
        """Merge this round's candidates into `tree` and append the ones that pay.

        Candidates are looked up beneath the root and beneath every drafted node
        likely enough to be accepted (an *anchor*: the committed text plus the
        drafted path to it is the suffix looked up), so context continues a
        model branch where the text repeats, and adds alternatives beside it.

        Args:
            tree: the round's tree so far (the root alone, or the model drafter's tree).
            sequence: (T,) committed tokens ending with the root.
            expected_tokens: tokens the round is expected to emit without context nodes (>= 1).
            round_ms: the round's time so far (draft time spent + verify of `tree`) in ms.
            costs: `mcsd.costs.cost_model.Costs` for the marginal verify time of a node, or None
                (then only `max_nodes` and `min_score` bound the graft).
            node_probs: each drafted node's probability of being accepted (N host floats), where the
                policy estimates it; default: its draft path probability exp(logp).
            max_nodes: at most this many nodes this round (a batch's share), within `config.max_nodes`.
            noise: the generation's `PositionNoise` where the target draws by it (sampling): each
                candidate's estimate then reads the noise its token will be drawn with (`given_noise`).
        Returns:
            Graft. Nodes are chosen best first by path probability (the product of
            their and their ancestors' acceptance estimates); a node joins while
            its expected tokens pay for its verify time: s * round_ms > tokens * dt.
        """
        self._sync(sequence)
        est = node_probs if node_probs is not None else tree.logp.float().exp().tolist()
        return self.grafted(tree, self._choose(tree.tokens.tolist(), tree.parents.tolist(), est, tree.logp.tolist(),
                                               expected_tokens, round_ms, costs, self._budget(max_nodes),
                                               noise=noise, first=sequence.numel()))

    def choose_under_root(self, sequence: torch.Tensor, round_ms: float, costs=None,
                          max_nodes: int | None = None, noise=None) -> tuple | None:
        """`graft`'s choice for a round that drafts nothing (a tree of the root `sequence[-1]` alone, expected
        to emit its one token in `round_ms`), made on the host before any tree or tensor exists: None where
        no candidate pays, so that a lookup that finds nothing costs the lookup alone; else the choice, which
        `grafted` puts on the root's tree; `noise` as in `graft`."""
        self._sync(sequence)
        choice = self._choose_under(self.history.tokens[-1], round_ms, costs, self._budget(max_nodes),
                                    costs.context_round_ms if costs is not None else 0.0, noise, sequence.numel())
        return choice if choice[0] else None

    def grafted(self, tree: DraftTree, choice: tuple) -> Graft:
        """The Graft of `choice` (`_choose`'s: tokens, parents, logp, proposed, gain) on `tree`."""
        tokens, parents, logp, proposed, gain = choice
        det = torch.tensor([False] * tree.size + [True] * len(tokens), device=tree.tokens.device)
        if tokens:
            tree = tree.graft(tokens, parents, logp)
            self.proposed_nodes += len(tokens)
        return Graft(tree, det, proposed, gain)

    def _budget(self, max_nodes: int | None) -> int:
        return self.config.max_nodes if max_nodes is None else min(self.config.max_nodes, max_nodes)

    def _choose_under(self, root: int, round_ms: float, costs, budget: int, fixed_ms: float = 0.0,
                      noise=None, first: int = 0) -> tuple:
        """`_choose` beneath the root token alone (a tree of one node, certain, emitting one token)."""
        return self._choose([root], [-1], [1.0], [0.0], 1.0, round_ms, costs, budget, fixed_ms, noise, first)

    def graft_under_root(self, root: int, budget: int) -> tuple[list[int], list[int], dict[int, list[tuple]]]:
        """The fixed-shape round's graft, on the host alone: up to `budget` nodes beneath the root token
        `root` (the committed text, `extend_history`'s, ending with it), best first while more likely
        than `min_score` (their verify rows are there whatever they hold: no cost test).

        Returns:
            (tokens, parents: each node's parent, 0 the root and i >= 1 the i-th node, parents first;
            proposed: node index (1 + its place) -> the statistics keys that proposed it, for
            `observe_path`).
        """
        tokens, parents, _, proposed, _ = self._choose_under(root, 0.0, None, self._budget(budget))
        self.proposed_nodes += len(tokens)
        return tokens, parents, proposed

    def _expand(self, node: _Node, evidence: dict[int, list[float]]) -> None:
        """Make `node`'s children from the matches deferred through it (`_propose_under`), one
        lookup's at a time: siblings ranked by their longest match, then by how many matches pass
        through them, then by the first match's recency (a long match's continuation is not diluted
        by short matches that disagree with it), each a statistics key and its rate as evidence; the
        matches that go on are deferred to the child they pass through."""
        groups, node.pending = node.pending, None
        for src, matches, depth in groups:
            kids: dict[int, list] = {}                  # token -> [longest match, count, matches on]
            for cont, n in matches:                     # most recent first: first seen, first in order
                entry = kids.get(cont[depth])
                if entry is None:
                    entry = kids[cont[depth]] = [n, 0, []]
                elif n > entry[0]:
                    entry[0] = n
                entry[1] += 1
                if len(cont) > depth + 1:
                    entry[2].append((cont, n))
            ranked = sorted(kids.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))     # stable: recency last
            for rank, (token, (n, _, going)) in enumerate(ranked):
                child = node.child(token)
                key = (src, _ngram_bucket(n), _depth_bucket(depth + 1), min(rank, 2))
                _proposes(child, key, self._rate(key), evidence)
                if going:
                    _defer(child, (src, going, depth + 1))

    def _choose(self, toks: list[int], pars: list[int], est: list[float], base_logp: list[float],
                expected_tokens: float, round_ms: float, costs, max_nodes: int, fixed_ms: float = 0.0,
                noise=None, first: int = 0):
        """`graft`'s choice over host lists (the tree's tokens, parents, acceptance estimates and draft
        log-probabilities): (tokens, parents, logp of the new nodes; proposed; their expected tokens).
        `fixed_ms`: what grafting anything costs the round besides its rows (a tree where there would be
        a plain step): charged from the first node on, and the graft kept only where, with it, the round
        still emits more a millisecond than without. With `noise`, a node at depth d is drawn at
        position `first` + d - 1 (`first`: the committed length), and its estimate reads its noise there."""
        cfg = self.config
        n_tree = len(toks)
        est = list(est)
        est[0] = 1.0
        # the drafted tree as trie nodes (parents come first), so candidates merge into it
        nodes = [_Node(toks[0])]
        paths: list[list[int]] = [[]]
        for i in range(1, n_tree):
            nodes.append(nodes[pars[i]].child(toks[i]))
            paths.append(paths[pars[i]] + [toks[i]])
        for i, node in enumerate(nodes):
            node.tree_idx = i
        evidence: dict[int, list[float]] = {}
        history_tail = self.history.tokens[-MAX_MATCH:]
        anchors = sorted((i for i in range(n_tree) if est[i] >= cfg.min_score), key=lambda i: -est[i])
        reach = graft_reach(max_nodes, max(len(p) for p in paths))
        for i in anchors[:cfg.max_anchors]:
            suffix = (history_tail + paths[i])[-MAX_MATCH:]
            self._propose_under(nodes[i], suffix, cfg.recycle_widths if i == 0 else cfg.recycle_widths[:2],
                                evidence, reach)
        proposed: dict[int, list[tuple]] = {}
        heap: list[tuple[float, int, _Node, int, float]] = []
        tie = 0

        def cond(node: _Node) -> float:           # several sources' evidence, as independent: 1 - prod(1 - c)
            miss = 1.0
            for c in evidence.get(id(node), ()):
                miss *= 1.0 - min(c, 0.99)
            return 1.0 - miss

        def push_kids(node: _Node, path: float, depth: int) -> None:
            nonlocal tie
            if node.pending is not None:
                self._expand(node, evidence)
            for kid in node.kids.values():
                kid.cond = cond(kid)
                if noise is not None and kid.cond > 0.0:    # drawn after `node`, at its position + 1
                    kid.cond = given_noise(kid.cond, noise.host_gumbel(first + depth, kid.token))
                s = path * kid.cond
                if 0 <= kid.tree_idx < n_tree:            # a drafted node: free; look beneath it
                    if kid.keys:
                        proposed[kid.tree_idx] = kid.keys
                    push_kids(kid, max(s, est[kid.tree_idx]), depth + 1)
                elif s >= cfg.min_score:
                    tie += 1
                    heapq.heappush(heap, (-s, tie, kid, node.tree_idx, s, depth + 1))

        push_kids(nodes[0], 1.0, 0)
        tokens, parents, logp = [], [], []
        tokens_base, ms_base = max(expected_tokens, 1.0), max(round_ms, 1e-3)
        tokens_now, ms_now, n_now = tokens_base, ms_base + (fixed_ms if costs is not None else 0.0), n_tree
        while heap and len(tokens) < max_nodes:
            _, _, kid, parent, s, depth = heapq.heappop(heap)
            if costs is not None:
                dt = costs.marginal_verify_ms(n_now)
                if s * ms_now <= tokens_now * dt:
                    break
                ms_now += dt
            tokens_now += s
            kid.tree_idx = n_now
            n_now += 1
            tokens.append(kid.token)
            parents.append(parent)
            logp.append((base_logp[parent] if parent < n_tree else logp[parent - n_tree])
                        + math.log(max(kid.cond, 1e-6)))
            proposed[kid.tree_idx] = kid.keys
            push_kids(kid, s, depth)
        if tokens and costs is not None and tokens_now * ms_base <= tokens_base * ms_now:   # not with fixed_ms
            return [], [], [], {i: keys for i, keys in proposed.items() if i < n_tree}, 0.0
        return tokens, parents, logp, proposed, tokens_now - tokens_base

    # ---------------------------------------------------------------- learning

    def observe(self, graft: Graft, path: torch.Tensor | list[int]) -> None:
        """Update each source's measured acceptance from the verified round.

        A proposed node counts when its parent was accepted (root included): it is
        accepted iff it is on `path` (the accepted root-to-node path, a tensor or host list).
        """
        if not graft.proposed:
            return
        self.observe_path(graft.proposed, graft.tree.parents.tolist(),
                          path.tolist() if isinstance(path, torch.Tensor) else path, graft.deterministic.tolist())

    def observe_path(self, proposed: dict[int, list[tuple]], parents, path: list[int], grafted) -> None:
        """`observe` over host values: the round's proposed nodes, each node's parent and whether it was
        grafted (counted as an accepted context node), both indexable by node index (lists, or mappings
        over the proposed nodes), and the accepted path (node indices, root first)."""
        on_path = set(path)
        lr = self.config.learning_rate
        for idx, keys in proposed.items():
            if parents[idx] not in on_path:
                continue
            hit = idx in on_path
            if hit and grafted[idx]:
                self.accepted_nodes += 1
            for key in keys:
                r = self._rate(key)
                self.rates[key] = r + lr * (float(hit) - r)


def _proposes(node: _Node, key: tuple, rate: float, evidence: dict[int, list[float]]) -> None:
    """The source statistics `key` proposes `node`, with its acceptance `rate` as evidence."""
    if key not in node.keys:
        node.keys.append(key)
    evidence.setdefault(id(node), []).append(rate)


def _defer(node: _Node, group: tuple[str, list, int]) -> None:
    """Matches through `node` whose children are made when the graft's choice reaches it (`_expand`)."""
    if node.pending is None:
        node.pending = [group]
    else:
        node.pending.append(group)


def graft_reach(max_nodes: int, drafted_depth: int) -> int:
    """How deep beneath an anchor a candidate can matter: along a continuation the drafted nodes come
    first (a node the drafter did not propose has no drafted child), at most `drafted_depth` of them,
    free, and every node after them takes one of the round's `max_nodes`; deeper candidates can be
    neither grafted nor a drafted node's evidence, so the lookups stop there (a batch's slot, whose
    share is a few nodes, builds a few trie nodes instead of `max_len` per match)."""
    return max(1, max_nodes + drafted_depth)


def describe(drafter: ContextDrafter) -> dict:
    """Measured acceptance per source key, for --stats / --json."""
    return {"sources": list(drafter.config.sources), "grafted": drafter.proposed_nodes,
            "accepted": drafter.accepted_nodes,
            "rates": {"/".join(map(str, k)): round(v, 3) for k, v in sorted(drafter.rates.items())}}


__all__ = ["ContextConfig", "ContextDrafter", "ContextStore", "Graft", "NGramIndex", "SOURCES",
           "parse_drafter_spec", "describe"]
