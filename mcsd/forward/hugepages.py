"""The models' weights and the target's cache on transparent huge pages, where Linux lends them.

Every decoding step streams the whole target through the CPU (88 MiB of q4 codes and scales for
SmolLM2-135M, an L3 of 32 MB): on 4 KiB pages that is some 22,000 pages a step, more than a core's TLB
holds, and where they lie in physical memory differs from one allocation to the next. Measured on a
2-core AMD EPYC (docs/results.md): four decoders running the same plain loop on one target in one
process spread 10-12% in time on 4 KiB pages, 1-2.5% once the process's large regions sat on 2 MiB
pages; a plain loop's blocks ran 0.85-0.98x their time once its pages were gathered.

Where the kernel's transparent huge pages are on `madvise` (the common default), memory is huge only
where asked: `advise` asks for every 2 MiB page the tensors' memory touches within the anonymous area
it lies in (`spans`: the heap's neighbours in those pages come along; memory a file backs, a checkpoint
read in place or edited there, is never asked for) (`MADV_HUGEPAGE`), and has the pages already
written gathered into huge ones now (`MADV_COLLAPSE`, Linux 6.1 and later; before, the kernel's own
scanner gathers them over time). Nothing changes in the values; a kernel that refuses either (THP
off, an older kernel, another OS) leaves the memory as it was. `MCSD_HUGEPAGES=0` turns it off.
"""

from __future__ import annotations

import bisect
import os
import sys

import torch

from . import mapped

HUGE = 2 << 20                      # a transparent huge page on x86-64 and most arm64 kernels
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25


def enabled() -> bool:
    """Asked for on Linux unless `MCSD_HUGEPAGES` is 0 (or off / false / no)."""
    return sys.platform.startswith("linux") and \
        os.environ.get("MCSD_HUGEPAGES", "1").strip().lower() not in ("0", "off", "false", "no")


def anonymous_areas(maps: str | None = None) -> list[tuple[int, int]]:
    """The process's private writable memory not backed by a file ([heap] and unnamed mappings), as
    sorted [start, end) address ranges, neighbours joined; from `maps` (/proc/self/maps' text) or the
    process's own (empty where it cannot be read)."""
    areas: list[tuple[int, int]] = []
    for lo, hi, perms, _, path in mapped.mappings(maps):
        if not perms.startswith("rw") or perms[3:4] != "p" or path not in ("", "[heap]"):
            continue
        if areas and areas[-1][1] == lo:                 # one area the kernel keeps in parts
            areas[-1] = (areas[-1][0], hi)
        else:
            areas.append((lo, hi))
    return areas


def spans(tensors, areas: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The huge pages the memory of the CPU tensors given touches, each within the anonymous area
    (`anonymous_areas`) it lies in (memory a file backs, as a checkpoint read in place, cannot be made
    huge and is left out), as merged 2 MiB-aligned [start, end) ranges. Small tensors count: a model's
    layers are many allocations of a few hundred KiB lying side by side on the heap."""
    starts = [lo for lo, _ in areas]
    out, seen = [], set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta or t.layout != torch.strided \
                or t.is_mkldnn:
            continue                                # oneDNN's prepacked copies hold no storage one can read
        storage = t.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if not start or not size or start in seen:
            continue
        seen.add(start)
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or areas[i][1] < start + size:
            continue
        area_lo, area_hi = areas[i]
        lo = max(start // HUGE * HUGE, -(-area_lo // HUGE) * HUGE)
        hi = min(-(-(start + size) // HUGE) * HUGE, area_hi // HUGE * HUGE)
        if hi > lo:
            out.append((lo, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(out):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def advise(tensors) -> int:
    """Ask for huge pages under the CPU tensors given (see the module); returns the bytes the kernel
    accepted the request for (0 where it was not asked or refused)."""
    if not enabled():
        return 0
    try:
        madvise = mapped._c_library().madvise
    except OSError:                                   # no C library to ask
        return 0
    accepted = 0
    for lo, hi in spans(tensors, anonymous_areas()):
        if madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0:
            accepted += hi - lo
            madvise(lo, hi - lo, _MADV_COLLAPSE)      # best effort: refused before Linux 6.1, or short of memory
    return accepted


def module_tensors(module: torch.nn.Module):
    """The tensors `module` computes with: its parameters and buffers, and those its layers hold beside
    them (q4 / Q8_0 codes and scales, prepacked copies: tensors in a submodule's attributes, or in the
    attributes of an object held there)."""
    yield from module.parameters()
    yield from module.buffers()
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif not isinstance(value, (torch.nn.Module, dict, list, tuple, str, int, float, bool, type(None))) \
                    and hasattr(value, "__dict__"):
                yield from (v for v in vars(value).values() if isinstance(v, torch.Tensor))
