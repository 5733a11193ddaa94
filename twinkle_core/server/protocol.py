"""The request fields of ``twinkle serve``, as vLLM's server names them, and what twinkle does with each.

vLLM's OpenAI server is the reference for names, types and defaults: the
clients RL and eval people run (TRL's ``VLLMClient``, lm-evaluation-harness,
agent SDKs on the ``openai`` client) send its fields, often at their default
values. Every field a route accepts is in :data:`FIELDS`, with one of three
treatments:

- ``implemented``: honoured, as vLLM honours it.
- ``neutral``: accepted only at a value that changes nothing (its default,
  e.g. ``presence_penalty`` 0); any other value is a 400 that names the field.
  These are the fields the engines cannot honour yet; a field that changes
  what is sampled is never silently ignored.
- ``no effect``: accepted at any value because it does not change what is
  sampled or returned here (``user``, ``cache_salt``...).

A field that is not in the table is refused (``extra="forbid"``). The table
is also the one ``docs/server.md`` shows; a test keeps the two in step.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Mapping
from typing import Any, Literal

import attrs
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from twinkle_core.data_format import Message
from twinkle_core.errors import TwinkleError

# The bodies live in bodies.py; they are named here too, where they always were.
from twinkle_core.server.bodies import ChatRequest, CompletionRequest, ResponsesRequest

__all__ = [
    "FIELDS",
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "FieldRule",
    "ResponsesRequest",
    "body_names",
    "brief",
    "fields_table",
    "in_body_terms",
    "input_index",
    "input_name",
    "neutral_violation",
    "openai_messages",
    "openai_tools",
]

Route = Literal["completions", "chat", "responses"]
Treatment = Literal["implemented", "neutral", "no effect"]

BOTH: tuple[Route, ...] = ("completions", "chat")
COMPLETIONS: tuple[Route, ...] = ("completions",)
CHAT: tuple[Route, ...] = ("chat",)
RESPONSES: tuple[Route, ...] = ("responses",)
#: The sampling fields ``/v1/responses`` takes under the chat route's names (vLLM's extras on it).
RESPONSES_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos")


@attrs.frozen
class FieldRule:
    """How one request field is treated.

    Attributes:
        name: the JSON key.
        routes: the routes that take it.
        treatment: ``implemented``, ``neutral`` or ``no effect`` (see the module).
        neutral: for ``neutral`` fields, the values accepted (``None`` always is).
        note: one line for the docs' table.
    """

    name: str
    routes: tuple[Route, ...]
    treatment: Treatment
    neutral: tuple[Any, ...] = ()
    note: str = ""


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        """OpenAI's ``{"error": {...}}`` body."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a JSON answer with its status."""
        return JSONResponse(self.body(), status_code=self.status)

    def event(self) -> str:
        """The error as a server-sent event, for a stream whose 200 has gone out already."""
        return f"data: {json.dumps(self.body())}\n\n"


def body_names(route: Route | None, req: Any = None) -> dict[str, str]:
    """The ``SamplingParams`` fields a request body calls by other names, and those names.

    Errors from the engine name its fields; a client should read the names it
    sent (``n``, not ``num_samples``). ``req``: the body, for the names that
    depend on which of two fields it used.
    """
    names = {"num_samples": "n"}
    # where an engine's ``inputs[i]`` came from: chat's messages, or the completions prompt (i-th of a batch)
    prompt = getattr(req, "prompt", None)
    batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    names["inputs"] = "messages" if route == "chat" else "prompt[]" if batched else "prompt"
    if route == "chat":
        names["logprobs"] = "top_logprobs"
        if getattr(req, "max_completion_tokens", None) is not None:
            names["max_tokens"] = "max_completion_tokens"
    response_format = getattr(req, "response_format", None)
    if isinstance(response_format, dict) and response_format.get("type") != "text":
        names["structured_outputs"] = "response_format"
    return names


_FIELD_REF = re.compile(r"\bSamplingParams\.(\w+)")


_INPUT_REF = re.compile(r"\binputs\[(\d+)\]")


