"""GMII: the MAC on a gigabit PHY's byte interface, each direction on the PHY's own
125 MHz clock (``gmii_tx`` from the MAC side's GTX_CLK, ``gmii_rx`` from RX_CLK)."""

from __future__ import annotations

from amaranth.hdl import Module
from amaranth.lib import wiring

from .mac import Mac, mac_signature
from .mac_rx import MAX_FRAME


class Gmii(wiring.Component):
    """Pins ``txd``/``tx_en``/``tx_er`` (registered in ``gmii_tx``) and
    ``rxd``/``rx_dv``/``rx_er`` (registered in ``gmii_rx`` before anything looks at
    them, so a pad's register can take them); ``tx``/``rx`` beats and ``rx_frames``
    in ``sync``. The crossings are the :class:`~fpgaccl.hw.eth.mac.Mac`'s AsyncFIFOs,
    on beats: ``sync`` must run at least ``125 MHz * 8 / width``."""

    def __init__(self, width: int, *, max_frame: int = MAX_FRAME) -> None:
        self.width = width
        self.max_frame = max_frame
        super().__init__(mac_signature(width))

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.mac = mac = Mac(self.width, max_frame=self.max_frame,
                                     tx_domain="gmii_tx", rx_domain="gmii_rx")
        wiring.connect(m, wiring.flipped(self.tx), mac.tx)
        wiring.connect(m, mac.rx, wiring.flipped(self.rx))
        # MacTx's outputs are already registers in gmii_tx.
        m.d.comb += [self.rx_frames.eq(mac.rx_frames), self.txd.eq(mac.txd),
                     self.tx_en.eq(mac.tx_en), self.tx_er.eq(mac.tx_er)]
        m.d.gmii_rx += [mac.rxd.eq(self.rxd), mac.rx_dv.eq(self.rx_dv),
                        mac.rx_er.eq(self.rx_er)]
        return m
