"""``fpgaccl run`` end to end: ranks from the launcher, one pcap that tshark decodes, and
no rank outliving a launcher that is told to stop."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fpgaccl.host.layers import dissect
from fpgaccl.host.pcap import read
from fpgaccl.proto.opcodes import Opcode
from fpgaccl.sim.servers.child import SocketServerProcess

SCRIPT = """
import numpy as np, fpgaccl.host
comm = fpgaccl.host.init()
x = np.arange(3000, dtype=np.float32) + comm.rank
comm.allreduce(x)
p = comm.world_size
assert np.array_equal(x, np.arange(3000, dtype=np.float32) * p + p * (p - 1) / 2), x[:4]
print("rank", comm.rank, "of", p, "ok", flush=True)
"""


def _fpgaccl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fpgaccl.host.cli", *args], text=True,
                          capture_output=True, timeout=timeout)


def test_run_spawns_ranks_and_init_finds_them(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    res = _fpgaccl("run", "-n", "3", "--", sys.executable, str(script))
    assert res.returncode == 0, res.stderr
    found = sorted(re.findall(r"rank (\d+) of (\d+) ok", res.stdout))
    assert found == [(str(r), "3") for r in range(3)], f"{res.stdout}\n{res.stderr}"
    assert "anyone who reaches" not in res.stderr  # the launcher gave the ranks a secret


def test_the_readmes_run_line_works_from_a_shell_without_the_environment(
        tmp_path: Path) -> None:
    # `./fpgaccl run -n 2 -- python script.py` where PATH knows no .venv: the ranks' python
    # must still be the one fpgaccl is installed in.
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    wrapper = Path(__file__).resolve().parents[2] / "fpgaccl"
    res = subprocess.run([str(wrapper), "run", "-n", "2", "--", "python", str(script)],
                         env=env, text=True, capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(re.findall(r"rank (\d+) of 2 ok", res.stdout)) == ["0", "1"], res.stdout


def test_run_reports_a_failing_rank(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['FPGACCL_RANK'] == '1' else 0)\n")
    res = _fpgaccl("run", "-n", "2", "--", sys.executable, str(script))
    assert res.returncode == 3
    assert "rank 1 exited with 3" in res.stderr


def test_run_reports_a_rank_killed_by_a_signal(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\n"
                      "if os.environ['FPGACCL_RANK'] == '1':\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n")
    res = _fpgaccl("run", "-n", "2", "--", sys.executable, str(script))
    assert res.returncode == 128 + 9, res.stderr
    assert "rank 1 was killed by SIGKILL" in res.stderr


def test_pcap_of_a_run_is_valid_rocev2(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    pcap = tmp_path / "run.pcap"
    res = _fpgaccl("run", "-n", "3", "--pcap", str(pcap), "--", sys.executable, str(script))
    assert res.returncode == 0, res.stderr
    frames = list(read(pcap))
    assert len(frames) > 10
    assert [t for t, _ in frames] == sorted(t for t, _ in frames), "not merged by time"
    opcodes = set()
    for _, f in frames:
        pkt = dissect(f)  # strict: every layer against proto, and the ICRC
        opcodes.add(pkt["BTH"].opcode)
    assert int(Opcode.ACKNOWLEDGE) in opcodes
    assert int(Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE) in opcodes
    tshark = shutil.which("tshark")
    if tshark is None:
        pytest.skip("tshark is not installed")
    out = subprocess.run([tshark, "-r", str(pcap), "-T", "fields", "-e", "udp.dstport",
                          "-e", "infiniband.bth.opcode", "-e", "infiniband.bth.psn",
                          "-e", "_ws.expert", "-e", "_ws.malformed"],
                         text=True, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    assert len(rows) == len(frames)
    for row in rows:
        assert row[0] == "4791"
        assert row[1] != "", f"tshark did not decode a BTH: {row}"
        assert row[3:] == [""] * len(row[3:]), f"tshark flags a frame: {row}"


def test_bench_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    res = _fpgaccl("bench", "allreduce", "-g", "3", "-b", "8", "-e", "64K", "-f", "8",
                   "-n", "2", "-w", "1", "-c", "1", "--json", str(out))
    assert res.returncode == 0, res.stderr + res.stdout
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 3 and doc["wrong_total"] == 0
    assert [r["size"] for r in doc["rows"]] == [8, 64, 512, 4096, 32768]
    for key in ("command", "git_rev", "machine", "date"):
        assert doc[key]
    # Numbers printed are the numbers stored.
    for row in doc["rows"]:
        assert f"{row['out_of_place']['busbw']:.3f}" in res.stdout


@pytest.mark.parametrize("coll", ["reduce_scatter", "allgather", "alltoall", "broadcast",
                                  "reduce", "sendrecv"])
def test_bench_checks_other_collectives(coll: str) -> None:
    res = _fpgaccl("bench", coll, "-g", "2", "-b", "1K", "-e", "16K", "-f", "16", "-n", "2",
                   "-w", "0", "-c", "1", "-d", "int32")
    assert res.returncode == 0, res.stderr + res.stdout
    assert "Out of bounds values : 0 OK" in res.stdout


# A rank that sleeps until stopped; rank 0 also starts a child of its own (a grandchild of
# the launcher), and with "ignore" rank 1 ignores the stop signals. Each process writes its
# pid file only when ready, so a signal sent after they all exist finds them set up.
SLEEPER = """
import os, pathlib, signal, subprocess, sys, time
d, mode, rank = pathlib.Path(sys.argv[1]), sys.argv[2], os.environ["FPGACCL_RANK"]
if mode == "ignore" and rank == "1":
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
if rank == "0":
    subprocess.Popen([sys.executable, "-c", "import os, pathlib, sys, time; "
                      "p = pathlib.Path(sys.argv[1]); p.write_text(str(os.getpid())); "
                      "p.rename(p.with_suffix('.pid')); time.sleep(600)",
                      str(d / "grandchild.tmp")])
