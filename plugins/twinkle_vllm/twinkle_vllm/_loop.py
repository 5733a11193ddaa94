"""An asyncio event loop on its own daemon thread.

vLLM's ``AsyncLLM`` is an asyncio object: every request is a coroutine on one
loop. Running that loop on a private thread lets any number of user threads
call the blocking ``sample()`` at once; their requests meet in the same engine
and are batched together (continuous batching), which is the point of vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """Runs an event loop forever on a daemon thread until :meth:`stop`."""

    def __init__(self, name: str = "twinkle-vllm-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        # A daemon thread: a user who forgets close() must still be able to exit.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()
        # Drain what stop() cancelled, so no "Task was destroyed" noise at exit.
        pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (use only through :meth:`submit` / :meth:`run` from other threads)."""
        return self._loop

    @property
    def alive(self) -> bool:
        """Whether the loop thread is still running."""
        return self._thread.is_alive() and not self._loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; return a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block the calling thread for its result.

        If the caller is interrupted (``KeyboardInterrupt``) or times out, the
        coroutine is cancelled so that its vLLM requests are aborted, not leaked.
        """
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop and join its thread (idempotent)."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
