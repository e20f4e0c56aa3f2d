"""Typed exceptions shared by every fpgaccl layer.

Each error names what was wrong (an argument, a header field, a peer) so a caller can
react without parsing messages.
"""

from __future__ import annotations


class FpgacclError(Exception):
    """Base class of every error fpgaccl raises on purpose."""


class InvalidArgumentError(FpgacclError, ValueError):
    """A public API argument is unusable; ``argument`` names it."""

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        super().__init__(f"{argument}: {message}")


class DtypeMismatchError(InvalidArgumentError, TypeError):
    """Buffers or ranks disagree on the element type."""


class CountMismatchError(InvalidArgumentError):
    """Buffers or ranks disagree on the element count."""


class UnsupportedError(InvalidArgumentError):
    """A dtype/op/algorithm combination the engine does not implement."""


class MalformedHeaderError(FpgacclError, ValueError):
    """A packet header cannot be decoded; ``header`` and ``field`` locate the fault."""

    def __init__(self, header: str, field: str, message: str) -> None:
        self.header = header
        self.field = field
        super().__init__(f"{header}.{field}: {message}")


class IcrcError(MalformedHeaderError):
    """The RoCEv2 invariant CRC does not match the packet."""

    def __init__(self, expected: int, found: int) -> None:
        self.expected = expected
        self.found = found
        super().__init__("ICRC", "icrc", f"expected {expected:#010x}, found {found:#010x}")


class TransportError(FpgacclError):
    """The reliable transport could not deliver (retries exhausted, QP in error)."""


class RemoteAccessError(TransportError):
    """A peer rejected an RDMA WRITE: wrong memory key, bounds or access rights."""


class CollectiveTimeoutError(FpgacclError, TimeoutError):
    """A collective did not complete within its deadline (a peer died or hung)."""

    def __init__(self, operation: str, rank: int, deadline_s: float, detail: str = "") -> None:
        self.operation = operation
        self.rank = rank
        self.deadline_s = deadline_s
        msg = f"rank {rank}: {operation} did not complete within {deadline_s:g} s"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class PeerDeadError(TransportError, CollectiveTimeoutError):
    """A peer stopped answering the transport: ``peer`` (its rank) ACKed nothing of what
    was outstanding to it for ``deadline_s`` (the peer timeout), or exhausted the retry
    limit. Both a :class:`TransportError` and a :class:`CollectiveTimeoutError`, so that
    either ``except`` catches it; ``ranks`` is ``[peer]`` as on a timeout."""

    def __init__(self, operation: str, rank: int, peer: int, timeout_s: float,
                 reason: str) -> None:
        self.peer = peer
        self.ranks = [peer]
        self.reason = reason
        self.operation = operation
        self.rank = rank
        self.deadline_s = timeout_s
        FpgacclError.__init__(self, f"rank {rank}: {operation}: rank {peer} is dead ({reason})")


class RanksTimeoutError(CollectiveTimeoutError):
    """A :class:`CollectiveTimeoutError` raised while every peer was alive: ``ranks``
    lists the ranks whose contribution (a grant, a message, the ACKs of what this rank
    sent) never arrived, and ``waits`` says what was awaited of each ((rank, what))."""

    def __init__(self, operation: str, rank: int, deadline_s: float,
                 waits: list[tuple[int, str]]) -> None:
        self.waits = waits
        self.ranks = sorted({r for r, _ in waits})
        detail = ", ".join(f"rank {r} ({what})" for r, what in waits)
        super().__init__(operation, rank, deadline_s,
                         f"no progress; waiting on {detail}" if waits else "no progress")


class AbortedError(FpgacclError):
    """The communicator was aborted (``Communicator.abort()``, from any thread) while
    ``operation`` was pending or before it was called: its engine is stopped and its
    ports are free; build a new communicator to go on."""

    def __init__(self, operation: str, rank: int) -> None:
        self.operation = operation
        self.rank = rank
        super().__init__(f"rank {rank}: {operation}: the communicator was aborted")


class UnmappedAddressError(FpgacclError):
    """A DMA address falls outside every registered memory window."""


class BackendUnavailableError(FpgacclError):
    """The requested backend cannot run here (missing toolchain, no board)."""


class ToolchainError(FpgacclError):
    """An external tool (Verilator, yosys, nextpnr, tshark) failed."""


class BitstreamMissingError(InvalidArgumentError):
    """``fpgaccl flash``: no bitstream where the argument says (or no finished build of
    the board's configuration when none was given)."""


class CableNotFoundError(BackendUnavailableError):
    """``fpgaccl flash``: openFPGALoader found no programming cable (board unplugged,
    wrong ``--cable``, or no permission on the USB device); ``cable`` names the one
    asked for (None: the board's default)."""

    def __init__(self, cable: str | None, message: str) -> None:
        self.cable = cable
        super().__init__(message)


class CollectiveMismatchError(InvalidArgumentError):
    """Ranks called one collective with different arguments (kind, count, dtype, op,
    root, algorithm, tag or call order). ``field`` is the first that differs, ``ranks``
    the two ranks that compared, ``values`` what each passed (as text). Every rank of
    the call raises it, and no user buffer was written."""

    def __init__(self, field: str, ranks: tuple[int, int], values: tuple[str, str]) -> None:
        self.field = field
        self.ranks = ranks
        self.values = values
        super().__init__(field, f"rank {ranks[0]} {values[0]}, rank {ranks[1]} {values[1]} "
                         "(every rank must pass the same count and dtype, op, root, "
                         "algorithm and tag, in the same order)")

    @staticmethod
    def of(field: str, ranks: tuple[int, int], values: tuple[str, str]) -> CollectiveMismatchError:
        """The error for ``field``: a count or dtype difference is also a
        :class:`CountMismatchError` or :class:`DtypeMismatchError`."""
        cls = {"count": CollectiveCountMismatchError, "counts": CollectiveCountMismatchError,
               "dtype": CollectiveDtypeMismatchError}.get(field, CollectiveMismatchError)
        return cls(field, ranks, values)


class CollectiveCountMismatchError(CollectiveMismatchError, CountMismatchError):
    """Ranks called one collective with different element counts (``count``), or
    all-to-all-v with per-peer counts that do not pair up (``counts``)."""


class CollectiveDtypeMismatchError(CollectiveMismatchError, DtypeMismatchError):
    """Ranks called one collective with different element types."""
