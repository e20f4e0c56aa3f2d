"""Process helpers the e2e tests share."""

from __future__ import annotations

import os
import signal
import subprocess


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (a node leaves its TAP and namespace on it), SIGKILL to its group after 40 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
