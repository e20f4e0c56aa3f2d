"""The node answers through the Linux kernel: ``fpgaccl node`` on a TAP in a fresh network
namespace, then from inside it arping, ping, a control-port HELLO and frames that are not
for the node (dropped and counted, the count read back through the control port).

Root only (TAP, namespaces); ``arping`` and ``ping`` are installed with apt when missing.
The first run builds the node in Verilator (minutes on a small machine; the fixture says
so); later runs reuse the cached build. Addresses are private and exist only inside the
namespace the test creates and removes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from ._procs import stop

NODE_IP = "10.213.7.2"
KEY = 0x5EC12E7
READY_S = 180

SCRIPT = r"""
import json, socket, struct, sys, time
from fpgaccl.host.board_device import UdpDevice
from fpgaccl.proto import ETH, IPV4, ipv4_checksum
from fpgaccl.proto.regmap import default_map
from fpgaccl.sim.tap import NODE, mac_int
tap, node_ip, node_mac, key = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dev = UdpDevice(node_ip, key, timeout_s=2.0, retries=3)
rmap = default_map(qps=NODE["qps"], regions=NODE["regions"], imem_words=NODE["imem_words"])
nfu = rmap.address("drops.not_for_us")
before = dev.csr_read(nfu)

def frame(dst_mac, dst_ip):
    icmp = bytes([8, 0, 0, 0]) + bytes(4)
    csum = ~sum(struct.unpack(">4H", icmp)) & 0xFFFF
    icmp = icmp[:2] + struct.pack(">H", csum) + icmp[4:]
    src_ip = socket.inet_aton(node_ip)[:3] + b"\x01"
    f = {"len": IPV4.size + len(icmp), "proto": 1, "src": int.from_bytes(src_ip, "big"),
         "dst": int.from_bytes(socket.inet_aton(dst_ip), "big")}
    ip = IPV4.pack(f)
    ip = IPV4.pack({**f, "chksum": ipv4_checksum(ip)})
    return ETH.pack(dst=dst_mac, src=0x020000000001, type=0x0800) + ip + icmp

s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((tap, 0))
other_ip = node_ip.rsplit(".", 1)[0] + ".99"
wrong = [frame(0x02AA00000099, node_ip)] * 3 + [frame(mac_int(node_mac), other_ip)] * 2
for f in wrong:
    s.send(f)
time.sleep(0.5)
after = dev.csr_read(nfu)
print(json.dumps({"info": {k: v for k, v in dev.info.items() if isinstance(v, int)},
                  "before": before, "after": after, "injected": len(wrong)}))
"""


def _sh(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _ensure_tools() -> None:
    missing = [pkg for tool, pkg in (("arping", "arping"), ("ping", "iputils-ping"))
               if shutil.which(tool) is None]
    if not missing:
        return
    print(f"installing {' '.join(missing)} with apt-get")
    r = _sh("apt-get", "install", "-y", "--no-install-recommends", *missing, timeout=300)
    if r.returncode:
        _sh("apt-get", "update", timeout=300)
        r = _sh("apt-get", "install", "-y", "--no-install-recommends", *missing, timeout=300)
    if r.returncode:
        pytest.skip(f"could not install {missing}: {r.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def node():
    if os.geteuid() != 0:
        print("skipping: TAP interfaces and network namespaces need root")
        pytest.skip("needs root for a TAP interface and a network namespace")
    if shutil.which("ip") is None:
        pytest.skip("ip (iproute2) is not installed")
    _ensure_tools()
    from fpgaccl.sim.tap import DEFAULT_MAC, build_node
    t = time.monotonic()
    print("building the EthNode simulation (cached; minutes the first time) ...", flush=True)
    build_node()
    print(f"build ready after {time.monotonic() - t:.1f} s", flush=True)
    tag = uuid.uuid4().hex[:6]
    ns, tap = f"fpn{tag}", f"fpt{tag}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fpgaccl.host.cli", "node", "--tap", tap, "--ip", NODE_IP,
         "--netns", ns], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        t = time.monotonic()
        lines = []
        while True:
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"fpgaccl node exited ({proc.wait()}):\n{''.join(lines)}")
            lines.append(line)
            if "ready:" in line:
                break
            if time.monotonic() - t > READY_S:
                pytest.fail(f"fpgaccl node not ready after {READY_S} s:\n{''.join(lines)}")
        print(f"node ready after {time.monotonic() - t:.1f} s: {line.strip()}", flush=True)
        assert f"MAC {DEFAULT_MAC}" in line and f"IP {NODE_IP}" in line, line
        yield {"ns": ns, "tap": tap, "ip": NODE_IP, "mac": DEFAULT_MAC}
    finally:
        stop(proc)
        left = os.path.exists(f"/var/run/netns/{ns}")
        if left:
            _sh("ip", "netns", "del", ns)
        assert not left, f"fpgaccl node left its namespace {ns} behind"
        assert proc.returncode == 0, f"fpgaccl node exited with {proc.returncode}"


def _in_ns(node, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return _sh("ip", "netns", "exec", node["ns"], *cmd, timeout=timeout)


def test_arping_resolves_the_node(node):
    r = _in_ns(node, "arping", "-c", "3", "-I", node["tap"], node["ip"])
    replies = re.findall(re.escape(node["mac"]), r.stdout, re.I)
    assert r.returncode == 0 and len(replies) == 3, r.stdout + r.stderr


def test_ping_gets_five_replies(node):
    r = _in_ns(node, "ping", "-c", "5", "-W", "2", node["ip"])
    assert r.returncode == 0 and " 5 received" in r.stdout, r.stdout + r.stderr


def test_control_port_and_drops(node):
    r = _in_ns(node, sys.executable, "-c", SCRIPT, node["tap"], node["ip"], node["mac"],
               str(KEY), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out)
    from fpgaccl.sim.tap import mac_int
    assert out["info"]["mac"] == mac_int(node["mac"])
    assert out["after"] - out["before"] == out["injected"], out
