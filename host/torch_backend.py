"""fpgaccl as a ``torch.distributed`` backend: a Python ``ProcessGroup`` over one
:class:`~fpgaccl.host.communicator.Communicator` per process.

Every call is posted to the Communicator with ``async_op=True`` and returns at once with a
:class:`FpgacclWork`. Its ``wait()`` runs the engine on the waiting thread until the call
is done (a blocking torch call waits at once, and wakes no other thread); a future asked
for (a DDP communication hook chains on one) is resolved by one completion thread, in
the order the futures were asked for, when the engine is done (the thread sleeps in a
queue while it has none). Contiguous
CPU tensors are handed to the engine as numpy views of their own memory; non-contiguous
ones go through a contiguous copy that is copied back, as Gloo does. What the engine
cannot do raises a typed :mod:`fpgaccl.errors` exception naming the argument.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from fpgaccl.errors import CollectiveTimeoutError, InvalidArgumentError, UnsupportedError

from .communicator import Communicator, Handle
from .environment import init, world_from_env

BACKEND_NAME = "fpgaccl"
_PORT_KEY = "fpgaccl/rendezvous"

# torch dtype -> (the dtype numpy views it as, the dtype the engine reduces it as).
# numpy has no bfloat16: such tensors are viewed as int16 and then as ml_dtypes' bfloat16.
_DTYPES: dict[torch.dtype, tuple[torch.dtype, np.dtype]] = {
    torch.float32: (torch.float32, np.dtype(np.float32)),
    torch.float64: (torch.float64, np.dtype(np.float64)),
    torch.float16: (torch.float16, np.dtype(np.float16)),
    torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
    torch.int8: (torch.int8, np.dtype(np.int8)),
    torch.int16: (torch.int16, np.dtype(np.int16)),
    torch.int32: (torch.int32, np.dtype(np.int32)),
    torch.int64: (torch.int64, np.dtype(np.int64)),
    torch.uint8: (torch.uint8, np.dtype(np.uint8)),
    torch.uint16: (torch.uint16, np.dtype(np.uint16)),
    torch.uint32: (torch.uint32, np.dtype(np.uint32)),
    torch.uint64: (torch.uint64, np.dtype(np.uint64)),
}
_NO_TORCH_DIVISION = frozenset({torch.uint16, torch.uint32, torch.uint64})
"""Unsigned types PyTorch stores but cannot divide (no div kernels on CPU)."""

_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band", dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor", dist.ReduceOp.AVG: "sum",
}


def as_array(t: torch.Tensor, argument: str) -> np.ndarray:
    """A flat numpy view of contiguous CPU tensor ``t``'s own memory (no copy)."""
    check_tensor(t, argument)
    if not t.is_contiguous():
        raise InvalidArgumentError(argument, "tensor is not contiguous")
    view_as, np_dtype = _DTYPES[t.dtype]
    flat = t.detach().reshape(-1)
    arr = flat.view(view_as).numpy()
    return arr if arr.dtype == np_dtype else arr.view(np_dtype)


def check_tensor(t: Any, argument: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(argument, f"expected a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise UnsupportedError(argument, f"{t.device.type} tensor: the fpgaccl backend takes "
                               "CPU tensors (device memory goes through the board backend's "
                               "GPU-peer window, not through torch yet)")
    if t.layout != torch.strided:
        raise UnsupportedError(argument, f"{t.layout} tensors are not supported")
    if t.dtype not in _DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _DTYPES)
        raise UnsupportedError(argument, f"dtype {t.dtype} is not one of {names}")


class _Arg:
    """A tensor argument as the engine sees it: the tensor's own memory when contiguous,
    else a contiguous copy, copied back by :meth:`finish` where the call writes it."""

    def __init__(self, t: torch.Tensor, argument: str, *, out: bool) -> None:
        check_tensor(t, argument)
        self.tensor = t
        self.work = t if t.is_contiguous() else t.contiguous()
        self.array = as_array(self.work, argument)
        self._copy_back = out and self.work is not t

    def finish(self) -> None:
        if self._copy_back:
            with torch.no_grad():
                self.tensor.copy_(self.work)


