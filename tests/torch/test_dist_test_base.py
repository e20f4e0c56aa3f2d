"""A subset of PyTorch's own distributed test base (``DistributedTest._DistTestBase``, in
the wheel) run against the fpgaccl backend by tests/torch/dist_test_spawn.py, 2 ranks.

Families not run, and why:
- CUDA / multi-GPU (``*_cuda``, ``*_gpu``, NCCL-only): fpgaccl.torch takes CPU tensors.
- Subgroups (``*_group``, ``*_full_group``, ``new_subgroups``, model averagers, hierarchical
  SGD): subset groups run on sub-communicators now (tests/torch/worker.py checks them),
  but upstream skips the ``*_group`` tests at 2 and 3 ranks ("small world size", tried),
  and a 4-rank spawn of each is more than this shared 2-core machine can time here.
- ``all_gather_coalesced`` (list of lists): not implemented (raises UnsupportedError).
- Tagged or any-source point to point (``*_with_tag``, ``*_any_source``): the engine matches
  by order per peer, without tags or wildcards.
- Complex tensors (``*_complex``): not among the backend's dtypes.
- Skipped upstream by backend name whatever the backend can do: ``all_to_all*`` (MPI only),
  ``get_future`` (mpi/nccl/gloo; also ``accumulate_gradients_no_sync``), and gloo only:
  ``all_reduce_coalesced_*``, ``sparse_all_reduce_*``, ``batch_isend_irecv_gloo*``,
  ``scatter_object_list``, ``monitored_barrier_*``, ``barrier_timeout_*``.
- World size or devices: ``gather_object`` needs exactly 4 ranks; ``DistributedSampler_padding``,
  ``ddp_zero_output_features``, ``ddp_sync_module_states``, ``ddp_inference`` and
  ``ddp_buffer_hook_allreduce`` need 2 CUDA devices; ``broadcast_object_list`` is disabled
  upstream (a known failure).
- Not tried yet: the profiler variants (``*_autograd_profiler``, ``*_torch_profiler``) and
  most of the DDP family; each test spawns 2 ranks (12-35 s on this loaded 2-core
  machine), so a representative few run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
# looked up, not imported: it needs expecttest, which the spawn file stands in for
if importlib.util.find_spec("torch.testing._internal.distributed.distributed_test") is None:
    pytest.skip("this torch wheel ships no distributed test base", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

TESTS = [
    # collectives on the default group
    "test_all_reduce_sum", "test_all_reduce_max", "test_all_reduce_sum_async", "test_reduce_sum",
    "test_broadcast", "test_all_gather", "test_gather", "test_scatter", "test_barrier",
    "test_all_gather_object_default_pg",
    # point to point
    "test_send_recv", "test_isend",
    # DDP on CPU
    "test_DistributedDataParallelCPU", "test_DistributedDataParallel_requires_grad",
    "test_static_graph_api_cpu",
]
"""Also passed here, left out for time: test_all_reduce_min, test_all_reduce_product,
test_reduce_max, test_reduce_min, test_reduce_product, test_reduce_sum_twice, test_irecv,
test_get_rank, test_get_backend, test_Backend_enum_class,
test_DistributedDataParallelCPU_grad_is_view, test_ddp_logging_data_cpu, test_ddp_create_graph."""
TIMEOUT_S = 480  # 12-35 s a test measured on a loaded 2-core machine (load 6-7)


def test_upstream_dist_test_base(tmp_path: Path) -> None:
    env = dict(os.environ, BACKEND="fpgaccl", WORLD_SIZE="2", TEMP_DIR=str(tmp_path))
    # Under CI=true torch's run_tests writes XML reports through xmlrunner, which we do
    # not install: the reports are not ours to keep.
    env.pop("CI", None)
    names = [f"TestDistBackendWithSpawn.{t}" for t in TESTS]
    res = subprocess.run([sys.executable, "tests/torch/dist_test_spawn.py", "-v", *names],
                         cwd=ROOT, env=env, text=True, capture_output=True, timeout=TIMEOUT_S)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    assert re.search(rf"^Ran {len(TESTS)} tests? ", log, re.M), log[-3000:]
    # a skip passes upstream ("OK (skipped=n)"); here it would hide a gap
    assert re.search(r"^OK$", log, re.M), re.findall(r"skipped '.*'", log)
