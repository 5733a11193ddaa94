"""Chat data: ``Message``, ``Tool`` and ``Trajectory``."""

from __future__ import annotations

import json
from typing import Any

import attrs

from twinkle_core.data_format._base import Record, check_extra
from twinkle_core.data_format.media import (
    MediaRef,
    check_source,
    count_placeholders,
    expand_placeholders,
    media_kind,
    media_source,
)
from twinkle_core.errors import InvalidInputError

__all__ = ["MAX_JSON_DEPTH", "ROLES", "Message", "Tool", "Trajectory", "json_data_problem"]

ROLES = ("system", "developer", "user", "assistant", "tool")

#: How deep JSON data in a conversation (tool-call arguments, tool schemas) may nest: templates render it
#: recursively, and a model can write arguments nested far past Python's recursion limit.
MAX_JSON_DEPTH = 64


def json_data_problem(value: Any) -> str | None:
    """Why ``value`` cannot be rendered into a prompt as JSON text (too deep, not encodable), or ``None``."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth >= MAX_JSON_DEPTH:
                return f"it nests deeper than {MAX_JSON_DEPTH} levels"
            if isinstance(item, dict):
                stack.extend((k, depth + 1) for k in item if isinstance(k, str))
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = item[exc.start]
                return f"the string {item!r:.40} holds {bad!r}, which is not encodable text (a lone surrogate)"
    return None


def _check_role(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in ROLES:
        raise InvalidInputError(f"Message.role={value!r} is invalid: expected one of {', '.join(ROLES)}.")


def _check_text(owner: str, value: str) -> None:
    # A lone surrogate ("\ud800") is a valid Python str but no tokenizer can encode it.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{owner}={value!r:.80} is invalid: it holds {value[exc.start]!r} at position {exc.start}, which is not"
            " encodable text (a lone surrogate); expected valid Unicode text."
        ) from None


def _check_opt_str(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidInputError(f"Message.{attribute.name}={value!r} is invalid: expected a string or None.")
    if value is not None:
        _check_text(f"Message.{attribute.name}", value)


def _check_content(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    # Text arrives as a string or as OpenAI-style parts ({"type": "text", "text": ...}); media parts have their
    # shape checked here (decoded where the prompt is encoded); parts of other types are kept for engines that take
    # them, and refused where text is rendered (Template.render).
    if not isinstance(value, (str, list)):
        raise InvalidInputError(f"Message.content={value!r} is invalid: expected a string or a list of content parts.")
    if isinstance(value, str):
        _check_text("Message.content", value)
        return
    for i, part in enumerate(value):
        if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
            raise InvalidInputError(
                f"Message.content[{i}]={part!r:.80} is invalid: expected a content part, a dict with a string"
                " 'type' (e.g. {'type': 'text', 'text': '...'})."
            )
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidInputError(
                    f"Message.content[{i}]={part!r:.80} is invalid: a text part needs a string 'text'."
                )
            _check_text(f"Message.content[{i}].text", part["text"])
        elif media_kind(part) is not None:
            media_source(part, f"Message.content[{i}]")


def _check_list_of_dicts(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, list) or not all(isinstance(v, dict) for v in value)):
        raise InvalidInputError(
            f"{type(inst).__name__}.{attribute.name}={value!r} is invalid: expected a list of dicts or None."
        )
    problem = json_data_problem(value)
    if problem is not None:
        raise InvalidInputError(f"{type(inst).__name__}.{attribute.name}={value!r:.80} is invalid: {problem}.")


@attrs.define(kw_only=True)
class Message(Record):
    """One chat turn.

    Attributes:
        role: ``system``, ``developer``, ``user``, ``assistant`` or ``tool``
            (``developer`` is OpenAI's newer name for system instructions; it
            reaches the template as written, as vLLM passes it on).
        content: the text (or a list of content parts).
        name: the speaker's name (OpenAI's ``name``), for templates that render it.
        tool_calls: the assistant's tool calls, in the OpenAI/Hugging Face shape.
        tool_call_id: for a ``tool`` message, the call it answers.
        reasoning_content: an assistant's reasoning, for templates that render it.
    """

    role: str = attrs.field(validator=_check_role)
    content: str | list[dict[str, Any]] = attrs.field(default="", validator=_check_content)
    tool_calls: list[dict[str, Any]] | None = attrs.field(default=None, validator=_check_list_of_dicts)
    tool_call_id: str | None = attrs.field(default=None, validator=_check_opt_str)
    reasoning_content: str | None = attrs.field(default=None, validator=_check_opt_str)
    name: str | None = attrs.field(default=None, validator=_check_opt_str)

    def to_hf(self) -> dict[str, Any]:
        """The message as a Hugging Face chat-template dict (unset fields left out; media parts as they are)."""
        plain = attrs.asdict(self, filter=lambda field, _: field.name != "content")
        return {"content": self.content, **{k: v for k, v in plain.items() if v is not None}}


def _check_tool_field(name: str, value: Any, kind: type) -> None:
    if not isinstance(value, kind):
        raise InvalidInputError(f"Tool.{name}={value!r:.80} is invalid: expected a {kind.__name__}.")
    if isinstance(value, str):
        _check_text(f"Tool.{name}", value)
    elif isinstance(value, dict):  # a JSON schema: the template renders it as JSON text
        problem = json_data_problem(value)
        if problem is not None:
            raise InvalidInputError(f"Tool.{name}={value!r:.80} is invalid: {problem}.")
        try:  # values JSON has no form for (sets, objects); depth and text were checked above
            json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"Tool.{name}={value!r:.80} is invalid: expected JSON data ({exc}).") from None


@attrs.define(kw_only=True)
class Tool(Record):
    """A tool the model may call, as a JSON-schema function description.

    Attributes:
        name: the function name.
        description: what it does.
        parameters: the JSON schema of its arguments.
    """

    name: str = attrs.field(validator=lambda i, a, v: _check_tool_field(a.name, v, str))
    description: str = attrs.field(default="", validator=lambda i, a, v: _check_tool_field(a.name, v, str))
    parameters: dict[str, Any] = attrs.field(factory=dict, validator=lambda i, a, v: _check_tool_field(a.name, v, dict))

    def to_hf(self) -> dict[str, Any]:
        """The tool in the ``{"type": "function", "function": ...}`` shape templates expect."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _to_messages(value: Any) -> Any:
    if isinstance(value, list):
        return [Message.from_dict(m) if isinstance(m, dict) else m for m in value]
    return value


