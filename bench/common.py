"""What every benchmark stores beside its numbers: the command, the git revision, the
machine and the date (bench/results/<bench>.json). Import as ``from common import ...``;
benchmarks run as ``python bench/<name>.py``, which puts this folder on sys.path."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def provenance() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        rev += "-dirty"
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_rev": rev,
        "machine": {"node": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_results(bench: str, results: Any, **extra: Any) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{bench}.json"
    path.write_text(json.dumps({**provenance(), **extra, "results": results}, indent=2) + "\n")
    return path


class Checkout:
    """Another revision's fpgaccl, importable from ``path`` (PYTHONPATH): a worktree and a
    package folder of links laid out as pyproject's package-dir maps it."""

    def __init__(self, rev: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-rev-"))
        self.src = self.tmp / "src"
        subprocess.run(["git", "worktree", "add", "--detach", str(self.src), rev], cwd=REPO,
                       check=True, capture_output=True)
        pkg = self.tmp / "pkg" / "fpgaccl"
        pkg.mkdir(parents=True)
        for f in (self.src / "api").iterdir():
            (pkg / f.name).symlink_to(f)
        for sub in ("proto", "hw", "sim", "host", "boards"):
            (pkg / sub).symlink_to(self.src / sub)
        self.path = str(self.tmp / "pkg")

    def close(self) -> None:
        subprocess.run(["git", "worktree", "remove", "--force", str(self.src)], cwd=REPO,
                       capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
