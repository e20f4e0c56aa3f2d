"""The control port on Amaranth's simulator, through EthServices: requests built by
scapy around :mod:`fpgaccl.proto.control` payloads; each answer must be byte for byte
the frame scapy builds around the proto encoder's response (scapy computes the IPv4
checksum), registers and memory must change exactly as the protocol says, and RoCE
frames in between must pass in order."""

import random

import pytest
from amaranth.sim import Simulator
from scapy.compat import raw
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from fpgaccl.hw.eth.l2 import EthServices
from fpgaccl.hw.eth.mac_rx import FCS_BYTES
from fpgaccl.hw.transport.layouts import mem_write_layout
from fpgaccl.proto import control as ctl
from fpgaccl.sim.models.stream import unpack
from tests.hw.eth_wire import collect_frames, send_frames
from tests.hw.test_eth_arp_icmp import A_IP, A_MAC, OUR_IP, OUR_MAC, ip_int, mac_int

KEY = 0x0123_4567_89AB_CDEF
SPORT = 40000
MAX_FRAME = 300
BODY_MAX = ctl.max_body(MAX_FRAME - FCS_BYTES)
"""The longest body whose frame, with its FCS, is MAX_FRAME bytes."""
PARAMS = {"mem_log2": 16, "mtu": 1024, "clock_ps": 4000, "gpu_va_base": 0x7F00_0000_0000}


def request(msg: ctl.Message, sport: int = SPORT, payload: bytes | None = None) -> bytes:
    return raw(Ether(dst=OUR_MAC, src=A_MAC) / IP(src=A_IP, dst=OUR_IP)
               / UDP(sport=sport, dport=ctl.CONTROL_PORT)
               / (ctl.encode(msg) if payload is None else payload))


def response(msg: ctl.Message, sport: int = SPORT) -> bytes:
    return raw(Ether(dst=A_MAC, src=OUR_MAC) / IP(src=OUR_IP, dst=A_IP, id=0, flags="DF")
               / UDP(sport=ctl.CONTROL_PORT, dport=sport, chksum=0) / ctl.encode(msg))


def roce(n: int) -> bytes:
    return raw(Ether(dst=OUR_MAC, src=A_MAC) / IP(src=A_IP, dst=OUR_IP)
               / UDP(sport=0xC000, dport=4791) / (bytes([n]) * 40))


