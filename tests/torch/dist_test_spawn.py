"""PyTorch's own ``DistributedTest._DistTestBase`` (shipped in the wheel as
``torch.testing._internal.distributed.distributed_test``) run against the fpgaccl backend,
the way PyTorch's ``test/distributed/test_distributed_spawn.py`` runs it for Gloo::

    BACKEND=fpgaccl WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) python tests/torch/dist_test_spawn.py \\
        TestDistBackendWithSpawn.test_all_reduce_sum

Each test spawns WORLD_SIZE ranks (multiprocessing ``spawn``: every rank re-imports this
file, which registers the backend) that join by ``file://`` and run the test body.
tests/torch/test_dist_test_base.py picks which tests run, and says why the others don't.
"""

from __future__ import annotations

import os
import sys
import types
import unittest
from pathlib import Path

# distributed_test reads these at import time; run_test.py sets them for gloo the same way.
os.environ.setdefault("BACKEND", "fpgaccl")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    raise SystemExit("TEMP_DIR must name a directory (the test base keeps its barrier there)")

# Spawned ranks start from this file's path, so the repository root is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

try:
    import expecttest  # noqa: F401
except ImportError:
    # torch's test utilities import it (a test-only package, not in torch's requirements)
    # for a TestCase base whose inline-expectation asserts these tests do not use.
    sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase, ACCEPT=False)


def _import_base() -> tuple[type, type]:
    from torch.testing._internal.common_distributed import DistTestCases

    # The base gates tests on backend names in these sets when it is imported: "plugin" is
    # its hook for out-of-tree backends; "ddp" and "gpu" gate DDP and object-collective
    # tests that run on CPU tensors when torch has no CUDA (this CPU wheel). Tests that
    # name gloo or mpi outright stay skipped.
    for feature in ("plugin", "ddp", "gpu"):
        DistTestCases.backend_feature[feature].add(os.environ["BACKEND"])
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    import fpgaccl.torch  # noqa: F401  (registers "fpgaccl" in every rank)

    return DistributedTest._DistTestBase, TestDistBackend


_DistTestBase, TestDistBackend = _import_base()


class TestDistBackendWithSpawn(TestDistBackend, _DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
