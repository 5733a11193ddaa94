"""``EchoTokenizer``: a byte-level tokenizer with ChatML special tokens, no dependencies.

It implements the part of the Hugging Face tokenizer interface that
``twinkle_core.Template`` uses (``encode``, ``decode``, ``apply_chat_template``,
``__len__``, ``eos_token_id``, ``chat_template``), so the core's templates work
with it unchanged. A real engine would load its model's tokenizer instead.

Token ids:

* ``0``-``255``: the bytes of UTF-8 text;
* ``256`` ``<|im_start|>``, ``257`` ``<|im_end|>`` (end of sequence),
  ``258`` ``<|endoftext|>`` (padding);
* ``259`` up to ``vocab_size - 1``: ``<|reserved_N|>``, unused special tokens
  (real checkpoints pad their vocabulary the same way).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "ECHO_CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_END_ID",
    "IM_START_ID",
    "NUM_BYTES",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "EchoTokenizer",
    "render_chatml",
]

#: Byte tokens come first: id ``b`` is the byte ``b``.
NUM_BYTES = 256
#: The named special tokens, in id order after the bytes.
SPECIAL_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
IM_START_ID = NUM_BYTES
IM_END_ID = NUM_BYTES + 1
PAD_ID = NUM_BYTES + 2
EOS_TOKEN = "<|im_end|>"

#: The chat template, as Jinja, for tools that read ``tokenizer.chat_template``.
#: :func:`render_chatml` renders exactly the same text without Jinja (a test
#: checks they agree), so the engine needs no template library.
ECHO_CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set first = 0 -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{ text(messages[0].content) + '\\n\\n' }}{%- set first = 1 -%}"
    "{%- endif -%}"
    "{{ 'Tools:\\n' }}"
    "{%- for tool in tools -%}{{ tool | tojson }}{{ '\\n' }}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages[first:] -%}"
    "{%- set body = text(message.content) -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + body }}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if body or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    '{{ \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' }}'
    "{%- if fn.arguments is string -%}{{ fn.arguments }}{%- else -%}{{ fn.arguments | tojson }}{%- endif -%}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _json(value: Any) -> str:
    # What Hugging Face's ``tojson`` filter produces.
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not content:
        return ""
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")


def render_chatml(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """Render a conversation as ChatML, exactly as :data:`ECHO_CHAT_TEMPLATE` does.

    Args:
        messages: Hugging Face chat dicts (``role``, ``content``, optional
            ``tool_calls``); ``content`` is a string, ``None`` or a list of
            ``{"type": "text", "text": ...}`` parts.
        tools: tool descriptions, listed as JSON in a system turn.
        add_generation_prompt: end with the assistant header, ready to sample.

    Returns:
        The prompt text, special tokens written out.
    """
    out: list[str] = []
    first = 0
    if tools:
        out.append("<|im_start|>system\n")
        if messages and messages[0].get("role") == "system":
            out.append(_text(messages[0].get("content")) + "\n\n")
            first = 1
        out.append("Tools:\n")
        out.extend(_json(tool) + "\n" for tool in tools)
        out.append("<|im_end|>\n")
    for message in messages[first:]:
        role = str(message["role"])
        body = _text(message.get("content"))
        out.append(f"<|im_start|>{role}\n{body}")
        if role == "assistant":
            for i, call in enumerate(message.get("tool_calls") or []):
                fn = call.get("function", call)
                args = fn.get("arguments")
                if body or i:
                    out.append("\n")
                arguments = args if isinstance(args, str) else _json(args)
                out.append(f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {arguments}}}\n</tool_call>')
        out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _render_jinja(source: str, **context: Any) -> str:
    """Render a foreign chat template the way Hugging Face does (needs ``jinja2``)."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ValueError(
            "EchoTokenizer renders its own ChatML template without dependencies; a different chat"
            " template needs jinja2 (pip install jinja2)."
        ) from exc

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _json
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(**context)


