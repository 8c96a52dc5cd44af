"""The learned policy's acceptance model as data: the feature rows it reads (`FEATURE_NAMES`), the model
itself (logistic regression or gradient-boosted trees as plain JSON arrays, evaluated with torch; loading
never runs code from the file), where it is installed, and its export from a fitted scikit-learn estimator.
"""


from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ...errors import ModelLoadError
from ...forward.kernels import interpolate
from ...loading.cache import models_dir
from .base import Frontier

FEATURE_NAMES = (
    "q_rank",         # draft probability of the candidate (its rank-r probability under the parent)
    "top1",           # parent's draft distribution: top-1 probability
    "margin",         # top-1 minus top-2 probability
    "entropy",        # entropy (nats)
    "depth",          # depth of the candidate
    "path_logp",      # cumulative draft log-probability of the path to the candidate
    "rank",           # sibling rank
    "parent_pred",    # predicted probability that the parent is on the accepted path (root: 1)
    "recent_accept",  # running mean of per-depth acceptance in this sequence
)
FORMAT = "mcsd-acceptance-model"
FORMAT_VERSION = 1


def candidate_features(frontier: Frontier, k: int, parent_pred: torch.Tensor, recent: float) -> torch.Tensor:
    """One feature row per (frontier node, rank < k).

    Args:
        frontier: the level being expanded (its `probs` is (F, V)).
        k: ranks considered per node.
        parent_pred: (F,) path probability of each frontier node.
        recent: running acceptance rate of this sequence.
    Returns:
        (F, k, len(FEATURE_NAMES)) float32.
    """
    return level_features(frontier.probs, frontier.tree.logp[frontier.nodes], frontier.depth, k, parent_pred, recent)


