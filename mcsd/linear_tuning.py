"""Each linear layer's product on the implementation measured fastest for its shape and block size.

The forward-wide matmul paths of `mcsd.kernels` (ATen, oneDNN, prepacked
oneDNN) pick one implementation for a whole forward. Which one is fastest
depends on the weight's shape as well: on a 2-core AVX2 EPYC in float32
(one thread, weights cold in cache, noisy shared machine), a 1-row product
with SmolLM2-135M's 49152 x 576 LM head took 10.6 ms through ATen, 8.3 ms on
prepacked oneDNN weights and 5.6 ms on MKL's packed weights, while its
576 x 576 projections were fastest through ATen; for 2-8 rows the product
computed transposed (`weight @ x.T`, which MKL serves with another kernel) took
half of ATen's time for most shapes. `tune` times every candidate per distinct
weight shape and block size on the model's own weights and `install` gives
each linear layer a forward that runs its measured choice inside
`tuned()`, the kernel table's "tuned" path (`mcsd.kernels.using("tuned")`), which the
calibration times like the others and the engine runs where it measured
fastest.

Candidates (`CANDIDATES`):
- "aten": `F.linear`;
- "nt": `(weight @ x.T).T`, the same product through BLAS the other way round;
- "onednn": oneDNN on a weight prepacked once (`mcsd.kernels.pack`'s layout);
- "mkl": MKL's packed-weight product (what inductor uses for float32 with
  frozen weights), packed for one block size, so only timed for 1 row.

All compute the same float32 sums in different orders: results agree to
float32 rounding, as between the other matmul paths. Limitations: only plain
`nn.Linear` layers of float32 CPU models; a packed copy
costs one more copy of the weights it serves; a layer whose weight changed
since falls back to `F.linear`.
"""

from __future__ import annotations

import time
import types

import torch
import torch.nn.functional as F

from . import kernels

CANDIDATES = ("aten", "nt", "onednn", "mkl")
ROWS = (1, 2, 4, 8, 16, 32, 64)       # block sizes timed; a block uses the next timed size at or above it


