"""The Ethernet address behind an IPv4 address, as the kernel knows it: what a host
tells a network-attached node about its peers (the node sends RoCE frames to the MAC in
its ``qp.peer_mac`` registers).

An address of this host is its interface's MAC (``ip -j addr``); any other is resolved
by the kernel's ARP (a datagram to the discard port starts it) and read from its
neighbour table (``/proc/net/arp``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from pathlib import Path

from fpgaccl.errors import BackendUnavailableError

ARP_TABLE = Path("/proc/net/arp")
ARP_COMPLETE = 0x2


def parse_mac(text: str) -> int:
    return int(text.replace(":", ""), 16)


def local_macs() -> dict[str, int]:
    """This host's IPv4 addresses and the MACs of the interfaces that hold them."""
    try:
        r = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True,
                           text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise BackendUnavailableError(f"ip -j addr (iproute2) failed: {e}") from e
    out = {}
    for link in json.loads(r.stdout or "[]"):
        mac = link.get("address")
        for a in link.get("addr_info", []):
            if mac and a.get("family") == "inet" and a.get("local"):
                out[a["local"]] = parse_mac(mac)
    return out


def arp_entry(ip: str) -> int | None:
    """The complete ARP entry for ``ip``, if the kernel has one."""
    for line in ARP_TABLE.read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 4 and f[0] == ip and int(f[2], 16) & ARP_COMPLETE:
            return parse_mac(f[3])
    return None


def resolve_mac(ip: str, *, timeout_s: float = 5.0) -> int:
    """The MAC frames to ``ip`` go to on its link; BackendUnavailableError if the kernel
    cannot resolve it within ``timeout_s``."""
    local = local_macs()
    if ip in local:
        return local[ip]
    end = time.monotonic() + timeout_s
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while True:
            mac = arp_entry(ip)
            if mac is not None:
                return mac
            if time.monotonic() > end:
                raise BackendUnavailableError(f"{ip}: no ARP answer within {timeout_s:g} s "
                                              "(not on a link of this host?)")
            with contextlib.suppress(OSError):   # the discard port: only ARP matters
                s.sendto(b"", (ip, 9))
            time.sleep(0.05)
