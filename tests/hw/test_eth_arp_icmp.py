"""ARP and ICMP echo at the network boundary, on Amaranth's simulator: the header
tables agree with scapy, replies are byte for byte what scapy says a correct reply
is, the ARP table learns, frames for others are counted, RoCE passes untouched."""

import random

import pytest
from amaranth.sim import Simulator
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.compat import raw
from scapy.layers.inet import ICMP, IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether

from fpgaccl.hw.eth.l2 import EthServices
from fpgaccl.proto import headers
from tests.hw.eth_wire import collect_frames, send_frames

OUR_MAC, OUR_IP = "02:aa:00:00:00:01", "10.0.0.1"
A_MAC, A_IP = "02:bb:00:00:00:02", "10.0.0.2"
B_MAC, B_IP = "02:cc:00:00:00:03", "10.0.0.3"


def mac_int(s: str) -> int:
    return int(s.replace(":", ""), 16)


def ip_int(s: str) -> int:
    return int.from_bytes(bytes(int(x) for x in s.split(".")), "big")


def padded(pkt) -> bytes:
    b = raw(pkt)
    return b + bytes(max(0, 60 - len(b)))  # as the MAC delivers it (FCS stripped)


def test_arp_table_matches_scapy_field_for_field():
    assert [f.name for f in headers.ARP] == [f.name for f in ARP.fields_desc]
    assert raw(ARP())[:8] == headers.ARP.pack()[:8]  # defaults: Ethernet/IPv4 who-has


def test_icmp_table_matches_scapy_echo_fields():
    names = [f.name for f in headers.ICMP]
    assert names == [f.name for f in ICMP.fields_desc][:len(names)]


@settings(max_examples=30, deadline=None)
@given(op=st.integers(0, 0xFFFF), hw=st.integers(0, 2**48 - 1), ip=st.integers(0, 2**32 - 1),
       ident=st.integers(0, 0xFFFF), seq=st.integers(0, 0xFFFF), chk=st.integers(0, 0xFFFF))
def test_arp_and_icmp_bytes_equal_scapys(op, hw, ip, ident, seq, chk):
    mac = ":".join(f"{b:02x}" for b in hw.to_bytes(6, "big"))
    dotted = ".".join(str(b) for b in ip.to_bytes(4, "big"))
    assert raw(ARP(op=op, hwsrc=mac, psrc=dotted, hwdst=mac, pdst=dotted)) == \
        headers.ARP.pack(op=op, hwsrc=hw, psrc=ip, hwdst=hw, pdst=ip)
    assert raw(ICMP(type=8, id=ident, seq=seq, chksum=chk)) == \
        headers.ICMP.pack(type=8, id=ident, seq=seq, chksum=chk)


def echo(src_mac, src_ip, dst_ip, payload, ident=7, seq=1, ttl=64, ipid=1):
    return Ether(dst=OUR_MAC, src=src_mac) / IP(src=src_ip, dst=dst_ip, ttl=ttl, id=ipid) \
        / ICMP(type="echo-request", id=ident, seq=seq) / payload


def expected_echo_reply(req, sent: bytes) -> bytes:
    rep = Ether(dst=req[Ether].src, src=OUR_MAC) / IP(
        src=req[IP].dst, dst=req[IP].src, ttl=req[IP].ttl, id=req[IP].id) / ICMP(
        type="echo-reply", id=req[ICMP].id, seq=req[ICMP].seq) / req[ICMP].payload
    return raw(rep) + sent[len(raw(rep)):]  # Ethernet padding comes back as it went


@pytest.mark.parametrize("width", [32, 64])
def test_asking_for_a_peer_sends_a_who_has_and_its_answer_is_learnt(width):
    dut = EthServices(width, max_frame=300)
    is_at = Ether(dst=OUR_MAC, src=B_MAC) / ARP(op="is-at", hwsrc=B_MAC, psrc=B_IP,
                                               hwdst=OUR_MAC, pdst=OUR_IP)
    tx_got, looked = [], {}

    async def node(ctx):
        ctx.set(dut.mac, mac_int(OUR_MAC))
        ctx.set(dut.ip, ip_int(OUR_IP))
        await ctx.tick()
        ctx.set(dut.ask_ip, ip_int(B_IP))
        ctx.set(dut.ask, 1)
        await ctx.tick()
        ctx.set(dut.ask, 0)
        for _ in range(100):
            await ctx.tick()
            if tx_got:
                break
        await send_frames(ctx, dut.rx, [padded(is_at)], width)
        await ctx.tick().repeat(100)
        ctx.set(dut.lookup_ip, ip_int(B_IP))
        await ctx.delay(1e-9)
        looked["b"] = (ctx.get(dut.lookup_hit), ctx.get(dut.lookup_mac))

    async def tx_sink(ctx):
        await collect_frames(ctx, dut.tx, width, tx_got, 1 << 30)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(node)
    sim.add_testbench(tx_sink, background=True)
    sim.run()
    assert tx_got == [raw(Ether(dst="ff:ff:ff:ff:ff:ff", src=OUR_MAC) / ARP(
        op="who-has", hwsrc=OUR_MAC, psrc=OUR_IP, hwdst="00:00:00:00:00:00", pdst=B_IP))]
    assert looked["b"] == (1, mac_int(B_MAC))


