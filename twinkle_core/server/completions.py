"""``/v1/completions`` as vLLM serves it: batched string or token-id prompts, echo, scoring, prompt log-probs.

A body's prompts become one engine call (``n`` samples each); choices are
prompt-major, ``index = prompt * n + sample``. With ``echo`` the prompt's
text comes first in each choice's text and, with ``logprobs``, the prompt's
tokens and log-probs come first in its log-prob block (the first token's
``None``): lm-evaluation-harness scores a continuation this way, with
``max_tokens`` 0 or 1.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from twinkle_core.data_format import InputFeature, SampledSequence, SampleResponse
from twinkle_core.data_format.params import MAX_NUM_SAMPLES
from twinkle_core.errors import PromptTooLongError, TwinkleError
from twinkle_core.server.bodies import CompletionRequest
from twinkle_core.server.calls import Pending
from twinkle_core.server.protocol import ApiError, body_names
from twinkle_core.server.shapes import TokenNames, choice_text, routes_field, stop_reason
from twinkle_core.server.state import ServerState

__all__ = ["MAX_SEQUENCES", "add_completion_routes", "complete"]

#: The most sequences (prompts x ``n``) one completions request may ask for: the engine holds every one
#: until the reply goes out, so a short body could otherwise ask for more memory than the machine has.
MAX_SEQUENCES = 65536


def _prompts(state: ServerState, req: CompletionRequest) -> tuple[list[InputFeature], list[str | None]]:
    """The prompts as features, and each one's text when it was given as text (for ``echo``)."""
    raw = req.prompt
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [raw]
    else:
        items = list(raw)
    if req.n <= MAX_NUM_SAMPLES and len(items) * req.n > MAX_SEQUENCES:  # a larger n: SamplingParams names it
        raise ApiError(
            400,
            f"{len(items)} prompts x n={req.n} asks for {len(items) * req.n} sequences in one request: expected at"
            f" most {MAX_SEQUENCES} (each holds memory until the reply goes out). Split the prompts over requests.",
            param="prompt",
        )
    features: list[InputFeature] = []
    texts: list[str | None] = []
    keep: int | None = None
    if req.truncate_prompt_tokens is not None:
        keep = state.sampler.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
        if keep == 0:
            message = "truncate_prompt_tokens=0 leaves no prompt: expected -1 or >= 1."
            raise ApiError(400, message, param="truncate_prompt_tokens")
    # A prompt longer than this can never run: refused before a long text is tokenized whole (or token ids copied).
    limit = state.sampler.max_model_len - 1
    for i, item in enumerate(items):
        try:
            if isinstance(item, str):
                ids = _tokenize(state, item, req, keep, limit)
                texts.append(item)
            else:
                if keep is None and len(item) > limit:
                    raise PromptTooLongError("", index=i, length=len(item), limit=limit)
                ids = list(item)
                texts.append(None)
        except PromptTooLongError as exc:
            too_long = PromptTooLongError("", index=i, length=exc.length, limit=limit, at_least=exc.at_least)
            raise state.refusal(too_long, body_names("completions", req)) from None
        if keep is not None and len(ids) > keep:
            ids = ids[:keep] if req.truncation_side == "right" else ids[-keep:]
            texts[-1] = None  # the echoed text is the kept tokens', decoded
        if not ids:
            raise ApiError(400, f"prompt[{i}] has no tokens: a prompt needs at least one.", param="prompt")
        features.append(InputFeature(input_ids=ids))
    return features, texts


def _tokenize(state: ServerState, text: str, req: CompletionRequest, keep: int | None, limit: int) -> list[int]:
    """A text prompt's ids, tokenizing only what it takes: refused past ``limit``, or (with ``keep``) at most
    ``keep + 1`` from the body's side, so the caller sees whether the text was cut."""
    template = state.sampler.template
    special = req.add_special_tokens
    if keep is None:
        return list(template.tokenize(text, max_tokens=limit, add_special_tokens=special))
    if req.truncation_side == "right":
        return list(template.tokenize(text, keep_first=keep + 1, add_special_tokens=special))
    return list(template.tokenize(text, keep_last=keep + 1, add_special_tokens=special))