def _one(tensors: Sequence[torch.Tensor], argument: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise UnsupportedError(argument, f"{len(tensors)} tensors: one tensor per process "
                               "(the multi-device list form is not supported)")
    return tensors[0]


def _op(opts: Any, call: str) -> str:
    op = opts.reduceOp
    for known, name in _OPS.items():
        if op == known:
            return name
    raise UnsupportedError("op", f"{call}: ReduceOp {op.op if hasattr(op, 'op') else op} is "
                           "not supported (sum, product, min, max, avg, band, bor, bxor are)")


def _is_avg(opts: Any) -> bool:
    return opts.reduceOp == dist.ReduceOp.AVG


def divide(t: torch.Tensor, n: int) -> None:
    """AVG: the engine's sum divided by the world size, once, in the tensor's dtype
    (floats round to nearest; integers truncate toward zero, as NCCL's avg does)."""
    with torch.no_grad():
        if t.is_floating_point():
            t.div_(n)
        elif t.dtype in _NO_TORCH_DIVISION:
            a = t.detach().numpy()   # the tensor's memory; unsigned: floor is trunc
            a //= a.dtype.type(n)
        else:
            t.div_(n, rounding_mode="trunc")


def _flat_cat(tensors: Sequence[torch.Tensor], argument: str) -> torch.Tensor:
    """The tensors packed end to end in one contiguous buffer (a copy)."""
    for i, t in enumerate(tensors):
        check_tensor(t, f"{argument}[{i}]")
    if len({t.dtype for t in tensors}) > 1:
        raise InvalidArgumentError(argument, "tensors of different dtypes")
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        at = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[at:at + n].view(t.shape))
            at += n


class _Posted:
    """One posted call: its handles, what turns their results into the call's, and the
    future that gets it. Settled once, by whichever thread comes first: a caller's
    ``wait()``, which drives the engine itself (a blocking torch call waits at once, and
    no other thread is woken for it), or, once the future was asked for, the completion
    thread."""

    __slots__ = ("finish", "future", "handles", "lock", "queued", "settled")

    def __init__(self, handles: Sequence[Handle], finish: Callable[[], Any]) -> None:
        self.handles = handles
        self.finish = finish
        self.future: Future = Future()
        self.lock = threading.Lock()
        self.queued = False
        self.settled = False

    def settle(self, drive: bool, timeout: float | None = None) -> bool:
        """Wait for the handles (driving the engine with ``drive``, else only waiting for
        whichever thread runs it), then resolve the future, once. False if ``timeout``
        seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        for h in self.handles:
            left = None if end is None else end - time.monotonic()
            if not h.ready(left, drive=drive):
                return False
        with self.lock:
            if self.settled:
                return True
            try:
                for h in self.handles:
                    h.wait()
                result = self.finish()
            except Exception as e:
                self.future.set_exception(e)
            else:
                self.future.set_result(result)
            self.settled = True
        return True

    def over(self) -> bool:
        """Settled, or settled now if every handle is over (no waiting, no driving)."""
        if not self.settled and all(h.is_ready() for h in self.handles):
            self.settle(drive=False)
        return self.settled


class FpgacclWork(dist._Work):
    """One posted call. ``wait()`` runs it to its end on the caller's thread; its future,
    once asked for, is resolved by the completion thread if no ``wait()`` comes first."""

    def __init__(self, posted: _Posted, completer: _Completer, name: str,
                 rank: int) -> None:
        super().__init__()
        self._posted = posted
        self._completer = completer
        self._name = name
        self._rank = rank

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Raises the call's error. Without a timeout (torch passes zero for none) the
        engine's own deadline bounds the wait."""
        limit = timeout.total_seconds() if timeout is not None else 0.0
        if not self._posted.settle(drive=True, timeout=limit if limit > 0 else None):
            raise CollectiveTimeoutError(self._name, self._rank, limit, "still running at "
                                         "wait(timeout)")
        self._posted.future.wait()
        return True

    def is_completed(self) -> bool:
        return self._posted.over()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self.is_completed():
            return None
        try:
            self._posted.future.value()
        except Exception as e:
            return e
        return None

    def get_future(self) -> Future:
        self._completer.watch(self._posted)
        return self._posted.future