class EchoTokenizer:
    """Bytes plus special tokens, with the Hugging Face methods templates need.

    Args:
        vocab_size: total number of ids; those past the named special tokens
            become ``<|reserved_N|>``. At least ``256 + 3``.

    Raises:
        ValueError: ``vocab_size`` too small.
    """

    #: Jinja source of the default template (rendered by :func:`render_chatml`).
    chat_template: str = ECHO_CHAT_TEMPLATE
    eos_token: str = EOS_TOKEN
    eos_token_id: int = IM_END_ID
    pad_token: str = "<|endoftext|>"
    pad_token_id: int = PAD_ID
    bos_token: str | None = None
    bos_token_id: int | None = None

    def __init__(self, vocab_size: int = 300) -> None:
        minimum = NUM_BYTES + len(SPECIAL_TOKENS)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
            raise ValueError(f"vocab_size={vocab_size!r} is invalid: expected an integer >= {minimum}.")
        self._vocab_size = vocab_size
        reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - minimum)]
        self._specials: list[str] = [*SPECIAL_TOKENS, *reserved]
        self._special_ids = {tok: NUM_BYTES + i for i, tok in enumerate(self._specials)}
        # Longest first, so a special token is never split by a shorter one.
        pattern = "|".join(re.escape(t) for t in sorted(self._specials, key=len, reverse=True))
        self._splitter = re.compile(f"({pattern})")

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return f"EchoTokenizer(vocab_size={self._vocab_size})"

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return self._vocab_size

    @property
    def all_special_tokens(self) -> list[str]:
        """Every special token string."""
        return list(self._specials)

    @property
    def all_special_ids(self) -> list[int]:
        """Every special token id."""
        return list(range(NUM_BYTES, self._vocab_size))

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (not a byte)."""
        return NUM_BYTES <= token_id < self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
        """Encode text: special-token strings become their ids, the rest UTF-8 bytes.

        Args:
            text: the text.
            add_special_tokens: accepted for compatibility; ChatML adds no BOS.

        Returns:
            The token ids.
        """
        ids: list[int] = []
        for i, piece in enumerate(self._splitter.split(text)):
            if i % 2:  # the splitter's capture group: a special token
                ids.append(self._special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """Decode ids to text; invalid UTF-8 becomes U+FFFD, as in byte-level BPE.

        Args:
            token_ids: the ids.
            skip_special_tokens: leave special tokens out of the text.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        parts: list[str] = []
        pending = bytearray()
        for tid in token_ids:
            tid = int(tid)
            if 0 <= tid < NUM_BYTES:
                pending.append(tid)
                continue
            if not NUM_BYTES <= tid < self._vocab_size:
                raise ValueError(f"token id {tid} is outside the vocabulary [0, {self._vocab_size}).")
            if pending:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if not skip_special_tokens:
                parts.append(self._specials[tid - NUM_BYTES])
        if pending:
            parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Token strings (bytes shown as their Latin-1 character, specials by name)."""
        return [chr(t) if t < NUM_BYTES else self._specials[t - NUM_BYTES] for t in token_ids]

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation, as ``transformers`` tokenizers do.

        The built-in ChatML template is rendered in plain Python; any other
        ``chat_template`` (e.g. one set with ``sampler.set_template("chatml")``)
        is rendered with ``jinja2`` when it is installed.

        Args:
            conversation: the messages, as Hugging Face chat dicts.
            tools: tool descriptions for the template.
            chat_template: Jinja source overriding the built-in template.
            add_generation_prompt: end with the assistant header.
            tokenize: return token ids instead of text.

        Returns:
            The rendered text, or its ids with ``tokenize=True``.
        """
        if chat_template is None or chat_template == ECHO_CHAT_TEMPLATE:
            text = render_chatml(conversation, tools, add_generation_prompt)
        else:
            text = _render_jinja(
                chat_template,
                messages=list(conversation),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        return self.encode(text) if tokenize else text
