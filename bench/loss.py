"""Loss, duplication and reordering on a four-namespace test bed: what they cost an allreduce.

Four ranks, each in its own network namespace, joined by veth pairs to a kernel bridge in a
fifth (the hub). Loss is an nftables netdev *ingress* rule on each rank's veth (``numgen
random``: the kernel drops the datagram) and duplication an *egress* ``dup to`` rule, both on
UDP port 4791 only (ACKs included), and each rule counts what it did. nftables cannot delay
and this kernel has no netem, so reordering is a detour: an ingress rule on the hub's veths
sends a share of the RoCEv2 datagrams (``fwd to``) into a spare veth pair, where a small
user-space relay (AF_PACKET) holds each ``--delay-ms`` and then puts it out of the bridge
port of its destination; everything else crosses the kernel bridge at once, so each detoured
datagram arrives behind the ones sent after it in that time. Checksum offload is off on the
veths (SIOCETHTOOL; no ethtool here) so that forwarded frames carry real checksums.

Each case is one 4 MiB float32 ring allreduce (checked bit-exact) after a barrier, timed on
every rank (the slowest is the case's time); cases run in interleaved rounds. Packets sent
and retransmitted are the engines' counters over the timed call; lost and duplicated are the
nft counters over the same call. Needs root, ``ip`` and ``nft``.

    sudo .venv/bin/python bench/loss.py [--rounds 1] [--cases clean,loss5dup2,loss10,reorder5]
        [--against REV] [--patient]

``--against REV`` runs another revision's engine too, case by case in the same rounds (the
fair comparison on a loaded machine); ``--patient`` gives the ranks a 60 s peer timeout and
no retry limit, for engines whose recovery the default liveness checks take for death.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from common import Checkout, write_results

WORLD = 4
MTU = 1024  # the veths' 1500-byte MTU holds a 1024-byte RoCEv2 payload
ELEMS = (4 << 20) // 4

CASES = {
    # name: (loss %, dup %, reorder %, through the relay)
    "clean": (0, 0, 0, False),
    "loss5dup2": (5, 2, 0, False),
    "loss10": (10, 0, 0, False),
    "reorder5": (0, 0, 5, True),
}

RANK = r"""
import json, os, sys, time, numpy as np, fpgaccl.host
comm = fpgaccl.host.init(deadline_s=600%(init)s)
r, p = comm.rank, comm.world_size
x = np.arange(%(elems)d, dtype=np.float32) + r
want = np.arange(%(elems)d, dtype=np.float32) * p + p * (p - 1) / 2
comm.barrier()
print("ready", flush=True)
sys.stdin.readline()  # the bench has reset the nft counters and started the relay
for _ in range(%(warm)d):  # untimed calls on the impaired path: what the engine learns stays
    w = x.copy()
    comm.allreduce(w, algo="ring")
if %(warm)d:
    print("warm", flush=True)
    sys.stdin.readline()  # counters reset again
comm.barrier()
s0 = comm.stats()
c0, t0 = time.process_time(), time.perf_counter()
comm.allreduce(x, algo="ring")
t, c = time.perf_counter() - t0, time.process_time() - c0
s1 = comm.stats()
ok = bool(np.array_equal(x, want))
comm.barrier()
d = {k: s1.get(k, 0) - s0.get(k, 0) for k in s1}
print(json.dumps({"rank": r, "ok": ok, "time_s": t, "cpu_s": c, "stats": d}), flush=True)
sys.stdin.readline()
comm.close()
"""

RELAY = r"""
import os, select, socket, sys, time
src, delay = sys.argv[1], float(sys.argv[2]) / 1000
out = {bytes.fromhex(m): d for m, d in (x.split("=") for x in sys.argv[3].split(","))}
rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
rx.bind((src, 0))
rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
tx = {}
for m, d in out.items():
    tx[m] = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    tx[m].bind((d, 0))
