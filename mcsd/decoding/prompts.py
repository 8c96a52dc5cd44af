"""Prompts as `TreeDecoder` takes them: a string, token ids (a list, or a (T,) / (1, T) tensor), or a
list of such prompts, generated one after another. Anything else is a ConfigError naming what was wrong."""

from __future__ import annotations

import torch

from ..config import ConfigError


def is_prompt_list(prompt) -> bool:
    """True for a list / tuple of prompts (strings, id lists or 1-D tensors), False for one prompt."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, list, tuple)) or (isinstance(p, torch.Tensor) and p.dim() >= 1)
                    for p in prompt))


def encode(prompt, tokenizer, vocab_size: int, device) -> torch.Tensor:
    """One prompt (str, list of ids, or tensor) -> (T,) long ids on `device`, each below `vocab_size`.
    A string is tokenised as is (no special tokens added) and needs a tokenizer."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError("the prompt is empty")
        if tokenizer is None:
            raise ConfigError("a string prompt needs a tokenizer; pass tokenizer=... or token ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:           # a lone surrogate: no UTF-8 text, no tokens
            raise ConfigError(f"the prompt is not valid Unicode text: a lone surrogate {prompt[exc.start]!r} at "
                              f"character {exc.start} (decode bytes with errors='replace', or fix the text)") from None
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    else:
        ids = _as_ids(prompt)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ConfigError(f"batched prompts are not supported (got batch size {ids.shape[0]})")
            ids = ids[0]
        if ids.dim() != 1:
            raise ConfigError(f"prompt ids must be 1-D or (1, T), got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ConfigError("the prompt is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ConfigError(f"prompt token ids must lie in [0, {vocab_size}); got {int(ids.min())}..{int(ids.max())}")
    return ids.to(device)


def _as_ids(prompt) -> torch.Tensor:
    """A list / array / tensor of token ids as a long tensor; ConfigError for anything else."""
    try:
        ids = torch.as_tensor(prompt)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ConfigError(f"prompt must be a string, or token ids as a list or tensor of integers; "
                          f"got {type(prompt).__name__}") from None
    if ids.numel() and (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool):
        raise ConfigError(f"prompt token ids must be integers, got {ids.dtype}")
    return ids.long()
