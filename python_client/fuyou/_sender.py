"""The chunk pipeline's sender thread: runs its jobs (callables) in order, off
the autograd thread (see _slots.py: the jobs fill the session's slots)."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

__all__ = ["Sender"]


class Sender:
    """One thread that runs the pipeline's jobs (callables) in order. The first
    job that raises stops the rest (they are dropped); ``flush`` waits until
    nothing is queued and raises that error."""

    def __init__(self, name: str):
        self._queue: "queue.Queue" = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self.error is None:
                    job()
            except BaseException as e:  # surfaces at the next hook or step()
                self.error = e
            finally:
                job = None
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def flush(self) -> None:
        with self._cond:
            while self._pending:
                self._cond.wait()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Ends the thread once the queued jobs ran (idempotent). Called on the
        sender thread itself (a garbage collection there closing an optimizer),
        it only asks the thread to end."""
        if self._thread.is_alive():
            self._queue.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()
