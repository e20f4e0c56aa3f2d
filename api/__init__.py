"""fpgaccl: network-attached FPGA collective offload.

Subpackages: ``proto`` (wire formats, the single source of truth), ``hw`` (Amaranth),
``sim`` (cocotb/Verilator), ``host`` (runtime), ``boards`` (bitstream builds).
"""

from __future__ import annotations

from typing import Any

from . import errors

__version__ = "0.1.0"


def init(backend: str | None = None, **kwargs: Any):
    """This process's Communicator, from the launcher's environment
    (see :func:`fpgaccl.host.init`; the backend defaults to FPGACCL_BACKEND, set by
    ``fpgaccl run --backend``, else software). Imported lazily: the runtime pulls in numpy and
    ml_dtypes, which ``import fpgaccl`` alone should not pay for."""
    from .host import init as _init
    return _init(backend, **kwargs)


__all__ = ["__version__", "errors", "init"]
