"""The routes RL trainers and eval tools call on a vLLM server, besides the OpenAI ones.

Tokenizer routes (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), the
server's description (``/version``, ``/server_info``, ``/get_world_size``,
``/metrics``), the RL controls (``/pause``, ``/resume``, ``/is_paused``,
``/abort_requests``, ``/reset_prefix_cache``) and runtime LoRA
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``). Shapes follow
vLLM's server. vLLM's weight-transfer routes are in
:mod:`twinkle_core.server.weights`.

``/pause`` holds new calls until ``/resume``; what it does to the server's
calls in flight is its ``mode``, mapped to twinkle's in-flight policies:
``abort`` aborts them (their replies come back with ``finish_reason
"abort"``), ``wait`` returns once they are done, ``keep`` lets them run on,
and an adapter change made while paused then applies to them at once
(``in_flight="keep"``: each token carries the version that produced it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import PlainTextResponse
from pydantic import Field

from twinkle_core._version import __version__
from twinkle_core.data_format import Trajectory
from twinkle_core.errors import PromptTooLongError, TwinkleError
from twinkle_core.server.bodies import TextBody
from twinkle_core.server.protocol import ApiError, openai_messages, openai_tools
from twinkle_core.server.state import ServerState

__all__ = ["add_control_routes"]

PAUSE_MODES = ("abort", "wait", "keep")


class _Body(TextBody):
    pass


class TokenizeRequest(_Body):
    """``/tokenize``: a text, or a conversation rendered by the server's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class LoadLoraRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoraRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class AbortRequest(TextBody):  # unknown keys refused: a misspelt one must not abort every call
    request_ids: list[str] | None = None


def _world_size(sampler: Any) -> int:
    mesh = getattr(sampler, "device_mesh", None)
    return int(getattr(mesh, "world_size", 1) or 1)


def _tp_size(sampler: Any) -> int:
    mesh = getattr(sampler, "device_mesh", None)
    return int(getattr(mesh, "tp_size", 1) or 1)


def add_control_routes(app: FastAPI, state: ServerState, transfer_config: dict[str, Any] | None = None) -> None:
    """Add the non-OpenAI routes of vLLM's server to ``app``."""

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__, "server": "twinkle"}

    _add_tokenizer_routes(app, state)
    _add_description_routes(app, state, transfer_config)
    _add_rl_controls(app, state)
    _add_lora_routes(app, state)


def _add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    """``/tokenize``, ``/detokenize`` and ``/tokenizer_info``."""
    sampler = state.sampler

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        state.adapter(req.model or "")  # an unknown model is a 404, as on the completion routes
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "tokenize needs exactly one of 'prompt' (a text) or 'messages' (a conversation).")
        # No request makes the server tokenize more than its context: a longer text is refused once that is clear.
        limit = sampler.max_model_len
        try:
            if req.prompt is not None:
                ids = sampler.template.tokenize(req.prompt, max_tokens=limit, add_special_tokens=req.add_special_tokens)
            else:
                template = state.template_with(req.chat_template_kwargs) or sampler.template
                try:
                    messages = openai_messages(req.messages or [])
                    trajectory = Trajectory(messages=messages, tools=openai_tools(req.tools))
                    ids = template.encode(
                        trajectory, add_generation_prompt=req.add_generation_prompt, max_tokens=limit
                    ).input_ids
                except PromptTooLongError:
                    raise
                except TwinkleError as exc:
                    raise ApiError(400, str(exc), param="messages") from None
        except PromptTooLongError as exc:
            where = "prompt" if req.prompt is not None else "messages"
            count = f"at least {exc.length}" if exc.at_least else str(exc.length)
            raise ApiError(
                400,
                f"The {where} has {count} tokens, more than this server tokenizes: at most {limit} (max_model_len).",
                param=where,
                code="context_length_exceeded",
            ) from None
        body: dict[str, Any] = {"count": len(ids), "max_model_len": sampler.max_model_len, "tokens": ids}
        body["token_strs"] = (
            [sampler.template.decode([t], skip_special_tokens=False) for t in ids] if (req.return_token_strs) else None
        )
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        state.adapter(req.model or "")
        vocab = sampler.vocab_size
        bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ApiError(400, f"tokens has id {bad[0]} outside the vocabulary [0, {vocab}).", param="tokens")
        return {"prompt": sampler.template.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tok = sampler.template.tokenizer

        def text(name: str) -> str | None:
            value = getattr(tok, name, None)
            return value if isinstance(value, str) else None

        template = getattr(tok, "chat_template", None)
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": text("eos_token"),
            "bos_token": text("bos_token"),
            "pad_token": text("pad_token"),
            "unk_token": text("unk_token"),
            "chat_template": template if isinstance(template, str) else None,
            "model_max_length": sampler.max_model_len,
            "vocab_size": sampler.vocab_size,
        }


