"""Which CPU matrix-product path runs a forward of a given size fastest: oneDNN, ATen's own,
or oneDNN on weights prepacked once.

On a CPU with native bfloat16 (AVX512-BF16, AMX) torch routes reduced-precision
matrix products through oneDNN. That path wins for many rows but carries a
fixed cost that dominates a forward of one or two rows: for SmolLM2-135M in
bfloat16 on a 2-core AVX512-BF16 EPYC, a 1-token step took 43 ms through
oneDNN and 25 ms through ATen's kernels, a 16-token verify 50 ms against
136 ms. Decoding is mostly forwards of a few rows, so the calibration
(`mcsd.costs.timing.measure`) times both paths per block size and the engine runs
each forward on the faster one.

The switch is torch's process-wide `torch.backends.mkldnn.enabled` flag, set
around one forward and restored after. It is only ever switched for bfloat16
and float16 models on a CPU where oneDNN would handle them (unpacked float32
products go through the same BLAS either way). Concurrent decoding threads
(PEARL) `suspend` switching, since the flag is shared.

A third path keeps oneDNN's kernels but reorders each linear layer's weight
into oneDNN's blocked layout once (`pack`), as inductor does when it freezes
weights. oneDNN otherwise reorders the weight inside every product, which is
most of its fixed cost: on the same CPU a target forward of 4 / 8 / 16 rows
took 30 / 35 / 42 ms on prepacked weights against 44 / 48 / 58 ms on plain
oneDNN and 48 / 79 / 144 ms on ATen (1 row: 34 / 44 / 24 ms), so trees of a
few nodes cost much less to verify. It serves float32 too, on any CPU oneDNN
runs on, in place of the BLAS call float32 products otherwise make: 1 / 4 / 8 /
16 rows took 37 / 39 / 46 / 55 ms against 54 / 79 / 80 / 92 ms (AVX512 EPYC),
and 40 / 46 / 54 / 69 ms against 56 / 84 / 84 / 99 ms with AVX2 only
(emulated). A float32 forward's rounding then depends on the path the calibration chose, as it
already depends on the block size.

Weights are held in one layout. Both plain paths read the plain weights; the
packed path reads its copy. A decoder keeps, of the two layouts, the one
faster over the block sizes it runs (`KernelTable.one_layout`, applied by
`mcsd.costs.profile.DeviceProfile.hold_once`), so a
profile that found the packed copy faster for trees and the plain weights for
single rows still holds one copy of each weight, at the cost of the other
layout's speed at the sizes it would have won. Where every block runs on the
packed copy, `pack(release=True)` lets the plain weights go, a layer at a
time (a meta tensor keeps their shape and dtype in place; the pages of a file
they were read from in place go too, `mcsd.forward.mapped`), and every product
of the layer reads the copy, whatever path a block asks for; `unpack`
brings them back from the copy, exactly. Weights that several modules share
(a tied LM head and embedding) are never let go. A packed copy is dropped from
use for a layer whose weight has changed since.
"""

from __future__ import annotations

import contextlib
import threading
import types

import torch
import torch.nn.functional as F

from . import fused, mapped

_suspensions = 0                  # > 0 while some caller runs forwards on several threads
_lock = threading.Lock()
_local = threading.local()        # .packed: linear layers on this thread use their prepacked weights

PATHS = ("onednn", "aten", "packed")
PACK_ROWS = 8                     # the block size oneDNN chooses the packed layout for (it serves every size)


def interpolate(table: dict[int, float], n: float) -> float:
    """A latency table {size: ms} read at size `n`: linear between measured sizes, flat below the
    smallest, proportional past the largest."""
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if n <= hi:
            return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)
    return table[xs[-1]] * n / xs[-1]                 # past the largest size: proportional


def switchable(dtype: torch.dtype, device) -> bool:
    """True where the two paths differ for this dtype and device: a CPU, bfloat16 or float16,
    and a oneDNN build that takes those products on this processor."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    check = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):
        return False


@contextlib.contextmanager
def onednn(enabled: bool):
    """Run the block with oneDNN matrix products on or off, restoring the previous setting."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def packable(dtype: torch.dtype, device) -> bool:
    """True where a linear layer's weight can be prepacked for oneDNN: float32 on any CPU
    oneDNN runs on, bfloat16 / float16 where `switchable`."""
    if dtype == torch.float32:
        if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
    elif not switchable(dtype, device):
        return False
    try:
        return torch.ops.mkldnn._reorder_linear_weight is not None
    except (AttributeError, RuntimeError):
        return False


