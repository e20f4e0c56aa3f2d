"""A simulation that serves ranks over a Unix socket, run as a child process: the
simulation server of the ``sim`` backend (:mod:`fpgaccl.sim.server`) and the simulated
board of the ``board`` backend (:mod:`fpgaccl.sim.board`) are started, awaited and
stopped alike."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from fpgaccl.errors import BackendUnavailableError


class SocketServerProcess:
    """``python -m module --socket PATH --run-dir DIR *args`` in a private temporary folder.

    The child gets its own process group: the simulator is a grandchild (cocotb's runner
    starts it), and killing the group is the only way not to leave it running."""

    kind = "simulation"

    def __init__(self, module: str, args: list[str], *, prefix: str, socket_name: str,
                 env: dict[str, str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.socket = os.path.join(self.dir, socket_name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--socket", self.socket, "--run-dir", self.dir,
             *args], env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout_s: float = 1800.0) -> str:
        """Wait for the socket (the first call may build the design: minutes)."""
        end = time.monotonic() + timeout_s
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise BackendUnavailableError(
                    f"the {self.kind} exited with {self.proc.returncode} before it "
                    f"listened (log: {self.dir}/sim.log)")
            if time.monotonic() > end:
                self._kill()
                raise BackendUnavailableError(f"no {self.kind} after {timeout_s:g} s")
            time.sleep(0.1)
        return self.socket

    def stop(self, timeout_s: float = 60.0) -> int:
        """Ask the child to shut down and wait for it; kill it if it does not end."""
        if self.proc.poll() is None and os.path.exists(self.socket):
            from fpgaccl.proto.framing import encode
            with contextlib.suppress(OSError), \
                    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.socket)
                s.sendall(encode({"op": "shutdown"}))
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()
            return self.proc.wait()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
