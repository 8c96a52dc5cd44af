"""Device cost profile: how long a target verify takes against tree size, and a draft step against width.

Measured once per (target, draft, dtype, device) and cached as JSON under
`<cache>/profiles/`. Tree policies read it to weigh a node's expected gain
against what it costs to draft and verify on *this* hardware.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .lm import CachedLM
from .models import cache_dir

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class DeviceProfile:
    """Latencies in milliseconds, median over repeated interleaved runs.

    Attributes:
        verify_ms: {tree tokens: target forward time} with a `prefix_len` cache.
        draft_ms: {tokens: draft forward time} (empty without a draft).
        meta: model names, dtype, device, backend, thread count, torch version.
    """

    verify_ms: dict[int, float]
    draft_ms: dict[int, float] = field(default_factory=dict)
    prefix_len: int = 200
    meta: dict = field(default_factory=dict)

    def verify_cost(self, n_tokens: int) -> float:
        """Interpolated verify time for n tokens (linear between measured sizes, flat outside)."""
        return interpolate(self.verify_ms, n_tokens)

    def draft_cost(self, n_tokens: int) -> float:
        return interpolate(self.draft_ms, n_tokens) if self.draft_ms else 0.0

    def to_json(self) -> str:
        d = asdict(self)
        d["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        d["draft_ms"] = {str(k): v for k, v in self.draft_ms.items()}
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        d = json.loads(text)
        return cls(verify_ms={int(k): float(v) for k, v in d["verify_ms"].items()},
                   draft_ms={int(k): float(v) for k, v in d.get("draft_ms", {}).items()},
                   prefix_len=int(d.get("prefix_len", 200)), meta=dict(d.get("meta", {})))


def interpolate(table: dict[int, float], n: float) -> float:
    """Linear between measured sizes, flat below the smallest, proportional past the largest."""
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if n <= hi:
            return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)
    return table[xs[-1]] * n / xs[-1]                 # past the largest size: proportional


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _block_latency(lm: CachedLM, n: int, prefix_len: int, vocab: int, gen: torch.Generator) -> float:
    """Time one forward of n fresh tokens (all visible to each other) after a prefix_len cache, ms."""
    tokens = torch.randint(0, vocab, (n,), generator=gen).to(lm.device)
    pos = torch.arange(prefix_len, prefix_len + n, device=lm.device)
    allowed = torch.ones(n, n, dtype=torch.bool, device=lm.device).tril_()
    _sync(lm.device)
    t0 = time.perf_counter()
    lm.forward(tokens, pos, allowed)
    _sync(lm.device)
    elapsed = (time.perf_counter() - t0) * 1000
    lm.commit(prefix_len, torch.zeros(0, dtype=torch.long, device=lm.device))     # back to the prefix
    return elapsed


@torch.inference_mode()
def _head_latency(drafter, n: int, prefix_len: int, vocab: int, gen: torch.Generator) -> float:
    """Time one step of a target-feature drafter over n tree nodes (head forward and scores), ms."""
    from . import kv_cache
    from .tree import causal_allowed
    feats = torch.randn(n, drafter.head.cfg.target_hidden, generator=gen).to(drafter.device, drafter.dtype)
    tokens = torch.randint(0, vocab, (n,), generator=gen).to(drafter.device)
    pos = torch.arange(prefix_len, prefix_len + n, device=drafter.device)
    _sync(drafter.device)
    t0 = time.perf_counter()
    drafter.head.scores(drafter._run(feats, tokens, pos, causal_allowed(n, drafter.device)))
    _sync(drafter.device)
    elapsed = (time.perf_counter() - t0) * 1000
    kv_cache.truncate(drafter.cache, prefix_len)
    return elapsed


class _HeadTimer:
    """A target-feature drafter with a `prefix_len` cache, timed like a CachedLM."""

    def __init__(self, drafter, prefix_len: int, gen: torch.Generator):
        from .tree import causal_allowed
        self.drafter, self.device = drafter, drafter.device
        self.vocab = drafter.embed.weight.shape[0]
        drafter.reset()
        with torch.inference_mode():
            drafter._run(torch.randn(prefix_len, drafter.head.cfg.target_hidden, generator=gen).to(
                drafter.device, drafter.dtype), torch.randint(0, self.vocab, (prefix_len,), generator=gen).to(
                drafter.device), torch.arange(prefix_len, device=drafter.device),
                causal_allowed(prefix_len, drafter.device))


def measure(target, draft=None, sizes=DEFAULT_SIZES, prefix_len: int = 200, repeats: int = 20,
            draft_sizes=(1, 2, 4, 8, 16, 32)) -> DeviceProfile:
    """Measure verify latency per tree size (and draft latency per level width), interleaved.

    `draft` is a causal LM or a target-feature drafter (`mcsd.feature_draft`).
    Sizes are visited in a shuffled order each repeat so that drift (thermal,
    other load) spreads evenly; the median of `repeats` runs is kept.
    """
    gen = torch.Generator().manual_seed(0)
    lms = {"verify": CachedLM(target)}
    if draft is not None:
        lms["draft"] = _HeadTimer(draft, prefix_len, gen) if _is_feature_drafter(draft) else CachedLM(draft)
    samples: dict[tuple[str, int], list[float]] = {}
    def timed(lm, n):
        if isinstance(lm, _HeadTimer):
            return _head_latency(lm.drafter, n, prefix_len, lm.vocab, gen)
        return _block_latency(lm, n, prefix_len, lm.model.get_input_embeddings().weight.shape[0], gen)

    for role, lm in lms.items():
        if isinstance(lm, CachedLM):
            lm.reset()
            vocab = lm.model.get_input_embeddings().weight.shape[0]
            lm.extend(torch.randint(0, vocab, (prefix_len,), generator=gen).to(lm.device))
        for n in (sizes if role == "verify" else draft_sizes):
            timed(lm, n)                                                         # warm-up
    plan = [(role, n) for role in lms for n in (sizes if role == "verify" else draft_sizes)]
    for _ in range(repeats):
        order = torch.randperm(len(plan), generator=gen).tolist()
        for i in order:
            role, n = plan[i]
            samples.setdefault((role, n), []).append(timed(lms[role], n))
    med = {k: statistics.median(v) for k, v in samples.items()}
    device = lms["verify"].device
    meta = {"target": _model_name(target), "draft": _model_name(draft) if draft is not None else None,
            "dtype": str(lms["verify"].dtype).replace("torch.", ""), "device": str(device),
            "attention": getattr(target.config, "_attn_implementation", None),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": repeats}
    return DeviceProfile(verify_ms={n: med[("verify", n)] for n in sizes},
                         draft_ms={n: med[("draft", n)] for n in draft_sizes} if draft is not None else {},
                         prefix_len=prefix_len, meta=meta)


def _is_feature_drafter(draft) -> bool:
    return getattr(draft, "uses_target_hidden", False) and hasattr(draft, "head")


def _model_name(model) -> str:
    if _is_feature_drafter(model):
        return f"feature-head:{model.name}"
    return str(getattr(model.config, "_name_or_path", "") or model.config.model_type)


def profile_path(target, draft, device=None) -> Path:
    """Cache file for this pair, dtype, device and thread count."""
    dev = device or next(target.parameters()).device
    key = "|".join([_model_name(target), _model_name(draft) if draft is not None else "-",
                    str(next(target.parameters()).dtype), str(dev), str(torch.get_num_threads())])
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir() / "profiles" / f"{digest}.json"


def load_or_measure(target, draft=None, measure_if_missing: bool = True, **kwargs) -> DeviceProfile | None:
    """The cached profile for this setup, measured (and cached) on first use."""
    path = profile_path(target, draft)
    if path.is_file():
        try:
            return DeviceProfile.from_json(path.read_text())
        except (ValueError, KeyError):
            pass                                      # unreadable: measure again
    if not measure_if_missing:
        return None
    prof = measure(target, draft, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.to_json())
    return prof
