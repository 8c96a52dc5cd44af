"""Weights read in place from a memory-mapped file, and the pages they occupy given back.

transformers maps a safetensors file and, where the file's dtype is the one asked for, hands
out tensors that point into the mapping: nothing is read until a weight is used. Every page
read stays resident (and counts in the process's memory) for as long as the file is mapped,
and the file stays mapped while any of its tensors is alive (a tied embedding, a norm).
Prepacking (`mcsd.forward.kernels.pack`) reads every plain weight to make its copy, so letting
the plain tensor go frees nothing: a 670M-parameter Llama in bfloat16 then held its weights
twice, the copies and the file's pages read to make them (3.1 GB of max RSS for 1.35 GB of
weights on an AVX512-BF16 EPYC). `give_back` drops the pages of a weight let go, so memory
holds the copies made so far and one group's plain pages at a time.

A page given back is not lost: the next read of it maps the file's page again. Only pages
that lie wholly inside the tensor's bytes are given back (a page it shares with a neighbour
stays), only where those bytes lie in a file mapping (memory torch allocated is freed with its
tensor), and only pages still the file's own: a private mapping's page written in place (a
user's `mul_`, `load_state_dict` into the loaded model, a LoRA merged in place) is the process's
private copy, which `MADV_DONTNEED` would throw away, reverting the weight to the checkpoint.
/proc/self/pagemap says which pages those are (present and not file-backed, or swapped out);
they stay. Where pagemap cannot be read, nothing is given back.

Linux only (it reads /proc/self/maps and /proc/self/pagemap and calls madvise through libc);
elsewhere nothing is given back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import numpy as np
import torch

_MADV_DONTNEED = 4                          # Linux: drop the pages; the next read maps the file's again
_PRESENT, _SWAPPED, _FILE = 1 << 63, 1 << 62, 1 << 61      # /proc/<pid>/pagemap flags of a page
_libc = None


def _c_library() -> ctypes.CDLL:
    """The C library (loaded once; Linux only)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc


def mappings(maps: str | None = None) -> list[tuple[int, int, str, str, str]]:
    """(start, end, perms, inode, path) of every mapping in `maps` (/proc/self/maps' text) or this
    process's own (empty where /proc is not there); path "" for an anonymous one."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return []
    out = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)            # address perms offset device inode [path]
        if len(fields) >= 5:
            start, end = fields[0].split("-")
            out.append((int(start, 16), int(end, 16), fields[1], fields[4],
                        fields[5].strip() if len(fields) == 6 else ""))
    return out


def file_ranges() -> list[tuple[int, int]]:
    """(start, end) of every file-backed mapping of this process (empty where /proc is not there)."""
    return [(lo, hi) for lo, hi, _, inode, path in mappings() if inode != "0" and path.startswith("/")]


def mapped_bytes(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> tuple[int, int] | None:
    """(start, end) addresses of a contiguous CPU tensor's bytes where they lie in one of the file
    mappings `ranges` (`file_ranges`), else None."""
    if tensor.device.type != "cpu" or tensor.is_meta or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for lo, hi in ranges:
        if lo <= start and end <= hi:
            return start, end
    return None


def written_pages(first: int, count: int) -> np.ndarray | None:
    """Which of `count` pages from address `first` (page-aligned) hold the process's own bytes rather
    than the file's: present but not file-backed (a private mapping's page copied on write), or
    swapped out (only anonymous pages swap). None where /proc/self/pagemap cannot be read.

    Returns:
        (count,) bool.
    """
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first // mmap.PAGESIZE * 8)
            raw = pagemap.read(8 * count)
    except OSError:
        return None
    if len(raw) != 8 * count:
        return None
    flags = np.frombuffer(raw, dtype=np.uint64)
    present = (flags & np.uint64(_PRESENT)) != 0
    own = present & ((flags & np.uint64(_FILE)) == 0)
    return own | ((flags & np.uint64(_SWAPPED)) != 0)


def _clean_runs(first: int, last: int) -> list[tuple[int, int]]:
    """The (start, end) address runs of whole pages in [first, last) that are still the file's own
    (`written_pages`), empty where that cannot be told."""
    page = mmap.PAGESIZE
    written = written_pages(first, (last - first) // page)
    if written is None:
        return []
    # the runs of clean pages: boundaries where `written` changes, with sentinels on both ends
    edges = np.flatnonzero(np.diff(np.concatenate(([True], written, [True])).astype(np.int8)))
    return [(first + int(a) * page, first + int(b) * page) for a, b in zip(edges[::2], edges[1::2])]


def give_back(tensors: list[torch.Tensor], ranges: list[tuple[int, int]] | None = None) -> int:
    """Drop the resident pages wholly inside each tensor's bytes, where they lie in a file mapping and
    nothing has written them (a written page of a private mapping is kept: see the module's note).

    Args:
        tensors: weights (reads map the file's pages again).
        ranges: the file mappings (`file_ranges`), read now if not given.
    Returns:
        the bytes given back (0 off Linux, where none lies in a file mapping, or where
        /proc/self/pagemap cannot be read).
    """
    if not sys.platform.startswith("linux") or not tensors:
        return 0
    ranges = file_ranges() if ranges is None else ranges
    spans = [s for s in (mapped_bytes(t, ranges) for t in tensors) if s is not None]
    if not spans:
        return 0
    page, given = mmap.PAGESIZE, 0
    for start, end in spans:
        first, last = -(-start // page) * page, end // page * page    # whole pages inside the bytes
        if last <= first:
            continue
        for lo, hi in _clean_runs(first, last):
            if _c_library().madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
                given += hi - lo
    return given


def trim() -> bool:
    """Hand memory the C allocator keeps after large frees back to the system (glibc's `malloc_trim`),
    so that copies dropped (a measurement's prepacked copies) are not still counted when the next ones
    are made. False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(_c_library().malloc_trim(0))
    except AttributeError:                   # another C library
        return False
