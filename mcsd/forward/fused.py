"""Sibling projections run as one matrix product.

Attention reads the same normed input through three linear layers: queries,
keys and values. Run separately, each is its own product with its own fixed
cost (dispatch, and a call into oneDNN or the int4 kernel), and the key and
value projections of a grouped-query model are small enough for that cost to
dominate. Measured on a 2-core Xeon with AMX, SmolLM2-135M, 2 threads, two
runs each (ms, separate -> joined):

| weights | 1 row | 9 rows | 64 rows |
| --- | --- | --- | --- |
| bfloat16, prepacked | 27.5-28.1 -> 26.9-27.0 | 30.6-31.1 -> 29.8-30.1 | 45.8-45.9 -> 44.1-44.7 |
| float32, prepacked | 37.5-37.9 -> 37.4-37.5 | 48.5-48.8 -> 47.6-47.8 | 113.8-117.5 -> 114.1-114.3 |
| q4 (int4 kernel) | 18.1-18.7 -> 17.5-18.3 | 34.0-34.7 -> 33.2-34.0 | 111.2-111.9 -> 111.9-113.5 |

Joining the gated MLP's gate and up projections as well gained nothing at 1
row and cost 0.7-1.0 ms at 64 rows (bfloat16), so they stay separate.

The model's code is left as it is: every sibling still calls its own layer.
The first call for a new input computes the product of all of them over the
concatenated weight (made once, by the path that owns it: `mcsd.forward.kernels`'
prepacked copy or `mcsd.forward.quant`'s int4 codes) and keeps it for that input;
each sibling returns its slice. An input is the same only if it is the same
tensor object at the same version (an in-place change starts a new product;
tensors made under inference mode have no version counter, so there only the
object counts), and the kept product is dropped once every sibling has taken
its slice. What is kept lives per thread, so concurrent forwards on one model
each have their own.

Limitations: only siblings that are plain `torch.nn.Linear` layers with the
same input width, dtype, device and bias presence are joined; a model whose
siblings read different inputs, or that calls one sibling alone, still gets
exact results, one product per call. In float32 a joined product may round
in another order than the separate ones (as another block size or matmul
path does); on the target above the logits of a 40-token prefill were
bit-identical.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

# names of linear layers that read one input inside one module (llama, mistral, qwen2, gemma, ...)
SIBLINGS = (("q_proj", "k_proj", "v_proj"),)


def sibling_groups(module: torch.nn.Module, siblings=SIBLINGS) -> list[list[torch.nn.Linear]]:
    """The groups of sibling linear layers inside `module` that can share one product (`siblings`:
    tuples of layer names that read one input)."""
    groups = []
    for parent in module.modules():
        for names in siblings:
            layers = [getattr(parent, name, None) for name in names]
            if not all(type(layer) is torch.nn.Linear for layer in layers):
                continue
            first = layers[0]
            if all(layer.in_features == first.in_features and layer.weight.dtype == first.weight.dtype
                   and layer.weight.device == first.weight.device
                   and (layer.bias is None) == (first.bias is None) for layer in layers):
                groups.append(layers)
    return groups


class Product:
    """One product for several sibling layers; each takes its slice of the last dimension.

    Args:
        sizes: each sibling's output width, in the order of the concatenated weight.
        compute: x (..., K) -> (..., sum(sizes)), the joined product.
        valid: called before each new product; False (the joined weight no longer matches the
            siblings' own) makes `part` return None, so the caller computes its own.
    """

    def __init__(self, sizes: list[int], compute: Callable[[torch.Tensor], torch.Tensor],
                 valid: Callable[[], bool] | None = None):
        self.sizes = list(sizes)
        self.compute = compute
        self.valid = valid
        self._kept = threading.local()          # .x, .version, .parts, .left

    def __deepcopy__(self, memo):
        return None          # a copied model has weights of its own: it runs unjoined until packed again

    def holds(self, x: torch.Tensor) -> bool:
        """The product for input `x` is computed and kept (some sibling has not taken its slice yet)."""
        kept = self._kept
        return getattr(kept, "x", None) is x and kept.version == _version(x)

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor | None:
        """Sibling `index`'s output for input `x` (..., K): (..., sizes[index]), a view of the joined
        product, computed on the first call for this input; None where `valid` says no."""
        kept = self._kept
        if not self.holds(x):
            if self.valid is not None and not self.valid():
                return None
            kept.x, kept.version = x, _version(x)
            kept.parts = self.compute(x).split(self.sizes, dim=-1)
            kept.left = len(self.sizes)
        out = kept.parts[index]
        kept.left -= 1
        if kept.left <= 0:                      # every sibling served: let go of input and product
            kept.x = kept.parts = None
        return out


def _version(x: torch.Tensor) -> int | None:
    # tensors made under inference mode keep no version counter (nor can autograd see them change)
    return None if x.is_inference() else x._version