def _add_description_routes(app: FastAPI, state: ServerState, transfer_config: dict[str, Any] | None) -> None:
    """What the server is: ``/get_world_size``, ``/server_info`` and ``/metrics``."""
    sampler = state.sampler

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)) -> dict[str, Any]:
        if transfer_config is not None:  # what a trainer's group counts: this process is one rank
            return {"world_size": 1}
        return {"world_size": _world_size(sampler) if include_dp else _tp_size(sampler)}

    @app.get("/server_info")
    async def server_info(config_format: str = Query("json")) -> dict[str, Any]:
        world = _world_size(sampler)
        return {
            "vllm_config": {
                "model_config": {"model": state.model_name, "max_model_len": sampler.max_model_len},
                "parallel_config": {
                    "tensor_parallel_size": _tp_size(sampler),
                    "data_parallel_size": world // _tp_size(sampler),
                    "world_size": world,
                },
                "weight_transfer_config": transfer_config,
            },
            "twinkle": {
                "version": __version__,
                "engine": getattr(sampler, "engine_name", "") or type(sampler).__name__,
                "weights_version": sampler.weights_version,
                "adapters": {name: info.version for name, info in sampler.adapters.items()},
            },
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        running = sum(len(calls) for calls in state.in_flight.values())
        rows = [
            ("vllm:num_requests_running", "gauge", "Calls of this server the engine is running.", running),
            ("vllm:num_requests_waiting", "gauge", "Calls held by /pause.", state.waiting),
            ("vllm:prompt_tokens_total", "counter", "Prompt tokens of finished calls.", state.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Generated tokens of finished calls.", state.generated_tokens),
            ("vllm:request_success_total", "counter", "Finished calls.", state.finished_calls),
            ("twinkle:weights_version", "gauge", "The sampler's weights version.", sampler.weights_version),
            ("twinkle:adapters_loaded", "gauge", "LoRA adapters loaded.", len(sampler.adapters)),
            ("twinkle:is_paused", "gauge", "1 while /pause holds new calls.", int(not state.running.is_set())),
        ]
        rows.append(
            ("twinkle:requests_pending", "gauge", "Sampling calls held now (running or waiting).", state.limits.pending)
        )
        lines = []
        for name, kind, doc, value in rows:
            lines += [
                f"# HELP {name} {doc}",
                f"# TYPE {name} {kind}",
                f'{name}{{model_name="{state.model_name}"}} {value}',
            ]
        refused = "twinkle:requests_refused_total"
        lines += [f"# HELP {refused} Requests refused, by reason.", f"# TYPE {refused} counter"]
        for reason, count in sorted(state.limits.refused.items()):
            lines.append(f'{refused}{{model_name="{state.model_name}",reason="{reason}"}} {count}')
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def _add_rl_controls(app: FastAPI, state: ServerState) -> None:
    """``/pause``, ``/resume``, ``/is_paused``, ``/abort_requests`` and ``/reset_prefix_cache``."""

    @app.post("/pause")
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True)) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ApiError(400, f"mode={mode!r} is invalid: expected one of {', '.join(PAUSE_MODES)}.", param="mode")
        state.running.clear()
        state.pause_mode = mode
        calls = [c for group in list(state.in_flight.values()) for c in group]
        if mode == "abort":
            for call in calls:
                call.abort()
        if mode in ("abort", "wait"):
            while any(not call.done() for call in calls):
                await asyncio.sleep(0.01)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        state.pause_mode = None
        state.running.set()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": not state.running.is_set()}

    @app.post("/abort_requests")
    async def abort_requests(req: AbortRequest) -> dict[str, Any]:
        ids = req.request_ids or list(state.in_flight)
        aborted = 0
        for rid in ids:
            for call in list(state.in_flight.get(rid, [])):
                aborted += bool(call.abort())
        return {"status": "aborted", "aborted": aborted}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = Query(False), reset_external: bool = Query(False)
    ) -> dict[str, Any]:
        # twinkle's engines key cached prefixes on the weights version and adapter: a cache entry from
        # other weights is never reused, so there is nothing stale to drop.
        return {"success": True}


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """Runtime LoRA: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""
    sampler = state.sampler

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraRequest) -> dict[str, Any]:
        if req.lora_name in ("base", state.model_name):
            raise ApiError(400, f"lora_name={req.lora_name!r} is the base model's name: pick another.")
        if req.lora_name in sampler.adapters and not req.load_inplace:
            raise ApiError(
                400,
                f"The adapter {req.lora_name!r} is already loaded: pass load_inplace=true to replace it.",
                param="lora_name",
            )
        in_flight = "keep" if state.pause_mode == "keep" else "wait"
        version = await asyncio.to_thread(
            sampler.add_adapter_to_model, req.lora_name, req.lora_path, in_flight=in_flight
        )
        return {"status": "loaded", "lora_name": req.lora_name, "weights_version": version}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraRequest) -> dict[str, Any]:
        if req.lora_name not in sampler.adapters:
            raise ApiError(404, f"The adapter {req.lora_name!r} is not loaded.", param="lora_name", code="not_found")
        in_flight = "keep" if state.pause_mode == "keep" else "wait"
        await asyncio.to_thread(sampler.remove_adapter, req.lora_name, in_flight=in_flight)
        return {"status": "unloaded", "lora_name": req.lora_name, "weights_version": sampler.weights_version}
