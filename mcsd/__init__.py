"""mcsd: lossless multi-candidate tree speculative decoding for Hugging Face causal LMs."""

from .config import ConfigError, DecodeConfig, SamplingConfig, TreeConfig
from .decoder import GenerationOutput, GenerationStats, TreeDecoder
from .draft import Drafter, ModelDrafter
from .models import ModelLoadError, TokenizerMismatchError, load_model_pair
from .tree import DraftTree, TreeTopology, parse_tree_spec

__version__ = "0.1.0"

__all__ = ["TreeDecoder", "load_model_pair", "GenerationOutput", "GenerationStats", "Drafter",
           "ModelDrafter", "DraftTree", "TreeTopology", "parse_tree_spec", "ConfigError",
           "ModelLoadError", "TokenizerMismatchError", "DecodeConfig", "SamplingConfig", "TreeConfig"]
