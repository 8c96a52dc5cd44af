"""SpecDec++: an acceptance head on the draft's hidden state stops drafting when a rejection grows likely.

Paper: Huang et al., "SpecDec++: Boosting Speculative Decoding via Adaptive
Candidate Lengths" (arXiv 2405.19715). A small residual MLP on the draft's
last hidden state predicts, for each draft token, the probability that the
target accepts it; the draft stops once the probability that at least one
token of the current run is rejected, 1 - prod(predicted acceptance), passes
a threshold h (the paper sweeps h over 0.3-0.7), with the length bounded.
The head is trained with a weighted binary cross-entropy (weight about 6 on
the rejection class) on soft labels min(1, p/q), on sequences mixing target
and draft tokens. The paper reports 2.04x (Alpaca) to 2.26x (GSM8K) with
Llama-2 7B / 70B chains.

Here:

- The head reads the drafter's `last_hidden` for the frontier rows it just
  ran: a standalone draft's last hidden state (after reading the node's
  token), or the feature drafter's predicted feature. It is trained per
  drafter by tools/train_specdecpp.py on traced trees (committed target
  tokens, then draft nodes: the tree's paths are the draft part of the mix),
  and stored as safetensors weights plus a JSON config
  (`models/decision-models/specdecpp.safetensors`, `specdecpp.json`): loading
  never runs code. The config names the drafter it was trained for; another
  drafter is refused.
- Chains (`default_tree` = 8 levels of 1) are the paper's setting: a node's
  predicted acceptance joins its path's product, and if 1 - product passes h
  the node's children are not drawn. On a tree every branch carries its own
  product and stops on its own; a branch that passes keeps the topology's
  fan-out.
- `min_depth` levels are always drafted (default 1).

Exactness: a frontier node's prediction comes from the hidden state of that
node (its token is already in the tree and is verified whatever is decided),
before any of its children is drawn (see base.py), so output stays exactly
the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ...config import ConfigError
from ...core.tree import TreeTopology
from ...errors import ModelLoadError
from ...loading.cache import models_dir
from .base import Frontier, TreePolicy
from .svip import check_min_depth, check_unit_interval

FORMAT = "mcsd-specdecpp-head"
FORMAT_VERSION = 1
TRAIN_COMMAND = "python tools/train_specdecpp.py"


class AcceptanceHead(nn.Module):
    """Residual MLP: (..., H) draft hidden states -> (...) acceptance logits.

    The input is RMS-normalised (no parameters), then `layers` blocks x + SiLU(W x + b), then one linear
    output unit.
    """

    def __init__(self, hidden: int, layers: int = 2):
        super().__init__()
        self.hidden, self.layers = hidden, layers
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)                   # (..., H)
        for block in self.blocks:
            x = x + nn.functional.silu(block(x))
        return self.out(x).squeeze(-1)                                                  # (...)

    def save(self, directory: str | Path, threshold: float, drafter: str | None, meta: dict | None = None,
             stem: str = "specdecpp") -> None:
        """Write `<stem>.safetensors` (weights) and `<stem>.json` (shape, threshold, drafter, meta)."""
        from safetensors.torch import save_file
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()},
                  str(directory / f"{stem}.safetensors"))
        config = {"format": FORMAT, "version": FORMAT_VERSION, "hidden": self.hidden, "layers": self.layers,
                  "threshold": float(threshold), "drafter": drafter, "meta": meta or {}}
        (directory / f"{stem}.json").write_text(json.dumps(config, indent=1))


class SpecDecHead:
    """A trained head with its config: `threshold` (the fitted h) and `drafter` ("model", "feature" or None)."""

    def __init__(self, head: AcceptanceHead, threshold: float, drafter: str | None, meta: dict | None = None):
        self.head, self.threshold, self.drafter, self.meta = head.eval().requires_grad_(False), threshold, drafter, \
            meta or {}

    @classmethod
    def load(cls, config_path: str | Path) -> "SpecDecHead":
        """Load `<stem>.json` and its `<stem>.safetensors` beside it. ModelLoadError on anything wrong."""
        config_path = Path(config_path)
        weights = config_path.with_suffix(".safetensors")
        if not config_path.is_file() or not weights.is_file():
            raise ModelLoadError(f"no SpecDec++ acceptance head at {config_path} (+ {weights.name}); train one with "
                                 f"`{TRAIN_COMMAND}` (traces from tools/collect_traces.py --hidden)")
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            cfg = json.loads(config_path.read_text())
            if not isinstance(cfg, dict) or cfg.get("format") != FORMAT or cfg.get("version") != FORMAT_VERSION:
                raise ValueError(f"not a SpecDec++ head config (expected {FORMAT!r} v{FORMAT_VERSION})")
            hidden, layers = int(cfg["hidden"]), int(cfg["layers"])
            if hidden < 1 or layers < 0:
                raise ValueError(f"bad shape: hidden {hidden}, layers {layers}")
            threshold = check_unit_interval("threshold", cfg["threshold"])
            head = AcceptanceHead(hidden, layers)
            head.load_state_dict(load_file(str(weights)), strict=True)
        except (OSError, KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot use SpecDec++ head {config_path}: {exc}") from None
        return cls(head, threshold, cfg.get("drafter"), cfg.get("meta"))

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """(F, H) hidden states -> (F,) predicted acceptance probabilities."""
        p = next(self.head.parameters())
        return torch.sigmoid(self.head(hidden.to(p.device, torch.float32)))


def default_model_path() -> Path:
    """The shipped head's config: models/decision-models/specdecpp.json."""
    return models_dir() / "decision-models" / "specdecpp.json"