def _mkl_available(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.mkl.is_available() and \
        hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def tunable(dtype: torch.dtype, device) -> bool:
    """True for float32 on a CPU, where ATen's, BLAS's transposed, oneDNN's and MKL's products
    differ. Reduced precision keeps the forward-wide paths (its "aten" would depend on the
    oneDNN flag)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


class _Tuned:
    """A layer's choice per timed block size, and the packed weights those choices need."""

    def __init__(self, layer: torch.nn.Linear, choice: dict[int, str]):
        self.choice = dict(choice)
        self.rows = sorted(self.choice)
        w = layer.weight.detach()
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(w, kernels.PACK_ROWS) \
            if "onednn" in self.choice.values() and kernels.packable(w.dtype, w.device) else None
        self.mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, 1) \
            if "mkl" in self.choice.values() and _mkl_available(w.dtype) else None
        self._stamp = kernels._Packed._stamp_of(layer)
        self._made_from = (layer.weight, layer.bias)         # kept alive, so their ids stay theirs

    def fresh(self, layer: torch.nn.Linear) -> bool:
        return kernels._Packed._stamp_of(layer) == self._stamp

    def __deepcopy__(self, memo):
        # A copied layer has weights of its own, which this was not made from (MKL's packed
        # buffers cannot be copied either): the copy runs unpacked until tuned again.
        return None

    def __call__(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
        """The layer's product on its tuned choice inside `tuned()`, else None (the caller's own path)."""
        if not getattr(kernels._local, "tuned", False) or x.dtype != layer.weight.dtype or not self.fresh(layer):
            return None
        rows = x.numel() // x.shape[-1]
        return _run(self.pick(rows), layer, x, self, rows)

    def pick(self, rows: int) -> str:
        for r in self.rows:
            if rows <= r:
                return self.choice[r]
        return self.choice[self.rows[-1]]


def _run(name: str, layer: torch.nn.Linear, x: torch.Tensor, tuned: _Tuned | None, rows: int) -> torch.Tensor:
    w, b = layer.weight, layer.bias
    if name == "nt":
        x2 = x.reshape(-1, x.shape[-1])                                          # (rows, in)
        out = torch.mm(w, x2.t()).t()                                            # (rows, out), transposed view
        if b is not None:
            out = out + b
        return out.reshape(*x.shape[:-1], w.shape[0])
    if name == "onednn" and tuned is not None and tuned.onednn is not None:
        return torch.ops.mkldnn._linear_pointwise(x, tuned.onednn, b, "none", [], "")
    if name == "mkl" and tuned is not None and tuned.mkl is not None and rows == 1:
        return torch.ops.mkl._mkl_linear(x, tuned.mkl, w, b, 1)
    return F.linear(x, w, b)


def _layers(module: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in module.modules() if type(m) is torch.nn.Linear and tunable(m.weight.dtype, m.weight.device)]


def _candidates(dtype: torch.dtype, device, rows: int) -> tuple[str, ...]:
    names = ["aten", "nt"]
    if kernels.packable(dtype, device):
        names.append("onednn")
    if rows == 1 and _mkl_available(dtype):
        names.append("mkl")
    return tuple(names)


SAMPLE_LAYERS = 16        # layers of one shape timed back to back (enough to keep their weights out of cache)


@torch.inference_mode()
def tune(module: torch.nn.Module, rows=ROWS, repeats: int = 5) -> dict:
    """Time every candidate on `module`'s linear layers, per weight shape and block size.

    Up to `SAMPLE_LAYERS` layers of one shape are run back to back (as in a
    forward, so their weights come from memory rather than cache), candidates
    interleaved within each repeat. The calling thread's CPU time is measured
    (time other processes hold the core does not count) and the minimum of
    `repeats` decides: noise on a shared machine only ever adds.

    Returns:
        {"shapes": {"OUTxIN": {rows: {candidate: microseconds per layer}}},
         "choice": {"OUTxIN": {rows: fastest candidate}}}: plain data, cacheable as JSON.
    """
    groups: dict[str, list[torch.nn.Linear]] = {}
    for layer in _layers(module):
        groups.setdefault(f"{layer.out_features}x{layer.in_features}", []).append(layer)
    timings: dict[str, dict[int, dict[str, float]]] = {}
    for key, layers in groups.items():
        layers = layers[:SAMPLE_LAYERS]
        packs = [_Tuned(layer, {1: "onednn", 2: "mkl"}) for layer in layers]        # packed weights to time with
        w = layers[0].weight
        for n in rows:
            x = torch.randn(n, w.shape[1], dtype=w.dtype, device=w.device)
            names = _candidates(w.dtype, w.device, n)
            samples: dict[str, list[float]] = {c: [] for c in names}
            for r in range(repeats + 1):                                         # round 0 warms up
                for c in names:
                    t0 = time.thread_time()
                    for layer, packed in zip(layers, packs):
                        _run(c, layer, x, packed, n)
                    if r:
                        samples[c].append((time.thread_time() - t0) * 1e6 / len(layers))
            timings.setdefault(key, {})[n] = {c: min(v) for c, v in samples.items()}
    choice = {key: {n: min(t, key=t.get) for n, t in per_rows.items()} for key, per_rows in timings.items()}
    return {"shapes": timings, "choice": choice}


def install(module: torch.nn.Module, tuning: dict) -> int:
    """Give each linear layer of `module` whose shape `tuning` covers its choices (and the packed
    weights they need); returns the number of layers set up. Layers keep serving the other paths."""
    done = 0
    for layer in _layers(module):
        choice = tuning["choice"].get(f"{layer.out_features}x{layer.in_features}")
        if not choice:
            continue
        with torch.no_grad():
            layer.__dict__["_mcsd_tuned"] = _Tuned(layer, {int(n): c for n, c in choice.items()})
        layer.__dict__["forward"] = types.MethodType(kernels._packed_forward, layer)   # asks the tuned choice first
        done += 1
    return done


def uninstall(module: torch.nn.Module) -> None:
    """Drop what `install` set up (prepacked copies made by `mcsd.kernels.pack` stay)."""
    for layer in module.modules():
        if layer.__dict__.pop("_mcsd_tuned", None) is not None and "_mcsd_packed" not in layer.__dict__:
            layer.__dict__.pop("forward", None)


def is_installed(module: torch.nn.Module) -> bool:
    return any("_mcsd_tuned" in layer.__dict__ for layer in module.modules())


def tuned(enabled: bool = True):
    """Run the block's linear layers on their tuned choices (where `install` gave them one);
    the same as `mcsd.kernels.using("tuned")` without touching the oneDNN flag."""
    return kernels.tuned_products(enabled)


def describe(tuning: dict) -> str:
    """One line: which candidate serves each shape, by block size."""
    parts = []
    for key, per_rows in tuning["choice"].items():
        runs: list[list] = []
        for n in sorted(per_rows, key=int):
            c = per_rows[n]
            if runs and runs[-1][0] == c:
                runs[-1][2] = n
            else:
                runs.append([c, n, n])
        parts.append(f"{key}: " + ", ".join(f"{c} {a}" + (f"-{b}" if b != a else "") for c, a, b in runs))
    return "; ".join(parts)
