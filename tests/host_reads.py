"""Host reads counted where torch makes them: at the dispatcher, on the CPU, as CUDA would sync on them.

A tensor's value reaches the host (on CUDA: the host waits for the device) through an operator,
not only through the Python methods that call it: `int(t)`, `t.item()`, a 0-dim tensor used as a
Python index or slice bound, `torch.equal`, `bool(t)` all end in `_local_scalar_dense`; a boolean
mask index, `nonzero`, `masked_select`, `unique` and their kin read a count to size their output;
a tensor made from Python data (`torch.tensor`, a list used as an index) is an upload, which CUDA
makes synchronously from pageable memory. `counting_host_reads` sees every such operator through a
`TorchDispatchMode`, so a read made inside a helper, a library or a transformers module is seen too.

What the dispatcher does not see on the CPU, because there it is no operator at all (a copy to the
device the tensor is already on): `tolist`, `cpu` and `numpy` (and with it `__array__`); those are
counted at the Python method. `.to(device)` is not: on the CPU a run cannot tell a copy to the host
from the round's own `.to(self.device)`. A device-to-host or host-to-device copy between devices is
counted at the dispatcher (`_to_copy` or `copy_` across devices) where one runs.

Run it inside `cuda_operators`: on the CPU mcsd draws and filters through one native call
(`mcsd.forward.native`) and tries partial sorts for top-p, where CUDA runs torch's operators; the
counter would not see what those read, or would see reads CUDA never makes.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# operators that read a tensor's value on the host (their result's size or a Python scalar depends on it)
READING_OPS = {
    aten._local_scalar_dense.default: "item", aten.item.default: "item",     # the latter under inference_mode
    aten.equal.default: "equal",
    aten.is_nonzero.default: "item",
    aten.nonzero.default: "nonzero", aten.nonzero.out: "nonzero", aten.argwhere.default: "nonzero",
    aten.where.default: "nonzero", aten.nonzero_numpy.default: "nonzero",     # where(c): under inference_mode
    aten.masked_select.default: "masked_select",
    aten.masked_scatter.default: "masked_scatter", aten.masked_scatter_.default: "masked_scatter",
    aten.unique_consecutive.default: "unique", aten._unique2.default: "unique", aten.unique_dim.default: "unique",
    aten._unique.default: "unique",
    aten.bincount.default: "bincount",
    aten.repeat_interleave.Tensor: "repeat_interleave", aten.repeat_interleave.self_Tensor: "repeat_interleave",
    aten.allclose.default: "allclose",
    aten.lift_fresh.default: "upload", aten.lift_fresh_copy.default: "upload",
}
INDEXING_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
COPY_OPS = {aten._to_copy.default, aten.copy_.default}
PYTHON_READS = ("tolist", "cpu", "numpy")


def _devices(func, args, kwargs) -> tuple[torch.device | None, torch.device | None]:
    """(source, destination) devices of a copy operator."""
    if func is aten.copy_.default:
        return args[1].device, args[0].device
    return args[0].device, kwargs.get("device") or args[0].device


class _Counter(TorchDispatchMode):
    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = READING_OPS.get(func)
        if name is not None and not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
            self.seen.append(name)
        elif func in INDEXING_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self.seen.append("boolean index")
        elif func in COPY_OPS:
            source, destination = _devices(func, args, kwargs)
            if source is not None and destination is not None and torch.device(source) != torch.device(destination):
                self.seen.append(f"copy {source}->{destination}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_host_reads():
    """Inside the block (this thread), every host read is listed by name in the list it yields."""
    seen: list[str] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in PYTHON_READS}

    def counted(name):
        method = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            seen.append(name)
            return method(self, *args, **kwargs)
        return read

    for name in PYTHON_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _Counter(seen):
            yield seen
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


@contextlib.contextmanager
def cuda_operators():
    """Inside the block the CPU runs the torch operators CUDA runs: mcsd's native library off
    (`MCSD_NATIVE=0`, read when the library is first asked for; looked up again after) and top-p by
    one full sort (`mcsd.core.sampling.PARTIAL_SORTS`: the CPU's partial sorts check on the host
    whether they hold enough mass, a read CUDA never makes)."""
    import os

    from mcsd.core import sampling
    from mcsd.forward import native
    before, sorts = os.environ.get("MCSD_NATIVE"), sampling.PARTIAL_SORTS
    os.environ["MCSD_NATIVE"] = "0"
    native.reset()
    sampling.PARTIAL_SORTS = ()
    try:
        yield
    finally:
        sampling.PARTIAL_SORTS = sorts
        if before is None:
            del os.environ["MCSD_NATIVE"]
        else:
            os.environ["MCSD_NATIVE"] = before
        native.reset()


def reads_per_round(decoder, prompt, **options) -> tuple[list[str], list[list[str]], list[int]]:
    """One generation's host reads: those of its set-up and prefill (the stream's first step), those of
    each round after it, and its tokens."""
    rounds, tokens = [], []
    stream = decoder.stream(prompt, **options)
    with counting_host_reads() as setup:
        tokens += next(stream)
    while True:
        with counting_host_reads() as seen:
            try:
                new = next(stream)
            except StopIteration:
                break
        rounds.append(list(seen))
        tokens += new
    return list(setup), rounds, tokens