def input_index(message: str) -> int | None:
    """The ``i`` of the first ``inputs[i]`` an engine's message names (``None``: none)."""
    found = _INPUT_REF.search(message)
    return None if found is None else int(found.group(1))


def input_name(index: int, names: Mapping[str, str]) -> str:
    """The body's name for the engine's ``inputs[index]`` (``names``: :func:`body_names`)."""
    where = names.get("inputs", "prompt")
    return f"prompt[{index}]" if where == "prompt[]" else where


def in_body_terms(message: str, names: Mapping[str, str]) -> str:
    """An engine's message with each ``SamplingParams.<field>`` and ``inputs[i]`` written as the body's field."""
    message = _INPUT_REF.sub(lambda m: input_name(int(m.group(1)), names), message)
    return _FIELD_REF.sub(lambda m: names.get(m.group(1), m.group(1)), message)


#: Short, bounded reprs of what a client sent, for error messages (a deeply nested value cannot blow the stack).
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 60, 60


def brief(value: Any) -> str:
    return _BRIEF.repr(value)[:60]


def openai_messages(raw: list[dict[str, Any]]) -> list[Message]:
    """OpenAI message dicts to :class:`Message` (``arguments`` JSON strings become dicts)."""
    out = []
    for i, m in enumerate(raw):
        m = dict(m)
        if m.get("role") == "tool":
            m.pop("name", None)  # OpenAI's legacy function name on tool results; templates key on tool_call_id
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                c = json.loads(json.dumps(c))
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
                        raise ApiError(
                            400,
                            f"messages[{i}].tool_calls: arguments {fn['arguments']!r:.80} are not JSON.",
                            param=f"messages[{i}]",
                        ) from None
                fixed.append(c)
            m["tool_calls"] = fixed
        try:
            out.append(Message.from_dict(m))
        except TwinkleError as exc:
            raise ApiError(400, f"messages[{i}]: {exc}", param=f"messages[{i}]") from None
    return out


