"""The calls of a ``Sampler``: check, run, stream, abort, continue and settle.

Every call (``sample``, ``submit``, ``asample``, ``handle.resume()``) takes
one path here: its arguments are checked into a :class:`Call`, its
:class:`~twinkle_core.requests.CallFeed` is tracked as in flight while it
runs, its run is continued after each weight change that keeps it
(``in_flight="keep"``), and the feed is settled once with the responses or
the error. A Ray replica serving a share of a call enters at
:meth:`Calls.run_checked`. The ``Sampler`` is the facade in front; this module
holds no public API of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from twinkle_core.data_format import (
    InputFeature,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    Trajectory,
)
from twinkle_core.data_format.media import input_media
from twinkle_core.data_format.params import resolve_params
from twinkle_core.engine import Engine
from twinkle_core.errors import (
    EngineDeadError,
    IncompleteUpdateError,
    InvalidInputError,
    PromptTooLongError,
    TemplateError,
    TwinkleError,
    UnknownAdapterError,
    UnsupportedFeatureError,
)
from twinkle_core.inputs import (
    OnInvalid,
    SampleInputs,
    check_alternatives,
    check_params,
    check_prompt,
    normalize_inputs,
    prompt_too_long,
    truncate_prompt,
    unpadded,
)
from twinkle_core.requests import CallFeed, EngineRun, Finished, SampleHandle
from twinkle_core.sampler.continuation import RunSpec, merge_sequences, plan_continuation
from twinkle_core.sampler.policy import Lifecycle, PolicyState
from twinkle_core.sampler.sequences import SequenceBuilder
from twinkle_core.sampler.templates import TemplateSlot

__all__ = ["Call", "Calls"]


@attrs.frozen
class Call:
    """The checked arguments of one call."""

    items: list[Any]
    params: SamplingParams
    adapter_name: str
    on_invalid: OnInvalid


def _check_media(items: list[Any], accepted: frozenset[str], engine: str) -> None:
    """Refuse, before any work, a prompt carrying a medium the engine does not pass to its model."""
    for index, item in enumerate(items):
        for kind in input_media(item):
            if kind not in accepted:
                takes = ", ".join(sorted(accepted)) or "text only"
                raise UnsupportedFeatureError(
                    f"inputs[{index}] holds {'an image' if kind == 'image' else 'a video'}, but the {engine} engine"
                    f" does not pass {kind}s to its model (it takes: {takes}). Nothing was sampled; send text-only"
                    " prompts to this engine."
                )


class Calls:
    """The call path of one sampler: its engine, state, template and sequence builder are given, none owned."""

    def __init__(
        self,
        engine: Engine,
        state: PolicyState,
        templates: TemplateSlot,
        sequences: SequenceBuilder,
        lifecycle: Lifecycle,
    ) -> None:
        self._engine = engine
        self._state = state
        self._templates = templates
        self._sequences = sequences
        self._lifecycle = lifecycle
        # Serialises the runs of engines that cannot run concurrently.
        self._serial = threading.Lock()

    def check(
        self,
        inputs: SampleInputs,
        sampling_params: SamplingParams | dict[str, Any] | None,
        adapter_name: str,
        num_samples: int | None,
        on_invalid: OnInvalid,
    ) -> tuple[CallFeed, Call | None]:
        """Check the arguments of a call; its feed, and the work (``None``: nothing to do)."""
        self._lifecycle.check_open()
        self._state.require_settled()
        if on_invalid not in ("raise", "skip"):
            raise InvalidInputError(f"on_invalid={on_invalid!r} is invalid: expected 'raise' or 'skip'.")
        params = resolve_params(sampling_params, num_samples)
        info = self._engine.info
        check_params(params, info.supported_params, info.vocab_size, info.name or type(self._engine).__name__)
        items = normalize_inputs(inputs, on_invalid=on_invalid)
        _check_media(items, info.media, info.name or type(self._engine).__name__)
        if not isinstance(adapter_name, str):
            raise UnknownAdapterError(f"adapter_name={adapter_name!r} is invalid: expected a string ('' = base model).")
        if items and adapter_name:
            self._state.require_adapter(adapter_name)
        feed = self._new_feed(len(items), params)
        if not items:
            feed.settle([], None)
            return feed, None
        return feed, Call(items, params, adapter_name, on_invalid)

    def _new_feed(self, num_inputs: int, params: SamplingParams) -> CallFeed:
        """The feed of a new call, whose handle's ``resume()`` continues it with ``params``."""
        return CallFeed(num_inputs, params.num_samples, resumer=lambda previous: self._resume(previous, params))

    def execute(self, feed: CallFeed, call: Call, *, background: bool = False) -> None:
        """Run a call to the end (in this thread, or in its own): one run, then a continuation after each ``keep``."""

        def first() -> list[SampleResponse]:
            return self.run_call(call, None, feed)

        self._run_call(feed, first, call.params, call.adapter_name, background=background)

    def _run_call(
        self,
        feed: CallFeed,
        first: Callable[[], list[SampleResponse]],
        params: SamplingParams,
        adapter: str,
        *,
        background: bool,
    ) -> None:
        """The one path every call takes: in flight while it runs, continued after each ``keep``, then settled.

        The call is in flight (``abort_all`` reaches it) from before its thread starts.
        """
        self._state.track(feed)
        if background:
            runner = threading.Thread(
                target=self._drive, args=(feed, first, params, adapter), name="twinkle-request", daemon=True
            )
            try:
                runner.start()
            except BaseException:  # no thread to be had: the call is not in flight
                self._state.untrack(feed)
                raise
        else:
            self._drive(feed, first, params, adapter)

    def _drive(
        self, feed: CallFeed, first: Callable[[], list[SampleResponse]], params: SamplingParams, adapter: str
    ) -> None:
        try:
            responses = first()
            while feed.take_suspended():
                try:
                    responses = self._continue(feed, responses, params, adapter)
                except (UnknownAdapterError, IncompleteUpdateError) as exc:
                    if isinstance(exc, UnknownAdapterError) and (not adapter or self._state.has_adapter(adapter)):
                        raise
                    # its adapter was removed meanwhile (in_flight="keep"), or the update it waited for failed
                    # part-way: nothing can continue it, and what it generated stands, ended as an abort ends it
                    for i, response in enumerate(responses):  # streams get the sequences a suspension held back
                        for j, seq in enumerate(response.sequences):
                            if seq.stop_reason == "abort":
                                feed.emit(Finished(i, j, seq))
                    break
        except BaseException as exc:
            feed.settle(None, exc)
        else:
            feed.settle(responses, None)
        finally:
            self._state.untrack(feed)

    def _resume(self, previous: SampleHandle, params: SamplingParams) -> SampleHandle:
        self._lifecycle.check_open()
        responses = previous.result()
        adapters = {seq.adapter_name for r in responses for seq in r.sequences}
        adapter = adapters.pop() if len(adapters) == 1 else ""
        if adapter:
            self._state.require_adapter(adapter)
        feed = self._new_feed(previous.num_inputs, params)

        def first() -> list[SampleResponse]:
            return self._continue(feed, responses, params, adapter, emit_all=True)

        self._run_call(feed, first, params, adapter, background=True)
        return feed.handle

    def _continue(
        self,
        feed: CallFeed,
        responses: list[SampleResponse],
        params: SamplingParams,
        adapter_name: str,
        *,
        emit_all: bool = False,
    ) -> list[SampleResponse]:
        """Continue every aborted sequence of ``responses`` from its partial tokens; merge each with its continuation.

        Each continuation is one prompt (the original prompt and the partial
        tokens) with one sample, what is left of ``max_tokens``, and its
        sample index and position, so seeded engines draw what the
        uninterrupted sequence would have.
        """
        limit = self._engine.max_prompt_len(params.replace(max_tokens=1))
        out, todo = plan_continuation(feed, responses, params, limit, emit_all=emit_all)
        if todo is None:
            return out
        prompts, cont_params, spec = todo
        results = self.run_call(Call(prompts, cont_params, adapter_name, "raise"), None, feed, spec)
        for (i, j), result in zip(spec.slots, results):
            merged = merge_sequences(
                out[i].prompt_token_ids,
                out[i].sequences[j],
                result.sequences[0],
                params=cont_params,
                template=self._templates.template,
                make_sequence=self._sequences.make,
            )
            out[i].sequences[j] = merged
        return out

    def run_checked(
        self,
        items: list[Any],
        params: SamplingParams,
        adapter_name: str,
        on_invalid: OnInvalid,
        indices: list[int] | None,
        feed: CallFeed | None = None,
        spec: RunSpec | None = None,
    ) -> list[SampleResponse]:
        """:meth:`run_call` on a call's arguments: where a Ray replica serving a share of a call enters."""
        return self.run_call(Call(items, params, adapter_name, on_invalid), indices, feed, spec)

    def run_call(
        self, call: Call, indices: list[int] | None, feed: CallFeed | None = None, spec: RunSpec | None = None
    ) -> list[SampleResponse]:
        """Run a checked call: hold the lock shared, check the adapter, then :meth:`_process`.

        The adapter check and the generation are one step under the lock, so
        no sequence is labelled with an adapter that was removed or replaced
        meanwhile.
        """
        try:
            with self._state.lock.read():
                self._lifecycle.check_open()
                self._state.require_settled()
                if call.adapter_name:
                    self._state.require_adapter(call.adapter_name)
                return self._process(call, indices, feed, spec)
        except EngineDeadError as exc:
            error = self._engine.after_death(exc)  # no lock held: the engine may restart itself
            if error is exc:
                raise
            raise error from exc.__cause__

    def _process(
        self, call: Call, indices: list[int] | None, feed: CallFeed | None, spec: RunSpec | None
    ) -> list[SampleResponse]:
        """Encode and check each input, run the valid ones, and answer in input order.

        ``call.items`` may hold errors (inputs ``normalize_inputs`` refused in skip
        mode). An invalid input raises, or with ``on_invalid="skip"`` gets a
        response with ``error`` set. Errors name input ``k`` as
        ``inputs[indices[k]]`` (default ``k``): a Ray replica serving a share of
        a call names each by its place in the whole call. ``feed`` receives
        each sequence as it finishes and can stop the run; ``spec`` describes a
        continuation (see ``_continue``).
        """
        items, params, adapter_name = call.items, call.params, call.adapter_name
        features: list[InputFeature | None] = []
        errors: dict[int, TwinkleError] = {}
        limit, vocab, max_model_len = (
            self._engine.max_prompt_len(params),
            self._engine.info.vocab_size,
            self._engine.info.max_model_len,
        )
        for k, item in enumerate(items):
            index = k if indices is None else indices[k]
            feature: InputFeature | None = item if isinstance(item, InputFeature) else None
            try:
                if isinstance(item, TwinkleError):
                    raise item
                encoded = self._encode_checked(item, index, params, limit, max_model_len)
                feature = truncate_prompt(unpadded(encoded, index), params, limit)
                check_prompt(feature, index, limit=limit, vocab=vocab, max_model_len=max_model_len)
            except TwinkleError as exc:
                if call.on_invalid == "raise" or not isinstance(exc, ValueError):
                    raise
                errors[k] = exc
            features.append(feature)
        valid_at = [k for k, f in enumerate(features) if k not in errors and f is not None]
        generated: Iterator[SampleResponse] = iter([])
        if valid_at:
            check_alternatives([len(features[k].input_ids) for k in valid_at], params, max_model_len)  # type: ignore[union-attr]
            run = self._engine_run([features[k] for k in valid_at], params, adapter_name, valid_at, feed, spec)  # type: ignore[misc]
            if run.stopped():  # aborted before it started: nothing generated
                for p in range(len(run.prompts)):
                    run.report_empty(p, "abort")
            elif self._engine.info.concurrent:
                self._run_engine(run)
            else:
                with self._serial:
                    self._run_engine(run)
            generated = iter(run.responses())
        out: list[SampleResponse] = []
        for k, feature in enumerate(features):
            if k in errors:
                ids = feature.input_ids if feature is not None else []
                out.append(SampleResponse(prompt_token_ids=list(ids), error=str(errors[k])))
            else:
                out.append(next(generated))
        return out

    def _run_engine(self, run: EngineRun) -> None:
        returned = self._engine.run(run)
        if returned is not None:  # an engine written before reporting: its responses count as reports
            run.report_all(returned)

    def _engine_run(
        self,
        prompts: list[InputFeature],
        params: SamplingParams,
        adapter_name: str,
        positions: list[int],
        feed: CallFeed | None,
        spec: RunSpec | None,
    ) -> EngineRun:
        """The run of ``prompts`` (inputs ``positions`` of the call), reporting finished sequences to ``feed``."""
        stop = feed.start_run() if feed is not None else None
        if spec is None:

            def on_finish(p: int, s: int, seq: SampledSequence) -> None:
                if feed is not None and not (seq.stop_reason == "abort" and feed.suspended):
                    feed.emit(Finished(positions[p], s, seq))

            return EngineRun(
                prompts, params, adapter_name, on_finish=on_finish, stop_event=stop, sequences=self._sequences
            )
        sample_base = [spec.sample_base[k] for k in positions]
        generated = [spec.generated[k] for k in positions]

        def on_continued(p: int, s: int, seq: SampledSequence) -> None:
            if seq.stop_reason == "abort" and spec.feed.suspended:
                return  # continued again after the next change
            if spec.responses is None:
                spec.feed.emit(Finished(positions[p], s, seq))
                return
            i, j = spec.slots[positions[p]]
            merged = merge_sequences(
                spec.responses[i].prompt_token_ids,
                spec.responses[i].sequences[j],
                seq,
                params=params,
                template=self._templates.template,
                make_sequence=self._sequences.make,
            )
            spec.feed.emit(Finished(i, j, merged))

        return EngineRun(
            prompts,
            params,
            adapter_name,
            sample_base=sample_base,
            generated=generated,
            max_tokens=[spec.budgets[k] for k in positions],
            on_finish=on_continued,
            stop_event=stop,
            sequences=self._sequences,
        )

    def _encode_checked(
        self, item: InputFeature | Trajectory, index: int, params: SamplingParams, limit: int, max_model_len: int
    ) -> InputFeature:
        """``encode``, with any failure of the template or tokenizer as a typed error naming the input.

        A text that cannot fit ``limit`` tokens is refused, and one truncated
        to its end is cut, without tokenizing all of a text far longer than
        that (:mod:`twinkle_core.template.bounds`).
        """
        keep = params.truncate_prompt_tokens
        try:
            if keep is not None:
                return self._templates.encode(item, keep_last=limit if keep == -1 else keep)
            return self._templates.encode(item, max_tokens=limit)
        except PromptTooLongError as exc:
            raise prompt_too_long(index, exc.length, limit, max_model_len, at_least=exc.at_least) from None
        except TwinkleError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, UnicodeError) as exc:
            raise TemplateError(
                f"inputs[{index}] could not be encoded by the chat template: {type(exc).__name__}: {exc}"
            ) from exc