held = []  # (due, frame), in arrival order
n = 0
print("relay ready", flush=True)
while not os.path.exists(sys.argv[4]):
    wait = 0.05 if not held else max(0.0, held[0][0] - time.monotonic())
    if select.select([rx], [], [], wait)[0]:
        while True:
            try:
                frame, addr = rx.recvfrom(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if addr[2] != socket.PACKET_OUTGOING:
                held.append((time.monotonic() + delay, frame))
    now = time.monotonic()
    while held and held[0][0] <= now:
        frame = held.pop(0)[1]
        s = tx.get(frame[0:6])
        if s is not None:
            s.send(frame)
            n += 1
print(n, flush=True)
"""


def sh(*cmd: str, inp: str | None = None) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60,
                          input=inp).stdout


def no_tx_checksum(ns: str, dev: str) -> None:
    """Checksum offload off on ``dev`` (ETHTOOL_STXCSUM through SIOCETHTOOL; no ethtool
    here): a frame the relay forwards must carry its real checksums."""
    code = ("import ctypes,fcntl,socket,struct,sys\n"
            "v=ctypes.create_string_buffer(struct.pack('II',0x17,0))\n"
            "r=struct.pack('16sP',sys.argv[1].encode(),ctypes.addressof(v))+bytes(16)\n"
            "fcntl.ioctl(socket.socket(),0x8946,r)\n")
    sh("ip", "netns", "exec", ns, sys.executable, "-c", code, dev)


class Bed:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:5]
        self.hub = f"lhub{tag}"
        self.ns = [f"lr{r}{tag}" for r in range(WORLD)]
        self.dev = [f"le{r}{tag}" for r in range(WORLD)]  # rank side
        self.hdev = [f"lh{r}{tag}" for r in range(WORLD)]  # hub side
        self.addrs = [f"192.0.2.{r + 1}" for r in range(WORLD)]
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for r in range(WORLD):
            sh("ip", "netns", "add", self.ns[r])
            sh("ip", "link", "add", self.dev[r], "netns", self.ns[r], "type", "veth", "peer",
               "name", self.hdev[r], "netns", self.hub)
            sh("ip", "-n", self.ns[r], "addr", "add", f"{self.addrs[r]}/24", "dev", self.dev[r])
            for ns, d in ((self.ns[r], self.dev[r]), (self.ns[r], "lo"),
                          (self.hub, self.hdev[r])):
                sh("ip", "-n", ns, "link", "set", d, "up")
            sh("ip", "-n", self.hub, "link", "set", self.hdev[r], "master", "br0")
            no_tx_checksum(self.ns[r], self.dev[r])
            no_tx_checksum(self.hub, self.hdev[r])
        # The detour of the reordered datagrams: into dly0, out of dly1 to the relay.
        sh("ip", "-n", self.hub, "link", "add", "dly0", "type", "veth", "peer", "name", "dly1")
        for d in ("dly0", "dly1"):
            sh("ip", "-n", self.hub, "link", "set", d, "up")
        self.macs = []
        for r in range(WORLD):
            out = sh("ip", "-n", self.ns[r], "link", "show", self.dev[r])
            self.macs.append(re.search(r"link/ether ([0-9a-f:]+)", out).group(1))

    def reorder(self, pct: int) -> None:
        """Divert ``pct`` % of the RoCEv2 datagrams entering the hub to the relay."""
        subprocess.run(["ip", "netns", "exec", self.hub, "nft", "delete", "table", "netdev",
                        "ro"], capture_output=True)
        if not pct:
            return
        rules = ["table netdev ro {"]
        for i, h in enumerate(self.hdev):
            rules += [f"chain c{i} {{", f"type filter hook ingress device {h} priority 0;",
                      f"udp dport 4791 numgen random mod 100 < {pct} counter fwd to dly0",
                      "}"]
        sh("ip", "netns", "exec", self.hub, "nft", "-f", "-", inp="\n".join([*rules, "}"]))

    def impair(self, loss: int, dup: int) -> None:
        for ns, d in zip(self.ns, self.dev, strict=True):
            subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "netdev",
                            "imp"], capture_output=True)
            rules = "\n".join([
                "table netdev imp {",
                "chain in {", f"type filter hook ingress device {d} priority 0;",
                f"udp dport 4791 numgen random mod 100 < {loss} counter drop", "}",
                "chain out {", f"type filter hook egress device {d} priority 0;",
                f"udp dport 4791 numgen random mod 100 < {dup} counter dup to {d}", "}",
                "}"]) + "\n"
            sh("ip", "netns", "exec", ns, "nft", "-f", "-", inp=rules)

    def counters(self) -> dict[str, int]:
        got = {"drop": 0, "dup": 0}
        for ns in self.ns:
            out = sh("ip", "netns", "exec", ns, "nft", "list", "table", "netdev", "imp")
            for packets, kind in re.findall(r"counter packets (\d+) bytes \d+ (drop|dup)", out):
                got[kind] += int(packets)
        return got

    def close(self) -> None:
        for ns in (*self.ns, self.hub):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def expect(procs: list[subprocess.Popen], word: str, failure: str) -> None:
    """Every rank's next line is ``word``; else ``failure``, with what the rank said."""
    for p in procs:
        line = p.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"{failure}: {line!r} {p.stderr.read()[-2000:]}")


def tell(procs: list[subprocess.Popen], word: str) -> None:
    for p in procs:
        p.stdin.write(word + "\n")
        p.stdin.flush()