class _Choices:
    """Builds the choices of one body (shared by the whole reply and the stream)."""

    def __init__(self, state: ServerState, req: CompletionRequest, features: list[InputFeature], texts: list[Any]):
        self.state, self.req, self.features, self.texts = state, req, features, texts
        self.names = TokenNames(state.sampler.template, bool(req.return_tokens_as_token_ids))
        self.eos = state.sampler.template.eos_token_id

    def choice(self, p: int, k: int, seq: SampledSequence, resp: SampleResponse | None) -> dict[str, Any]:
        req, template = self.req, self.state.sampler.template
        text = choice_text(
            seq,
            template,
            skip_special_tokens=req.skip_special_tokens,
            include_stop=req.include_stop_str_in_output,
        )
        prompt_ids = self.features[p].input_ids
        prompt_lps = resp.prompt_logprobs if resp is not None else None
        prompt_tops = resp.prompt_top_logprobs if resp is not None else None
        if req.echo:
            echoed = self.texts[p]
            if echoed is None:
                echoed = str(template.decode(prompt_ids, skip_special_tokens=req.skip_special_tokens))
            text = echoed + text
        block = None
        if req.logprobs is not None:
            tokens = list(seq.tokens)
            lps: list[float | None] = list(seq.logprobs or [])
            tops: list[Any] = list(seq.top_logprobs or [])
            if req.echo:
                plps = list(prompt_lps or [None] * len(prompt_ids))
                ptops = [t or [] for t in (prompt_tops or [[]] * len(prompt_ids))]
                tokens, lps, tops = list(prompt_ids) + tokens, plps + lps, ptops + tops
            block = self.names.completion_block(tokens, lps, tops if req.logprobs > 0 else None)
        out: dict[str, Any] = {
            "index": p * req.n + k,
            "text": text,
            "logprobs": block,
            "finish_reason": "length" if seq.stop_reason == "length" else seq.stop_reason,
            "stop_reason": stop_reason(seq, self.eos),
            "token_ids": seq.tokens,
            "sampled_logprobs": seq.logprobs,
            "weights_version": seq.weights_version,
            "adapter_name": seq.adapter_name,
            **routes_field(seq.routed_experts),
        }
        if req.return_token_ids:
            out["prompt_token_ids"] = prompt_ids
        if req.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.names.prompt_logprobs(prompt_ids, prompt_lps, prompt_tops)
        return out


def add_completion_routes(app: FastAPI, state: ServerState) -> None:
    """Add ``/v1/completions`` to ``app``."""

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await complete(state, req, request)


async def complete(state: ServerState, req: CompletionRequest, request: Request) -> Any:
    """The ``/v1/completions`` route."""
    adapter = state.adapter(req.model or "")
    features, texts = _prompts(state, req)
    if req.stream and req.echo and req.logprobs is not None:
        raise ApiError(
            400,
            "stream with echo and logprobs is not supported: the prompt's log-probs come with whole replies.",
            param="stream",
        )
    # echo with logprobs needs the prompt's log-probs (with as many alternatives as the completion's)
    wanted = [x for x in (req.prompt_logprobs, req.logprobs if req.echo else None) if x is not None]
    params = state.params(
        req,
        "completions",
        max_tokens=req.max_tokens,
        default_max_tokens=16,  # the completions API's own default
        logprobs=req.logprobs,
        prompt_logprobs=max(wanted) if wanted else None,
    )
    await state.unpaused()
    try:
        pending = Pending(state.sampler, features, params, adapter)
    except Exception as exc:
        raise state.refusal(exc, body_names("completions", req)) from None
    rid = req.request_id or ("cmpl-" + uuid.uuid4().hex)
    build = _Choices(state, req, features, texts)
    prompt_tokens = sum(len(f.input_ids) for f in features)
    if req.stream:
        return StreamingResponse(
            _stream(state, rid, req, pending, build, prompt_tokens), media_type="text/event-stream"
        )
    try:
        with state.tracked(rid, pending):
            responses = await pending.until_done_or_gone(request)
    except TwinkleError as exc:  # refused once it ran (a grammar that does not compile...)
        raise state.refusal(exc, body_names("completions", req)) from None
    choices = [
        build.choice(p, k, seq, resp) for p, resp in enumerate(responses) for k, seq in enumerate(resp.sequences)
    ]
    used = sum(len(c["token_ids"]) for c in choices)
    state.count(prompt_tokens, used)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model or state.model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": used, "total_tokens": prompt_tokens + used},
    }


async def _stream(
    state: ServerState, rid: str, req: CompletionRequest, pending: Any, build: _Choices, prompt_tokens: int
) -> AsyncIterator[str]:
    """Each choice as one chunk when the engine finishes it (prompt log-probs come with the whole reply)."""
    created, used, complete = int(time.time()), 0, False
    try:
        try:
            with state.tracked(rid, pending):
                async for item in pending.finished():
                    used += len(item.sequence.tokens)
                    choice = build.choice(item.input_index, item.sample_index, item.sequence, None)
                    body = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": req.model or state.model_name,
                    }
                    yield f"data: {json.dumps({**body, 'choices': [choice]})}\n\n"
        except Exception as exc:  # the engine refused the call once it ran: say so in the stream
            yield state.stream_error(exc, body_names("completions", req))
            complete = True
            return
        if req.stream_options and req.stream_options.get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": used, "total_tokens": prompt_tokens + used}
            body = {"id": rid, "object": "text_completion", "created": created, "model": req.model or state.model_name}
            yield f"data: {json.dumps({**body, 'choices': [], 'usage': usage})}\n\n"
        state.count(prompt_tokens, used)
        yield "data: [DONE]\n\n"
        complete = True
    finally:
        if not complete:
            pending.abort()
