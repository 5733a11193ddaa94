"""The request bodies of ``twinkle serve``: vLLM's fields, as pydantic models.

Each route's body is a model whose fields are vLLM's names, types and
defaults; unknown fields are refused (``extra="forbid"``), and so is a lone
surrogate anywhere in a body. What twinkle does with each field, and which
are accepted only at a neutral value, is the table in
:mod:`twinkle_core.server.protocol` (``FIELDS``); a test keeps the two equal.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ChatRequest", "CompletionRequest", "ResponsesRequest", "TextBody", "lone_surrogate"]


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where a string in a parsed JSON body holds a lone surrogate, described; ``None`` if none does.

    JSON's ``"\\ud83d"`` decodes to a Python string no tokenizer can encode
    (or the reply serialise): such a body is refused up front, naming the field.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                f"{path or 'body'}={value!r:.60} holds {value[exc.start]!r} at position {exc.start}, a lone"
                " surrogate that is not encodable text; expected valid Unicode text"
            )
        return None
    if isinstance(value, list):
        if set(map(type, value)) <= _SCALARS:  # token ids: one pass in C, not a call per id
            return None
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return None
    for key, item in items:
        found = lone_surrogate(key, f"{path}.<key>" if path else "<key>") or lone_surrogate(
            item, f"{path}.{key}" if path else str(key)
        )
        if found:
            return found
    return None


#: JSON values that hold no text.
_SCALARS = frozenset((int, float, bool, type(None)))


class TextBody(BaseModel):
    """A request body of the server: unknown fields and lone surrogates anywhere in it are refused."""

    # Unknown fields are refused: an option the server would silently ignore is a bug.
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found:
            raise ValueError(found)
        return data


class _Request(TextBody):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # vLLM's range: a signed 64-bit integer
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    request_id: str | None = None
    user: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    truncation_side: Literal["left", "right"] | None = None
    stream_interval: int | None = None
    # Accepted only at their neutral values (checked against FIELDS before anything runs).
    priority: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logprob_token_ids: Any = None
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    watermarking: Any = None
    routed_experts_prompt_start: Any = None
    return_routed_experts: bool | None = None
    return_token_offsets: Any = None
    mm_payload: Any = None
    return_mm_kwargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None


class CompletionRequest(_Request):
    """The ``/v1/completions`` body (vLLM's fields; see :data:`FIELDS`)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    echo: bool | None = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    suffix: Any = None
    prompt_embeds: Any = None


class ChatRequest(_Request):
    """The ``/v1/chat/completions`` body (vLLM's fields; see :data:`FIELDS`)."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    reasoning_effort: Any = None
    include_reasoning: Any = None
    return_prompt_text: Any = None
    echo: Any = None
    add_special_tokens: Any = None
    truncate_prompt_tokens: Any = None


class ResponsesRequest(TextBody):
    """The ``/v1/responses`` body (vLLM's fields; see :data:`FIELDS`)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Any = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool | None = False
    user: str | None = None
    session_id: str | None = None
    request_id: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    prompt_cache_retention: Any = None
    # Accepted only at their neutral values (checked against FIELDS before anything runs).
    background: Any = None
    truncation: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    stream_options: Any = None
    context_management: Any = None
