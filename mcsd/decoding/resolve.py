"""What a `TreeDecoder` is built from, resolved and checked: the drafters as given (a causal LM, a
Drafter, "context", or a list of one of each), the policy name ("auto" and the default tree made
concrete), the lossy multi-root tree and the attention backend. Bad combinations are a ConfigError
here, before anything is measured or run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError
from ..drafting.context import ContextDrafter
from ..drafting.draft import Drafter, ModelDrafter
from ..drafting.pearl import PearlMode
from ..drafting.policies import POLICIES, TreePolicy, resolve_policy
from ..forward.attention import set_backend
from ..loading.models import check_vocab_sizes


@dataclass
class Parts:
    """A decoder's parts.

    Attributes:
        drafter: the model drafter (a ModelDrafter around a causal LM, or a Drafter as given), or None.
        draft: the draft as given (a causal LM or a Drafter, not the context drafter), or None: what
            the device profile times.
        context: the context drafter, or None.
        policy: a policy name (never "auto") or a TreePolicy.
        tree: the tree spec for a policy name (the lossy roots as its first level), or None.
        attention: the target's attention backend in use.
    """

    drafter: Drafter | None
    draft: object
    context: ContextDrafter | None
    policy: str | TreePolicy
    tree: object
    attention: str


def resolve(target: torch.nn.Module, draft, tree, policy, attention: str, lossy_roots: int,
            cuda_graphs: bool = True, fixed_round: bool = False) -> Parts:
    """`TreeDecoder`'s arguments -> its Parts (see `TreeDecoder` for what each may be); `fixed_round`:
    the decoder takes the fixed-shape round by default on this device (round "auto" or "fixed" on CUDA),
    where policy "auto" grows a feature head's static tree (`resolve_policy`)."""
    draft, context = split_drafters(draft)
    if context is not None and lossy_roots:
        raise ConfigError("context drafting is exact-only; it cannot be combined with lossy_target_roots")
    if context is not None and draft is None:
        if policy not in ("auto", "static"):
            raise ConfigError(f"policy {policy!r} shapes a draft model's tree; context drafting alone "
                              f"(no draft model) takes no policy")
        policy, tree = "static", ""                 # nothing to draft with a model: the root alone, then context
    policy = resolve_policy(policy, lossy=lossy_roots > 0, drafting=draft is not None,
                            fixed_round=fixed_round and getattr(draft, "static_blocks", False))
    if tree is None and isinstance(policy, str):
        tree = POLICIES[policy].default_tree if policy in POLICIES else TreePolicy.default_tree
    if lossy_roots and policy == "pearl":
        raise ConfigError("PEARL drafts exact chains; it does not combine with lossy_target_roots")
    if context is not None and (policy == "pearl" or isinstance(policy, PearlMode)):
        raise ConfigError("the pearl mode drafts a chain with a draft model; it does not take context drafting")
    if lossy_roots:
        vocab = target.get_input_embeddings().weight.shape[0]
        if not 1 <= lossy_roots <= vocab or not isinstance(tree, str):
            raise ConfigError(f"lossy_target_roots needs a width between 1 and the vocabulary size ({vocab}) "
                              f"and a k-config tree string")
        # candidate roots form the first level; the drafted tree grows beneath each of them
        tree = f"{lossy_roots},{tree}" if tree.strip() not in ("", "0") else str(lossy_roots)
    backend = set_backend(target, attention)
    return Parts(model_drafter(target, draft, attention, cuda_graphs), draft, context, policy, tree, backend)


def model_drafter(target: torch.nn.Module, draft, attention: str, cuda_graphs: bool = True) -> Drafter | None:
    """A causal LM as a ModelDrafter (same vocabulary, `attention` backend, `cuda_graphs` as the target's),
    a Drafter as it is, or None."""
    if draft is None:
        return None
    if isinstance(draft, torch.nn.Module):
        check_vocab_sizes(target, draft)
        set_backend(draft, attention)
        return ModelDrafter(draft, cuda_graphs=cuda_graphs)
    if all(hasattr(draft, m) for m in ("begin_round", "step", "commit", "reset")):
        return draft
    got = repr(draft) if isinstance(draft, str) else type(draft).__name__
    raise ConfigError(f"draft must be a causal LM, a Drafter, \"context\" (context drafting), a list of a "
                      f"model drafter and \"context\", or None; got {got}")


def split_drafters(draft):
    """`draft` as given -> (model drafter or None, ContextDrafter or None)."""
    items = list(draft) if isinstance(draft, (list, tuple)) else [draft]
    if not items:
        raise ConfigError(f"draft is an empty {type(draft).__name__}: a list names a model drafter, \"context\" "
                          f"or one of each (for the target alone, pass draft=None)")
    model, context = None, None
    for item in items:
        if isinstance(item, str) and item == "context":
            item = ContextDrafter()
        if isinstance(item, ContextDrafter):
            if context is not None:
                raise ConfigError("draft lists at most one context drafter")
            context = item
        elif item is not None:
            if model is not None:
                raise ConfigError("draft lists at most one model drafter (a causal LM or a Drafter) "
                                  "and one context drafter")
            model = item
    return model, context
