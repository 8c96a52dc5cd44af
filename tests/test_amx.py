"""The products on 8-bit activations on AMX tiles (q4_kernel.c, int8_isa "amx"): bit for bit the
VNNI and AVX2 paths' results, through the public entry points, wherever this CPU has AMX-INT8 and Linux
grants the tile state; skipped with the reason elsewhere."""

from __future__ import annotations

import pytest
import torch
from conftest import require_native

from mcsd.forward import native, quant


@pytest.fixture(scope="module", autouse=True)
def native_kernel(tmp_path_factory):
    yield from require_native(tmp_path_factory)


@pytest.fixture
def amx():
    """The tile path, where it runs here; the default instruction set again after the test."""
    why = native.int8_isa_absent("amx")
    if why is not None:
        pytest.skip(f"the products on AMX tiles do not run here: {why}")
    yield
    native.int8_isa(native.int8_isas_here()[0])


def _on(isa: str, layer, x: torch.Tensor) -> torch.Tensor:
    native.int8_isa(isa)
    return layer(x)


def _weights(n: int, k: int, gen: torch.Generator):
    """Random Q4_1 and Q8_0 codes of n x k weights and their float16 scales and offsets."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)     # -128 too: a foreign file's code
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.08).half()
    return q, q8, d, m


def test_the_tile_path_is_chosen_first_where_it_runs(amx):
    assert native.int8_isas_here()[0] == "amx" and native.int8_isa() == "amx"
    assert "avx512vnni" in native.int8_isas_here()           # its few-row products, and the reference


def test_tiles_give_the_vnni_paths_bits_on_every_block_count_and_odd_shapes(amx):
    """K = 32 g for every block count g of 1..64 (odd ones: a lone last block where two blocks share a
    tile product), outputs and rows of odd sizes (a last group of 8 outputs cut short, a lone last
    group, the last 16 rows short, fewer rows than the tiles take):
    Q4_1 and Q8_0 on tiles equal AVX512-VNNI and AVX2 bit for bit."""
    gen = torch.Generator().manual_seed(74)
    outputs = (1, 7, 9, 13, 24, 33, 67)
    rows = (1, 3, 5, 6, 8, 9, 16, 17, 21, 33)
    for g in range(1, 65):
        k, n = 32 * g, outputs[g % len(outputs)]
        q, q8, d, m = _weights(n, k, gen)
        for layer in (quant.Q4Linear(q, d, m, act8=True), quant.Q8Linear(q8, d, act8=True)):
            for r in (rows[g % len(rows)], rows[(g + 3) % len(rows)]):
                x = torch.randn(r, k, generator=gen) * torch.logspace(-2, 2, r)[:, None]
                on_tiles = _on("amx", layer, x)
                assert torch.equal(on_tiles, _on("avx512vnni", layer, x)), (type(layer).__name__, g, n, r)
                assert torch.equal(on_tiles, _on("avx2", layer, x)), (type(layer).__name__, g, n, r)


def test_a_rows_result_on_tiles_does_not_depend_on_the_rows_beside_it(amx):
    """Rows 1-5 run on AVX512-VNNI, 6-8 on tiles two blocks a tile product, 9-16 one block, more 16
    rows at a time (the last 1-8 paired again): each row's result is the same alone and in every
    block (LM head shape: the Q8_0 product of many outputs)."""
    gen = torch.Generator().manual_seed(7)
    q, q8, d, m = _weights(203, 576, gen)
    native.int8_isa("amx")
    for layer in (quant.Q4Linear(q, d, m, act8=True), quant.Q8Linear(q8, d, act8=True)):
        x = torch.randn(40, 576, generator=gen)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(40)])
        for r in (2, 5, 6, 9, 16, 17, 22, 32, 40):
            assert torch.equal(layer(x[:r]), alone[:r])
        assert torch.equal(layer(x[5:26]), alone[5:26])


def test_the_comparison_sees_one_changed_scale(amx):
    """The check above can fail: one block's scale (Q4_1: or offset) changed in the weights the tiles
    read, and the outputs it feeds no longer equal the VNNI path's on the original weights."""
    gen = torch.Generator().manual_seed(3)
    q, q8, d, m = _weights(40, 320, gen)
    x = torch.randn(16, 320, generator=gen)
    d2, m2 = d.clone(), m.clone()
    d2[21, 4] = d2[21, 4] * 1.5
    m2[30, 7] = m2[30, 7] * 1.5
    for before, after, changed in (
            (quant.Q4Linear(q, d, m, act8=True), quant.Q4Linear(q, d2, m, act8=True), [21]),
            (quant.Q4Linear(q, d, m, act8=True), quant.Q4Linear(q, d, m2, act8=True), [30]),
            (quant.Q8Linear(q8, d, act8=True), quant.Q8Linear(q8, d2, act8=True), [21])):
        reference, on_tiles = _on("avx512vnni", before, x), _on("amx", after, x)
        assert not torch.equal(on_tiles, reference)
        differs = (on_tiles != reference).any(0).nonzero().flatten().tolist()
        assert differs == changed
