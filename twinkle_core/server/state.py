"""The state behind the server's routes: the sampler, the sessions, the options and the calls in flight.

:class:`ServerState` is what every route module is handed: it turns a body's
fields into the engine's ``SamplingParams`` (a 400 naming the field it cannot
honour), names the calls in flight for ``/abort_requests`` and the
``--request-timeout`` deadline, holds new calls while ``/pause`` is on, and
counts finished calls for ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from twinkle_core.data_format import SamplingParams
from twinkle_core.episode import OnTemplateMismatch
from twinkle_core.errors import ConfigError, PromptTooLongError, TwinkleError
from twinkle_core.server.calls import Pending
from twinkle_core.server.limits import Limits
from twinkle_core.server.media import MediaAccess
from twinkle_core.server.protocol import ApiError, Route, body_names, brief, neutral_violation
from twinkle_core.server.refusals import error_answer
from twinkle_core.server.sessions import SessionStore
from twinkle_core.tools import get_tool_parser

__all__ = ["ServerState"]

log = logging.getLogger("twinkle.server")


class ServerState:
    """The state behind the routes: the sampler, the sessions and the options."""

    def __init__(
        self,
        sampler: Any,
        *,
        model_name: str,
        tool_parser: Any,
        on_template_mismatch: OnTemplateMismatch,
        default_max_tokens: int,
        max_logprobs: int,
        sessions: SessionStore,
        limits: Limits,
        media_access: MediaAccess | None = None,
    ) -> None:
        self.sampler = sampler
        #: where a request's images may come from (local files, remote URLs)
        self.media_access = media_access or MediaAccess()
        self.limits = limits
        self.model_name = model_name
        self.tool_parser = get_tool_parser(tool_parser)
        self.no_parser = get_tool_parser("none")
        self.on_template_mismatch = on_template_mismatch
        if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int) or default_max_tokens < 1:
            raise ConfigError(
                f"default_max_tokens={default_max_tokens!r} is invalid: expected an integer >= 1 (max_tokens for a"
                " request that gives none)."
            )
        self.default_max_tokens = default_max_tokens
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < 0:
            raise ConfigError(
                f"max_logprobs={max_logprobs!r} is invalid: expected an integer >= 0 (the most log-prob"
                " alternatives a request may ask for per position)."
            )
        self.max_logprobs = max_logprobs
        self.sessions = sessions
        #: the calls in flight by request id (the server's own calls only)
        self.in_flight: dict[str, list[Pending]] = {}
        #: set while the server takes new calls; cleared by /pause (made in the app's event loop)
        self.running = asyncio.Event()
        self.running.set()
        self.pause_mode: str | None = None
        self.waiting = 0  # calls held by /pause
        self.prompt_tokens = self.generated_tokens = self.finished_calls = 0

    # -- request pieces ----------------------------------------------------------------------------
    def adapter(self, model: str) -> str:
        if model in ("base", self.model_name, ""):
            return ""
        if model in self.sampler.adapters:
            return model
        names = ", ".join(["base", self.model_name, *self.sampler.adapters])
        raise ApiError(
            404, f"The model {model!r} does not exist: this server has {names}.", param="model", code="model_not_found"
        )

    def params(
        self,
        req: Any,
        route: Route,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        default_max_tokens: int | None = None,
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` for a body (a 400 naming the field it cannot honour).

        ``max_tokens``: the body's (``None`` when it gives none: ``default_max_tokens``,
        else the server's ``--max-tokens``, is used then).
        """
        bad = neutral_violation(route, req.model_dump(exclude_unset=True))
        if bad is not None:
            raise ApiError(400, bad, param=bad.split("=", 1)[0])
        limit = self.sampler.max_model_len
        if max_tokens is not None and max_tokens > limit:
            # As vLLM's server answers. A budget within the context is cut to what the prompt leaves.
            name = body_names(route, req).get("max_tokens", "max_tokens")
            raise ApiError(
                400,
                f"{name}={max_tokens} is more than this model's context of {limit} tokens (max_model_len, the"
                f" prompt included): ask for at most {limit}; a reply ends where the context does.",
                param=name,
            )
        if req.stream and req.prompt_logprobs is not None:
            raise ApiError(
                400,
                "stream with prompt_logprobs is not supported: the prompt's log-probs come with whole replies;"
                " ask without stream.",
                param="prompt_logprobs",
            )
        for field, count in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            # Each alternative is a row per position per choice of the reply: a client cannot ask for the vocabulary.
            if count is not None and count > self.max_logprobs:
                name = body_names(route).get(field, field)
                raise ApiError(
                    400,
                    f"{name}={count} is more than this server allows: at most {self.max_logprobs} log-prob"
                    f" alternatives per position (start it with --max-logprobs {count} for more).",
                    param=name,
                )
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options needs stream=true.", param="stream_options")
        if req.stream_options is not None and set(req.stream_options) - {"include_usage"}:
            raise ApiError(
                400,
                f"stream_options={brief(req.stream_options)}: only 'include_usage' is supported.",
                param="stream_options",
            )
        fields: dict[str, Any] = {
            "num_samples": req.n,
            "max_tokens": max_tokens if max_tokens is not None else default_max_tokens or self.default_max_tokens,
            # the sampled token's log-prob always comes back (as sampled_logprobs)
            "logprobs": logprobs if logprobs is not None else 0,
            "prompt_logprobs": prompt_logprobs,
            "ignore_eos": req.ignore_eos,
        }
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "min_tokens",
            "logit_bias",
            "allowed_token_ids",
            "bad_words",
        ):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        if req.top_k is not None:
            fields["top_k"] = -1 if req.top_k == 0 else req.top_k  # vLLM: 0 and -1 both mean off
        if req.stop is not None and req.stop != []:  # "" is refused below, as [""] is: it never matches
            fields["stop"] = req.stop
        if req.stop_token_ids:
            fields["stop_token_ids"] = req.stop_token_ids
        if req.return_routed_experts:
            fields["return_routed_experts"] = True
        structured = _structured_outputs(req.structured_outputs, req.response_format)
        if structured is not None:
            fields["structured_outputs"] = structured
        try:
            return SamplingParams(**fields)
        except TwinkleError as exc:
            raise error_answer(exc, body_names(route, req)) from None

    def template_with(self, options: dict[str, Any] | None) -> Any:
        """The sampler's template with a body's ``chat_template_kwargs`` (``None`` when it sets none)."""
        if not options:
            return None
        try:
            return self.sampler.template.with_options(**options)
        except TwinkleError as exc:
            raise ApiError(400, str(exc), param="chat_template_kwargs") from None

    def check_parts(self, parts: int, names: Mapping[str, str]) -> None:
        """Refuse a conversation of more messages and tools than the context has tokens, before any is
        converted or rendered: each renders to a token at least."""
        limit = self.sampler.max_model_len - 1
        if parts > limit:
            raise self.refusal(PromptTooLongError("", index=0, length=parts, limit=limit, at_least=True), names)

    def refusal(self, exc: BaseException, names: Mapping[str, str] | None = None) -> BaseException:
        """What a route raises for an engine call refused at submission (the error itself if unexpected).

        ``names``: :func:`body_names` of the call's body.
        """
        if isinstance(exc, TwinkleError):
            return error_answer(exc, names)
        return exc

    def stream_error(self, exc: Exception, names: Mapping[str, str] | None = None) -> str:
        """A call that failed after its stream's 200 went out: the error as the stream's last events, then ``[DONE]``.

        A refused input (a token id out of the vocabulary, a prompt too long, a
        bad grammar) is found by the engine once the call runs; the client gets
        the same error body a call without ``stream`` gets, not a cut connection.
        """
        error = self.refusal(exc, names)
        if not isinstance(error, ApiError):
            log.error("a streamed call failed", exc_info=exc)
            error = ApiError(
                500, f"Internal error ({type(exc).__name__}); the server is still up.", kind="server_error"
            )
        self.limits.refuse_answer(error)
        return error.event() + "data: [DONE]\n\n"

    # -- calls in flight, pause --------------------------------------------------------------------
    @contextmanager
    def tracked(self, request_id: str, pending: Pending) -> Iterator[None]:
        """Name a call in flight (``/abort_requests`` takes the name) while the block runs; abort it at the
        deadline (``--request-timeout``)."""
        self.in_flight.setdefault(request_id, []).append(pending)
        deadline = self.limits.deadline(pending.abort)
        try:
            yield
        finally:
            if deadline is not None:
                deadline.cancel()
            calls = self.in_flight.get(request_id, [])
            if pending in calls:
                calls.remove(pending)
            if not calls:
                self.in_flight.pop(request_id, None)

    async def unpaused(self) -> None:
        """Wait while the server is paused (``/pause``): new calls start after ``/resume``."""
        if self.running.is_set():
            return
        self.waiting += 1
        try:
            await self.running.wait()
        finally:
            self.waiting -= 1

    def count(self, prompt_tokens: int, generated_tokens: int) -> None:
        """Add a finished call to ``/metrics``."""
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens
        self.finished_calls += 1


def _structured_outputs(structured: dict[str, Any] | None, response_format: dict[str, Any] | None) -> Any:
    """vLLM's ``structured_outputs``, or OpenAI's ``response_format``, as ``SamplingParams.structured_outputs``."""
    if response_format is None or response_format.get("type") == "text":
        return structured  # {} is refused by SamplingParams (a constraint names exactly one kind), not dropped
    if structured is not None:
        raise ApiError(400, "Give structured_outputs or response_format, not both.", param="response_format")
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(
                400,
                f"response_format={brief(response_format)}: a json_schema needs json_schema.schema, a JSON schema.",
                param="response_format",
            )
        return {"json": schema}
    raise ApiError(
        400,
        f"response_format={brief(response_format)}: expected type 'text', 'json_object' or 'json_schema'.",
        param="response_format",
    )