def run_case(bed: Bed, name: str, delay_ms: float, init: str = "",
             pythonpath: str | None = None, warm: int = 0) -> dict:
    loss, dup, reorder, relayed = CASES[name]
    bed.impair(loss, dup)
    env_base = dict(os.environ, FPGACCL_WORLD_SIZE=str(WORLD), MASTER_ADDR=bed.addrs[0],
                    MASTER_PORT="29611", FPGACCL_MTU=str(MTU),
                    FPGACCL_JOB_SECRET=uuid.uuid4().hex)
    if pythonpath:
        env_base["PYTHONPATH"] = pythonpath
    script = RANK % {"elems": ELEMS, "init": init, "warm": warm}
    relay = None
    stop = Path(tempfile.gettempdir()) / f"loss-relay-stop-{uuid.uuid4().hex}"
    if relayed:
        macs = ",".join(f"{m.replace(':', '')}={h}"
                        for m, h in zip(bed.macs, bed.hdev, strict=True))
        relay = subprocess.Popen(["ip", "netns", "exec", bed.hub, sys.executable, "-c", RELAY,
                                  "dly1", str(delay_ms), macs, str(stop)],
                                 stdout=subprocess.PIPE, text=True)
        assert relay.stdout.readline().strip() == "relay ready"
    procs = []
    try:
        for r in range(WORLD):
            env = dict(env_base, FPGACCL_RANK=str(r))
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", bed.ns[r], sys.executable, "-c", script], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))
        expect(procs, "ready", f"{name}: a rank did not start")
        bed.impair(loss, dup)  # counters from zero for the timed call
        bed.reorder(reorder)
        tell(procs, "go")
        if warm:
            expect(procs, "warm", f"{name}: a rank failed warming up")
            bed.impair(loss, dup)  # counters from zero for the timed call
            tell(procs, "go")
        res = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{name}: a rank failed: {p.stderr.read()[-3000:]}")
            res.append(json.loads(line))
        imp = bed.counters()
        tell(procs, "bye")
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if relay is not None:
            stop.touch()
            delayed = int(relay.communicate(timeout=30)[0].split()[-1])
            stop.unlink()
        bed.reorder(0)
    st = [r["stats"] for r in res]
    row = {
        "case": name, "loss_pct": loss, "dup_pct": dup, "reorder_pct": reorder, "warm": warm,
        "time_s": max(r["time_s"] for r in res),
        "cpu_s": sum(r["cpu_s"] for r in res),  # all ranks' CPU over the call
        "ok": all(r["ok"] for r in res),
        "sent": sum(s.get("tx_packets", 0) + s.get("bulk_tx_packets", 0) for s in st),
        "retransmitted": sum(s.get("retransmits", 0) for s in st),
        "timeouts": sum(s.get("timeouts", 0) for s in st),
        "naks_rx": sum(s.get("nak_rx", 0) for s in st),
        "naks_ignored": sum(s.get("nak_ignored", 0) for s in st),
        "window_cuts": sum(s.get("window_cuts", 0) for s in st),
        # Reordering (QueuePair._cut_reported): cuts spared and undone, needless resends.
        "window_cuts_spared": sum(s.get("window_cuts_spared", 0) for s in st),
        "window_cuts_undone": sum(s.get("window_cuts_undone", 0) for s in st),
        "resends_needless": sum(s.get("resends_needless", 0) for s in st),
        "duplicates_reported": sum(s.get("duplicates_reported", 0) for s in st),
        "held": sum(s.get("rx_held", 0) for s in st),
        # The requester's reordering window (QueuePair._defer): resends that waited,
        # and the holes that filled meanwhile.
        "resends_deferred": sum(s.get("resends_deferred", 0) for s in st),
        "holes_filled_late": sum(s.get("holes_filled_late", 0) for s in st),
        "holes_reported": sum(s.get("holes_reported", 0) for s in st),
        # Holding reports (QueuePair._report_held): how far a responder holds past a hole.
        "held_reports": sum(s.get("held_reports", 0) for s in st),
        # Reordering notices (QueuePair._notify_reordering): sent, and hole reports the
        # peer then held back and those a late packet spared.
        "reordering_notices": sum(s.get("reordering_notices", 0) for s in st),
        "reports_held_back": sum(s.get("reports_held_back", 0) for s in st),
        "reports_spared": sum(s.get("reports_spared", 0) for s in st),
        "holdoffs_dropped": sum(s.get("holdoffs_dropped", 0) for s in st),
        # Retransmitted packets by what resent them (QueuePair.retransmit's ``why``).
        "retx_by": {k[5:]: sum(s.get(k, 0) for s in st)
                    for k in sorted({k for s in st for k in s if k.startswith("retx_")})},
        "lost": imp["drop"], "duplicated": imp["dup"],
    }
    if relay is not None:
        row["delayed"] = delayed
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--delay-ms", type=float, default=1.0,
                    help="how late each reordered datagram arrives")
    ap.add_argument("--patient", action="store_true",
                    help="peer_timeout_s=60, retry_limit=None: time what the defaults fail")
    ap.add_argument("--against", default="", metavar="REV",
                    help="also run, interleaved with this tree, the fpgaccl of git revision "
                         "REV (checked out in a temporary worktree)")
    ap.add_argument("--warm", type=int, default=0, metavar="N",
                    help="N untimed allreduces on the impaired path before the timed one "
                         "(the engine keeps what it learned: window, round trip, reordering)")
    ap.add_argument("--out", default="loss")
    ap.add_argument("--label", default="", help="stored with the rows (before/after)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/loss.py needs root (network namespaces, nftables)")
    names = args.cases.split(",")
    for n in names:
        if n not in CASES:
            sys.exit(f"--cases: unknown case {n!r} (known: {', '.join(CASES)})")
    variants: list[tuple[str, str | None]] = [("this tree", None)]
    other = None
    if args.against:
        other = Checkout(args.against)
        variants.insert(0, (args.against, other.path))
    # A TERM or HUP unwinds through the finally blocks: ranks killed, namespaces deleted.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit("bench/loss.py: signal, cleaning up"))
    init = ", peer_timeout_s=60, retry_limit=None" if args.patient else ""
    bed = Bed()
    rows: list[dict] = []
    load = os.getloadavg()
    try:
        for rnd in range(args.rounds):
            for n in names:
                for variant, pythonpath in variants:  # interleaved: the same load for each
                    try:
                        row = run_case(bed, n, args.delay_ms, init, pythonpath, args.warm)
                    except RuntimeError as e:  # a failed case is a result too
                        row = {"case": n, "time_s": None, "ok": False,
                               "error": str(e)[-600:]}
                    row.update(round=rnd, variant=variant, load1=os.getloadavg()[0])
                    rows.append(row)
                    if row["time_s"] is None:
                        print(f"round {rnd} {variant:10s} {n:10s} FAILED: "
                              f"{row['error'].splitlines()[-1]}", file=sys.stderr, flush=True)
                        continue
                    print(f"round {rnd} {variant:10s} {n:10s} {row['time_s']:8.3f} s  "
                          f"sent {row['sent']:7d}  retx {row['retransmitted']:7d}  "
                          f"lost {row['lost']:6d}  ok {row['ok']}", file=sys.stderr, flush=True)
    finally:
        bed.close()
        if other is not None:
            other.close()
    table = []
    for variant, _ in variants:
        base = None
        for n in names:
            mine = [r for r in rows if r["case"] == n and r["variant"] == variant]
            failed = sum(r["time_s"] is None for r in mine)
            mine = [r for r in mine if r["time_s"] is not None]
            if not mine:
                table.append({"variant": variant, "case": n, "time_s": None, "ok": False,
                              "failed": failed})
                continue
            med = sorted(r["time_s"] for r in mine)[len(mine) // 2]
            agg = {k: sum(r[k] for r in mine) // len(mine)
                   for k in ("sent", "retransmitted", "lost", "duplicated", "timeouts",
                             "naks_rx")}
            if n == "clean":
                base = med
            table.append({"variant": variant, "case": n, "time_s": med,
                          "ok": all(r["ok"] for r in mine), "failed": failed, **agg,
                          "x_clean": med / base if base else None,
                          "retx_per_lost": (agg["retransmitted"] / agg["lost"]
                                            if agg["lost"] else None)})
    print(f"\n4 ranks, {ELEMS * 4 >> 20} MiB float32 ring allreduce, MTU {MTU}, "
          f"{args.rounds} round(s), median time; load at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} cores, shared)")
    print(f"{'variant':10s} {'case':10s} {'time s':>8s} {'x clean':>8s} {'sent':>8s} "
          f"{'retx':>8s} {'lost':>7s} {'dup':>6s} {'retx/lost':>9s} {'RTOs':>6s} ok")
    for t in table:
        if t["time_s"] is None:
            print(f"{t['variant']:10s} {t['case']:10s} {'failed':>8s} (every round)")
            continue
        x = f"{t['x_clean']:8.2f}" if t["x_clean"] else f"{'-':>8s}"
        rl = f"{t['retx_per_lost']:9.2f}" if t["retx_per_lost"] is not None else f"{'-':>9s}"
        fails = f" ({t['failed']} failed)" if t["failed"] else ""
        print(f"{t['variant']:10s} {t['case']:10s} {t['time_s']:8.3f} {x} {t['sent']:8d} "
              f"{t['retransmitted']:8d} {t['lost']:7d} {t['duplicated']:6d} {rl} "
              f"{t['timeouts']:6d} {'yes' if t['ok'] else 'NO'}{fails}")
    path = write_results(args.out, {"table": table, "rounds": rows}, label=args.label,
                         load_at_start=load, world=WORLD, bytes=ELEMS * 4, mtu=MTU,
                         delay_ms=args.delay_ms, patient=args.patient)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
