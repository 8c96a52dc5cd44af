"""Tree policies, selectable by name. A new policy registers itself in `POLICIES`."""

from __future__ import annotations

from ...config import ConfigError
from ...core.tree import TreeTopology
from .acceptance import FEATURE_NAMES, AcceptanceModel
from .base import Frontier, TreePolicy
from .disco import DiscoPolicy
from .heuristic import ConfidencePolicy, HeuristicPolicy
from .learned import LearnedPolicy
from .specdecpp import SpecDecPPPolicy
from .static import StaticPolicy
from .svip import SVIPPolicy

POLICIES: dict[str, type[TreePolicy]] = {
    StaticPolicy.name: StaticPolicy,
    HeuristicPolicy.name: HeuristicPolicy,
    ConfidencePolicy.name: ConfidencePolicy,
    LearnedPolicy.name: LearnedPolicy,
    SVIPPolicy.name: SVIPPolicy,
    DiscoPolicy.name: DiscoPolicy,
    SpecDecPPPolicy.name: SpecDecPPPolicy,
}


def register_policy(cls: type[TreePolicy]) -> type[TreePolicy]:
    """Class decorator: make a policy selectable by its `name`."""
    POLICIES[cls.name] = cls
    return cls


def resolve_policy(name, lossy: bool = False, drafting: bool = True, fixed_round: bool = False):
    """"auto" -> "learned" when its acceptance model is installed and the run is exact and drafts
    (the lossy multi-root variant grows static trees), else "static"; also "static" where the run takes
    the fixed-shape round by default (`fixed_round`: a feature head on CUDA), whose static tree replays
    as CUDA graphs while the learned policy's per-level decisions run as eager operators, about 1,100 a
    drafted round (docs/results.md: the static 4,2,2 tree 1.64x HF's static-cache generate on an H200,
    the learned policy's 0.82x). Other names pass through."""
    if name != "auto":
        return name
    from .learned import default_model_path
    return "learned" if drafting and not lossy and not fixed_round and default_model_path().is_file() else "static"


def make_policy(policy, tree_spec, **options) -> TreePolicy:
    """Build a policy by name (or pass an instance through) over the topology of `tree_spec`
    (None: the policy's own `default_tree`)."""
    if isinstance(policy, TreePolicy):
        return policy
    try:
        cls = POLICIES[policy]
    except KeyError:
        raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    import inspect
    known = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "topology")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"policy {policy!r} has no setting {', '.join(map(repr, unknown))}; "
                          f"its settings: {', '.join(known) or 'none'}")
    return cls(TreeTopology.from_spec(cls.default_tree if tree_spec is None else tree_spec), **options)


__all__ = ["POLICIES", "Frontier", "TreePolicy", "StaticPolicy", "HeuristicPolicy",
           "ConfidencePolicy", "LearnedPolicy", "SVIPPolicy", "DiscoPolicy",
           "SpecDecPPPolicy", "AcceptanceModel", "FEATURE_NAMES", "register_policy", "make_policy",
           "resolve_policy"]
