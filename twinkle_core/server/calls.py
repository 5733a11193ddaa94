"""One engine call of the server, and the wait for it that a client's disconnect cuts short."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from twinkle_core.data_format import InputFeature, SampleResponse, SamplingParams
from twinkle_core.requests import Finished, SampleHandle

__all__ = ["Pending", "client_gone"]

log = logging.getLogger("twinkle.server")


async def client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so only a disconnect comes next)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Pending:
    """One engine call: a ``submit()`` handle, or ``sample()`` in a worker thread where there is none."""

    def __init__(self, sampler: Any, prompts: list[InputFeature], params: SamplingParams, adapter: str) -> None:
        submit = getattr(sampler, "submit", None)
        self.handle: SampleHandle | None = None
        self._thread: asyncio.Future[list[SampleResponse]] | None = None
        if submit is not None:
            self.handle = submit(prompts, params, adapter)
        else:
            self._thread = asyncio.ensure_future(asyncio.to_thread(sampler.sample, prompts, params, adapter))

    async def responses(self) -> list[SampleResponse]:
        """What ``sample()`` returns; awaiting it from a cancelled task never cancels the engine call."""
        if self.handle is not None:
            return list(await asyncio.shield(self.handle))
        assert self._thread is not None
        return list(await asyncio.shield(self._thread))

    async def finished(self) -> AsyncIterator[Finished]:
        """Each sequence as the engine finishes it (all at the end without a handle)."""
        if self.handle is not None:
            async for item in self.handle:
                yield item
            return
        for p, response in enumerate(await self.responses()):
            for k, seq in enumerate(response.sequences):
                yield Finished(input_index=p, sample_index=k, sequence=seq)

    def done(self) -> bool:
        """Whether the engine call has finished."""
        if self.handle is not None:
            return self.handle.done()
        assert self._thread is not None
        return self._thread.done()

    def abort(self) -> bool:
        """Stop the engine call (its unfinished sequences end with ``stop_reason="abort"``); whether it ran."""
        if self.handle is None or self.handle.done():
            return False
        self.handle.abort()
        return True

    async def until_done_or_gone(self, request: Request) -> list[SampleResponse]:
        """The responses; aborts the call first if the client disconnects while it runs."""
        result = asyncio.ensure_future(self.responses())
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done() and self.abort():
                log.info("client left before its reply; the engine call was aborted")
            return await result
        finally:
            gone.cancel()
