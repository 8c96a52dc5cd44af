"""The models' weights and the target's cache on transparent huge pages: which memory is asked for,
and that asking changes no value (whether the kernel grants it is the machine's)."""

import torch

from mcsd.forward import hugepages
from mcsd.forward.static_cache import StaticCache

MB = 1 << 20
MAPS = """\
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0 
7f0000a00000-7f0001000000 rw-p 00000000 00:00 0 
7f0001000000-7f0001400000 r--p 00000000 fd:01 42                         /models/model.safetensors
7f0001400000-7f0001800000 rw-s 00000000 00:01 7                          /dev/shm/shared
7f0001800000-7f0002000000 rw-p 00000000 00:00 0                          [heap]
7f0002000000-7f0002200000 r-xp 00000000 fd:01 43                         /usr/lib/libc.so.6
"""


class Span:
    """A stand-in CPU tensor at a given address (what `spans` reads of one)."""

    def __init__(self, start, size):
        self._start, self._size = start, size
        self.device, self.is_meta, self.layout, self.is_mkldnn = torch.device("cpu"), False, torch.strided, False

    def untyped_storage(self):
        return self

    def data_ptr(self):
        return self._start

    def nbytes(self):
        return self._size


def test_anonymous_areas_are_private_writable_memory_no_file_backs():
    base = 0x7f0000000000
    assert hugepages.anonymous_areas(MAPS) == [(base, base + 16 * MB), (base + 24 * MB, base + 32 * MB)]


def test_spans_cover_the_huge_pages_tensors_touch_within_their_area(monkeypatch):
    base = 0x7f0000000000
    areas = hugepages.anonymous_areas(MAPS)
    monkeypatch.setattr(torch, "Tensor", Span)
    small = [Span(base + 3 * MB + 4096, 300_000), Span(base + 3 * MB + 600_000, 300_000)]   # one huge page
    across = Span(base + 5 * MB - 100, 200)                                 # straddles two pages
    in_file = Span(base + 17 * MB, 2 * MB)                                  # the checkpoint, read in place
    past_end = Span(base + 15 * MB, 2 * MB)                                 # runs off its area: not ours
    heap = Span(base + 24 * MB + 100, 3 * MB)
    got = hugepages.spans(small + [across, in_file, past_end, heap, small[0]], areas)
    assert got == [(base + 2 * MB, base + 6 * MB), (base + 24 * MB, base + 28 * MB)]
    assert all(lo % hugepages.HUGE == 0 and hi % hugepages.HUGE == 0 for lo, hi in got)


def test_advising_changes_no_value_and_can_be_turned_off(monkeypatch):
    t = torch.randn(3 * MB)                                                  # 12 MiB of float32
    before = t.clone()
    packed = [torch.randn(64, 64).to_mkldnn()] if torch.backends.mkldnn.is_available() else []
    assert hugepages.advise([t, torch.randn(4)[:2], *packed]) >= 0          # a packed copy is passed over
    assert torch.equal(t, before)
    monkeypatch.setenv("MCSD_HUGEPAGES", "0")
    assert not hugepages.enabled() and hugepages.advise([t]) == 0


def test_a_grown_cache_keeps_its_entries():
    cache = StaticCache(2, 1, 8, torch.float32, "cpu")
    cache.reserve(4)
    cache.keys[:, :, :, :4] = torch.arange(2 * 4 * 8, dtype=torch.float32).view(2, 1, 1, 4, 8)
    cache.length = 4
    kept = cache.keys[:, :, :, :4].clone()
    cache.reserve(cache.capacity + 5000)                                     # reallocated, large enough to advise
    assert torch.equal(cache.keys[:, :, :, :4], kept)
