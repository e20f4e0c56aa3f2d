"""Decode captures with Wireshark's tshark: the independent judge of what we send."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fpgaccl.errors import BackendUnavailableError, ToolchainError

_FIELDS = ("frame.number", "frame.protocols", "infiniband.bth.opcode", "infiniband.bth.destqp",
           "infiniband.bth.psn", "infiniband.reth.r_key", "infiniband.immdt",
           "infiniband.aeth.syndrome", "infiniband.invariant.crc", "_ws.malformed",
           "_ws.expert.severity")


@dataclass(frozen=True)
class Decoded:
    number: int
    protocols: str
    opcode: int | None
    dqpn: int | None
    psn: int | None
    rkey: int | None
    immdt: int | None
    syndrome: int | None
    icrc: int | None
    malformed: bool
    expert: str

    @property
    def is_rocev2(self) -> bool:
        return ":udp:infiniband" in self.protocols


def tshark_path() -> str:
    path = shutil.which("tshark")
    if path is None:
        raise BackendUnavailableError(
            "tshark is not installed (Debian package 'tshark'; ./fpgaccl installs it as root)")
    return path


def _int(text: str, base: int = 0) -> int | None:
    return int(text, base) if text else None


def decode(pcap: str | Path) -> list[Decoded]:
    """One :class:`Decoded` per frame of ``pcap`` as tshark's RoCEv2 dissector sees it."""
    cmd = [tshark_path(), "-r", str(pcap), "-T", "fields", "-E", "separator=\t",
           "-E", "occurrence=f"]
    for f in _FIELDS:
        cmd += ["-e", f]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ToolchainError(f"tshark failed on {pcap}: {proc.stderr.strip()}")
    rows = []
    for line in proc.stdout.splitlines():
        c = (line.split("\t") + [""] * len(_FIELDS))[: len(_FIELDS)]
        rows.append(Decoded(int(c[0]), c[1], _int(c[2]), _int(c[3]), _int(c[4]), _int(c[5]),
                            _int(c[6], 16), _int(c[7]), _int(c[8]), bool(c[9]), c[10]))
    return rows
