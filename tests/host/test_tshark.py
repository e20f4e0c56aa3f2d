"""Wireshark's dissector is the independent judge: every frame we build must decode as
valid RoCEv2 with the opcode, QPN, PSN and ICRC we meant. Not skipped when tshark is
missing: ``./fpgaccl test`` installs it, and a silent skip would hide a broken claim."""

from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from fpgaccl import proto
from fpgaccl.host.demo import demo_frames, run_demo
from fpgaccl.host.tshark import decode
from fpgaccl.proto import Opcode


def test_tshark_decodes_every_frame_as_rocev2(tmp_path):
    frames = demo_frames(bytes(range(200)) * 20, qpn=0xABC, psn=(1 << 24) - 2)
    pcap = tmp_path / "write.pcap"
    wrpcap(str(pcap), [Ether(f) for f in frames])
    rows = decode(pcap)
    assert len(rows) == len(frames)
    for frame, row in zip(frames, rows, strict=True):
        ours = proto.parse_frame(frame)
        assert row.is_rocev2, row.protocols
        assert not row.malformed and row.expert == "", row
        assert (row.opcode, row.dqpn, row.psn) == (
            ours.bth["opcode"], ours.bth["dqpn"], ours.bth["psn"])
        # tshark shows the ICRC as the 32-bit word on the wire, read big-endian.
        assert row.icrc == int.from_bytes(frame[-4:], "big")
    assert [r.opcode for r in rows[:4]] == [Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE,
                                           Opcode.RDMA_WRITE_MIDDLE,
                                           Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE]
    assert rows[0].rkey == 0x1234
    assert rows[3].immdt == proto.COLLECTIVE_IMM.to_int(coll_id=1, step=0)
    assert [r.psn for r in rows[:4]] == [(1 << 24) - 2, (1 << 24) - 1, 0, 1]


def test_tshark_flags_a_frame_cut_short(tmp_path):
    """The check has teeth: a truncated frame is reported malformed."""
    frame = demo_frames(bytes(64))[0]
    pcap = tmp_path / "cut.pcap"
    wrpcap(str(pcap), [Ether(frame[:50])])
    (row,) = decode(pcap)
    assert row.malformed or row.expert or not row.is_rocev2


def test_demo_command_succeeds(tmp_path, capsys):
    assert run_demo(tmp_path / "demo.pcap") == 0
    assert "all frames valid RoCEv2" in capsys.readouterr().out