tmp = d / f"rank{rank}.tmp"
tmp.write_text(str(os.getpid()))
tmp.rename(tmp.with_suffix(".pid"))  # whole, or not there
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie nobody reaps (a container's init may not) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _pids(d: Path, n: int, launcher: subprocess.Popen) -> list[int]:
    end = time.monotonic() + 10
    while len(files := list(d.glob("*.pid"))) < n:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < end, "the ranks did not start"
        time.sleep(0.02)
    return [int(f.read_text()) for f in files]


def _signalled(tmp_path: Path, sig: int, mode: str, grace: float) -> tuple:
    """Start 3 sleeping ranks, signal the launcher; its exit status, stderr, the seconds
    it took to exit and the pids of the ranks and the grandchild."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", "3", "--grace", str(grace),
         "--", sys.executable, "-c", SLEEPER, str(tmp_path), mode],
        stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = _pids(tmp_path, 4, launcher)
        t0 = time.monotonic()
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=grace + 10)
        return launcher.returncode, err, time.monotonic() - t0, pids
    finally:
        launcher.kill()
        survivors = [p for p in pids if _alive(p)]
        for p in survivors:  # never leave them behind, even when the test fails
            os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT],
                         ids=lambda s: s.name)
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path: Path, sig: int) -> None:
    rc, err, took, pids = _signalled(tmp_path, sig, "obey", grace=5)
    assert rc == 128 + sig, err
    assert took < 5, f"the ranks obeyed at once, yet the launcher took {took:.1f} s"
    assert f"stopped by {signal.Signals(sig).name}" in err
    assert [p for p in pids if _alive(p)] == [], "ranks (or a rank's child) survived"


def test_a_rank_that_ignores_the_signal_is_killed_after_the_grace_period(
        tmp_path: Path) -> None:
    rc, err, took, pids = _signalled(tmp_path, signal.SIGTERM, "ignore", grace=1.5)
    assert rc == 128 + signal.SIGTERM, err
    assert 1.5 <= took < 1.5 + 5, took
    assert "rank(s) [1] still running after SIGTERM: SIGKILL" in err
    assert [p for p in pids if _alive(p)] == []


class _BuildingBoard(SocketServerProcess):
    """A simulated board that never gets to listen (it still builds), in a session of its
    own as the real one; with ``obey=False`` it ignores SIGTERM too."""

    def __init__(self, made: list, obey: bool) -> None:
        self.dir = tempfile.mkdtemp(prefix="fpgaccl-test-board-")
        self.socket = os.path.join(self.dir, "board.sock")
        ignore = "" if obey else "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        self.proc = subprocess.Popen([sys.executable, "-c", f"import signal, time; {ignore}"
                                      "time.sleep(600)"], start_new_session=True)
        made.append(self)


@pytest.mark.parametrize("obey", [True, False], ids=["obeys", "ignores"])
def test_a_signal_while_the_board_builds_stops_the_board(monkeypatch, obey: bool) -> None:
    from fpgaccl.host import launcher
    from fpgaccl.sim import board
    monkeypatch.delenv("FPGACCL_BOARD", raising=False)
    made: list = []
    monkeypatch.setattr(board, "BoardProcess", lambda: _BuildingBoard(made, obey))
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    old = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("SIGTERM reached the test"))
    t0 = time.monotonic()
    try:
        rc = launcher.run(2, ["true"], backend="board", grace_s=1.0)
    finally:
        signal.signal(signal.SIGTERM, old)
        for b in made:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(b.proc.pid, signal.SIGKILL)
    took = time.monotonic() - t0
    assert rc == 128 + signal.SIGTERM
    (b,) = made
    assert b.proc.poll() is not None, "the board outlived the launcher"
    assert took < (1.5 if obey else 1.0 + 5), took


SKIP_SCRIPT = """
import numpy as np, fpgaccl.host
comm = fpgaccl.host.init()
x = np.ones(1000, np.float32)
for i in range(3):
    if comm.rank == 2 and i == 2:
        break  # rank 2 skips the third call
    comm.allreduce(x)
print("rank", comm.rank, "done", flush=True)
"""


def test_a_failed_run_prints_every_ranks_flight_record(tmp_path: Path) -> None:
    script = tmp_path / "skip.py"
    script.write_text(SKIP_SCRIPT)
    res = _fpgaccl("run", "-n", "4", "--deadline", "5", "--", sys.executable, str(script))
    assert res.returncode != 0, res.stderr
    err = res.stderr
    assert "flight recorder" in err, err
    blocks = re.split(r"\n  rank (\d) world ", err.split("flight recorder", 1)[1])
    by_rank = {int(blocks[i]): blocks[i + 1] for i in range(1, len(blocks), 2)}
    assert sorted(by_rank) == [0, 1, 2, 3], err
    # Rank 2 finished two allreduces, and its third call is the barrier of leaving;
    # every rank's third call fails on the signatures (checked by default), naming the
    # field and the two sides of the pair it learnt of, and the report names the call
    # where they differ.
    mismatch = (r"failed .*\(CollectiveMismatchError: kind: "
                r"(rank [01] allreduce, rank 2 barrier|rank 2 barrier, rank 3 allreduce)")
    assert re.search(r"#2 allreduce count=1000 dtype=FLOAT32 op=SUM.*: done", by_rank[2])
    assert re.search(r"#3 barrier .*" + mismatch, by_rank[2]), by_rank[2]
    for r in (0, 1, 3):
        assert re.search(r"#1 allreduce .*: done", by_rank[r]), by_rank[r]
        assert re.search(r"#3 allreduce .*" + mismatch, by_rank[r]), by_rank[r]
    assert re.search(r"world: the ranks' call #3 differs: allreduce 1000 FLOAT32 SUM "
                     r"allreduce/\w+ on rank\(s\) \[0, 1, 3\]; barrier [^;]*on rank\(s\) \[2\]",
                     err), err
