"""What every benchmark stores beside its numbers: the command, the git revision, the
machine and the date (bench/results/<bench>.json). Import as ``from common import ...``;
benchmarks run as ``python bench/<name>.py``, which puts this folder on sys.path."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
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
