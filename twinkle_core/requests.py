"""Requests as first-class objects: ``submit()`` returns a :class:`SampleHandle`.

A handle is one call of ``sample()`` that runs in the background. It can be
waited on (``result()``), streamed as its sequences finish
(``as_completed()``, or ``async for`` inside an event loop), awaited
(``await handle``), aborted (``abort()``: unfinished sequences come back with
``stop_reason="abort"`` and what they generated so far) and continued
(``resume()``: the aborted sequences go on under the current weights).

The engine side is :class:`EngineRun`: what one ``_run`` of an engine
generates, the switch that tells it to stop early, and the callback through
which it reports each sequence as it finishes. ``sample()`` and ``submit()``
share all of it: ``sample()`` is a submit whose run happens in the caller's
thread, followed by ``result()``.

Threads and asyncio meet in one place, :meth:`SampleHandle.__await__` and
:meth:`SampleHandle.__aiter__`, through the standard library's
``asyncio.wrap_future`` and ``loop.call_soon_threadsafe``: a running event
loop is never blocked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

import attrs

from twinkle_core.data_format import InputFeature, SampledSequence, SampleResponse, SamplingParams
from twinkle_core.errors import TwinkleError

__all__ = ["IN_FLIGHT_POLICIES", "CallFeed", "EngineRun", "Finished", "InFlightPolicy", "SampleHandle", "StopSwitch"]

#: What a weight or adapter change does to requests in flight (see ``Sampler.update_weights``).
IN_FLIGHT_POLICIES = ("wait", "abort", "keep")
InFlightPolicy = str


@attrs.frozen
class Finished:
    """One finished sequence of a submitted call, as ``as_completed()`` yields it.

    Attributes:
        input_index: the input's place in the call.
        sample_index: which of its ``num_samples`` completions.
        sequence: the completion.
    """

    input_index: int
    sample_index: int
    sequence: SampledSequence


class StopSwitch(threading.Event):
    """A ``threading.Event`` that also calls back when set: an engine on an event loop needs no polling."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callback_lock = threading.Lock()

    def set(self) -> None:
        with self._callback_lock:
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the setting thread) when set; at once if it already is."""
        with self._callback_lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def remove_callback(self, callback: Callable[[], None]) -> None:
        """Forget ``callback`` (the run ended first)."""
        with self._callback_lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


class EngineRun:
    """What one engine run generates, and how the engine reports back.

    ``Engine.run`` reads it: ``prompts``, ``params`` (with ``num_samples``
    completions per prompt) and ``adapter_name`` as ``BatchEngine.generate``
    gets them, plus, for continued sequences, the sample index
    and the number of tokens generated before this run of each prompt
    (``sample_base`` and ``generated``: seeded randomness keyed on them makes
    a continued sequence draw what the uninterrupted one would have). While
    running, an engine checks :meth:`stopped` (or waits on ``stop_event``)
    between steps and then ends its unfinished sequences with
    ``stop_reason="abort"``, keeping what they generated.

    The engine reports each sequence once, as soon as it is final, with
    :meth:`report` (what it generated: the core builds the sequence) or
    :meth:`finish` (a sequence it built with ``EngineContext.make_sequence``),
    and a prompt's scores with :meth:`report_scores`; the core assembles the
    responses from the reports (:meth:`responses`).

    Attributes:
        prompts: validated prompts.
        params: the sampling parameters.
        adapter_name: the adapter (``""`` for the base model).
        sample_base: per prompt, the sample index of its first completion.
        generated: per prompt, completion tokens generated before this run
            (they are at the end of the prompt).
        max_tokens: per prompt, the most tokens to generate in this run
            (``params.max_tokens``, or less for a continuation).
        stop_event: set when the run should stop early (``add_callback`` to hear it at once).
    """

    def __init__(
        self,
        prompts: list[InputFeature],
        params: SamplingParams,
        adapter_name: str,
        *,
        sample_base: list[int] | None = None,
        generated: list[int] | None = None,
        max_tokens: list[int] | None = None,
        on_finish: Callable[[int, int, SampledSequence], None] | None = None,
        stop_event: StopSwitch | None = None,
        sequences: Any = None,
    ) -> None:
        self.prompts = prompts
        self.params = params
        self.adapter_name = adapter_name
        self.sample_base = sample_base if sample_base is not None else [0] * len(prompts)
        self.generated = generated if generated is not None else [0] * len(prompts)
        self.max_tokens = max_tokens if max_tokens is not None else [params.max_tokens] * len(prompts)
        self.stop_event = stop_event if stop_event is not None else StopSwitch()
        self._on_finish = on_finish
        self._builder = sequences  # the sampler's SequenceBuilder
        self._sequences: dict[tuple[int, int], SampledSequence] = {}
        self._scores: dict[int, tuple[Any, Any]] = {}
        self._report_lock = threading.Lock()

    def stopped(self) -> bool:
        """Whether the run should end now (an abort, or a weight change under the ``keep`` policy)."""
        return self.stop_event.is_set()

    def report(
        self,
        prompt_index: int,
        sample_index: int,
        tokens: list[int],
        *,
        stop_reason: str,
        stop: str | int | None = None,
        logprobs: list[float] | None = None,
        top_logprobs: Any = None,
        sampling_mask: Any = None,
        routed_experts: Any = None,
    ) -> SampledSequence:
        """Report one final sequence by what was generated; the core builds it (text, version, training feature).

        ``stop_reason`` is ``"stop"``, ``"length"`` or ``"abort"``; ``stop`` the
        token id or string that ended it. Returns the sequence as built.
        """
        sequence: SampledSequence = self._require_builder().make(
            self.prompts[prompt_index],
            tokens,
            stop_reason=stop_reason,
            adapter_name=self.adapter_name,
            params=self.params,
            stop=stop,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            sampling_mask=sampling_mask,
            routed_experts=routed_experts,
        )
        self.finish(prompt_index, sample_index, sequence)
        return sequence

    def report_empty(self, prompt_index: int, stop_reason: str) -> None:
        """Report every sample of a prompt as generating nothing (no room to generate, or stopped before it began).

        Each carries the per-token fields ``params`` asks for, empty.
        """
        prompt = self.prompts[prompt_index]
        for s in range(self.params.num_samples):
            self.finish(
                prompt_index, s, self._require_builder().empty(prompt, self.params, self.adapter_name, stop_reason)
            )

    def _require_builder(self) -> Any:
        if self._builder is None:
            raise TypeError("This EngineRun has no sequence builder: the sampler that makes a run gives it one.")
        return self._builder

    def finish(self, prompt_index: int, sample_index: int, sequence: SampledSequence) -> None:
        """Report one final sequence, built already (``sample_index`` counts within this run's ``num_samples``).

        The first report of a sequence stands; a later one is ignored.
        """
        with self._report_lock:
            key = (prompt_index, sample_index)
            if key in self._sequences:
                return
            self._sequences[key] = sequence
        if self._on_finish is not None:
            self._on_finish(prompt_index, sample_index, sequence)

    def reported(self, prompt_index: int, sample_index: int) -> bool:
        """Whether that sequence was reported already."""
        with self._report_lock:
            return (prompt_index, sample_index) in self._sequences

    def report_scores(self, prompt_index: int, logprobs: list[float | None] | None, top_logprobs: Any = None) -> None:
        """Report a prompt's scores (``prompt_logprobs``: ``None`` at position 0, then one per prompt token)."""
        with self._report_lock:
            self._scores.setdefault(prompt_index, (logprobs, top_logprobs))

    def report_all(self, responses: list[SampleResponse]) -> None:
        """Report every sequence and score of ``responses`` not reported yet (an engine that returns responses)."""
        for p, response in enumerate(responses):
            for s, sequence in enumerate(response.sequences):
                self.finish(p, s, sequence)
            if response.prompt_logprobs is not None:
                self.report_scores(p, response.prompt_logprobs, response.prompt_top_logprobs)

    def responses(self) -> list[SampleResponse]:
        """The run's responses, one per prompt, assembled from the reports.

        Raises:
            TwinkleError: the engine ended the run without reporting a sequence.
        """
        out: list[SampleResponse] = []
        for p, prompt in enumerate(self.prompts):
            missing = [s for s in range(self.params.num_samples) if (p, s) not in self._sequences]
            if missing:
                raise TwinkleError(
                    f"The engine ended its run without reporting sample(s) {missing} of prompt {p}: every"
                    " sequence must be reported once (EngineRun.report or EngineRun.finish)."
                )
            logprobs, top = self._scores.get(p, (None, None))
            out.append(
                SampleResponse(
                    prompt_token_ids=list(prompt.input_ids),
                    sequences=[self._sequences[(p, s)] for s in range(self.params.num_samples)],
                    prompt_logprobs=logprobs,
                    prompt_top_logprobs=top,
                )
            )
        return out


class SampleHandle:
    """A submitted ``sample()`` call.

    Returned by ``Sampler.submit``. Thread-safe: any thread may wait on it,
    stream it or abort it.
    """

    def __init__(
        self, num_inputs: int, num_samples: int, *, resumer: Callable[[SampleHandle], SampleHandle] | None = None
    ) -> None:
        self.num_inputs = num_inputs
        self.num_samples = num_samples
        self._cond = threading.Condition()
        self._future: concurrent.futures.Future[list[SampleResponse]] = concurrent.futures.Future()
        self._events: list[Finished] = []
        self._listeners: list[Callable[[Finished | None], None]] = []
        self._abort = threading.Event()
        self._run_stop: StopSwitch | None = None
        self._suspended = False
        #: continues the aborted sequences in a new call (see ``resume``)
        self._resumer = resumer

    # -- state -----------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the call has finished (with a result or an error)."""
        return self._future.done()

    @property
    def aborted(self) -> bool:
        """Whether ``abort()`` was called."""
        return self._abort.is_set()

    def result(self, timeout: float | None = None) -> list[SampleResponse]:
        """What ``sample()`` would return: one ``SampleResponse`` per input, in input order.

        Raises:
            TimeoutError: not done within ``timeout`` seconds (the call goes on).
            Any error the call raised (the same ``sample()`` raises).
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"The call did not finish within {timeout} s; it is still running.") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's error once it is done, or ``None``."""
        try:
            return self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"The call did not finish within {timeout} s; it is still running.") from None

    # -- streaming -------------------------------------------------------------------------
    def as_completed(self, timeout: float | None = None) -> Iterator[Finished]:
        """Yield each sequence as it finishes (every one exactly once), then stop.

        Args:
            timeout: the longest wait for the next sequence, in seconds.

        Raises:
            TimeoutError: no sequence finished within ``timeout``.
            The call's error, after the sequences that finished before it.
        """
        seen = 0
        while True:
            with self._cond:
                ready = self._cond.wait_for(
                    lambda count=seen: count < len(self._events) or self._future.done(),  # type: ignore[misc]
                    timeout,
                )
                if not ready:
                    raise TimeoutError(f"No sequence finished within {timeout} s.")
                batch = self._events[seen:]
                seen += len(batch)
                finished = self._future.done() and seen >= len(self._events)
            yield from batch
            if finished:
                error = self._future.exception()
                if error is not None:
                    raise error
                return

    def __iter__(self) -> Iterator[Finished]:
        return self.as_completed()

    def __aiter__(self) -> AsyncIterator[Finished]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[Finished]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Finished | None] = asyncio.Queue()

        def push(item: Finished | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        with self._cond:
            for item in self._events:
                queue.put_nowait(item)
            if self._future.done():
                queue.put_nowait(None)
            else:
                self._listeners.append(push)
        try:
            while True:
                next_item = await queue.get()
                if next_item is None:
                    break
                yield next_item
        finally:
            with self._cond:
                if push in self._listeners:
                    self._listeners.remove(push)
        error = self._future.exception()
        if error is not None:
            raise error

    def __await__(self) -> Generator[Any, None, list[SampleResponse]]:
        return asyncio.wrap_future(self._future).__await__()

    # -- control ---------------------------------------------------------------------------
    def abort(self) -> None:
        """Stop the unfinished sequences; they come back with ``stop_reason="abort"``.

        Finished sequences are untouched. Aborting twice, or a finished call, is harmless.
        """
        with self._cond:
            self._abort.set()
            if self._run_stop is not None:
                self._run_stop.set()

    def resume(self) -> SampleHandle:
        """Continue the aborted sequences under the current weights, in a new call.

        Waits for this call to finish. Each aborted sequence goes on from its
        partial tokens with what is left of ``max_tokens``; the new handle's
        result is this one's, with every continued sequence holding both parts
        (tokens, log-probs, training feature; ``version_spans`` when the
        weights changed in between). Sequences that had finished are copied.
        """
        self.result()
        if self._resumer is None:  # pragma: no cover - every sampler sets it
            raise RuntimeError("This handle was not created by a sampler.")
        return self._resumer(self)


class CallFeed:
    """The producing side of one :class:`SampleHandle`: what the sampler (or a replica host) drives.

    Users hold the handle (``feed.handle``) and only ever read, stream, abort
    or resume it; the code that runs the call holds the feed and reports
    through it: a stop switch per engine run, sequences as they finish, the
    outcome. A ``keep`` weight change suspends the current run so the call
    can continue after it.
    """

    def __init__(
        self, num_inputs: int, num_samples: int, *, resumer: Callable[[SampleHandle], SampleHandle] | None = None
    ) -> None:
        self.handle = SampleHandle(num_inputs, num_samples, resumer=resumer)

    @property
    def aborted(self) -> bool:
        """Whether the user aborted the call."""
        return self.handle.aborted

    @property
    def suspended(self) -> bool:
        """Whether the current run was stopped for a ``keep`` weight change (its aborts are not the user's)."""
        return self.handle._suspended

    def start_run(self) -> StopSwitch:
        """A fresh stop switch for the next engine run, already set if the call was aborted."""
        h = self.handle
        with h._cond:
            event = StopSwitch()
            if h._abort.is_set():
                event.set()
            h._run_stop = event
            return event

    def suspend(self) -> bool:
        """Stop the current run so a weight change can go in; the call continues after it (``keep``)."""
        h = self.handle
        with h._cond:
            if h._future.done() or h._abort.is_set():
                return False
            h._suspended = True
            if h._run_stop is not None:
                h._run_stop.set()
            return True

    def take_suspended(self) -> bool:
        """Whether the run just ended was suspended (and not aborted since); clears the mark."""
        h = self.handle
        with h._cond:
            was, h._suspended = h._suspended, False
            return was and not h._abort.is_set()

    def emit(self, item: Finished) -> None:
        """Report one finished sequence to every reader of the handle."""
        h = self.handle
        with h._cond:
            h._events.append(item)
            listeners = list(h._listeners)
            h._cond.notify_all()
        for push in listeners:
            push(item)

    def settle(self, responses: list[SampleResponse] | None, error: BaseException | None) -> None:
        """End the call with its responses, or with ``error`` (the first outcome wins)."""
        h = self.handle
        with h._cond:
            if h._future.done():
                return
            if error is not None:
                h._future.set_exception(error)
            else:
                h._future.set_result(responses or [])
            listeners, h._listeners = list(h._listeners), []
            h._cond.notify_all()
        for push in listeners:
            push(None)
