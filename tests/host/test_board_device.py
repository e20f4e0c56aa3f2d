"""UdpDevice's client logic against a socket on 127.0.0.1 that answers with responses
the proto encoder builds. Codec-level only: no HDL answers here (that needs the node
top and a TAP bridge in Verilator), so this is not an end-to-end proof."""

import itertools
import socket
import threading
import time

import pytest

from fpgaccl.errors import BackendUnavailableError, TransportError
from fpgaccl.host.board_device import KEY_ENV, SimDevice, UdpDevice
from fpgaccl.proto import control as ctl

KEY = 0xFEED


class Canned:
    """Answers each request as ``reply(req)`` says (None: stays silent), from a thread."""

    def __init__(self, reply=None, max_body=16) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.seen: list[bytes] = []
        self.regs: dict[int, int] = {}
        self.mem = bytearray(256)
        self.max_body = max_body
        self.reply = reply or self.node
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            data, peer = self.sock.recvfrom(65536)
            self.seen.append(data)
            for out in self.reply(ctl.decode(data)) or ():
                self.sock.sendto(ctl.encode(out), peer)

    def node(self, req: ctl.Message):
        if req.key != KEY:
            return [ctl.answer(req, ctl.Status.BAD_KEY)] if req.op == ctl.Op.HELLO else []
        body = b""
        if req.op == ctl.Op.HELLO:
            body = ctl.INFO.pack(max_body=self.max_body, nodes=1, gpu_va_base=0x1000)
        elif req.op == ctl.Op.CSR_WRITE:
            self.regs.update(ctl.pairs(req.body))
        elif req.op == ctl.Op.CSR_READ:
            body = b"".join(self.regs.get(req.addr + 4 * i, 0).to_bytes(4, "big")
                            for i in range(req.count))
        elif req.op == ctl.Op.MEM_WRITE:
            self.mem[req.addr:req.addr + req.count] = req.body
        else:
            body = bytes(self.mem[req.addr:req.addr + req.count])
        return [ctl.answer(req, body=body)]


def dev(server: Canned, **kw) -> UdpDevice:
    return UdpDevice("127.0.0.1", KEY, port=server.port, **kw)


def test_calls_batch_to_the_nodes_max_body():
    srv = Canned()
    d = dev(srv)
    assert d.info["max_body"] == 16 and d.gpu_va_base == 0x1000
    d.csr_write([(4 * i, i) for i in range(5)])          # 2 + 2 + 1 pairs
    assert srv.regs == {4 * i: i for i in range(5)} and d.csr_read(8) == 2
    d.host_write(3, bytes(range(40)))
    assert d.host_read(3, 40) == bytes(range(40))
    ops = [ctl.decode(m).op for m in srv.seen]
    assert ops.count(ctl.Op.CSR_WRITE) == 3 and ops.count(ctl.Op.MEM_WRITE) == 3
    seqs = [ctl.decode(m).seq for m in srv.seen]
    assert all((b - a) % (1 << 32) == 1 for a, b in itertools.pairwise(seqs))
    with pytest.raises(BackendUnavailableError, match="GPU"):
        d.gpu_alloc(4)


def test_a_lost_answer_is_retried_with_the_same_bytes_and_late_answers_skipped():
    drops = {"n": 0}
    srv = Canned()

    def flaky(req):
        if req.op == ctl.Op.CSR_WRITE and drops["n"] < 2:
            drops["n"] += 1
            return [ctl.answer(ctl.Message(req.op, (req.seq - 1) % (1 << 32), 0))]  # older seq
        return srv.node(req)

    srv.reply = flaky
    d = dev(srv, timeout_s=0.05)
    d.csr_write([(0x18, 7)])
    writes = [m for m in srv.seen if ctl.decode(m).op == ctl.Op.CSR_WRITE]
    assert len(writes) == 3 and len(set(writes)) == 1


def test_silence_and_refusals_raise_typed_errors_naming_the_address():
    srv = Canned()
    d = dev(srv, timeout_s=0.05, retries=1)
    srv.reply = lambda req: []
    with pytest.raises(TransportError, match=f"127.0.0.1:{srv.port}.*2 tries"):
        d.csr_read(0)
    srv.reply = lambda req: [ctl.answer(req, ctl.Status.OUT_OF_RANGE)]
    with pytest.raises(TransportError, match="OUT_OF_RANGE"):
        d.csr_read(0x1_0000)
    with pytest.raises(BackendUnavailableError, match=KEY_ENV):
        UdpDevice("127.0.0.1", KEY + 1, port=Canned().port)


def test_board_spec_names_one_address_per_rank(monkeypatch):
    a, b = Canned(), Canned()
    spec = f"udp:127.0.0.1:{a.port},127.0.0.1:{b.port}"
    monkeypatch.setenv(KEY_ENV, f"{KEY:x}")
    d = SimDevice.from_env(1, spec)
    assert isinstance(d, UdpDevice) and d.addr == ("127.0.0.1", b.port)
    with pytest.raises(BackendUnavailableError, match="rank 2"):
        SimDevice.from_env(2, spec)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(BackendUnavailableError, match=KEY_ENV):
        SimDevice.from_env(0, spec)


def test_one_address_is_this_ranks_node(monkeypatch):
    a = Canned()
    monkeypatch.setenv(KEY_ENV, f"{KEY:x}")
    d = SimDevice.from_env(3, f"udp:127.0.0.1:{a.port}")
    assert d.addr == ("127.0.0.1", a.port)
    with pytest.raises(BackendUnavailableError, match="rank 1"):
        SimDevice.from_env(1, f"udp:127.0.0.1:{a.port},,127.0.0.1:{a.port}")


def test_bodies_are_bounded_by_the_paths_ip_mtu():
    # A node that takes 4000-byte bodies behind a 1500-byte link: a bigger request would
    # leave as IP fragments, which a node drops.
    srv = Canned(max_body=4000)
    srv.mem = bytearray(8192)
    d = dev(srv, ip_mtu=1500)
    assert d.max_body == ctl.max_body(1514) == ctl.MAX_BODY_1500
    d.host_write(0, bytes(range(256)) * 12)
    writes = [ctl.decode(m) for m in srv.seen if ctl.decode(m).op == ctl.Op.MEM_WRITE]
    assert [w.count for w in writes] == [1444, 1444, 184]
    assert max(len(m) for m in srv.seen) <= 1500 - 28


def test_register_blocks_read_in_one_request_per_body():
    srv = Canned(max_body=16)        # 4 registers a request
    srv.regs = {0x100 + 4 * i: i + 7 for i in range(10)}
    d = dev(srv)
    assert d.csr_read_many(0x100, 10) == [i + 7 for i in range(10)]
    reads = [ctl.decode(m) for m in srv.seen if ctl.decode(m).op == ctl.Op.CSR_READ]
    assert [(r.addr, r.count) for r in reads] == [(0x100, 4), (0x110, 4), (0x120, 2)]


def test_each_retry_waits_twice_as_long():
    srv = Canned()
    d = dev(srv, timeout_s=0.05, retries=3)
    srv.reply = lambda req: []
    t = time.monotonic()
    with pytest.raises(TransportError, match=r"4 tries in 0\.75 s"):
        d.csr_read(0)
    assert time.monotonic() - t >= 0.75
    assert d.requests - 1 == 4 and d.resent == 3   # the HELLO, then 4 sends
