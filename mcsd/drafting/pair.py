"""A target and its drafter, loaded and checked together: a draft model that shares the target's
tokenizer, or a feature head (mcsd's or a published EAGLE-3 one) bound to the target; the target's q4
weights attached here.

The pair is refused when the draft's tokenizer differs from the target's (vocabulary or special
tokens): drafts would then propose ids that mean something else to the target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import WEIGHTS, ConfigError
from ..errors import ModelLoadError
from ..forward import quant
from ..loading.models import (
    check_tokenizers,
    check_vocab_sizes,
    gguf_source,
    has_tokenizer_files,
    load_pretrained,
    load_tokenizer,
    parse_dtype,
    preset_draft_dir,
    preset_path,
)
from ..loading.presets import DEFAULT_PRESET, PRESETS
from ..loading.sources import check_source
from .eagle3 import Eagle3Drafter, Eagle3FormatError, eagle3_layout, load_eagle3_head
from .feature_draft import FeatureDrafter, FeatureHead, is_feature_head


def load_model(source: str, dtype="bfloat16", device="cpu", role: str = "target", weights: str = "dense"):
    """Load one causal LM in eval mode (`load_pretrained`), its linear layers on q4 codes if asked.

    Args:
        source, dtype, device, role: as `mcsd.loading.models.load_pretrained`.
        weights: "dense", or "q4": the linear layers run on the 4-bit codes of the Q4_1 GGUF the
            model comes from (`mcsd.forward.quant`; on the CPU only), or "q4q8": those codes on
            8-bit activations (the native kernel's integer products; float32 only).
    Raises:
        ConfigError for an unknown `weights`, or q4 from a source that is no GGUF;
        ModelLoadError with the source and the underlying cause.
    """
    if weights not in WEIGHTS:
        raise ConfigError(f"unknown weights {weights!r}; choose {' or '.join(WEIGHTS)}")
    model = load_pretrained(source, dtype, device, role)
    if weights in quant.ON_CODES:
        gguf_path = gguf_source(source)
        if gguf_path is None:
            raise ConfigError(f"q4 weights are read from a Q4_1 GGUF file; {source!r} is neither one, nor a preset, "
                              f"nor a directory converted from one")
        quant.attach(model, gguf_path, act8=weights == "q4q8")
    return model



def load_feature_drafter(source: str, target, dtype="bfloat16"):
    """A saved feature head, checked against the target and bound to it."""
    try:
        head = FeatureHead.load(Path(source).expanduser(), parse_dtype(dtype))
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    hidden = target.get_input_embeddings().weight.shape[1]
    vocab = target.get_output_embeddings().weight.shape[0]
    if (head.cfg.target_hidden, head.cfg.vocab_size) != (hidden, vocab):
        raise ModelLoadError(f"feature head in {source} was built for hidden size {head.cfg.target_hidden} and "
                             f"vocabulary {head.cfg.vocab_size}; the target has {hidden} and {vocab}")
    # The head reads the target's features and embeddings, so it sits on the target's input device.
    folder = Path(source).expanduser().resolve()
    return FeatureDrafter(head.to(target.get_input_embeddings().weight.device), target,
                          name=folder.name, directory=folder)


def load_eagle3_drafter(source: str, target, dtype="bfloat16"):
    """A published EAGLE-3 head (either layout, `mcsd.drafting.eagle3`), checked against the target
    (width, vocabulary, the layers it reads) and bound to it.

    Raises:
        ModelLoadError, one line naming the folder and the cause.
    """
    folder = Path(source).expanduser()
    n_layers = int(getattr(target.config, "num_hidden_layers", 0) or 0)
    try:
        head = load_eagle3_head(folder, n_layers or None, parse_dtype(dtype))
    except Eagle3FormatError as exc:
        raise ModelLoadError(str(exc)) from None
    hidden = target.get_input_embeddings().weight.shape[1]
    vocab = target.get_output_embeddings().weight.shape[0]
    if head.cfg.hidden != hidden:
        raise ModelLoadError(f"EAGLE-3 head in {source} was made for hidden size {head.cfg.hidden}; "
                             f"the target has {hidden}")
    if head.cfg.vocab_size != vocab:
        raise ModelLoadError(f"EAGLE-3 head in {source} was made for a vocabulary of {head.cfg.vocab_size}; "
                             f"the target has {vocab}")
    bad = [i for i in head.cfg.aux_layers if not 0 <= i < n_layers]
    if bad:
        raise ModelLoadError(f"EAGLE-3 head in {source} reads target layers {list(head.cfg.aux_layers)}; the "
                             f"target has {n_layers} layers (ids 0..{n_layers - 1})")
    if head.embed_tokens is not None and head.embed_tokens.weight.shape == target.get_input_embeddings().weight.shape \
            and torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight):
        head.embed_tokens = None                       # a copy of the target's: embed with the target's own
    folder = folder.resolve()
    return Eagle3Drafter(head.to(target.get_input_embeddings().weight.device), target, name=folder.name,
                         directory=folder)


def cast_pair(target, draft, dtype):
    """Convert a loaded pair to `dtype` in place (the target, and a draft model or a feature
    head; a feature drafter is rebound in place to the converted head and target, so the objects a
    caller holds all run in `dtype`). Returns (target, draft), the same objects."""
    dtype = parse_dtype(dtype)
    target.to(dtype)
    if isinstance(draft, torch.nn.Module):
        draft.to(dtype)
    elif isinstance(draft, FeatureDrafter):
        quant.detach(draft.head)              # codes of its old weights go (the new drafter makes its own)
        head = draft.head.to(dtype)
        head.attach_lm_head(target.get_output_embeddings().weight)
        draft.rebind(target, head)
    return target, draft


def _has_tokenizer(source: str) -> bool:
    p = Path(source).expanduser()
    if p.is_dir():
        return has_tokenizer_files(p)
    return True  # GGUF files and hub ids carry one


def load_model_pair(target: str | None = None, draft: str | None = None, dtype="bfloat16",
                    device="cpu", draft_device=None, drafter: str | None = None, weights: str = "dense"):
    """Load a target, a draft that shares its tokenizer, and that tokenizer.

    Args:
        target: target source (preset, directory, .gguf, hub id); None = the default preset.
        draft: draft source; None = the preset's draft (only valid with a preset target).
            A directory holding `feature_head.json` is a target-feature head and
            comes back as a ready `FeatureDrafter` bound to the target; one holding an
            EAGLE-3 head (original or speculators layout) comes back as an `Eagle3Drafter`.
        drafter: with a preset and no `draft`: "model" (standalone draft LM),
            "feature" (the head that reads the target's features), or None for
            the preset's default (`Preset.default_drafter`: the faster one).
        dtype: compute dtype of both models.
        device: target device or device_map ("auto" / dict spreads it over GPUs).
        draft_device: draft device; defaults to `device`, or "cuda:0" with a device_map.
        weights: the target's ("dense", "q4" or "q4q8", see `load_model`); a draft model stays dense.
    Returns:
        (target_model, draft_model, tokenizer)
    Raises:
        ConfigError, ModelLoadError, TokenizerMismatchError.
    """
    if target is None:
        target = DEFAULT_PRESET
    if draft is None:
        check_source(target, "target")                 # a target that cannot load is named as such first
        if target not in PRESETS:
            raise ConfigError(f"no draft given for target {target!r}; pass draft=... "
                              f"(presets with a built-in draft: {', '.join(PRESETS)})")
        draft = str(preset_draft_dir(PRESETS[target], drafter))
    if draft_device is None:
        draft_device = "cuda:0" if isinstance(device, dict) or device == "auto" else device
    tokenizer = load_tokenizer(target)
    target_model = load_model(target, dtype, device, role="target", weights=weights)
    if is_feature_head(Path(draft).expanduser()):
        return target_model, load_feature_drafter(draft, target_model, dtype), tokenizer
    if eagle3_layout(Path(draft).expanduser()) is not None:
        return target_model, load_eagle3_drafter(draft, target_model, dtype), tokenizer
    draft_model = load_model(draft, dtype, draft_device, role="draft")
    draft_src = preset_path(draft, "draft")
    if _has_tokenizer(draft_src):
        check_tokenizers(tokenizer, load_tokenizer(draft_src))
    check_vocab_sizes(target_model, draft_model)
    return target_model, draft_model, tokenizer