class _Packed:
    """A prepacked weight in oneDNN's blocked layout for one linear layer, or for sibling layers that
    read one input (`mcsd.forward.fused`: their weights concatenated, one product, each takes its slice)."""

    def __init__(self, layers: list[torch.nn.Linear]):
        weight = torch.cat([layer.weight.detach() for layer in layers]) if len(layers) > 1 \
            else layers[0].weight.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        biases = [layer.bias for layer in layers]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.layers = list(layers)
        self._made_from = [(layer.weight, layer.bias) for layer in layers]   # kept alive: their ids stay theirs
        self._stamps = [self._stamp_of(w, b) for w, b in self._made_from]
        self.product = fused.Product([layer.out_features for layer in layers], self._mm, self.fresh) \
            if len(layers) > 1 else None

    @staticmethod
    def _stamp_of(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        return (weight.data_ptr(), weight._version,
                None if bias is None else (bias.data_ptr(), bias._version))

    def fresh(self) -> bool:
        """Its layers' weights (and biases) are still the tensors this copy was made from, unchanged
        (the same objects, storage and version counter). Runs on every product: kept cheap."""
        for layer, (weight, bias), stamp in zip(self.layers, self._made_from, self._stamps):
            if layer.weight is not weight or layer.bias is not bias or self._stamp_of(weight, bias) != stamp:
                return False
        return True

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def let_go(self, index: int) -> None:
        """Replace layer `index`'s plain weight by a meta tensor of its shape: this copy holds it now."""
        layer = self.layers[index]
        w = layer.weight
        layer.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"),
                                          requires_grad=w.requires_grad)
        self._made_from[index] = (layer.weight, layer.bias)
        self._stamps[index] = self._stamp_of(layer.weight, layer.bias)

    def plain(self, index: int, dense: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `index`'s weight in the plain layout, read back from this copy (exactly: a reorder);
        `dense`: the whole copy read back already."""
        dense = self.weight.to_dense() if dense is None else dense
        start = sum(layer.out_features for layer in self.layers[:index])
        return dense[start:start + self.layers[index].out_features].clone()

    def __deepcopy__(self, memo):
        # A deep copy of a packed model has weights of its own, which this was not made from (and
        # oneDNN's opaque tensors cannot be copied): the copy runs on its plain weights until packed.
        return None


def _packed_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed = layer.__dict__.get("_mcsd_packed")
    if packed is not None and (getattr(_local, "packed", False) or layer.weight.is_meta) \
            and x.dtype == packed.weight.dtype:
        if packed.product is not None:                     # freshness checked once per joined product
            out = packed.product.part(x, layer.__dict__["_mcsd_sibling"])
            if out is not None:
                return out
        elif packed.fresh():
            return packed._mm(x)
    if layer.weight.is_meta:
        raise RuntimeError("this linear layer's plain weight was let go for its prepacked copy, which no longer "
                           "serves it (a copied model, or another dtype): call mcsd.forward.kernels.unpack on the "
                           "original model first")
    return F.linear(x, layer.weight, layer.bias)


def _shared(module: torch.nn.Module) -> set[int]:
    """Storages that more than one parameter of `module` points into (a tied LM head and embedding)."""
    seen: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        if not p.is_meta:
            key = p.untyped_storage().data_ptr()
            seen[key] = seen.get(key, 0) + 1
    return {key for key, n in seen.items() if n > 1}


def pack(module: torch.nn.Module, join: bool = True, release: bool = False, drop_pages: bool = False) -> int:
    """Give every packable linear layer of `module` a prepacked copy of its weight, used only
    inside a block that runs on the packed path; with `join`, sibling layers that read one input
    share one copy and one product (`mcsd.forward.fused`). Repacks a layer whose weight changed;
    returns the number of layers packed now.

    With `release`, the plain weights are let go as each copy is made, and the pages of a
    file they were read from in place with them (`mcsd.forward.mapped`), so memory never holds two
    copies of more than one group; every product then runs on the copy. Weights that are shared
    with another parameter stay. A layer let go before is left as it is. With `drop_pages` (and
    without `release`) the plain weights stay, but their pages read from a file in place are given
    back as each copy is made: for a while when only the copies run (a measurement of the packed
    path), after which a read of the plain weights maps the file's pages again."""
    shared = _shared(module) if release or drop_pages else set()
    files = mapped.file_ranges() if release or drop_pages else []

    def eligible(layer) -> bool:
        return _on_table_paths(layer) and (layer.weight.is_meta and "_mcsd_packed" in layer.__dict__
                                           or packable(layer.weight.dtype, layer.weight.device))
    groups = [g for g in fused.sibling_groups(module) if all(map(eligible, g))] if join else []
    joined = {id(layer) for group in groups for layer in group}
    groups += [[layer] for layer in module.modules() if eligible(layer) and id(layer) not in joined]
    done = 0
    for group in groups:
        current = [layer.__dict__.get("_mcsd_packed") for layer in group]
        if current[0] is not None and all(c is current[0] for c in current) \
                and current[0].layers == group and current[0].fresh():
            packed = current[0]
        elif any(layer.weight.is_meta for layer in group):
            continue                                            # let go, and its copy serves it no longer
        else:
            with torch.no_grad():
                packed = _Packed(group)
            for i, layer in enumerate(group):
                layer.__dict__["_mcsd_packed"] = packed
                layer.__dict__["_mcsd_sibling"] = i
                layer.__dict__["forward"] = types.MethodType(_packed_forward, layer)
            done += len(group)
        if release or drop_pages:
            plain = [i for i, layer in enumerate(group)
                     if not layer.weight.is_meta and layer.weight.untyped_storage().data_ptr() not in shared]
            gone = [group[i].weight for i in plain]
            if release:
                for i in plain:
                    packed.let_go(i)
            mapped.give_back(gone, files)                       # before the next group's pages are read
    return done


def unpack(module: torch.nn.Module) -> None:
    """Drop the prepacked copies `pack` made (the layers are plain `nn.Linear`s again, their plain
    weights read back from the copies where `pack` let them go)."""
    read_back: dict[int, torch.Tensor] = {}                     # one reorder per joined copy
    for layer in module.modules():
        if "_mcsd_packed" in layer.__dict__:
            packed = layer.__dict__["_mcsd_packed"]
            if layer.weight.is_meta and packed is not None:
                if id(packed) not in read_back:
                    read_back = {id(packed): packed.weight.to_dense()}   # siblings follow one another
                rows = packed.plain(layer.__dict__["_mcsd_sibling"], read_back[id(packed)])
                layer.weight = torch.nn.Parameter(rows, requires_grad=layer.weight.requires_grad)
            del layer.__dict__["_mcsd_packed"]
            layer.__dict__.pop("_mcsd_sibling", None)
            layer.__dict__.pop("forward", None)


def _on_table_paths(layer: torch.nn.Module) -> bool:
    """A linear layer whose products a kernel table's paths run: plain or prepacked, not another
    path's forward (`mcsd.forward.quant`'s codes)."""
    own = layer.__dict__.get("forward")
    return type(layer) is torch.nn.Linear and (own is None or getattr(own, "__func__", None) is _packed_forward)


def governed(module: torch.nn.Module) -> int:
    """How many of `module`'s linear layers run on the paths a kernel table chooses."""
    return sum(map(_on_table_paths, module.modules()))


def weight_device(layer: torch.nn.Linear) -> torch.device | None:
    """The device a linear layer's weight is on, read through a plain weight let go for its prepacked
    copy (the copy's device); None for another meta weight (one held as codes elsewhere, `mcsd.forward.quant`)."""
    if not layer.weight.is_meta:
        return layer.weight.device
    packed = layer.__dict__.get("_mcsd_packed")
    return packed.weight.device if packed is not None else None


def released(module: torch.nn.Module) -> int:
    """How many of `module`'s linear layers hold their weight only as a prepacked copy."""
    return sum(1 for layer in module.modules()
               if "_mcsd_packed" in layer.__dict__ and layer.weight.is_meta)


def joined(module: torch.nn.Module) -> int:
    """How many of `module`'s linear layers share a prepacked product with their siblings."""
    return sum(1 for layer in module.modules()
               if getattr(layer.__dict__.get("_mcsd_packed"), "product", None) is not None)


def is_packed(module: torch.nn.Module) -> bool:
    """Some linear layer of `module` has a prepacked copy of its current weight."""
    return any(layer.__dict__.get("_mcsd_packed") is not None and layer._mcsd_packed.fresh()
               for layer in module.modules() if isinstance(layer, torch.nn.Linear))


@contextlib.contextmanager
def _packed_weights(enabled: bool):
    before = getattr(_local, "packed", False)
    _local.packed = enabled
    try:
        yield
    finally:
        _local.packed = before


@contextlib.contextmanager
def using(path: str):
    """Run the block on one matmul path: "onednn", "aten" or "packed" (see the module's text)."""
    if path not in PATHS:
        raise ValueError(f"unknown matmul path {path!r}; choose from {', '.join(PATHS)}")
    with onednn(path != "aten"), _packed_weights(path == "packed"):
        yield


@contextlib.contextmanager
def suspend():
    """Leave the flag alone inside the block, on every thread (for callers that run forwards
    on several threads at once)."""
    global _suspensions
    with _lock:
        _suspensions += 1
    try:
        yield
    finally:
        with _lock:
            _suspensions -= 1


class KernelTable:
    """Measured forward latency per block size on each path; picks the fastest path for a size.

    Args:
        onednn_ms: {rows: ms} through oneDNN (the default path).
        aten_ms: {rows: ms} through ATen's kernels; may cover fewer sizes.
        packed_ms: {rows: ms} through oneDNN on prepacked weights (`pack`), or None.
            Between and beyond measured sizes each is interpolated as in
            `interpolate`; past the largest size ATen was timed at,
            ATen is not considered.
    """

    def __init__(self, onednn_ms: dict[int, float], aten_ms: dict[int, float],
                 packed_ms: dict[int, float] | None = None):
        self.onednn_ms, self.aten_ms, self.packed_ms = dict(onednn_ms), dict(aten_ms), dict(packed_ms or {})
        if not (self.onednn_ms or self.packed_ms):
            raise ValueError("a kernel table needs the oneDNN or the prepacked timings")
        self._limit = max(self.aten_ms) if self.aten_ms else 0
        self._top = max([*self.onednn_ms, *self.aten_ms, *self.packed_ms])
        self._memo: dict[int, str] = {}

    def plain_ms(self, rows: int) -> float:
        """A block's time on the faster plain-weight path (oneDNN or, within its sizes, ATen)."""
        times = [interpolate(t, rows) for t in (self.onednn_ms,) if t]
        if self.aten_ms and rows <= self._limit:
            times.append(interpolate(self.aten_ms, rows))
        return min(times)

    def one_layout(self, rows) -> str:
        """"plain" or "packed": the weight layout whose paths run blocks of the sizes in `rows`
        faster in total (the layout there is, where only one was timed)."""
        if not self.packed_ms:
            return "plain"
        if not (self.onednn_ms or self.aten_ms):
            return "packed"
        plain = sum(self.plain_ms(n) for n in rows)
        return "packed" if sum(interpolate(self.packed_ms, n) for n in rows) < plain else "plain"

    @property
    def packed_only(self) -> bool:
        """Every block size runs on the prepacked weights: the plain ones can be let go (`pack`)."""
        return all(self.path(n) == "packed" for n in range(1, self._top + 2))

    def path(self, rows: int) -> str:
        """The fastest path for a block of `rows` ("onednn", "aten" or "packed")."""
        hit = self._memo.get(rows)
        if hit is None:
            options = [("onednn", self.onednn_ms)] if self.onednn_ms else []
            if self.packed_ms:
                options.append(("packed", self.packed_ms))
            if rows <= self._limit:
                options.append(("aten", self.aten_ms))
            hit = min(options, key=lambda o: interpolate(o[1], rows))[0]    # ties: the earlier
            self._memo[rows] = hit
        return hit

    def use_onednn(self, rows: int) -> bool:
        """oneDNN runs the block's products (on plain or prepacked weights)."""
        return self.path(rows) != "aten"

    @property
    def uses_packed(self) -> bool:
        """Some measured block size runs on prepacked weights (they must be made: `pack`)."""
        return any(self.path(n) == "packed" for n in range(1, self._top + 1))

    def describe(self) -> str:
        names = {"aten": "ATen kernels", "packed": "prepacked oneDNN weights", "onednn": "oneDNN"}
        runs: list[list] = []                                  # [path, first rows, last rows]
        for n in range(1, self._top + 2):                      # _top + 1 stands for every larger block
            p = self.path(n)
            if runs and runs[-1][0] == p:
                runs[-1][2] = n
            else:
                runs.append([p, n, n])
        if len(runs) == 1:
            return f"{names[runs[0][0]]} for every block"

        def rows(a: int, b: int) -> str:
            return "1 row" if a == b == 1 else f"{a} rows" if a == b else f"{a}-{b} rows"
        return ", ".join(f"{names[p]} for {rows(a, b)}" for p, a, b in runs[:-1]) + f", {names[runs[-1][0]]} above"

    @contextlib.contextmanager
    def running(self, rows: int):
        """Run a forward of `rows` block rows on its fastest path."""
        if _suspensions:
            yield
            return
        with using(self.path(rows)):
            yield


@contextlib.contextmanager
def running(table: KernelTable | None, rows: int):
    """`table.running(rows)`, or nothing when there is no table."""
    if table is None:
        yield
    else:
        with table.running(rows):
            yield
