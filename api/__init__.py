"""fpgaccl: network-attached FPGA collective offload.

Subpackages: ``proto`` (wire formats, the single source of truth), ``hw`` (Amaranth),
``sim`` (cocotb/Verilator), ``host`` (runtime), ``boards`` (bitstream builds).
"""

from . import errors

__version__ = "0.1.0"

__all__ = ["__version__", "errors"]
