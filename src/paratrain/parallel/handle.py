"""An in-flight collective of the data-parallel reducers, native or ours, with the
timestamps the overlap report needs (launch, observed completion)."""

from __future__ import annotations

import time


class Handle:
    """An in-flight collective: ``wait()`` blocks until its result is in place, then runs
    the optional ``then`` callback once (e.g. copy out, free a buffer)."""

    __slots__ = ("work", "then", "launched_s", "done_s", "nbytes")

    def __init__(self, work=None, then=None) -> None:
        self.work = work
        self.then = then
        self.launched_s = time.perf_counter()
        self.done_s: float | None = None
        self.nbytes = 0  # size of the buffer in flight, for memory accounting

    def is_completed(self) -> bool:
        if self.done_s is not None:
            return True
        if self.work is None or self.work.is_completed():
            self.done_s = time.perf_counter()
            return True
        return False

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.done_s is None:
            self.done_s = time.perf_counter()
        if self.then is not None:
            then, self.then = self.then, None
            then()