def _level_columns(probs: torch.Tensor, logp: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """What a level's features are made of: (the nodes' top max(k, 2) draft probabilities (F, k'), each
    node's sum of p log p (F,), minus its entropy, and each candidate's path log-probability (F, k))."""
    probs = probs.float()
    top = torch.topk(probs, max(k, 2), dim=-1).values
    plogp = (probs * probs.clamp_min(1e-12).log()).sum(-1)
    return top, plogp, logp.float()[:, None] + top[:, :k].clamp_min(1e-12).log()


def level_features(probs: torch.Tensor, logp: torch.Tensor, depth: int, k: int, parent_pred: torch.Tensor,
                   recent: float) -> torch.Tensor:
    """`candidate_features` from tensors alone (the fixed-shape round has no `Frontier`).

    Args:
        probs: (F, V) the frontier nodes' draft distributions (or (F, K) over a sub-vocabulary).
        logp: (F,) their paths' cumulative draft log-probabilities.
        depth: the frontier's depth (its children land at depth + 1).
        k: ranks considered per node.
        parent_pred: (F,) path probability of each frontier node.
        recent: running acceptance rate of this sequence.
    Returns:
        (F, k, len(FEATURE_NAMES)) float32.
    """
    top, plogp, path_logp = _level_columns(probs, logp, k)
    f, kk = probs.shape[0], k
    cols = [
        top[:, :k],
        top[:, :1].expand(f, kk),
        (top[:, 0] - top[:, 1])[:, None].expand(f, kk),
        (-plogp)[:, None].expand(f, kk),
        torch.full((f, kk), float(depth + 1), device=probs.device),
        path_logp,
        torch.arange(kk, device=probs.device, dtype=torch.float32)[None].expand(f, kk),
        parent_pred.float()[:, None].expand(f, kk),
        torch.full((f, kk), float(recent), device=probs.device),
    ]
    return torch.stack(cols, dim=-1)


# ---------------------------------------------------------------------------- models as data

class AcceptanceModel:
    """P(candidate accepted | parent accepted) from a JSON parameter file; evaluated with torch."""

    def __init__(self, spec: dict, source: str = "<dict>"):
        if spec.get("format") != FORMAT or spec.get("version") != FORMAT_VERSION:
            raise ValueError(f"{source}: not an mcsd acceptance model (format {spec.get('format')!r}, "
                             f"version {spec.get('version')!r}; expected {FORMAT!r} v{FORMAT_VERSION})")
        names = tuple(spec.get("features", ()))
        if not names or any(n not in FEATURE_NAMES for n in names):
            raise ValueError(f"{source}: unknown features {[n for n in names if n not in FEATURE_NAMES]}; "
                             f"this mcsd knows {list(FEATURE_NAMES)}")
        self.columns = torch.tensor([FEATURE_NAMES.index(n) for n in names])
        self.kind = spec.get("kind")
        self.meta = spec.get("meta", {})
        try:
            if self.kind == "logistic":
                self.mean = torch.tensor(spec["mean"], dtype=torch.float32)
                self.scale = torch.tensor(spec["scale"], dtype=torch.float32)
                self.coef = torch.tensor(spec["coef"], dtype=torch.float32)
                self.intercept = float(spec["intercept"])
                shapes = {self.mean.numel(), self.scale.numel(), self.coef.numel()}
                if shapes != {len(names)}:
                    raise ValueError("coefficient count does not match the feature list")
            elif self.kind == "gbt":
                self.init = float(spec["init"])
                self.learning_rate = float(spec["learning_rate"])
                self.forest = _Forest([_Tree(t, len(names)) for t in spec["trees"]])
            else:
                raise ValueError(f"unknown model kind {self.kind!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed acceptance model ({exc})") from None
        self.sampled = _sampled_shifts(spec.get("sampled"), source)
        self._folded = _folded(self) if self.kind == "logistic" else None
        self._ranks: dict = {}                       # (k, device) -> (k,) the rank column's term, made once

    def logit_shift(self, temperature: float) -> float:
        """What sampling at `temperature` (0: greedy) adds to the model's logit, from the model's
        `sampled` table (piecewise linear between its temperatures, its end values beyond them): 0
        where the file has none. The model learns from greedy labels (a node is accepted where it is
        the target's argmax); sampled, a node is accepted where it is the target's seeded draw, which
        the draft's tempered features misjudge (their own sharpness moves with the temperature)."""
        if self.sampled is None:
            return 0.0
        temps, shifts = self.sampled                 # flat beyond the last temperature
        return interpolate(dict(zip(temps, shifts)), min(temperature, temps[-1]))

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceModel":
        try:
            return cls(json.loads(Path(path).read_text()), str(path))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot use acceptance model {path}: {exc}") from None

    def to(self, device) -> "AcceptanceModel":
        """A copy whose parameters sit on `device` (so that predicting there copies nothing to it)."""
        import copy
        out = copy.copy(self)
        out.columns = self.columns.to(device)
        if self.kind == "logistic":
            out.mean, out.scale, out.coef = (t.to(device) for t in (self.mean, self.scale, self.coef))
            out._folded = (self._folded[0], self._folded[1].to(device), self._folded[2])
            out._ranks = {}
        else:
            out.forest = copy.copy(self.forest)
            for name in ("left", "right", "feature", "threshold", "value", "offset"):
                setattr(out.forest, name, getattr(self.forest, name).to(device))
        return out

    def level_proba(self, probs: torch.Tensor, logp: torch.Tensor, depth: int, k: int, parent_pred: torch.Tensor,
                    recent: float, shift: float = 0.0) -> torch.Tensor:
        """`predict_proba(level_features(probs, logp, depth, k, parent_pred, recent), shift)`: (F, k) one
        level's candidates' acceptance. A logistic model's score is a weighted sum of the columns, so it
        is summed here column by column with the weights folded (the scaler's mean and scale in them),
        each node's own columns once a node and the level's constants on the host: about two thirds of
        the tensor operations a level (the same values to float32 rounding)."""
        if self._folded is None:
            return self.predict_proba(level_features(probs, logp, depth, k, parent_pred, recent), shift)
        w, row_weights, bias = self._folded
        top, plogp, path_logp = _level_columns(probs, logp, k)                              # (F, k'), (F,), (F, k)
        top1 = top[:, 0]
        per_node = torch.stack([top1, top1 - top[:, 1], plogp, parent_pred.float()], dim=1)  # (F, 4)
        const = bias + w["depth"] * (depth + 1) + w["recent_accept"] * recent + shift
        node = per_node @ row_weights.to(probs.device) + const                              # (F,)
        q = top[:, :k]                                                                      # (F, k)
        key = (k, probs.device)
        ranks = self._ranks.get(key)
        if ranks is None:
            ranks = self._ranks[key] = torch.arange(k, dtype=torch.float32, device=probs.device) * w["rank"]
        logit = (q * w["q_rank"] + path_logp * w["path_logp"]) + ranks + node[:, None]
        return torch.sigmoid(logit)

    def level_rows(self, probs: torch.Tensor, logp: torch.Tensor, depth: int, k: int, parent_pred: list[float],
                   recent: float, shift: float = 0.0) -> list[list[float]]:
        """`level_proba` for a level grown on the host (the learned policy's own loop): its columns
        read from the device once, and a logistic model's score summed in Python floats (float64),
        which for a level of a few nodes and ranks costs less than the two dozen small tensor
        operations it replaces (the policy's decision per level in decoding 0.34 -> 0.16 ms at T 1.0
        on a 2-core EPYC). `parent_pred` is a list; returns F lists of k probabilities. Other kinds of
        model run `level_proba`."""
        if self._folded is None:
            parent = torch.tensor(parent_pred, dtype=torch.float32, device=probs.device)
            return self.level_proba(probs, logp, depth, k, parent, recent, shift).tolist()
        w, _, bias = self._folded
        top, plogp, path_logp = _level_columns(probs, logp, k)                              # (F, k'), (F,), (F, k)
        f, width = top.shape
        flat = torch.cat([top.flatten(), plogp, path_logp.flatten()]).tolist()
        tops, plogps, paths = flat[:f * width], flat[f * width:f * width + f], flat[f * width + f:]
        const = bias + w["depth"] * (depth + 1) + w["recent_accept"] * recent + shift
        rows = []
        for i in range(f):
            q, path = tops[i * width:(i + 1) * width], paths[i * k:(i + 1) * k]
            node = (const + w["top1"] * q[0] + w["margin"] * (q[0] - q[1]) - w["entropy"] * plogps[i]
                    + w["parent_pred"] * parent_pred[i])
            rows.append([_sigmoid(node + w["q_rank"] * q[r] + w["path_logp"] * path[r] + w["rank"] * r)
                         for r in range(k)])
        return rows

    def predict_proba(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        """x: (..., len(FEATURE_NAMES)) -> (...) probabilities, `shift` (`logit_shift`) added to the logit."""
        z = x.float()[..., self.columns.to(x.device)]
        if self.kind == "logistic":
            logit = ((z - self.mean.to(z.device)) / self.scale.to(z.device)) @ self.coef.to(z.device) + self.intercept
        else:
            logit = self.init + self.learning_rate * self.forest(z)
        return torch.sigmoid(logit + shift if shift else logit)


def _sigmoid(x: float) -> float:
    """The logistic function of a host float, without overflow for large negative x."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _folded(model: "AcceptanceModel") -> tuple[dict[str, float], torch.Tensor, float]:
    """A logistic model's weight per `FEATURE_NAMES` column (by name) with the scaler folded in, coef /
    scale (0 for a column it does not read), the per-node columns' as a (4,) tensor (top1, margin, minus the
    entropy, parent_pred), and its bias, intercept - sum(coef x mean / scale)."""
    coef, mean, scale = (t.double().tolist() for t in (model.coef, model.mean, model.scale))
    weights = [0.0] * len(FEATURE_NAMES)
    bias = model.intercept
    for column, c, m, s in zip(model.columns.tolist(), coef, mean, scale):
        weights[column] = c / s
        bias -= c * m / s
    w = dict(zip(FEATURE_NAMES, weights))
    rows = torch.tensor([w["top1"], w["margin"], -w["entropy"], w["parent_pred"]], dtype=torch.float32)
    return w, rows, bias


def _sampled_shifts(table, source: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The optional `sampled` entry of a model file: {"temperature": [...], "logit_shift": [...]} with
    increasing temperatures from 0 and finite shifts, one per temperature; None where absent."""
    if table is None:
        return None
    try:
        temps = tuple(float(t) for t in table["temperature"])
        shifts = tuple(float(b) for b in table["logit_shift"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: malformed 'sampled' table ({exc!r})") from None
    if not temps or len(temps) != len(shifts):
        raise ValueError(f"{source}: the 'sampled' table needs one logit shift per temperature "
                         f"({len(temps)} temperatures, {len(shifts)} shifts)")
    if temps[0] < 0 or any(b <= a for a, b in zip(temps, temps[1:])) \
            or not all(abs(b) < 1e3 for b in shifts):
        raise ValueError(f"{source}: the 'sampled' table's temperatures must increase from 0 or more and its "
                         f"shifts be finite (temperatures {list(temps)}, shifts {list(shifts)})")
    return temps, shifts


class _Tree:
    """A regression tree as flat arrays (sklearn's tree_ layout), checked; evaluated by `_Forest`."""

    def __init__(self, t: dict, n_features: int):
        self.left = torch.tensor(t["left"], dtype=torch.long)
        self.right = torch.tensor(t["right"], dtype=torch.long)
        self.feature = torch.tensor(t["feature"], dtype=torch.long)
        self.threshold = torch.tensor(t["threshold"], dtype=torch.float32)
        self.value = torch.tensor(t["value"], dtype=torch.float32)
        n = self.left.numel()
        if not (self.right.numel() == self.feature.numel() == self.threshold.numel() == self.value.numel() == n):
            raise ValueError("tree arrays differ in length")
        inner = self.left >= 0
        if (self.feature[inner] >= n_features).any() or (self.left[inner] >= n).any() or (self.right[inner] >= n).any():
            raise ValueError("tree refers to a feature or node that does not exist")
        self.depth = int(t.get("max_depth", 32))


class _Forest:
    """All trees of an ensemble in padded (trees, nodes) arrays, traversed together.

    One pass per level of the deepest tree, whatever the number of trees: the
    policy calls this once per draft level, so its cost is a few dozen small
    tensor ops, not a few per tree.
    """

    def __init__(self, trees: list[_Tree]):
        if not trees:
            raise ValueError("an ensemble needs at least one tree")
        width = max(t.left.numel() for t in trees)
        self.depth = max(t.depth for t in trees)

        def stack(attr, fill):
            rows = [torch.cat([getattr(t, attr), torch.full((width - getattr(t, attr).numel(),), fill,
                                                           dtype=getattr(t, attr).dtype)]) for t in trees]
            return torch.stack(rows).flatten()                          # (T * width,)
        self.left, self.right = stack("left", -1), stack("right", -1)
        self.feature, self.threshold, self.value = stack("feature", 0), stack("threshold", 0.0), stack("value", 0.0)
        self.offset = torch.arange(len(trees)) * width                  # (T,) first node of each tree

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """z: (..., D) -> (...) the sum of the trees' leaf values."""
        dev = z.device
        left, right, feat, thr = (a.to(dev) for a in (self.left, self.right, self.feature, self.threshold))
        rows = z.reshape(-1, z.shape[-1])                                # (R, D)
        offset = self.offset.to(dev)[None]                               # (1, T)
        idx = offset.expand(rows.shape[0], -1)                           # (R, T) current node of each tree
        for _ in range(self.depth):
            go_left = rows.gather(1, feat[idx].clamp_min(0)) <= thr[idx]
            child = torch.where(go_left, left[idx], right[idx])          # local index in its tree; -1 at a leaf
            idx = torch.where(left[idx] >= 0, offset + child, idx)
        return self.value.to(dev)[idx].sum(-1).reshape(z.shape[:-1])


def default_model_path() -> Path:
    """The shipped acceptance model: models/decision-models/acceptance.json."""
    return models_dir() / "decision-models" / "acceptance.json"


def drafter_model_path(drafter) -> Path | None:
    """The acceptance model a drafter ships beside its weights (`<its folder>/acceptance.json`), if any.

    A drafter's folder is its `directory` (a feature head's, set when it is
    loaded; a standalone draft model's, the folder it was loaded from).
    """
    folder = getattr(drafter, "directory", None)
    path = Path(folder) / "acceptance.json" if folder else None
    return path if path is not None and path.is_file() else None


def export_sklearn(estimator, feature_names=FEATURE_NAMES, meta: dict | None = None) -> dict:
    """Parameters of a fitted scikit-learn model as a JSON-ready dict (for AcceptanceModel).

    Supports `Pipeline(StandardScaler, LogisticRegression)` (or a bare
    LogisticRegression) and a binary `GradientBoostingClassifier` with its
    default prior initialisation.
    """
    import numpy as np
    import sklearn
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression

    names = list(feature_names)
    spec = {"format": FORMAT, "version": FORMAT_VERSION, "features": names,
            "meta": {"sklearn": sklearn.__version__, **(meta or {})}}
    steps = dict(estimator.steps) if hasattr(estimator, "steps") else {"model": estimator}
    model = list(steps.values())[-1]
    if isinstance(model, LogisticRegression):
        scaler = next((s for s in steps.values() if hasattr(s, "scale_")), None)
        mean = scaler.mean_ if scaler is not None else np.zeros(len(names))
        scale = scaler.scale_ if scaler is not None else np.ones(len(names))
        spec.update(kind="logistic", mean=[float(v) for v in mean], scale=[float(v) for v in scale],
                    coef=[float(v) for v in model.coef_[0]], intercept=float(model.intercept_[0]))
    elif isinstance(model, GradientBoostingClassifier):
        prior = float(model.init_.class_prior_[1])
        trees = []
        for est in model.estimators_[:, 0]:
            t = est.tree_
            trees.append({"left": t.children_left.tolist(), "right": t.children_right.tolist(),
                          "feature": t.feature.tolist(), "threshold": t.threshold.tolist(),
                          "value": t.value[:, 0, 0].tolist(), "max_depth": int(t.max_depth)})
        spec.update(kind="gbt", init=math.log(prior / (1 - prior)), learning_rate=float(model.learning_rate),
                    trees=trees)
    else:
        raise TypeError(f"cannot export {type(model).__name__}; use logistic regression or gradient boosting")
    return spec
