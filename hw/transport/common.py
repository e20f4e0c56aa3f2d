"""Small gateware helpers shared by the requester and the responder."""

from __future__ import annotations

from amaranth.hdl import Module, Signal, Value

from fpgaccl.proto.opcodes import PSN_BITS, QPN_BITS

from .layouts import QPState


def psn_sub(m: Module, a: Value, b: Value, name: str) -> Signal:
    """``a - b`` modulo 2^24; bit 23 set means ``a`` is behind ``b`` (the serial-number
    comparison of proto.opcodes.psn_diff, so wrap-around at 2^24 needs no special case)."""
    d = Signal(PSN_BITS, name=name)
    m.d.comb += d.eq(a - b)
    return d


def behind(d: Value) -> Value:
    return d[PSN_BITS - 1]


def sat_inc(m: Module, counter: Signal) -> None:
    with m.If(~counter.all()):
        m.d.sync += counter.eq(counter + 1)


def qp_lookup(m: Module, qp_ctl, nqp: int, dqpn: Value, min_state: int, name: str):
    """Registered-input, combinational QPN -> index match over the context table.

    Returns (hit, index). A QP answers only from ``min_state`` on and never in ERROR, so
    a context being set up by software cannot take traffic.
    """
    hit = Signal(name=f"{name}_hit")
    idx = Signal(range(max(nqp, 2)), name=f"{name}_idx")
    for i in reversed(range(nqp)):
        st = qp_ctl[i].state.state
        with m.If((qp_ctl[i].local_qpn.value[:QPN_BITS] == dqpn)
                  & (st >= min_state) & (st != QPState.ERROR)):
            m.d.comb += [hit.eq(1), idx.eq(i)]
    return hit, idx


def pick(values, idx: Value, width: int, m: Module, name: str) -> Signal:
    """``values[idx]`` for a Python list of per-QP signals."""
    out = Signal(width, name=name)
    with m.Switch(idx):
        for i, v in enumerate(values):
            with m.Case(i):
                m.d.comb += out.eq(v)
    return out
