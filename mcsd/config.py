"""Frozen configuration dataclasses: what to generate and how the tree is shaped.

Config is data. The CLI maps flags onto these by keyword; nothing in the engine
reads globals or keys behaviour on a model's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A user-supplied setting is invalid. The message says which one and why."""


@dataclass(frozen=True)
class SamplingConfig:
    """How a next token is chosen from logits. Applied identically to target and draft."""

    temperature: float = 0.0  # 0 means greedy (argmax); > 0 samples from softmax(logits / T)
    top_k: int = 0            # keep only the k most likely tokens; 0 disables
    top_p: float = 1.0        # keep the smallest set of tokens whose mass reaches top_p; 1.0 disables

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ConfigError(f"top_k must be a non-negative integer, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DecodeConfig:
    """One generation request."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None                # seeds a private torch.Generator; None draws fresh entropy
    stop_strings: tuple[str, ...] = ()     # stop once the decoded text contains one of these
    eos_token_ids: tuple[int, ...] = ()    # empty: taken from the tokenizer / generation config
    ignore_eos: bool = False               # keep going past EOS (benchmarks of fixed length)

    def __post_init__(self):
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ConfigError("stop_strings must be non-empty strings")


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree grown under each round's target-initialised root.

    `spec` is either MCSD's k-config string ("4,2,2": 4 children of the root, 2
    under each of those, 2 under each of those; "1,1,1,1" is a chain of 4) or an
    explicit list of paths, Medusa style: each path is a tuple of sibling ranks
    from the root, e.g. ((0,), (1,), (0, 0)) is two children of the root and one
    grandchild under the first.
    """

    spec: str | tuple[tuple[int, ...], ...] = "4,2,2"
