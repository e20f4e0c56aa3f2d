"""A register-driven backend's calls, run one at a time in the order they were issued, on
a thread of the communicator's own.

An engine behind registers runs one program at a time, but a process may hold several
communicators over it (sub-communicators) and issue their calls in any order with async
handles. Each communicator's calls therefore wait on its own thread, not the caller's,
and one communicator blocked on a peer never stops another's calls from being issued.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class Call:
    """A call queued or running: done when ``event`` is set, failed if ``error`` then is
    not None (the :class:`~fpgaccl.host.backends.base.Pending` shape)."""

    def __init__(self, name: str, deadline_s: float) -> None:
        self.name = name
        self.deadline_s = deadline_s
        self.event = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self.event.set()


class SerialCalls:
    """Runs submitted work in order on one thread, started at the first call."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._refuse: Callable[[str], BaseException] | None = None
        self._stopped = False

    def submit(self, name: str, deadline_s: float, work: Callable[[], None]) -> Call:
        call = Call(name, deadline_s)
        with self._lock:
            if self._refuse is not None or self._stopped:
                call.finish(self._refuse(name) if self._refuse else
                            RuntimeError(f"{self._name}: calls after close"))
                return call
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()
            self._queue.put((call, work))
        return call

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            call, work = item
            refuse = self._refuse
            if refuse is not None:
                call.finish(refuse(call.name))
                continue
            try:
                work()
            except BaseException as e:  # handed to the caller's wait()
                refuse = self._refuse   # an abort while it ran: its error is the abort
                call.finish(refuse(call.name) if refuse is not None else e)
            else:
                call.finish(None)

    def stop(self, refuse: Callable[[str], BaseException] | None = None,
             wait: bool = True) -> None:
        """No more calls; with ``refuse``, every queued call (and one running, when it
        ends) fails with ``refuse(its name)``; ``wait``: return once the thread ended,
        i.e. once the calls issued before have run."""
        with self._lock:
            if refuse is not None:
                self._refuse = refuse
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
            self._queue.put(None)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()
