"""The network boundary: the Ethernet MAC and what answers on it besides RoCE.

- :mod:`~fpgaccl.hw.eth.mac`: :class:`Mac`, beats <-> a GMII-shaped byte interface.
- :mod:`~fpgaccl.hw.eth.mac_tx` / :mod:`~fpgaccl.hw.eth.mac_rx`: the byte-wide
  framing (preamble/SFD, padding, FCS, gap; SFD hunt, FCS check, verdict).
- :mod:`~fpgaccl.hw.eth.gmii`: :class:`Gmii`, the MAC on GMII pins in the PHY's clock domains.
- :mod:`~fpgaccl.hw.eth.width`: beats <-> one byte per cycle.
- :mod:`~fpgaccl.hw.eth.gate`: store and forward; only frames with a good verdict pass.
- :mod:`~fpgaccl.hw.eth.l2`: :class:`EthServices`: the demux (ARP, ICMP echo, control,
  RoCE, not-for-us), the responders and the transmit frame mux.
- :mod:`~fpgaccl.hw.eth.control`: :class:`ControlEndpoint`, the control port
  (:mod:`fpgaccl.proto.control`): registers and memory over UDP 4792.
- :mod:`~fpgaccl.hw.eth.arp` / :mod:`~fpgaccl.hw.eth.icmp`: the ARP responder with its
  learnt table, the ICMP echo responder.
- :mod:`~fpgaccl.hw.eth.header`: header capture/overlay on beats, frame admission.
- :mod:`~fpgaccl.hw.eth.symbols`: the byte and verdict layouts shared by the stages.
"""
