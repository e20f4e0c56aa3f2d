"""The network node's share of the board backend that needs no node: how its memory is
laid out into segments, and how a peer's MAC is found (tests/e2e/test_board_network.py
runs the whole backend against simulated nodes through the kernel)."""

import pytest

from fpgaccl.errors import UnsupportedError
from fpgaccl.host.backends.network import PAD_BYTES, region_layout
from fpgaccl.host.neighbors import local_macs, parse_mac, resolve_mac


@pytest.mark.parametrize(("mem_log2", "asked", "span", "stage"), [
    (16, 64 << 10, 16 << 10, 12 << 10),     # the simulated node: 64 KiB
    (18, 64 << 10, 64 << 10, 60 << 10),     # 256 KiB (ECP5-85F block RAM)
    (18, 16 << 10, 64 << 10, 16 << 10),     # a smaller segment asked for is kept
    (24, 64 << 10, 4 << 20, 64 << 10),
])
def test_segments_follow_the_nodes_memory(mem_log2, asked, span, stage):
    assert region_layout(mem_log2, asked) == (span, stage)
    assert 4 * span <= 1 << mem_log2 and stage + PAD_BYTES <= span


def test_a_node_too_small_for_a_segment_is_refused():
    with pytest.raises(UnsupportedError, match="stage_bytes"):
        region_layout(14, 64 << 10)    # 4 KiB per buffer leaves no room for padding


def test_local_addresses_are_their_interfaces_mac():
    macs = local_macs()
    assert macs["127.0.0.1"] == 0          # the loopback interface's MAC
    assert resolve_mac("127.0.0.1") == 0
    assert parse_mac("02:fc:cc:00:00:02") == 0x02FCCC000002
