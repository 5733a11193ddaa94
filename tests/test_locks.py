"""The readers-writer lock that keeps samples and state changes apart.

Threads are ordered by what the lock lets us observe (``writers_waiting``),
never by sleeping and hoping the other thread got somewhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from twinkle_core.locks import ReadWriteLock


def wait_until(condition: Callable[[], bool], what: str, deadline_s: float = 30.0) -> None:
    """Poll ``condition``; the deadline only stops a broken lock from hanging the run."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {deadline_s} s")
        time.sleep(0.001)


def test_readers_share_writers_wait() -> None:
    lock = ReadWriteLock()
    events: list[str] = []

    def reader() -> None:
        with lock.read():
            events.append("second reader")

    def writer() -> None:
        with lock.write():
            events.append("writer")

    with lock.read():
        # readers share: a second one gets in while this one holds the lock
        second = threading.Thread(target=reader)
        second.start()
        second.join(30)
        assert not second.is_alive() and events == ["second reader"]

        w = threading.Thread(target=writer)
        w.start()
        wait_until(lambda: lock.writers_waiting == 1, "the writer waiting for the lock")
        assert events == ["second reader"], "the writer must wait for the reader"
    w.join(30)
    assert not w.is_alive() and events == ["second reader", "writer"]
    assert lock.writers_waiting == 0
