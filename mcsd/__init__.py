"""mcsd: lossless multi-candidate tree speculative decoding for Hugging Face causal LMs.

The names below are imported on first use (PEP 562), so `import mcsd` and the
command line's quick paths (`--help`, `--list-models`) do not pay for torch.
"""

from __future__ import annotations

import importlib as _importlib

__version__ = "0.1.0"

_EXPORTS = {
    "TreeDecoder": "decoding.decoder", "GenerationOutput": "core.output", "GenerationStats": "core.output",
    "Drafter": "drafting.draft", "ModelDrafter": "drafting.draft",
    "load_model_pair": "drafting.pair",
    "ModelLoadError": "errors", "TokenizerMismatchError": "errors",
    "DraftTree": "core.tree", "TreeTopology": "core.tree", "parse_tree_spec": "core.tree",
    "ConfigError": "config", "DecodeConfig": "config", "SamplingConfig": "config", "TreeConfig": "config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mcsd' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value                      # later lookups skip this function
    return value


def __dir__():
    return sorted({n for n in globals() if not n.startswith("_") and n != "annotations"} | set(_EXPORTS)
                  | {"__version__"})
