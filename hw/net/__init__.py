"""Network path of the engine: Ethernet II / IPv4 / UDP / RoCEv2 receive parser and
transmit builder with IPv4 checksum and ICRC in hardware, generated from ``fpgaccl.proto``.

- :class:`~fpgaccl.hw.net.parser.RoceParser`: frame beats in; header record + realigned
  payload out, store-and-forward, per-reason saturating drop counters.
- :class:`~fpgaccl.hw.net.builder.RoceBuilder`: header record + payload beats in; frame out.
- :mod:`~fpgaccl.hw.net.crc`: CRC-32 update matrices for N-byte beats, built in Python.
- :mod:`~fpgaccl.hw.net.record`: the header record layout and opcode decode.
- :mod:`~fpgaccl.hw.net.layouts`: header structs and the one byte-order conversion.
"""