def openai_tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI function tools for the template: ``strict`` (a boolean OpenAI's schema has, which vLLM
    does not enforce either) is checked and left out; every other key goes on to ``Tool``'s checks."""
    out = []
    for i, tool in enumerate(raw or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and "strict" in fn:
            if fn["strict"] is not None and not isinstance(fn["strict"], bool):
                raise ApiError(
                    400,
                    f"tools[{i}].function.strict={brief(fn['strict'])} is invalid: expected a boolean.",
                    param=f"tools[{i}]",
                )
            tool = {**tool, "function": {k: v for k, v in fn.items() if k != "strict"}}
        out.append(tool)
    return out


#: Every accepted request field, in the order of the docs' table.
FIELDS: tuple[FieldRule, ...] = (
    # -- shared sampling fields ----------------------------------------------------------
    FieldRule("model", BOTH, "implemented", note="the served name, `base`, or a loaded adapter's name"),
    FieldRule("n", BOTH, "implemented", note="choices per prompt, prompt-major (`index` = prompt * n + sample)"),
    FieldRule("temperature", BOTH, "implemented", note="0 is greedy; default 1"),
    FieldRule("top_p", BOTH, "implemented"),
    FieldRule("top_k", BOTH, "implemented", note="0 and -1 mean off"),
    FieldRule("min_p", BOTH, "implemented"),
    FieldRule("repetition_penalty", BOTH, "implemented"),
    FieldRule("seed", BOTH, "implemented", note="reproducible whatever is batched with it"),
    FieldRule("stop", BOTH, "implemented", note="a string or a list; the text is cut before it"),
    FieldRule("stop_token_ids", BOTH, "implemented"),
    FieldRule("ignore_eos", BOTH, "implemented"),
    FieldRule(
        "max_tokens",
        BOTH,
        "implemented",
        note="completions default 16; 0 scores the prompt only; over max_model_len: 400, as vLLM",
    ),
    FieldRule("include_stop_str_in_output", COMPLETIONS, "implemented", note="the matched stop string ends the text"),
    FieldRule("include_stop_str_in_output", CHAT, "neutral", (False,), note="a turn's content is parsed text"),
    FieldRule("skip_special_tokens", COMPLETIONS, "implemented", note="text only; tokens are the same"),
    FieldRule("skip_special_tokens", CHAT, "neutral", (True,), note="a turn's content is parsed text"),
    FieldRule(
        "prompt_logprobs", BOTH, "implemented", note="vLLM's shape: `{token_id: {logprob, rank, decoded_token}}`"
    ),
    FieldRule("return_token_ids", BOTH, "implemented", note="`prompt_token_ids` (and `token_ids`, always sent)"),
    FieldRule("return_tokens_as_token_ids", BOTH, "implemented", note="logprob tokens as `token_id:N`"),
    FieldRule("stream", BOTH, "implemented", note="each choice is sent when the engine finishes it"),
    FieldRule("stream_options", BOTH, "implemented", note="`include_usage` only"),
    FieldRule("request_id", BOTH, "implemented", note="the reply's id; `/abort_requests` takes it"),
    FieldRule("user", BOTH, "no effect", note="on chat: the session id when no header or `session_id` names one"),
    FieldRule("session_id", BOTH, "implemented", note="chat: the twinkle session; completions: no effect"),
    FieldRule("cache_salt", BOTH, "no effect", note="prefix caches here never change what is sampled"),
    FieldRule("priority", BOTH, "neutral", (0,), note="no priority scheduling"),
    FieldRule("presence_penalty", BOTH, "implemented", note="over the completion, in [-2, 2]"),
    FieldRule("frequency_penalty", BOTH, "implemented", note="over the completion, in [-2, 2]"),
    FieldRule("min_tokens", BOTH, "implemented", note="EOS, stop ids and stop strings held back until then"),
    FieldRule("logit_bias", BOTH, "implemented", note="`{token id: bias}`, each in [-100, 100] (larger: a 400)"),
    FieldRule("allowed_token_ids", BOTH, "implemented"),
    FieldRule("bad_words", BOTH, "implemented", note="vLLM's rule: as written and after a space"),
    FieldRule("structured_outputs", BOTH, "implemented", note="`json`, `regex`, `choice`, `grammar` or `json_object`"),
    FieldRule("response_format", BOTH, "implemented", note="`text`, `json_object`, `json_schema` (its `schema`)"),
    FieldRule("logprob_token_ids", BOTH, "neutral", (), note="chosen logprob ids: not yet"),
    FieldRule("spaces_between_special_tokens", BOTH, "neutral", (True,), note="fast tokenizers have one spacing"),
    FieldRule("truncation_side", BOTH, "implemented", note="`left` (default: keep the last N) or `right`"),
    FieldRule("use_beam_search", BOTH, "neutral", (False,), note="no beam search"),
    FieldRule("length_penalty", BOTH, "neutral", (1, 1.0), note="beam search only"),
    FieldRule("watermarking", BOTH, "neutral", (False,)),
    FieldRule(
        "return_routed_experts",
        BOTH,
        "implemented",
        note="twinkle's: each choice's `routed_experts`, base64 `.npy` as vLLM sends them (MoE, torch engine)",
    ),
    FieldRule("routed_experts_prompt_start", BOTH, "neutral", (0,), note="the prompt's routes are always whole"),
    FieldRule("return_token_offsets", BOTH, "neutral", (False,), note="render routes only in vLLM"),
    FieldRule("mm_payload", BOTH, "neutral", ("tensors",), note="text models"),
    FieldRule("return_mm_kwargs", BOTH, "neutral", (False,), note="text models"),
    FieldRule("kv_transfer_params", BOTH, "neutral", ({},), note="no disaggregated prefill"),
    FieldRule("ec_transfer_params", BOTH, "neutral", ({},), note="no disaggregated prefill"),
    FieldRule("vllm_xargs", BOTH, "neutral", ({},), note="vLLM plugins' own arguments"),
    FieldRule("repetition_detection", BOTH, "neutral", (), note="not yet"),
    FieldRule("thinking_token_budget", BOTH, "neutral", (), note="not yet"),
    FieldRule("stream_interval", BOTH, "no effect", note="streams send whole choices"),
    # -- /v1/completions ----------------------------------------------------------------
    FieldRule("prompt", COMPLETIONS, "implemented", note="a string, strings, token ids, or lists of token ids"),
    FieldRule("echo", COMPLETIONS, "implemented", note="the prompt's text, tokens and log-probs come first"),
    FieldRule("logprobs", BOTH, "implemented", note="completions: top-k count; chat: a boolean"),
    FieldRule("add_special_tokens", COMPLETIONS, "implemented", note="for string prompts; default true, as vLLM"),
    FieldRule("truncate_prompt_tokens", COMPLETIONS, "implemented", note="keep N tokens (-1: the model's limit)"),
    FieldRule("suffix", COMPLETIONS, "neutral", ("",), note="no insertion"),
    FieldRule("prompt_embeds", COMPLETIONS, "neutral", (), note="token prompts only"),
    # -- /v1/chat/completions -----------------------------------------------------------
    FieldRule(
        "messages",
        CHAT,
        "implemented",
        note="OpenAI messages: text content parts, `name`, and the `developer` role"
        " (both handed to the template as written, as vLLM does)",
    ),
    FieldRule(
        "tools",
        CHAT,
        "implemented",
        note="OpenAI function tools; with a forcing `tool_choice`, `strict: false` leaves a tool's arguments free",
    ),
    FieldRule(
        "tool_choice",
        CHAT,
        "implemented",
        note="`none`, `auto`; `required` and a named function constrain the turn to the parser's call syntax",
    ),
    FieldRule("parallel_tool_calls", CHAT, "implemented", note="`false`: the turn is constrained to at most one call"),
    FieldRule("top_logprobs", CHAT, "implemented"),
    FieldRule("max_completion_tokens", CHAT, "implemented", note="wins over `max_tokens`"),
    FieldRule("add_generation_prompt", CHAT, "neutral", (True,), note="sessions sample a new assistant turn"),
    FieldRule("continue_final_message", CHAT, "neutral", (False,), note="sessions sample a new assistant turn"),
    FieldRule("chat_template", CHAT, "neutral", (), note="the server's template (`--template`)"),
    FieldRule("chat_template_kwargs", CHAT, "implemented", note="chat template variables (`enable_thinking`...)"),
    FieldRule("documents", CHAT, "neutral", ([],), note="no RAG templates"),
    FieldRule("media_io_kwargs", CHAT, "neutral", ({},), note="text models"),
    FieldRule("mm_processor_kwargs", CHAT, "neutral", ({},), note="text models"),
    FieldRule("reasoning_effort", CHAT, "neutral", (), note="no reasoning parser"),
    FieldRule("include_reasoning", CHAT, "neutral", (True,), note="no reasoning parser"),
    FieldRule("return_prompt_text", CHAT, "neutral", (False,), note="not yet"),
    FieldRule("echo", CHAT, "neutral", (False,), note="chat replies hold the new turn only"),
    FieldRule("add_special_tokens", CHAT, "neutral", (False,), note="the template writes every special token"),
    FieldRule("truncate_prompt_tokens", CHAT, "neutral", (), note="a session's prompt is never cut"),
    # -- /v1/responses (see docs/server.md, "The Responses API") --------------------------------------------------
    FieldRule("input", RESPONSES, "implemented", note="a string, or message, `function_call` and output items"),
    FieldRule("instructions", RESPONSES, "implemented", note="a system message before `input`"),
    *(FieldRule(name, RESPONSES, "implemented", note="as on chat") for name in RESPONSES_SAMPLING),
    FieldRule("max_output_tokens", RESPONSES, "implemented", note="as chat's `max_completion_tokens`"),
    FieldRule("tools", RESPONSES, "implemented", note="function tools only; hosted tools are a 400"),
    FieldRule("tool_choice", RESPONSES, "implemented", note="as on chat; a named choice is `{type, name}`"),
    FieldRule("parallel_tool_calls", RESPONSES, "implemented", note="as on chat"),
    FieldRule("text", RESPONSES, "implemented", note="`format`: `text`, `json_object` or `json_schema`"),
    FieldRule("top_logprobs", RESPONSES, "implemented", note="with `include` `message.output_text.logprobs`"),
    FieldRule("include", RESPONSES, "implemented", note="`message.output_text.logprobs` only"),
    FieldRule("previous_response_id", RESPONSES, "implemented", note="continues the stored response's episode"),
    FieldRule("store", RESPONSES, "implemented", note="default true: kept for `previous_response_id` (bounded)"),
    FieldRule("stream", RESPONSES, "implemented", note="the Responses events, each output item once sampled"),
    FieldRule("model", RESPONSES, "implemented", note="as on chat"),
    FieldRule("user", RESPONSES, "implemented", note="the session, after the header and `session_id`"),
    FieldRule("session_id", RESPONSES, "implemented", note="twinkle's: the session the call joins"),
    FieldRule("request_id", RESPONSES, "implemented", note="the response's id"),
    FieldRule("metadata", RESPONSES, "no effect", note="returned as sent"),
    FieldRule("service_tier", RESPONSES, "no effect"),
    FieldRule("prompt_cache_key", RESPONSES, "no effect"),
    FieldRule("safety_identifier", RESPONSES, "no effect"),
    FieldRule("background", RESPONSES, "neutral", (False,), note="every call is answered when done"),
    FieldRule("truncation", RESPONSES, "neutral", ("disabled",), note="an episode's prompt is never cut"),
    FieldRule("reasoning", RESPONSES, "neutral", (), note="no reasoning items: the model cannot produce them"),
    FieldRule("max_tool_calls", RESPONSES, "neutral", (), note="use `parallel_tool_calls: false`"),
    FieldRule("prompt", RESPONSES, "neutral", (), note="no stored prompt templates"),
    FieldRule("conversation", RESPONSES, "neutral", (), note="use `previous_response_id`"),
    FieldRule("stream_options", RESPONSES, "neutral", (), note="no options"),
    FieldRule("context_management", RESPONSES, "neutral", (), note="an episode's prompt is never cut"),
    FieldRule("prompt_cache_retention", RESPONSES, "no effect"),
)

_BY_ROUTE: dict[Route, dict[str, FieldRule]] = {
    route: {f.name: f for f in FIELDS if route in f.routes} for route in ("completions", "chat", "responses")
}


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same kind (``False`` is not ``0`` here, nor ``1`` ``True``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isfinite(a) and a == b
    return type(a) is type(b) and a == b


def neutral_violation(route: Route, body: dict[str, Any]) -> str | None:
    """The first ``neutral`` field of ``body`` set to a value that would change something, as an error message."""
    for name, value in body.items():
        rule = _BY_ROUTE[route].get(name)
        if rule is None or rule.treatment != "neutral" or value is None:
            continue
        if not any(_same(value, ok) for ok in rule.neutral):
            accepted = " or ".join(["unset", *(repr(v) for v in rule.neutral)])
            why = f" ({rule.note})" if rule.note else ""
            return f"{name}={value!r:.80} is not supported by twinkle serve{why}: leave it {accepted}."
    return None


def model_fields(route: Route) -> set[str]:
    """The body keys a route's model accepts (the table must name exactly these)."""
    classes: dict[Route, type[BaseModel]] = {
        "completions": CompletionRequest,
        "chat": ChatRequest,
        "responses": ResponsesRequest,
    }
    return set(classes[route].model_fields)


def fields_table() -> str:
    """The request fields as the Markdown table ``docs/server.md`` shows (a test keeps the two equal)."""
    rows = ["| field | completions | chat | responses | note |", "|---|---|---|---|---|"]
    names = list(dict.fromkeys(f.name for f in FIELDS))
    for name in names:
        cells: list[str] = []
        notes: list[str] = []
        routes: tuple[Route, ...] = ("completions", "chat", "responses")
        for route in routes:
            rule = _BY_ROUTE[route].get(name)
            if rule is None:
                cells.append("—")
                continue
            cell: str = rule.treatment
            if rule.treatment == "neutral":
                cell += " (" + ", ".join(["unset", *(f"`{json.dumps(v)}`" for v in rule.neutral)]) + ")"
            cells.append(cell)
            if rule.note and rule.note not in notes:
                notes.append(rule.note)
        rows.append(f"| `{name}` | {' | '.join(cells)} | {'; '.join(notes)} |")
    return "\n".join(rows) + "\n"
