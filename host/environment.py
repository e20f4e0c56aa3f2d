"""``fpgaccl.init()``: this process's communicator, from the environment of whichever
launcher started it (``fpgaccl run``, torchrun, Slurm, OpenMPI)."""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fpgaccl.errors import InvalidArgumentError

from .communicator import Communicator
from .link import ImpairedLink

_WORLD: Communicator | None = None


_RANK_VARS = ("FPGACCL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_SIZE_VARS = ("FPGACCL_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
              "PMI_SIZE")


def world_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world_size) from whichever launcher's variables are set; (0, 1) if none."""
    env = os.environ if env is None else env
    for rank_var, size_var in zip(_RANK_VARS, _SIZE_VARS, strict=True):
        if env.get(rank_var, "") != "" and env.get(size_var, "") != "":
            try:
                return int(env[rank_var]), int(env[size_var])
            except ValueError:
                raise InvalidArgumentError(rank_var, f"{env[rank_var]!r} / {size_var}="
                                           f"{env[size_var]!r} are not integers") from None
    return 0, 1


def _spans_hosts(env: Mapping[str, str]) -> bool:
    """Whether Slurm or OpenMPI placed this job's ranks on more than one host."""
    try:
        if int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1) > 1:
            return True
        local, size = env.get("OMPI_COMM_WORLD_LOCAL_SIZE"), env.get("OMPI_COMM_WORLD_SIZE")
        return bool(local and size) and int(local) < int(size)
    except ValueError:
        return False


def init(backend: str | None = None, **kwargs: Any) -> Communicator:
    """This process's communicator, from the environment of whichever launcher started it.

    ``fpgaccl run`` sets FPGACCL_RANK/FPGACCL_WORLD_SIZE; torchrun sets RANK/WORLD_SIZE/
    MASTER_ADDR/MASTER_PORT; Slurm SLURM_PROCID/SLURM_NTASKS; OpenMPI
    OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE. Without any of them: a world of one.
    The backend, unless given, is FPGACCL_BACKEND's (``fpgaccl run --backend``), else
    ``software``.
    """
    global _WORLD
    if _WORLD is not None and not _WORLD._closed:
        return _WORLD
    rank, world = world_from_env()
    env = os.environ
    if world > 1 and "master_addr" not in kwargs and not env.get("MASTER_ADDR") \
            and _spans_hosts(env):
        # Neither launcher names a rendezvous host, and the loopback default would leave
        # every host's ranks waiting for a rank 0 of their own.
        raise InvalidArgumentError("MASTER_ADDR", "the ranks span several hosts: set it "
                                   "(and MASTER_PORT) to rank 0's host in the job script")
    backend = backend or env.get("FPGACCL_BACKEND") or "software"
    if "FPGACCL_PCAP_DIR" in env and "pcap" not in kwargs:
        kwargs["pcap"] = Path(env["FPGACCL_PCAP_DIR"]) / f"rank{rank}.pcap"
    if "FPGACCL_IMPAIR" in env and "impair" not in kwargs:
        kwargs["impair"] = ImpairedLink.parse(env["FPGACCL_IMPAIR"], seed=rank)
    for key, conv in (("deadline_s", float), ("mtu", int), ("rto_s", float)):
        name = f"FPGACCL_{key.upper()}"
        if name in env and key not in kwargs:
            kwargs[key] = conv(env[name])
    _WORLD = Communicator(rank, world, backend, **kwargs)
    atexit.register(_WORLD.close)
    return _WORLD