class _Completer:
    """The thread that settles, in the order they were asked for, the calls whose
    futures were asked for (a DDP communication hook chains work on one), driving the
    engine meanwhile as a waiting caller does; it costs nothing while idle."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fpgaccl-torch", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()

    def post(self, handles: Sequence[Handle], finish: Callable[[], Any], name: str,
             rank: int) -> FpgacclWork:
        return FpgacclWork(_Posted(handles, finish), self, name, rank)

    def watch(self, posted: _Posted) -> None:
        with self._lock:
            if posted.queued or posted.settled:
                return
            posted.queued = True
        self._queue.put(posted)

    def _run(self) -> None:
        while True:
            posted = self._queue.get()
            if posted is None:
                return
            # It drives the engine as a waiting caller would (a DDP step waits on
            # futures only): the engine thread, polling without a spin, ran DDP's
            # buckets about 10 % slower.
            posted.settle(drive=True)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class _Shared:
    """This process's one Communicator (each engine owns UDP 4791 on its rank's address,
    so a process has one) and the completion thread, shared by its whole-world groups."""

    comm: Communicator | None = None
    completer: _Completer | None = None
    users = 0
    lock = threading.Lock()

    @classmethod
    def acquire(cls, store: dist.Store, rank: int, size: int,
                timeout: timedelta) -> tuple[Communicator, _Completer]:
        with cls.lock:
            if cls.comm is None:
                cls.comm = _open_communicator(store, rank, size, timeout)
                cls.completer = _Completer()
                atexit.register(cls.close)
            elif (cls.comm.rank, cls.comm.world_size) != (rank, size):
                raise UnsupportedError("ranks", f"a group of {size} ranks in which this process is "
                                       f"rank {rank}, but its communicator is rank "
                                       f"{cls.comm.rank} of {cls.comm.world_size}")
            cls.users += 1
            assert cls.completer is not None
            return cls.comm, cls.completer

    @classmethod
    def acquire_world(cls) -> Communicator:
        """The world's communicator, for a subgroup's engine to be opened from."""
        with cls.lock:
            if cls.comm is None:
                raise UnsupportedError("ranks", "new_group(ranks=...) before the default "
                                       "group: call init_process_group('fpgaccl') first")
            cls.users += 1
            return cls.comm

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users <= 0:
                cls._close_locked()

    @classmethod
    def close(cls) -> None:
        with cls.lock:
            cls._close_locked()

    @classmethod
    def _close_locked(cls) -> None:
        if cls.completer is not None:
            cls.completer.stop()
        if cls.comm is not None:
            cls.comm.close()
        cls.comm, cls.completer, cls.users = None, None, 0


def _store_host(store: dist.Store) -> str | None:
    """The host of the TCPStore under ``store`` (through PrefixStores), if any."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return getattr(store, "host", None) if isinstance(store, dist.TCPStore) else None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((socket.gethostbyname(host), 0))
        return s.getsockname()[1]


def _master_port_for(listen_port: int) -> int:
    """The ``master_port`` that makes the rendezvous listen on ``listen_port``: under
    torchrun the runtime listens on master_port + 1 (fpgaccl.host.rendezvous)."""
    return listen_port - 1 if "TORCHELASTIC_RUN_ID" in os.environ else listen_port


def _open_communicator(store: dist.Store, rank: int, size: int,
                       timeout: timedelta) -> Communicator:
    """Rank 0 picks a free TCP port for fpgaccl's rendezvous and tells the others through
    the c10d store: MASTER_PORT is the store's own (env://, torchrun's agent)."""
    # A world of one takes the port too: local ranks' engine addresses derive from it.
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or _store_host(store) or "127.0.0.1"
        port = (int(os.environ["FPGACCL_RDZV_PORT"]) if "FPGACCL_RDZV_PORT" in os.environ
                else _free_port(host))
        store.set(_PORT_KEY, f"{host} {_master_port_for(port)}")
    host, master_port = store.get(_PORT_KEY).decode().split()
    options: dict[str, Any] = {"master_addr": host, "master_port": int(master_port)}
    if "FPGACCL_DEADLINE_S" not in os.environ:
        options["deadline_s"] = timeout.total_seconds()
    if world_from_env() == (rank, size):
        # The launcher's world: fpgaccl.init() applies its options (backend, pcap,
        # impairment, MTU, RTO) and the script's own fpgaccl.init() shares this one.
        return init(**options)
    return Communicator(rank, size, os.environ.get("FPGACCL_BACKEND") or "software", **options)