def drafter_kind(drafter) -> str:
    return "feature" if getattr(drafter, "uses_target_hidden", False) else "model"


class SpecDecPPPolicy(TreePolicy):
    """Draft a node's children while 1 - prod(predicted acceptance along its path) <= h.

    Args:
        topology: the largest tree (depth bound and fan-out).
        model: a SpecDecHead or a path to its JSON config (default: the shipped `specdecpp.json`).
        threshold: h, overriding the fitted one, in (0, 1].
        min_depth: levels always drafted (default 1).
    """

    name = "specdecpp"
    default_tree = "1,1,1,1,1,1,1,1"

    def __init__(self, topology: TreeTopology, model: SpecDecHead | str | Path | None = None,
                 threshold: float | None = None, min_depth: int = 1):
        super().__init__(topology)
        self.model = model if isinstance(model, SpecDecHead) else SpecDecHead.load(
            model if model is not None else default_model_path())
        self.threshold = (self.model.threshold if threshold is None
                          else check_unit_interval("SpecDec++'s threshold h", threshold))
        self.min_depth = check_min_depth(min_depth)
        self.drafter = None

    def bind_drafter(self, drafter) -> None:
        if not hasattr(drafter, "last_hidden"):
            raise ConfigError(f"the SpecDec++ policy reads the draft's hidden states; {type(drafter).__name__} "
                              f"does not expose `last_hidden`")
        if self.model.drafter is not None and self.model.drafter != drafter_kind(drafter):
            raise ConfigError(f"this SpecDec++ head was trained for the {self.model.drafter!r} drafter, not "
                              f"{drafter_kind(drafter)!r}; train one for it with `{TRAIN_COMMAND}`")
        drafter.keep_hidden = True
        self.drafter = drafter

    def begin_round(self) -> int:
        self._survive = torch.ones(self.topology.size, device=self.topology.parents.device)   # per tree node
        return self.topology.max_depth

    def expand(self, frontier: Frontier) -> torch.Tensor:
        if frontier.depth < self.min_depth:
            return frontier.max_children
        if self.drafter is None:
            raise ConfigError("the SpecDec++ policy needs the drafter's hidden states; use it through TreeDecoder")
        hidden = self.drafter.last_hidden                                              # (F, H)
        if hidden is None or hidden.shape != (frontier.nodes.numel(), self.model.head.hidden):
            raise ConfigError(f"SpecDec++ head expects hidden states of width {self.model.head.hidden} for "
                              f"{frontier.nodes.numel()} rows, got "
                              f"{None if hidden is None else tuple(hidden.shape)}")
        accept = self.model.predict(hidden).to(self._survive.device)                  # (F,)
        parents = frontier.tree.parents[frontier.nodes]
        survive = torch.where(parents >= 0, self._survive[parents.clamp(min=0)] * accept, torch.ones_like(accept))
        self._survive[frontier.nodes] = survive
        stop = (1.0 - survive) > self.threshold
        return torch.where(stop, torch.zeros_like(frontier.max_children), frontier.max_children)
