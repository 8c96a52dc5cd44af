"""Which CPU matrix-product path runs a forward of a given size faster: oneDNN or ATen's own.

On a CPU with native bfloat16 (AVX512-BF16, AMX) torch routes reduced-precision
matrix products through oneDNN. That path wins for many rows but carries a
fixed cost that dominates a forward of one or two rows: for SmolLM2-135M in
bfloat16 on a 2-core AVX512-BF16 EPYC, a 1-token step took 43 ms through
oneDNN and 25 ms through ATen's kernels, a 16-token verify 50 ms against
136 ms. Decoding is mostly forwards of a few rows, so the calibration
(`mcsd.profile.measure`) times both paths per block size and the engine runs
each forward on the faster one.

The switch is torch's process-wide `torch.backends.mkldnn.enabled` flag, set
around one forward and restored after. It is only ever switched for bfloat16
and float16 models on a CPU where oneDNN would handle them (float32 products
go through the same BLAS either way, and its rounding stays independent of
calibration). Concurrent decoding threads (PEARL) `suspend` switching, since
the flag is shared.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_suspensions = 0                  # > 0 while some caller runs forwards on several threads
_lock = threading.Lock()


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
    """Measured forward latency per block size on each path; picks the faster path for a size.

    Args:
        onednn_ms: {rows: ms} through oneDNN (the default path).
        aten_ms: {rows: ms} through ATen's kernels; may cover fewer sizes.
            Between and beyond measured sizes both are interpolated as in
            `mcsd.profile.interpolate`; past the largest size ATen was timed at,
            oneDNN is used.
    """

    def __init__(self, onednn_ms: dict[int, float], aten_ms: dict[int, float]):
        self.onednn_ms, self.aten_ms = dict(onednn_ms), dict(aten_ms)
        self._limit = max(self.aten_ms) if self.aten_ms else 0
        self._memo: dict[int, bool] = {}

    def use_onednn(self, rows: int) -> bool:
        hit = self._memo.get(rows)
        if hit is None:
            from .profile import interpolate
            hit = rows > self._limit or interpolate(self.onednn_ms, rows) <= interpolate(self.aten_ms, rows)
            self._memo[rows] = hit
        return hit

    def aten_sizes(self) -> list[int]:
        """Block sizes (up to the largest timed) that run through ATen."""
        return [n for n in range(1, self._limit + 1) if not self.use_onednn(n)]

    def describe(self) -> str:
        sizes = self.aten_sizes()
        if not sizes:
            return "oneDNN for every block"
        runs, start = [], sizes[0]
        for a, b in zip(sizes, sizes[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        return f"ATen kernels for {', '.join(runs)} rows, oneDNN above"

    @contextlib.contextmanager
    def running(self, rows: int):
        """Run a forward of `rows` block rows on its faster path."""
        if _suspensions:
            yield
            return
        with onednn(self.use_onednn(rows)):
            yield


@contextlib.contextmanager
def running(table: KernelTable | None, rows: int):
    """`table.running(rows)`, or nothing when there is no table."""
    if table is None:
        yield
    else:
        with table.running(rows):
            yield