def _store_rendezvous(store: dist.Store, rank: int, size: int
                      ) -> Callable[[dict], list[dict]]:
    """A subgroup's engines exchange their records through the group's own store (a
    PrefixStore of the group: only members create the group's backend, so the world's
    communicator, whose collectives need every rank, cannot carry them)."""
    def rendezvous(info: dict) -> list[dict]:
        store.set(f"fpgaccl/sub/{rank}", json.dumps(info))
        return [json.loads(store.get(f"fpgaccl/sub/{r}")) for r in range(size)]

    return rendezvous


class ProcessGroupFpgaccl(dist.ProcessGroup):
    """The ``fpgaccl`` process group: every collective of its ranks, posted
    asynchronously to the engine. Whole-world groups share the process's communicator; a
    subgroup (``new_group(ranks=[...])``) has a sub-communicator of its own (an engine
    of its own: :meth:`Communicator.open_sub`) and its own completion thread, so calls on
    different groups may be issued in any order."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 ranks: Sequence[int] | None = None) -> None:
        super().__init__(rank, size)
        self._sub = ranks is not None
        if ranks is None:
            self.comm, self._completer = _Shared.acquire(store, rank, size, timeout)
        else:
            world = _Shared.acquire_world()
            try:
                self.comm = world.open_sub(rank, size, _store_rendezvous(store, rank, size),
                                           f"world.group{list(ranks)}")
            except BaseException:
                _Shared.release()
                raise
            self._completer = _Completer()
            # Before the world's communicator closes (atexit runs the last registered
            # first): leaving is a barrier of the group's own.
            atexit.register(self.shutdown)
        self._open = True
        self._group_name = self._group_desc = ""

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch stores a group's name and description in the backends registered under it, and
    # a Python group has none, so the base class's properties raise (DeviceMesh, FSDP2 and
    # functional collectives read group_name): keep them here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupFpgaccl(rank={self.rank()}, size={self.size()})"

    # ------------------------------------------------------------------ plumbing
    def _post(self, handles: Sequence[Handle], finish: Callable[[], Any],
              call: str) -> FpgacclWork:
        return self._completer.post(handles, finish, call, self.rank())

    def _reduced(self, t: torch.Tensor, avg: bool) -> None:
        if avg:
            divide(t, self.size())

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> FpgacclWork:
        opts = opts or dist.AllreduceOptions()
        op = _op(opts, "allreduce")
        a = _Arg(_one(tensors, "tensors"), "tensors", out=True)
        h = self.comm.allreduce(a.array, op=op, async_op=True)

        def finish() -> list[torch.Tensor]:
            a.finish()
            self._reduced(a.tensor, _is_avg(opts))
            return tensors

        return self._post([h], finish, "allreduce")

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> FpgacclWork:
        opts = opts or dist.BroadcastOptions()
        a = _Arg(_one(tensors, "tensors"), "tensors", out=True)
        h = self.comm.broadcast(a.array, root=opts.rootRank, async_op=True)

        def finish() -> list[torch.Tensor]:
            a.finish()
            return tensors

        return self._post([h], finish, "broadcast")

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> FpgacclWork:
        opts = opts or dist.ReduceOptions()
        op = _op(opts, "reduce")
        root = opts.rootRank
        a = _Arg(_one(tensors, "tensors"), "tensors", out=self.rank() == root)
        h = self.comm.reduce(a.array, op=op, root=root, async_op=True)

        def finish() -> list[torch.Tensor]:
            a.finish()
            if self.rank() == root:
                self._reduced(a.tensor, _is_avg(opts))
            return tensors

        return self._post([h], finish, "reduce")

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> FpgacclWork:
        o = _Arg(output, "output_tensor", out=True)
        i = _Arg(input, "input_tensor", out=False)
        h = self.comm.allgather(i.array, o.array, async_op=True)

        def finish() -> list[torch.Tensor]:
            o.finish()
            return [output]

        return self._post([h], finish, "all_gather_single")

    _allgather_base = all_gather_single

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> FpgacclWork:
        outs = _one(output_tensors, "output_tensors")
        i = _Arg(_one(input_tensors, "input_tensors"), "input_tensor", out=False)
        self._check_list(outs, "tensor_list", i.tensor)
        flat = torch.empty(self.size() * i.tensor.numel(), dtype=i.tensor.dtype)
        h = self.comm.allgather(i.array, as_array(flat, "tensor_list"), async_op=True)

        def finish() -> list[list[torch.Tensor]]:
            _unpack(flat, outs)
            return output_tensors

        return self._post([h], finish, "allgather")

    def _check_list(self, tensors: Sequence[torch.Tensor], argument: str,
                    like: torch.Tensor) -> None:
        if len(tensors) != self.size():
            raise InvalidArgumentError(argument, f"{len(tensors)} tensors, world_size is "
                                       f"{self.size()}")
        for j, t in enumerate(tensors):
            check_tensor(t, f"{argument}[{j}]")
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise InvalidArgumentError(f"{argument}[{j}]", f"{t.numel()} x {t.dtype}, "
                                           f"expected {like.numel()} x {like.dtype}")

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> FpgacclWork:
        opts = opts or dist.ReduceScatterOptions()
        op = _op(opts, "reduce_scatter")
        o = _Arg(output, "output", out=True)
        i = _Arg(input, "input", out=False)
        h = self.comm.reduce_scatter(i.array, o.array, op=op, async_op=True)

        def finish() -> list[torch.Tensor]:
            o.finish()
            self._reduced(output, _is_avg(opts))
            return [output]

        return self._post([h], finish, "reduce_scatter_single")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> FpgacclWork:
        opts = opts or dist.ReduceScatterOptions()
        op = _op(opts, "reduce_scatter")
        o = _Arg(_one(output_tensors, "output"), "output", out=True)
        ins = _one(input_tensors, "input_list")
        self._check_list(ins, "input_list", o.tensor)
        flat = _flat_cat(ins, "input_list")
        h = self.comm.reduce_scatter(as_array(flat, "input_list"), o.array, op=op,
                                     async_op=True)

        def finish() -> list[torch.Tensor]:
            o.finish()
            self._reduced(o.tensor, _is_avg(opts))
            return output_tensors

        return self._post([h], finish, "reduce_scatter")

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> FpgacclWork:
        o = _Arg(output, "output", out=True)
        i = _Arg(input, "input", out=False)
        if not output_split_sizes and not input_split_sizes:
            h = self.comm.alltoall(i.array, o.array, async_op=True)
        else:
            sc = self._counts(input, input_split_sizes, "input_split_sizes")
            rc = self._counts(output, output_split_sizes, "output_split_sizes")
            h = self.comm.alltoallv(i.array, sc, o.array, rc, async_op=True)

        def finish() -> list[torch.Tensor]:
            o.finish()
            return [output]

        return self._post([h], finish, "all_to_all_single")

    alltoall_base = all_to_all_single

    def _counts(self, t: torch.Tensor, splits: Sequence[int], argument: str) -> list[int]:
        """Element counts per rank from split sizes along dim 0 (even split if none)."""
        p = self.size()
        rows = t.shape[0] if t.dim() else 1
        row = t.numel() // rows if rows else 0
        if not splits:
            if rows % p:
                raise InvalidArgumentError(argument, f"dim 0 ({rows}) is not a multiple of "
                                           f"world_size {p}: give split sizes")
            return [rows // p * row] * p
        if len(splits) != p or sum(splits) != rows:
            raise InvalidArgumentError(argument, f"{list(splits)} must have {p} entries "
                                       f"summing to dim 0 ({rows})")
        return [int(s) * row for s in splits]

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> FpgacclWork:
        p = self.size()
        for name, ts in (("output_tensor_list", output_tensors),
                         ("input_tensor_list", input_tensors)):
            if len(ts) != p:
                raise InvalidArgumentError(name, f"{len(ts)} tensors, world_size is {p}")
        flat_in = _flat_cat(input_tensors, "input_tensor_list")
        flat_out = _flat_cat(output_tensors, "output_tensor_list")
        if flat_out.dtype != flat_in.dtype:
            raise InvalidArgumentError("output_tensor_list", f"{flat_out.dtype} differs from "
                                       f"the inputs' {flat_in.dtype}")
        h = self.comm.alltoallv(as_array(flat_in, "input_tensor_list"),
                                [t.numel() for t in input_tensors],
                                as_array(flat_out, "output_tensor_list"),
                                [t.numel() for t in output_tensors], async_op=True)

        def finish() -> list[torch.Tensor]:
            _unpack(flat_out, output_tensors)
            return output_tensors

        return self._post([h], finish, "alltoall")

    # gather and scatter: alltoallv with counts only to (or from) the root, numbered like
    # every collective, so they cannot be matched with a user's send/recv.
    def _root_side(self, root: int, lists: list[list[torch.Tensor]], argument: str,
                   like: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        """The root's world_size tensors shaped like ``like`` and the counts from (or to)
        every rank; none elsewhere."""
        if self.rank() != root:
            return [], [0] * self.size()
        tensors = _one(lists, argument)
        self._check_list(tensors, argument, like)
        return tensors, [like.numel()] * self.size()

    def _only(self, root: int, n: int) -> list[int]:
        return [n if j == root else 0 for j in range(self.size())]

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> FpgacclWork:
        root = (opts or dist.GatherOptions()).rootRank
        i = _Arg(_one(input_tensors, "input_tensors"), "tensor", out=False)
        outs, rc = self._root_side(root, output_tensors, "gather_list", i.tensor)
        flat = torch.empty(sum(rc), dtype=i.tensor.dtype)
        h = self.comm.alltoallv(i.array, self._only(root, i.tensor.numel()),
                                as_array(flat, "gather_list"), rc, async_op=True)

        def finish() -> list[list[torch.Tensor]]:
            _unpack(flat, outs)
            return output_tensors

        return self._post([h], finish, "gather")

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> FpgacclWork:
        root = (opts or dist.ScatterOptions()).rootRank
        o = _Arg(_one(output_tensors, "output_tensors"), "tensor", out=True)
        ins, sc = self._root_side(root, input_tensors, "scatter_list", o.tensor)
        flat = _flat_cat(ins, "scatter_list") if ins else o.tensor.new_empty(0)
        h = self.comm.alltoallv(as_array(flat, "scatter_list"), sc, o.array,
                                self._only(root, o.tensor.numel()), async_op=True)

        def finish() -> list[torch.Tensor]:
            o.finish()
            return output_tensors

        return self._post([h], finish, "scatter")

    def barrier(self, opts: Any = None) -> FpgacclWork:
        return self._post([self.comm.barrier(async_op=True)], lambda: None, "barrier")

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> FpgacclWork:
        self._no_tag(tag, "send")
        a = _Arg(_one(tensors, "tensor"), "tensor", out=False)
        h = self.comm.send(a.array, dstRank, async_op=True)
        return self._post([h], lambda: tensors, "send")

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> FpgacclWork:
        self._no_tag(tag, "recv")
        a = _Arg(_one(tensors, "tensor"), "tensor", out=True)
        h = self.comm.recv(a.array, srcRank, async_op=True)

        def finish() -> list[torch.Tensor]:
            a.finish()
            return tensors

        return self._post([h], finish, "recv")

    @staticmethod
    def _no_tag(tag: int, call: str) -> None:
        if tag != 0:
            raise UnsupportedError("tag", f"{call}: tag {tag}: the engine matches messages "
                                   "by order per peer, without tags")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> FpgacclWork:
        raise UnsupportedError("src", "recv from any source (src=None): name the sender")

    # ------------------------------------------------------------------ not supported
    def _unsupported(self, call: str, argument: str) -> FpgacclWork:
        raise UnsupportedError(argument, f"{call} is not supported by the fpgaccl backend; "
                               "issue the calls one by one")

    def allgather_coalesced(self, output_lists: Any, input_list: Any,
                            opts: Any = None) -> FpgacclWork:
        return self._unsupported("allgather_coalesced", "input_tensor_list")

    # The coalesced calls are one collective over a flat buffer: torch's functional
    # collectives (DTensor, FSDP2's full_tensor) issue even a single all-gather this way.
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> FpgacclWork:
        opts = opts or dist.AllreduceCoalescedOptions()
        op = _op(opts, "allreduce_coalesced")
        flat = _flat_cat(tensors, "tensors")
        h = self.comm.allreduce(as_array(flat, "tensors"), op=op, async_op=True)

        def finish() -> list[torch.Tensor]:
            self._reduced(flat, _is_avg(opts))
            _unpack(flat, tensors)
            return tensors

        return self._post([h], finish, "allreduce_coalesced")

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> FpgacclWork:
        self._check_pairs(outputs, inputs, "output_tensors", "input_tensors")
        flat_in = _flat_cat(inputs, "input_tensors")
        # rank r's block holds its inputs end to end: output k takes its slice of every block
        flat_out = torch.empty(self.size() * flat_in.numel(), dtype=flat_in.dtype)
        h = self.comm.allgather(as_array(flat_in, "input_tensors"),
                                as_array(flat_out, "output_tensors"), async_op=True)

        def finish() -> list[torch.Tensor]:
            blocks = flat_out.view(self.size(), -1)
            parts = [blocks[:, a:b] for a, b in self._spans(inputs)]
            _unpack(torch.cat([part.reshape(-1) for part in parts]), outputs)
            return outputs

        return self._post([h], finish, "allgather_into_tensor_coalesced")

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> FpgacclWork:
        opts = opts or dist.ReduceScatterOptions()
        op = _op(opts, "reduce_scatter_tensor_coalesced")
        self._check_pairs(inputs, outputs, "input_tensors", "output_tensors")
        # rank r's block: its chunk of every input, so output k is a slice of the result
        chunks = [t.detach().reshape(self.size(), -1) for t in inputs]
        flat_in = torch.cat(chunks, dim=1).reshape(-1)
        flat_out = torch.empty(flat_in.numel() // self.size(), dtype=flat_in.dtype)
        h = self.comm.reduce_scatter(as_array(flat_in, "input_tensors"),
                                     as_array(flat_out, "output_tensors"), op=op, async_op=True)

        def finish() -> list[torch.Tensor]:
            self._reduced(flat_out, _is_avg(opts))
            _unpack(flat_out, outputs)
            return outputs

        return self._post([h], finish, "reduce_scatter_tensor_coalesced")

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _check_pairs(self, big: Sequence[torch.Tensor], small: Sequence[torch.Tensor],
                     big_name: str, small_name: str) -> None:
        """``big[k]`` holds world_size times ``small[k]``'s elements, all of one dtype."""
        if len(big) != len(small):
            raise InvalidArgumentError(big_name, f"{len(big)} tensors, {small_name} has "
                                       f"{len(small)}")
        for k, (b, s) in enumerate(zip(big, small, strict=True)):
            check_tensor(b, f"{big_name}[{k}]")
            check_tensor(s, f"{small_name}[{k}]")
            if b.numel() != self.size() * s.numel() or b.dtype != s.dtype:
                raise InvalidArgumentError(f"{big_name}[{k}]", f"{b.numel()} x {b.dtype}, "
                                           f"expected world_size x {s.numel()} x {s.dtype}")
        if len({t.dtype for t in big}) > 1:
            raise InvalidArgumentError(big_name, "tensors of different dtypes: the fpgaccl "
                                       "backend coalesces one dtype per call")

    @staticmethod
    def _spans(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        ends = np.cumsum([0] + [t.numel() for t in tensors]).tolist()
        return list(itertools.pairwise(ends))

    # ------------------------------------------------------------------ leaving
    def shutdown(self) -> None:
        if self._open:
            self._open = False
            if self._sub:
                self._completer.stop()
                self.comm.close()
            _Shared.release()

    def abort(self) -> None:
        self.shutdown()


def create_process_group(opts: Any, pg_options: Any = None) -> ProcessGroupFpgaccl:
    """The creator ``register_backend`` calls (extended API: it names the group's ranks)."""
    ranks = list(opts.global_ranks_in_group)
    whole = not ranks or (ranks == list(range(opts.group_size)) and (
        _Shared.comm is None or _Shared.comm.world_size == opts.group_size))
    return ProcessGroupFpgaccl(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                               None if whole else ranks)


def register() -> None:
    """Make ``torch.distributed.init_process_group("fpgaccl")`` open this backend."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                      devices=["cpu"])


__all__ = ["BACKEND_NAME", "FpgacclWork", "ProcessGroupFpgaccl", "as_array", "register"]