def _to_tools(value: Any) -> Any:
    if isinstance(value, list):
        out = []
        for t in value:
            if isinstance(t, dict) and t.get("type") == "function" and "function" in t:
                t = t["function"]
            out.append(Tool.from_dict(t) if isinstance(t, dict) else t)
        return out
    return value


def _check_messages(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise InvalidInputError(f"Trajectory.messages={value!r} is invalid: expected a non-empty list of messages.")
    for i, m in enumerate(value):
        if not isinstance(m, Message):
            raise InvalidInputError(
                f"Trajectory.messages[{i}]={m!r} is invalid: expected a Message or a dict with 'role' and 'content'."
            )


def _check_media_list(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, list):
        raise InvalidInputError(f"Trajectory.{attribute.name}={value!r:.80} is invalid: expected a list.")
    for i, source in enumerate(value):
        check_source(attribute.name[:-1], source, f"Trajectory.{attribute.name}[{i}]")


def _check_tools(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, list) or not all(isinstance(t, Tool) for t in value):
        raise InvalidInputError(f"Trajectory.tools={value!r} is invalid: expected a list of Tool.")


@attrs.define(kw_only=True)
class Trajectory(Record):
    """A conversation to continue: messages, the tools on offer, and user data.

    Attributes:
        messages: the turns so far (dicts are converted to :class:`Message`).
        tools: tools offered to the model (rendered by the chat template).
        extra: free-form user data carried along untouched (ids, rewards...).
        images: one image for each ``<image>`` placeholder in the messages'
            text, in order (a PIL image, bytes, a path or a ``data:`` URL).
        videos: one video (a list of frames) for each ``<video>`` placeholder.
    """

    messages: list[Message] = attrs.field(converter=_to_messages, validator=_check_messages)
    tools: list[Tool] = attrs.field(factory=list, converter=_to_tools, validator=_check_tools)
    extra: dict[str, Any] = attrs.field(factory=dict, validator=check_extra)
    images: list[Any] = attrs.field(factory=list, validator=_check_media_list)
    videos: list[Any] = attrs.field(factory=list, validator=_check_media_list)

    def __attrs_post_init__(self) -> None:
        if not (self.images or self.videos):
            return  # without media, "<image>" in text is text
        found = {"image": 0, "video": 0}
        for m in self.messages:
            for text in (
                [m.content] if isinstance(m.content, str) else [p["text"] for p in m.content if p["type"] == "text"]
            ):
                for kind, n in count_placeholders(text).items():
                    found[kind] += n
        for kind, given in (("image", self.images), ("video", self.videos)):
            if found[kind] != len(given):
                raise InvalidInputError(
                    f"Trajectory.{kind}s holds {len(given)} {kind}(s) but the messages' text holds {found[kind]}"
                    f" '<{kind}>' placeholder(s): expected one placeholder for each {kind}, in order."
                )

    def media(self) -> tuple[list[dict[str, Any]], list[MediaRef]]:
        """The messages in Hugging Face form with every medium as a ``{"type": kind}`` block, and the media in order.

        Placeholders filled from ``images`` / ``videos`` become blocks; each
        medium is named by where it came from (``Trajectory.images[1]``,
        ``Trajectory.messages[0].content[2]``). Nothing is decoded.
        """
        queues = {
            "image": [(s, f"Trajectory.images[{i}]") for i, s in enumerate(self.images)],
            "video": [(s, f"Trajectory.videos[{i}]") for i, s in enumerate(self.videos)],
        }
        messages: list[dict[str, Any]] = []
        refs: list[MediaRef] = []
        for i, message in enumerate(self.messages):
            hf = message.to_hf()
            parts = [{"type": "text", "text": hf["content"]}] if isinstance(hf["content"], str) else hf["content"]
            blocks: list[dict[str, Any]] = []
            for j, part in enumerate(parts):
                kind = media_kind(part)
                if part["type"] == "text" and (self.images or self.videos):
                    blocks.extend(expand_placeholders(part["text"], queues))
                elif kind is not None:
                    blocks.append(
                        {"type": kind, kind: media_source(part, ""), "_where": f"Trajectory.messages[{i}].content[{j}]"}
                    )
                else:
                    blocks.append(part)
            if any("_where" in b for b in blocks):
                for b in blocks:
                    if "_where" in b:
                        kind = b["type"]
                        refs.append((kind, b.pop(kind), b.pop("_where")))
                hf = {**hf, "content": blocks}
            messages.append(hf)
        return messages, refs

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """Build from a dict; a message missing ``role`` gets a clear error."""
        data = cls._check_keys(data)
        msgs = data.get("messages")
        if isinstance(msgs, list):
            for i, m in enumerate(msgs):
                if isinstance(m, dict) and "role" not in m:
                    raise InvalidInputError(f"Trajectory.messages[{i}]={m!r} has no 'role'.")
        return cls(**data)
