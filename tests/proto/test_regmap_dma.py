"""The DMA blocks of the register map: present, non-overlapping at the largest builds,
and the page-table entry packs a bus address the way the translator reads it."""

import pytest

from fpgaccl.proto.regmap import DMA_MAX_OUTSTANDING, GPU_PAGE_BITS, Access, default_map


@pytest.mark.parametrize("kw", [{}, {"qps": 64, "regions": 64, "dma_host_windows": 16,
                                      "gpu_pages": 2048, "imem_words": 2048}])
def test_dma_blocks_fit(kw):
    rmap = default_map(**kw)       # RegisterMap refuses overlapping blocks
    assert rmap["dma_gpt"].memory
    assert len(rmap["dma_gpt"].registers) == kw.get("gpu_pages", 256)
    assert rmap["dma_host"].count == kw.get("dma_host_windows", 4)


def test_dma_registers():
    rmap = default_map()
    dma = rmap["dma"]
    assert dma["sq_tail"].access is Access.WO          # the doorbell
    assert {r.name for r in dma.registers if r.access is Access.RC} == {
        "completed", "unmapped", "forbidden", "bus_errors"}
    ctl = dma["control"].decode(dma["control"].reset or dma["control"].encode())
    assert ctl["max_rd"] == ctl["max_wr"] == DMA_MAX_OUTSTANDING
    pte = rmap["dma_gpt"]["pte5"]
    bus = 0x1F_FFFF_0000
    word = pte.encode(valid=1, read=1, write=0, page=bus >> GPU_PAGE_BITS)
    assert pte.decode(word) == {"valid": 1, "read": 1, "write": 0, "page": bus >> 16}
    assert rmap.address("dma_gpt.pte5") == rmap["dma_gpt"].base + 20
