"""fpgaccl's host runtime: the Communicator API, its software engine, launcher and tools."""

from __future__ import annotations

from .buffers import DTYPES, OPS, DeviceArray
from .communicator import Communicator, Handle
from .environment import init

__all__ = ["DTYPES", "OPS", "Communicator", "DeviceArray", "Handle", "init"]
