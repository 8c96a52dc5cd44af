"""Shared by the length-policy trainers (mcsd.train.disco, mcsd.train.specdecpp): chains out of trace folders,
path labels, and a round-by-round simulation that scores a stopping rule against static chain lengths.

Traces come from mcsd.train.traces (a wide tree per round, conditional
labels for every node). The rank-0 path under each round's root is exactly the
chain a greedy chain drafter would have drawn, so chain decisions can be
replayed on it without running a model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mcsd.costs.profile import DeviceProfile
from mcsd.drafting.policies.acceptance import FEATURE_NAMES

COL = {name: i for i, name in enumerate(FEATURE_NAMES)}


def path_labels(label: np.ndarray, parent_row: np.ndarray) -> np.ndarray:
    """(M,) conditional labels -> (M,) labels of the whole path (the node and all its ancestors accepted).
    Rows are parents-first within a round."""
    path = label.astype(np.float64).copy()
    for i in range(len(path)):
        if parent_row[i] >= 0:
            path[i] *= path[parent_row[i]]
    return path


def chains(data: dict, max_depth: int = 8) -> np.ndarray:
    """(R, max_depth) row index of the rank-0 node at depth 1..max_depth under each round's root; -1 past
    the traced depth."""
    rank = data["features"][:, COL["rank"]]
    parent = data["parent_row"]
    rows = np.arange(len(parent))
    child0 = np.full(len(parent), -1)
    first = rows[(rank == 0) & (parent < 0)]
    inner = (rank == 0) & (parent >= 0)
    child0[parent[inner]] = rows[inner]
    out = np.full((len(first), max_depth), -1)
    out[:, 0] = first
    for j in range(1, max_depth):
        prev = out[:, j - 1]
        out[:, j] = np.where(prev >= 0, child0[np.maximum(prev, 0)], -1)
    return out


class ChainCosts:
    """Round costs in milliseconds from a device profile (verify time against tokens, draft step time),
    interpolated between the measured sizes."""

    def __init__(self, verify_ms: dict, draft_ms: float, source: str):
        sizes = sorted(int(k) for k in verify_ms)
        self.sizes = np.array(sizes, dtype=np.float64)
        self.verify = np.array([float(verify_ms[str(s)] if str(s) in verify_ms else verify_ms[s]) for s in sizes])
        self.draft = float(draft_ms)
        self.source = source

    @classmethod
    def load(cls, path: Path | None) -> "ChainCosts":
        """A profile written by mcsd.costs.profile (verify time per size and the width-1 draft step, each on
        the faster matmul path, which is what the engine runs), or, without one, generic costs: verify
        of n tokens = (1 + 0.02 (n - 1)) steps, a draft step 0.07 steps."""
        if path is None:
            return cls({str(n): 1 + 0.02 * (n - 1) for n in (1, 2, 4, 8, 16)}, 0.07, "generic")
        prof = DeviceProfile.from_json(Path(path).read_text())
        return cls(prof.best_ms("verify"), prof.best_ms("draft")[1], str(path))

    def verify_ms(self, n: np.ndarray) -> np.ndarray:
        return np.interp(n, self.sizes, self.verify)

    def as_dict(self) -> dict:
        return {"source": self.source, "verify_ms": dict(zip(self.sizes.astype(int).tolist(), self.verify.tolist())),
                "draft_ms": self.draft}


def simulate(drafted: np.ndarray, path_ok: np.ndarray, costs: ChainCosts, max_depth: int) -> dict:
    """Replay chain rounds.

    Args:
        drafted: (R,) draft tokens offered per round (0..max_depth).
        path_ok: (R, max_depth) 1 where the rank-0 node at that depth and all above it are accepted.
        costs: round costs.
        max_depth: the chain's bound (a policy that reached it ran no extra draft step to decide).
    Returns:
        tau (tokens per round), tokens per second, mean drafted length.
    """
    depth = np.arange(path_ok.shape[1])[None]
    accepted = (path_ok * (depth < drafted[:, None])).sum(1)
    forwards = np.where(drafted > 0, np.minimum(drafted + 1, max_depth), 0)   # the deciding step included
    ms = costs.verify_ms(drafted + 1.0) + forwards * costs.draft
    tokens = accepted + 1
    return {"tau": float(tokens.mean()), "tokens_per_s": float(1e3 * tokens.sum() / ms.sum()),
            "mean_drafted": float(drafted.mean())}


def drafted_from_decisions(go_on: np.ndarray, min_depth: int) -> np.ndarray:
    """(R, D) whether the decision at depth j (for the node at depth j+1) lets it be drafted -> (R,)
    drafted length: the leading run of True, with the first `min_depth` decisions forced on."""
    go = go_on.copy()
    go[:, :min_depth] = True
    return np.cumprod(go, axis=1).sum(1)


def static_table(path_ok: np.ndarray, valid: np.ndarray, costs: ChainCosts, max_depth: int) -> dict:
    """Simulated figures of every static chain length 1..max_depth."""
    out = {}
    for k in range(1, max_depth + 1):
        drafted = np.minimum(valid.sum(1), k)
        out[k] = simulate(drafted, path_ok, costs, k)
    return out


def auc_or_none(y: np.ndarray, p: np.ndarray) -> float | None:
    """ROC AUC, or None when the labels hold one class only (tiny trace sets)."""
    from sklearn.metrics import roc_auc_score
    y = np.asarray(y).astype(bool)
    return float(roc_auc_score(y, p)) if 0 < y.sum() < len(y) else None


def main(argv=None) -> int:
    """A library with no stage of its own: `--help` (or no argument) prints what it is and what runs it."""
    from mcsd.train import library_main
    return library_main(__doc__, "`python tools/train_disco.py` and `python tools/train_specdecpp.py` run it.", argv)
