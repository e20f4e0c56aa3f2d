"""The flight recorder: each communicator's last calls, for the post-mortem of a failed run.

A :class:`FlightRecorder` keeps a ring of the last :data:`DEFAULT_ENTRIES` calls of one
communicator: its sequence number (the call signature's), name, signature fields,
wall-clock start and end, and state (``pending``, ``done``, ``failed`` with the error).
``Communicator.flight_record()`` returns it. Where the environment names a directory
(:data:`FLIGHT_DIR_ENV`: ``fpgaccl run`` gives every rank one), a rank writes the
records of all its communicators to ``rank<N>.json`` there when a call fails and again
at exit; the launcher reads them back (:func:`read_dir`) and prints every rank's last
entries (:func:`report`) when the run fails, as NCCL's flight recorder dump does.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

FLIGHT_DIR_ENV = "FPGACCL_FLIGHT_DIR"
DEFAULT_ENTRIES = 64
"""Calls each communicator remembers (FPGACCL_FLIGHT_ENTRIES overrides)."""

FIELDS = ("seq", "name", "count", "dtype", "op", "root", "algo", "tag", "peer")
"""What an entry says of its call (None where it does not apply), beside ``start``,
``end``, ``state`` and ``error``. ``seq``: the call's number in its communicator (for
``send``/``recv``: in the direction to or from ``peer``). A call records them as a tuple
in this order, raw (enums, the algorithm's tuple): they are formatted only when read."""
_live: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
_atexit_lock = threading.Lock()
_atexit_armed = False
# Engine jobs time their end on the monotonic clock; records are read across ranks.
_WALL_OFFSET = time.time() - time.monotonic()


class Entry:
    """One call. ``job`` (the backend's pending call) tells its end where it has one."""

    __slots__ = ("end", "error", "fields", "job", "start", "state")

    def __init__(self, fields: tuple, job: Any) -> None:
        self.fields = fields
        self.job = job
        # A caller may run its job to the end before the call is recorded: the job's own
        # creation is the start.
        created = getattr(job, "created", 0.0)
        self.start = created + _WALL_OFFSET if created else time.time()
        self.end: float | None = None
        self.state = "pending"
        self.error: str | None = None

    def resolve(self) -> None:
        """Take the state from the pending call once it is over."""
        job = self.job
        if self.state != "pending" or job is None or not job.event.is_set():
            return
        ended = getattr(job, "ended", 0.0)
        self.end = ended + _WALL_OFFSET if ended else time.time()
        if job.error is not None:
            self.fail(job.error)
        else:
            self.state = "done"
            self.job = None

    def fail(self, error: BaseException) -> None:
        if self.end is None:
            self.end = time.time()
        self.state = "failed"
        self.error = f"{type(error).__name__}: {error}"
        self.job = None

    def as_dict(self) -> dict[str, Any]:
        out = dict(zip(FIELDS, self.fields, strict=False))
        for key in ("dtype", "op"):
            out[key] = getattr(out.get(key), "name", None)
        out["algo"] = "/".join(map(str, out.get("algo") or ())) or None
        for key in FIELDS:
            out.setdefault(key, None)
        out.update(start=self.start, end=self.end, state=self.state, error=self.error)
        return out


class FlightRecorder:
    """The ring of one communicator (``label``: which one, e.g. ``world`` or
    ``world.split1``), rank ``rank`` of ``world_size``."""

    def __init__(self, label: str, rank: int, world_size: int,
                 entries: int | None = None) -> None:
        if entries is None:
            entries = int(os.environ.get("FPGACCL_FLIGHT_ENTRIES", DEFAULT_ENTRIES))
        self.label = label
        self.rank = rank
        self.world_size = world_size
        self._ring: deque[Entry] = deque(maxlen=max(1, entries))
        self._lock = threading.Lock()
        self.failures = 0
        _live.add(self)
        _arm_atexit()

    def record(self, job: Any, fields: tuple) -> Entry:
        """``fields``: the call's :data:`FIELDS`, in order (missing ones at the end are
        None)."""
        entry = Entry(fields, job)
        self._ring.append(entry)  # one bytecode-level append: the GIL keeps it whole
        return entry

    def failed(self, entry: Entry, error: BaseException) -> None:
        """``entry``'s call raised ``error``: recorded, and the records written where the
        environment asks for them."""
        with self._lock:
            if entry.state == "failed":
                return
            entry.fail(error)
            self.failures += 1
        write_all()

    def entries(self) -> list[dict[str, Any]]:
        """The ring, oldest first, each call's state as of now."""
        with self._lock:
            ring = list(self._ring)  # a copy: calls may append meanwhile
            for e in ring:
                e.resolve()
            return [e.as_dict() for e in ring]

    def dump(self) -> dict[str, Any]:
        return {"communicator": self.label, "rank": self.rank, "world_size": self.world_size,
                "entries": self.entries()}


def write_all(directory: str | None = None) -> Path | None:
    """Write every live recorder of this process to ``rank<N>.json`` in ``directory``
    (default: :data:`FLIGHT_DIR_ENV`; none: nothing is written). ``N``: the rank in the
    first (world) communicator."""
    directory = directory or os.environ.get(FLIGHT_DIR_ENV)
    recorders = sorted(_live, key=lambda r: r.label)
    if not directory or not recorders:
        return None
    world = min(recorders, key=lambda r: len(r.label))
    rank = os.environ.get("FPGACCL_RANK", str(world.rank))
    path = Path(directory) / f"rank{rank}.json"
    body = json.dumps({"rank": int(rank), "pid": os.getpid(),
                       "communicators": [r.dump() for r in recorders]})
    tmp = path.with_suffix(".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(body)
        tmp.replace(path)  # a reader never sees half a file
        return path
    return None


def _arm_atexit() -> None:
    global _atexit_armed
    with _atexit_lock:
        if not _atexit_armed and os.environ.get(FLIGHT_DIR_ENV):
            _atexit_armed = True
            atexit.register(write_all)


def read_dir(directory: str | Path) -> dict[int, dict[str, Any]]:
    """The records the ranks wrote to ``directory``, by rank (unreadable files skipped)."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(directory).glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            data = json.loads(path.read_text())
            out[int(data["rank"])] = data
    return out


def _describe(e: dict[str, Any], t0: float) -> str:
    parts = [f"#{e.get('seq')}", str(e.get("name"))]
    for key in ("count", "dtype", "op", "root", "peer", "tag"):
        if e.get(key) not in (None, 0, "") or (key == "root" and e.get(key) == 0):
            parts.append(f"{key}={e[key]}")
    took = ("" if e.get("end") is None
            else f" {1e3 * (e['end'] - e['start']):.1f} ms")
    line = f"t+{e['start'] - t0:.3f}s {' '.join(parts)}: {e['state']}{took}"
    return line + (f" ({e['error']})" if e.get("error") else "")


def report(records: dict[int, dict[str, Any]], world_size: int, last: int = 8) -> str:
    """Every rank's last ``last`` entries of each communicator, as text; ranks that
    wrote nothing (killed, or never built a communicator) are named."""
    starts = [e["start"] for d in records.values() for c in d["communicators"]
              for e in c["entries"]]
    t0 = min(starts, default=0.0)
    lines = ["fpgaccl run: flight recorder (each rank's last calls, oldest first):"]
    for rank in range(world_size):
        data = records.get(rank)
        if data is None:
            lines.append(f"  rank {rank}: no record (killed, or no communicator)")
            continue
        for comm in data["communicators"]:
            entries = comm["entries"][-last:]
            lines.append(f"  rank {rank} {comm['communicator']} (rank {comm['rank']} of "
                         f"{comm['world_size']}): {len(comm['entries'])} call(s)")
            lines.extend(f"    {_describe(e, t0)}" for e in entries)
    lines.extend(_first_difference(records))
    return "\n".join(lines)


def _what(e: dict[str, Any]) -> str:
    keys = ("name", "count", "dtype", "op", "root", "algo", "tag")
    return " ".join(str(e[k]) for k in keys if e.get(k) is not None
                    and not (k == "tag" and e[k] == 0))


def _first_difference(records: dict[int, dict[str, Any]]) -> list[str]:
    """Per communicator, the first call number at which the ranks that recorded it
    disagree on what the call was: the usual cause of a hang."""
    calls: dict[str, dict[int, dict[int, str]]] = {}  # label -> seq -> rank -> what
    for rank, data in records.items():
        for comm in data["communicators"]:
            for e in comm["entries"]:
                if e.get("name") not in ("send", "recv"):  # their seq is per peer
                    calls.setdefault(comm["communicator"], {}).setdefault(
                        e["seq"], {})[rank] = _what(e)
    out = []
    for label, by_seq in sorted(calls.items()):
        for seq in sorted(by_seq):
            seen = by_seq[seq]
            if len(set(seen.values())) > 1:
                groups: dict[str, list[int]] = {}
                for rank, what in sorted(seen.items()):
                    groups.setdefault(what, []).append(rank)
                out.append(f"  {label}: the ranks' call #{seq} differs: " + "; ".join(
                    f"{what} on rank(s) {ranks}" for what, ranks in groups.items()))
                break
    return out
