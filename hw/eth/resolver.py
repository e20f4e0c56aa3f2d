"""Each queue pair's destination MAC: its static register where the host wrote one, else
what ARP learnt for its peer's address, found by asking."""

from __future__ import annotations

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from .arp import one_hot_select

ASK_EVERY_LOG2 = 12
"""Cycles between two who-has for the queue pairs still unresolved, in turn (41 us at
100 MHz, so a peer that never answers costs the link nothing); a queue pair asks at
once when it comes to need a MAC (its peer's address written, no static MAC)."""


class PeerResolver(wiring.Component):
    """``peer_ip``/``static_mac`` (the QP registers, one per queue pair) in, ``dst`` out:
    the static MAC where it is not zero (the override), else the MAC the ARP table
    (``lookup_*``, :class:`~fpgaccl.hw.eth.arp.ArpTable`) holds for the peer's address,
    copied per queue pair as the table is scanned (it holds fewer entries than there may
    be peers); zero while unknown, and then a who-has for it is asked (``ask`` held
    with ``ask_ip`` until ``ask_taken``). Everything on ``dst`` is a flop, so the
    transmit path's pick of it is as short as before."""

    def __init__(self, qps: int) -> None:
        self.qps = qps
        super().__init__({
            "peer_ip": In(data.ArrayLayout(32, qps)),
            "static_mac": In(data.ArrayLayout(48, qps)),
            "dst": Out(data.ArrayLayout(48, qps)),
            "lookup_ip": Out(32),
            "lookup_hit": In(1),
            "lookup_mac": In(48),
            "ask": Out(1),
            "ask_ip": Out(32),
            "ask_taken": In(1),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        n = self.qps
        learnt = [Signal(48, name=f"learnt{i}") for i in range(n)]
        learnt_ip = [Signal(32, name=f"learnt_ip{i}") for i in range(n)]
        known = Signal(n)      # what was learnt is still for the peer's address
        need = Signal(n)
        need_was = Signal(n)

        # The table is read one queue pair a cycle: the address from a flop, the answer
        # stored the next cycle against the queue pair it was for.
        scan = Signal(range(n))
        looked = Signal(range(n))
        m.d.sync += [scan.eq(Mux(scan == n - 1, 0, scan + 1)), looked.eq(scan),
                     self.lookup_ip.eq(self.peer_ip[scan])]
        for i in range(n):
            peer_ip, static = self.peer_ip[i], self.static_mac[i]
            with m.If(looked == i):
                with m.If(self.lookup_hit & (self.lookup_ip != 0)):
                    m.d.sync += [learnt[i].eq(self.lookup_mac),
                                 learnt_ip[i].eq(self.lookup_ip)]
                # Decided as the table is consulted, so a peer it knows never asks.
                m.d.sync += need[i].eq((static == 0) & (self.lookup_ip != 0) &
                                       ~self.lookup_hit & ~known[i])
            m.d.sync += [
                known[i].eq((learnt_ip[i] == peer_ip) & (peer_ip != 0)),
                self.dst[i].eq(Mux(static != 0, static, Mux(known[i], learnt[i], 0))),
            ]

        # Who to ask: a queue pair that has just come to need a MAC, and every
        # 2**ASK_EVERY_LOG2 cycles the next one in turn that still needs it.
        pending = Signal(n)
        timer = Signal(ASK_EVERY_LOG2)
        turn = Signal(range(n))
        periodic = Signal(n)
        m.d.comb += periodic.eq(Mux(timer == 0, need & (1 << turn), 0))
        m.d.sync += [timer.eq(timer + 1), need_was.eq(need)]
        with m.If(timer == 0):
            m.d.sync += turn.eq(Mux(turn == n - 1, 0, turn + 1))
        first = Signal(n)      # the lowest pending queue pair, one-hot
        m.d.comb += first.eq(pending & -pending)
        taking = ~self.ask & pending.any()
        m.d.sync += pending.eq((pending & ~Mux(taking, first, 0)) | (need & ~need_was)
                               | periodic)
        with m.If(taking):
            m.d.sync += [self.ask.eq(1), self.ask_ip.eq(
                one_hot_select([self.peer_ip[i] for i in range(n)], first))]
        with m.Elif(self.ask & self.ask_taken):
            m.d.sync += self.ask.eq(0)
        return m
