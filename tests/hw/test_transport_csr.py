"""The transport's CSR ports are the CSR bank's, so a node wires them with one ``eq``."""

from amaranth.hdl import Module

from fpgaccl.hw.csr.bank import CSRBank
from fpgaccl.hw.transport import Transport
from fpgaccl.proto.regmap import default_map


def test_csr_ports_match_the_bank():
    bank = CSRBank(default_map(qps=4, regions=4))
    t = Transport(64, nqp=4, nmr=4, mtu=256)
    assert t.qp_ctl.shape() == bank.qp_ctl.shape()
    assert t.mr_ctl.shape() == bank.mr_ctl.shape()
    assert t.qp_sts.shape() == bank.qp_sts.shape()
    m = Module()
    m.d.comb += [t.qp_ctl.eq(bank.qp_ctl), t.mr_ctl.eq(bank.mr_ctl), bank.qp_sts.eq(t.qp_sts)]
