"""``import fpgaccl.torch`` registers ``fpgaccl`` as a ``torch.distributed`` backend::

    import torch.distributed as dist
    import fpgaccl.torch  # noqa: F401
    dist.init_process_group("fpgaccl")

The process group lives in :mod:`fpgaccl.host.torch_backend`. There is no
``torch.backends`` entry point: torch runs those (meant for device extensions) inside every
``import torch``, which would load fpgaccl into every torch process and turn any failure
of ours into a failing ``import torch``.
"""

from __future__ import annotations

from fpgaccl.host.torch_backend import BACKEND_NAME, FpgacclWork, ProcessGroupFpgaccl, register

register()

__all__ = ["BACKEND_NAME", "FpgacclWork", "ProcessGroupFpgaccl", "register"]
