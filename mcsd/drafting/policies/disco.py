"""DISCO: a classifier on the draft's confidence decides, token by token, whether to keep drafting.

Paper: Mamou et al., "Dynamic Speculation Lookahead Accelerates Speculative
Decoding of Large Language Models" (arXiv 2405.04304). After each draft
token a small classifier reads the draft's confidence and predicts whether
the next draft token would still be accepted; drafting goes on while it says
so. Labels come from an oracle (the accepted length of each round), and the
decision threshold is tuned on held-out data for speed. The paper reports
about +10% over the best static lookahead. Hugging Face's
`assistant_confidence_threshold` descends from it (it refits a threshold on
the draft's top probability by ROC with cost FPR + 3 FNR).

Here:

- Features of a frontier node f, read before its children are drawn
  (`DISCO_FEATURES`): f's own draft probability under its parent (1 for the
  root), the top-1 and top-2 probabilities and the entropy of f's own draft
  distribution (the one its children come from), and f's depth.
- The classifier is a standardised logistic regression, fitted with
  scikit-learn by tools/train_disco.py on the fitting split's traces, with the
  oracle label "the rank-0 child of f lies on the accepted path"; the
  threshold is the one that maximised simulated tokens per second on those
  traces, given the machine's measured verify and draft costs. It is stored
  as plain JSON (`models/decision-models/disco.json`): loading never runs code.
- Chains (`default_tree` = 8 levels of 1) are the paper's setting. On a tree
  the same test runs per frontier node: a node whose predicted continuation
  falls below the threshold gets no children; one above it keeps the
  topology's fan-out.
- `min_depth` levels are always drafted (default 1).

Exactness: f's features describe f and its own distribution; none of its
children's tokens decides whether they are drawn (see base.py), so output
stays exactly the target's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ...core.tree import TreeTopology
from ...errors import ModelLoadError
from ...loading.cache import models_dir
from .base import Frontier, TreePolicy
from .svip import check_min_depth, check_unit_interval, entropy_nats

DISCO_FEATURES = (
    "q_own",      # the frontier node's own draft probability under its parent (root: 1)
    "top1",       # its draft distribution's top-1 probability
    "top2",       # ... and top-2
    "entropy",    # ... and entropy (nats)
    "depth",      # the frontier node's depth (draft tokens already on its path)
)
FORMAT = "mcsd-disco-classifier"
FORMAT_VERSION = 1
TRAIN_COMMAND = "python tools/train_disco.py"


def disco_features(frontier: Frontier) -> torch.Tensor:
    """(F, len(DISCO_FEATURES)) float32 features of the frontier nodes."""
    tree, nodes = frontier.tree, frontier.nodes
    probs = frontier.probs.float()
    parents = tree.parents[nodes]
    parent_logp = torch.where(parents >= 0, tree.logp[parents.clamp(min=0)], torch.zeros_like(tree.logp[nodes]))
    q_own = torch.where(parents >= 0, (tree.logp[nodes] - parent_logp).exp(), torch.ones_like(parent_logp))
    top = torch.topk(probs, min(2, probs.shape[-1]), dim=-1).values
    top2 = top[:, 1] if top.shape[1] > 1 else torch.zeros_like(top[:, 0])
    depth = torch.full_like(q_own, float(frontier.depth))
    return torch.stack([q_own.float(), top[:, 0], top2, entropy_nats(probs), depth.float()], dim=-1)


class DiscoClassifier:
    """P(continue) from a JSON parameter file (standardised logistic regression), evaluated with torch."""

    def __init__(self, spec: dict, source: str = "<dict>"):
        if not isinstance(spec, dict) or spec.get("format") != FORMAT or spec.get("version") != FORMAT_VERSION:
            got = (spec.get("format"), spec.get("version")) if isinstance(spec, dict) else type(spec).__name__
            raise ValueError(f"{source}: not a DISCO classifier (got {got}; expected {FORMAT!r} v{FORMAT_VERSION})")
        if list(spec.get("features", ())) != list(DISCO_FEATURES):
            raise ValueError(f"{source}: features {spec.get('features')} differ from {list(DISCO_FEATURES)}")
        try:
            self.mean = torch.tensor(spec["mean"], dtype=torch.float32)
            self.scale = torch.tensor(spec["scale"], dtype=torch.float32)
            self.coef = torch.tensor(spec["coef"], dtype=torch.float32)
            self.intercept = float(spec["intercept"])
            self.threshold = float(spec["threshold"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed DISCO classifier ({exc})") from None
        n = len(DISCO_FEATURES)
        if not (self.mean.shape == self.scale.shape == self.coef.shape == (n,)) or (self.scale <= 0).any():
            raise ValueError(f"{source}: malformed DISCO classifier (needs {n} means, positive scales, coefficients)")
        if not math.isfinite(self.threshold) or not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"{source}: threshold {self.threshold} is not in [0, 1]")
        self.meta = spec.get("meta", {})

    @classmethod
    def load(cls, path: str | Path) -> "DiscoClassifier":
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"no DISCO classifier at {path}; train one with `{TRAIN_COMMAND}` "
                                 f"(traces from tools/collect_traces.py)")
        try:
            return cls(json.loads(path.read_text()), str(path))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot use DISCO classifier {path}: {exc}") from None

    def predict_proba(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., len(DISCO_FEATURES)) -> (...) probability that drafting should go on."""
        z = (x.float() - self.mean.to(x.device)) / self.scale.to(x.device)
        return torch.sigmoid(z @ self.coef.to(x.device) + self.intercept)


def default_model_path() -> Path:
    """The shipped classifier: models/decision-models/disco.json."""
    return models_dir() / "decision-models" / "disco.json"


class DiscoPolicy(TreePolicy):
    """Draft a node's children while the classifier's P(continue) reaches the threshold.

    Args:
        topology: the largest tree (depth bound and fan-out).
        model: a DiscoClassifier or a path to one (default: the shipped `disco.json`).
        threshold: overrides the fitted threshold, in [0, 1].
        min_depth: levels always drafted (default 1).
    """

    name = "disco"
    default_tree = "1,1,1,1,1,1,1,1"

    def __init__(self, topology: TreeTopology, model: DiscoClassifier | str | Path | None = None,
                 threshold: float | None = None, min_depth: int = 1):
        super().__init__(topology)
        self.model = model if isinstance(model, DiscoClassifier) else DiscoClassifier.load(
            model if model is not None else default_model_path())
        self.threshold = (self.model.threshold if threshold is None
                          else check_unit_interval("DISCO's threshold", threshold, low_open=False))
        self.min_depth = check_min_depth(min_depth)

    def expand(self, frontier: Frontier) -> torch.Tensor:
        if frontier.depth < self.min_depth:
            return frontier.max_children
        go_on = self.model.predict_proba(disco_features(frontier)) >= self.threshold         # (F,)
        return torch.where(go_on, frontier.max_children, torch.zeros_like(frontier.max_children))
