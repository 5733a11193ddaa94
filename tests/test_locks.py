"""The readers-writer lock that keeps samples and state changes apart."""

from __future__ import annotations

import threading
import time

from twinkle_core.locks import ReadWriteLock


def test_readers_share_writers_wait() -> None:
    lock = ReadWriteLock()
    events: list[str] = []
    with lock.read():
        with lock.read():  # readers share
            events.append("two readers")

        def writer() -> None:
            with lock.write():
                events.append("writer")

        t = threading.Thread(target=writer)
        t.start()
        time.sleep(0.1)
        assert events == ["two readers"], "the writer must wait for the reader"
    t.join(5)
    assert events == ["two readers", "writer"]