@pytest.mark.parametrize("width", [32, 64])
def test_arp_icmp_and_roce_through_the_services(width):
    dut = EthServices(width, max_frame=300)
    rng = random.Random(width)
    who_has = Ether(dst="ff:ff:ff:ff:ff:ff", src=A_MAC) / ARP(
        op="who-has", hwsrc=A_MAC, psrc=A_IP, pdst=OUR_IP)
    who_has_other = Ether(dst="ff:ff:ff:ff:ff:ff", src=A_MAC) / ARP(
        op="who-has", hwsrc=A_MAC, psrc=A_IP, pdst="10.0.0.9")
    is_at = Ether(dst=OUR_MAC, src=B_MAC) / ARP(op="is-at", hwsrc=B_MAC, psrc=B_IP,
                                               hwdst=OUR_MAC, pdst=OUR_IP)
    ping = echo(A_MAC, A_IP, OUR_IP, bytes(rng.getrandbits(8) for _ in range(56)))
    small_ping = echo(B_MAC, B_IP, OUR_IP, b"hi", ident=0x1234, seq=0xFFFF, ttl=3, ipid=99)
    ping_other = echo(A_MAC, A_IP, "10.0.0.9", b"x" * 20)
    roce = Ether(dst=OUR_MAC, src=A_MAC) / IP(src=A_IP, dst=OUR_IP) / UDP(
        sport=0xC000, dport=4791) / bytes(range(40))
    other_mac = Ether(dst="02:dd:00:00:00:04", src=A_MAC) / IP(src=A_IP, dst=OUR_IP) / UDP()
    ipv6 = Ether(dst=OUR_MAC, src=A_MAC) / IPv6() / UDP()
    rx = [who_has, who_has_other, ping, roce, other_mac, is_at, ipv6, ping_other, small_ping]
    rx_bytes = [padded(p) for p in rx]
    roce_tx = padded(roce)  # anything the RoCE side sends goes out as it is

    roce_got, tx_got, lookups = [], [], {}

    async def source(ctx):
        ctx.set(dut.mac, mac_int(OUR_MAC))
        ctx.set(dut.ip, ip_int(OUR_IP))
        await ctx.tick()
        await send_frames(ctx, dut.rx, rx_bytes, width)

    async def roce_source(ctx):
        await ctx.tick().repeat(30)
        await send_frames(ctx, dut.roce_tx, [roce_tx], width)

    async def roce_sink(ctx):
        await collect_frames(ctx, dut.roce_rx, width, roce_got, 600, rng)

    async def tx_sink(ctx):
        await collect_frames(ctx, dut.tx, width, tx_got, 600, random.Random(1))
        for ip in (A_IP, B_IP, "10.0.0.9"):
            ctx.set(dut.lookup_ip, ip_int(ip))
            await ctx.delay(1e-9)
            lookups[ip] = (ctx.get(dut.lookup_hit), ctx.get(dut.lookup_mac))
        lookups["counts"] = (ctx.get(dut.not_for_us), ctx.get(dut.service_busy))

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    for p in (source, roce_source, roce_sink, tx_sink):
        sim.add_testbench(p)
    sim.run()

    # RoCE and everything nothing here serves (IPv6: the parser counts its ethertype)
    # pass untouched and in order.
    assert roce_got == [padded(roce), padded(ipv6)]

    arp_reply = raw(Ether(dst=A_MAC, src=OUR_MAC) / ARP(
        op="is-at", hwsrc=OUR_MAC, psrc=OUR_IP, hwdst=A_MAC, pdst=A_IP))
    want = sorted([arp_reply, expected_echo_reply(ping, rx_bytes[2]),
                   expected_echo_reply(small_ping, rx_bytes[8]), roce_tx])
    assert sorted(tx_got) == want
    for frame in tx_got:
        pkt = Ether(frame)
        if ICMP in pkt:
            assert pkt[ICMP].type == 0
            again = Ether(raw(pkt))
            del again[IP].chksum, again[ICMP].chksum
            again = Ether(raw(again))
            assert (again[IP].chksum, again[ICMP].chksum) == (pkt[IP].chksum, pkt[ICMP].chksum)

    assert lookups[A_IP] == (1, mac_int(A_MAC))    # learnt from its request
    assert lookups[B_IP] == (1, mac_int(B_MAC))    # learnt from its reply
    assert lookups["10.0.0.9"][0] == 0
    assert lookups["counts"] == (3, 0)  # who-has other, other MAC, ping other