class Bench:
    """EthServices with a register file and a byte memory behind its control port.
    ``steps`` are (frame, replies expected); a step waits for its replies (or, with
    none, long enough for a drop) before the next, since the port holds one request."""

    def __init__(self, width: int, key: int) -> None:
        self.width = width
        self.dut = EthServices(width, max_frame=MAX_FRAME, control={"key": key, **PARAMS})
        self.regs: dict[int, int] = {}
        self.writes: list[tuple[int, int]] = []
        self.mem = bytearray(random.Random(width).randbytes(1 << 16))
        self.tx: list[bytes] = []
        self.roce: list[bytes] = []
        self.counts = {}

    def run(self, steps) -> list[bytes]:
        dut, w = self.dut, self.width

        async def source(ctx):
            ctx.set(dut.mac, mac_int(OUR_MAC))
            ctx.set(dut.ip, ip_int(OUR_IP))
            await ctx.tick()
            for step in steps:
                if callable(step):
                    step()
                    continue
                frame, replies = step
                want = len(self.tx) + replies
                await send_frames(ctx, dut.rx, [frame], w)
                for _ in range(3000 if replies else 150):
                    await ctx.tick()
                    if replies and len(self.tx) >= want:
                        break
                assert len(self.tx) == want, f"no reply to {frame.hex()}"
            self.counts = {"key": ctx.get(dut.control_key),
                           "malformed": ctx.get(dut.control_malformed),
                           "busy": ctx.get(dut.service_busy)}

        async def tx_sink(ctx):
            await collect_frames(ctx, dut.tx, w, self.tx, 1 << 30, random.Random(2))

        async def roce_sink(ctx):
            await collect_frames(ctx, dut.roce_rx, w, self.roce, 1 << 30)

        async def csr(ctx):
            bus = dut.csr
            while True:
                _, _, addr, r_stb, w_stb, data = await ctx.tick().sample(
                    bus.addr, bus.r_stb, bus.w_stb, bus.w_data)
                if w_stb:
                    self.regs[addr] = data
                    self.writes.append((addr, data))
                if r_stb:
                    ctx.set(bus.r_data, self.regs.get(addr, 0))

        async def memory(ctx):
            layout = mem_write_layout(w)
            ctx.set(dut.wr.ready, 1)
            ctx.set(dut.rd_req.ready, 1)
            while True:
                _, _, rv, raddr, rlen, wv, wbeat = await ctx.tick().sample(
                    dut.rd_req.valid, dut.rd_req.payload.addr, dut.rd_req.payload.len,
                    dut.wr.valid, dut.wr.payload.as_value())
                if wv:
                    b = unpack(layout, wbeat)
                    data = b["data"].to_bytes(w // 8, "little")
                    for i in range(w // 8):
                        if b["keep"] >> i & 1:
                            self.mem[b["addr"] + i] = data[i]
                if rv:
                    ctx.set(dut.rd_req.ready, 0)
                    await send_frames(ctx, dut.rd_resp, [bytes(self.mem[raddr:raddr + rlen])], w)
                    ctx.set(dut.rd_req.ready, 1)

        sim = Simulator(dut)
        sim.add_clock(1e-8)
        sim.add_testbench(source)
        for p in (tx_sink, roce_sink, csr, memory):
            sim.add_testbench(p, background=True)
        sim.run()
        return self.tx


def info(width: int) -> bytes:
    return ctl.INFO.pack(mac=mac_int(OUR_MAC), ip=ip_int(OUR_IP), width=width,
                         max_body=BODY_MAX, **PARAMS)


@pytest.mark.parametrize("width", [32, 64])
def test_each_op_answered_as_the_encoder_says(width):
    bench = Bench(width, KEY)
    hello = ctl.hello(1, KEY)
    wr = ctl.csr_write(2, KEY, [(0x18, 0x1111_2222), (0x1C, 5), (0xFFFC, 0xDEADBEEF)])
    rd = ctl.csr_read(3, KEY, 0x18, 2)
    mw = ctl.mem_write(4, KEY, 0x41, bytes(range(100, 113)))   # 13 bytes, unaligned
    mr = ctl.mem_read(5, KEY, 0x3E, 17)
    steps = [(request(hello), 1), (roce(1), 0), (request(wr), 1), (request(rd), 1),
             (roce(2), 0), (request(mw), 1), (request(mr), 1), (roce(3), 0)]
    before = bytes(bench.mem)
    got = bench.run(steps)

    after = bytearray(before)
    after[0x41:0x4E] = bytes(range(100, 113))
    assert got == [
        response(ctl.answer(hello, body=info(width))),
        response(ctl.answer(wr)),
        response(ctl.answer(rd, body=b"\x11\x11\x22\x22\x00\x00\x00\x05")),
        response(ctl.answer(mw)),
        response(ctl.answer(mr, body=bytes(after[0x3E:0x3E + 17]))),
    ]
    for frame in got:   # the proto decoder and scapy accept every answer
        pkt = Ether(frame)
        msg = ctl.decode(raw(pkt[UDP].payload))
        assert msg.response and msg.key == 0
        again = Ether(frame)
        del again[IP].chksum
        assert Ether(raw(again))[IP].chksum == pkt[IP].chksum
    assert bench.writes == [(0x18, 0x1111_2222), (0x1C, 5), (0xFFFC, 0xDEADBEEF)]
    assert bytes(bench.mem) == bytes(after)
    assert bench.roce == [roce(1), roce(2), roce(3)]
    assert bench.counts == {"key": 0, "malformed": 0, "busy": 0}


@pytest.mark.parametrize("width", [32, 64])
def test_the_longest_answer_fits_the_largest_frame_with_its_fcs(width):
    # HELLO's max_body is the longest body the node sends: with the headers and the FCS
    # the MAC appends, its frame is exactly the largest the MAC takes.
    bench = Bench(width, KEY)
    longest = ctl.mem_read(1, KEY, 0x10, BODY_MAX)
    (frame,) = bench.run([(request(longest), 1)])
    assert len(frame) + FCS_BYTES == MAX_FRAME
    assert frame == response(ctl.answer(longest, body=bytes(bench.mem[0x10:0x10 + BODY_MAX])))


@pytest.mark.parametrize("width", [32, 64])
def test_retries_are_not_executed_twice_and_stale_writes_refused(width):
    bench = Bench(width, KEY)
    wr = ctl.csr_write(10, KEY, [(0x18, 1)])
    mw = ctl.mem_write(11, KEY, 0x100, b"\xAA\xBB")
    other = ctl.csr_write(10, KEY, [(0x1C, 7)])   # same seq, another client port

    def meddle():   # what the engine might do between a write and its retry
        bench.regs[0x18] = 99
        bench.mem[0x100] = 0x55

    steps = [(request(wr), 1), (request(mw), 1), meddle,
             (request(mw), 1),                      # retry: answered, not executed
             (request(wr), 1),                      # behind the last write: stale
             (request(ctl.csr_read(12, KEY, 0x18)), 1),
             (request(other, sport=SPORT + 1), 1),  # another client: executed
             (request(ctl.csr_read(12, KEY, 0x18)), 1)]  # reads are simply re-run
    got = bench.run(steps)
    assert got[2] == got[1] == response(ctl.answer(mw))
    assert got[3] == response(ctl.answer(wr, ctl.Status.STALE))
    assert ctl.decode(raw(Ether(got[4])[UDP].payload)).body == (99).to_bytes(4, "big")
    assert got[5] == response(ctl.answer(other), sport=SPORT + 1)
    assert bench.writes == [(0x18, 1), (0x1C, 7)]
    assert bench.mem[0x100:0x102] == b"\x55\xBB"


@pytest.mark.parametrize("width", [32, 64])
def test_wrong_key_and_bad_requests_write_nothing(width):
    bench = Bench(width, KEY)
    bad_key = ctl.csr_write(1, KEY ^ 1, [(0x18, 1)])
    bad_mem = ctl.mem_write(2, KEY ^ 1 << 63, 0x10, b"x")
    hello_bad = ctl.hello(3, 5)
    bad_op = ctl.Message(9, 4, KEY, 0, 1)
    range_wr = ctl.csr_write(5, KEY, [(0x18, 1), (0x1_0000, 2)])  # refused whole
    unaligned = ctl.csr_read(6, KEY, 0x19)
    too_long = ctl.mem_read(7, KEY, 0, BODY_MAX + 1)
    past_mem = ctl.mem_write(8, KEY, 0xFFFF, b"ab")
    zero = ctl.csr_read(9, KEY, 0x18, 0)
    good = ctl.encode(ctl.csr_read(10, KEY, 0x18))
    bad_magic = b"\x46\x44" + good[2:]
    response_flag = good[:2] + bytes([good[2] | 0x8]) + good[3:]
    short_body = ctl.encode(ctl.mem_write(11, KEY, 0x10, b"abc"))[:-1]
    steps = [(request(bad_key), 0), (request(bad_mem), 0), (request(hello_bad), 1),
             (request(bad_op), 1), (request(range_wr), 1), (request(unaligned), 1),
             (request(too_long), 1), (request(past_mem), 1), (request(zero), 1),
             (request(None, payload=bad_magic), 0), (request(None, payload=response_flag), 0),
             (request(None, payload=short_body), 0), (request(None, payload=good[:20]), 0)]
    got = bench.run(steps)
    S = ctl.Status
    assert got == [response(ctl.answer(m, s)) for m, s in (
        (hello_bad, S.BAD_KEY), (bad_op, S.BAD_OP), (range_wr, S.OUT_OF_RANGE),
        (unaligned, S.OUT_OF_RANGE), (too_long, S.BAD_LENGTH), (past_mem, S.OUT_OF_RANGE),
        (zero, S.BAD_LENGTH))]
    for m, frame in zip((hello_bad, bad_op, range_wr, unaligned, too_long, past_mem, zero),
                        got, strict=True):   # the node's checks are proto's
        want = S.BAD_KEY if m is hello_bad else ctl.check(
            m, body_max=BODY_MAX, mem_log2=PARAMS["mem_log2"])
        assert ctl.decode(raw(Ether(frame)[UDP].payload)).status == want
    assert bench.writes == []
    assert bench.mem == bytearray(random.Random(width).randbytes(1 << 16))
    assert bench.counts == {"key": 3, "malformed": 4, "busy": 0}


def test_first_contact_sets_the_key():
    bench = Bench(32, 0)
    steps = [(request(ctl.csr_write(1, 0, [(0x18, 1)])), 0),   # no key yet: dropped
             (request(ctl.hello(2, 0)), 1),                       # zero is no key
             (request(ctl.hello(3, KEY)), 1),                     # first contact
             (request(ctl.hello(4, KEY + 1)), 1),                 # too late
             (request(ctl.csr_write(5, KEY, [(0x18, 1)])), 1)]
    got = bench.run(steps)
    assert got == [response(ctl.answer(ctl.hello(2, 0), ctl.Status.BAD_KEY)),
                   response(ctl.answer(ctl.hello(3, KEY), body=info(32))),
                   response(ctl.answer(ctl.hello(4, KEY + 1), ctl.Status.BAD_KEY)),
                   response(ctl.answer(ctl.csr_write(5, KEY, [(0x18, 1)])))]
    assert bench.writes == [(0x18, 1)]
    assert bench.counts["key"] == 3   # the write, HELLO with zero, HELLO too late
