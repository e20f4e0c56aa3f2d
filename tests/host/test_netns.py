"""Two ranks in separate network namespaces joined by a veth pair, impaired in the kernel.

Loss comes from an nftables netdev *ingress* chain and duplication from an *egress* one
(this kernel has no netem), so the datagrams are lost and duplicated by Linux, not by
our own shim. (An ingress ``dup to`` the same device sends the copy back out, where the
other side drops it as not its own: it duplicated nothing.) Each rule counts what it
did, and the test checks that both happened. Needs root, ``ip`` and ``nft`` (with the
netdev egress hook: Linux 5.16+); skipped with the reason otherwise. Addresses are from
TEST-NET-1 and exist only inside the namespaces this test creates and deletes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

SCRIPT = r"""
import json, numpy as np, fpgaccl.host
comm = fpgaccl.host.init(rto_s=0.02, deadline_s=60)
p, r = comm.world_size, comm.rank
x = np.arange(600_000, dtype=np.float32) + r
comm.allreduce(x, algo="ring")
ok = bool(np.array_equal(x, np.arange(600_000, dtype=np.float32) * p + p * (p - 1) / 2))
y = np.full(1000, r + 1, np.int64)
comm.allreduce(y, algo="tree")
ok = ok and bool((y == p * (p + 1) // 2).all())
print(json.dumps({"rank": r, "ok": ok, "stats": comm.stats(), "drops": comm.drop_counters()}),
      flush=True)
"""


PROBE_RX = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
s.bind((sys.argv[1], 4791))
s.settimeout(1)
print("ready", flush=True)
got = []
try:
    while True:
        got.append(s.recv(64))
except TimeoutError:
    pass
print(len(got), len(set(got)))
"""
PROBE_TX = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(1000):
    s.sendto(b"%d" % i, (sys.argv[1], 4791))
    if i % 50 == 49:
        time.sleep(0.005)
"""


def _probe(ns: tuple[str, str], to: str) -> tuple[int, int]:
    """(datagrams, distinct ones) that arrive in ``ns[1]`` of 1000 sent from ``ns[0]``."""
    rx = subprocess.Popen(["ip", "netns", "exec", ns[1], sys.executable, "-c", PROBE_RX, to],
                          stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "ready"
    subprocess.run(["ip", "netns", "exec", ns[0], sys.executable, "-c", PROBE_TX, to],
                   check=True, timeout=30)
    out, _ = rx.communicate(timeout=30)
    n, distinct = out.split()
    return int(n), int(distinct)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def veth_pair():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (apt-get install iproute2 nftables)")
    tag = uuid.uuid4().hex[:6]
    ns = (f"fpa{tag}", f"fpb{tag}")
    devs = (f"va{tag}", f"vb{tag}")
    addrs = ("192.0.2.1", "192.0.2.2")
    try:
        for n in ns:
            _sh("ip", "netns", "add", n)
        _sh("ip", "link", "add", devs[0], "netns", ns[0], "type", "veth", "peer", "name",
            devs[1], "netns", ns[1])
        for n, d, a in zip(ns, devs, addrs, strict=True):
            _sh("ip", "-n", n, "addr", "add", f"{a}/24", "dev", d)
            _sh("ip", "-n", n, "link", "set", d, "up")
            _sh("ip", "-n", n, "link", "set", "lo", "up")
            # 4 % loss on each ingress, 2 % duplicates on each egress.
            rules = "\n".join([
                "table netdev imp {",
                "chain in {", f"type filter hook ingress device {d} priority 0;",
                "udp dport 4791 numgen random mod 100 < 4 counter drop", "}",
                "chain out {", f"type filter hook egress device {d} priority 0;",
                f"udp dport 4791 numgen random mod 100 < 2 counter dup to {d}", "}",
                "}"]) + "\n"
            subprocess.run(["ip", "netns", "exec", n, "nft", "-f", "-"], input=rules,
                           check=True, capture_output=True, text=True, timeout=30)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        err = e.stderr if isinstance(e, subprocess.CalledProcessError) else str(e)
        pytest.skip(f"cannot build the namespace test bed here: {err}")
    yield ns, addrs
    for n in ns:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_kernel_impaired_link_between_namespaces(veth_pair, tmp_path) -> None:
    import json
    ns, addrs = veth_pair
    # The impairment is real: datagrams arrive twice, and some never.
    n, distinct = _probe(ns, addrs[1])
    assert n > distinct and distinct < 1000, (n, distinct)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    procs = []
    for r, n in enumerate(ns):
        env = dict(os.environ, FPGACCL_RANK=str(r), FPGACCL_WORLD_SIZE="2",
                   MASTER_ADDR=addrs[0], MASTER_PORT="29533",
                   FPGACCL_MTU="1024")  # the veth has a 1500-byte MTU
        procs.append(subprocess.Popen(["ip", "netns", "exec", n, sys.executable, str(script)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    res = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(r["ok"] for r in res), res
    # The kernel really dropped and duplicated datagrams, and the transport recovered.
    counted = {"drop": 0, "dup": 0}
    for n in ns:
        out = subprocess.run(["ip", "netns", "exec", n, "nft", "list", "table", "netdev",
                              "imp"], check=True, capture_output=True, text=True,
                             timeout=30).stdout
        for packets, kind in re.findall(r"counter packets (\d+) bytes \d+ (drop|dup)", out):
            counted[kind] += int(packets)
    assert counted["drop"] > 0 and counted["dup"] > 0, counted
    assert sum(r["stats"].get("retransmits", 0) for r in res) > 0
    # Duplicates reached the receivers, which dropped them.
    assert sum(r["drops"]["PSN_DUPLICATE"] for r in res) > 0
    # Early arrivals on a veth can only come from the kernel's drops: the responder held
    # them (proto/reliability.py) rather than dropping them.
    assert sum(r["stats"].get("rx_held", 0) for r in res) > 0
    from fpgaccl.host import native
    if native.load() is not None:  # the losses hit the C steady-state loop too
        assert sum(r["stats"].get("bulk_rx_packets", 0) + r["stats"].get("bulk_tx_packets", 0)
                   for r in res) > 0
