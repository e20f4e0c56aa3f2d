"""Streaming reduction unit: element-wise ``a op b`` over two beat streams, with the
element type and operator chosen at run time (codes from :mod:`fpgaccl.proto.reduce`)."""
