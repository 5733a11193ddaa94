"""``Template``: a tokenizer plus its chat template, turning chats into token ids."""

from __future__ import annotations

import copy
import os
from typing import Any, ClassVar

from twinkle_core.data_format import InputFeature, Trajectory, training_feature
from twinkle_core.data_format.feature import over_tokens
from twinkle_core.data_format.media import media_kind
from twinkle_core.errors import InvalidInputError, PromptTooLongError, TemplateError, UnsupportedFeatureError
from twinkle_core.template.bounds import first_tokens, last_tokens

__all__ = ["CHATML_JINJA", "ChatMLTemplate", "Template", "load_tokenizer"]

#: A plain ChatML template (system/user/assistant/tool), usable with any tokenizer.
CHATML_JINJA = (
    # Newlines are emitted as string expressions: the {%- tags strip literal ones.
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ 'You can call these tools:' }}{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{{ '<|im_start|>' + message.role + '\\n' }}{{ message.content }}"
    # A call is written as its name and arguments, the form the Hermes parser reads back.
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{ '\\n<tool_call>' }}{{ {'name': fn.name, 'arguments': fn.arguments} | tojson }}{{ '</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _text_only(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with content parts joined into one string (one line per part), as templates expect.

    Raises:
        UnsupportedFeatureError: an image or video: this template has no
            processor to turn it into the model's inputs.
        InvalidInputError: another part that is not text: a template renders
            text only, and dropping the part would change the prompt without a word.
    """
    parts = message.get("content")
    if not isinstance(parts, list):
        return message
    for part in parts:
        if media_kind(part) is not None:
            raise UnsupportedFeatureError(
                f"messages[{index}] holds {'an image' if media_kind(part) == 'image' else 'a video'}, but this model"
                " has no processor (no preprocessor_config.json or processor_config.json in its folder): it takes"
                " text only. Use a vision-language model, or send text parts."
            )
        if part.get("type") != "text":
            raise InvalidInputError(
                f"messages[{index}] has a content part of type {part.get('type')!r}: the chat template renders"
                " text only (this engine passes no images or audio to the model). Send text parts or a string."
            )
    return {**message, "content": "\n".join(part["text"] for part in parts)}


def _as_trajectory(trajectory: Any) -> Trajectory:
    if isinstance(trajectory, dict):
        trajectory = Trajectory.from_dict(trajectory)
    if not isinstance(trajectory, Trajectory):
        raise InvalidInputError(f"Template.encode expects a Trajectory, got {type(trajectory).__name__}.")
    return trajectory


def load_tokenizer(model_dir: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Load a Hugging Face tokenizer from a local folder (imports transformers lazily)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), **kwargs)


#: The arguments of ``apply_chat_template`` that are not template variables.
_RENDER_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class Template:
    """A Hugging Face tokenizer and the chat template that renders conversations.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``encode``, ``decode``
            and ``apply_chat_template``).
        chat_template: a Jinja chat template overriding the tokenizer's own;
            subclasses registered by name set the class attribute instead.

    A model whose tokenizer has no chat template can still sample from
    ``InputFeature`` inputs; a ``Trajectory`` then raises ``TemplateError``
    until a template is set (``sampler.set_template("chatml")``).
    """

    #: Jinja source used instead of the tokenizer's template (``None``: the tokenizer's).
    chat_template: ClassVar[str | None] = None

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self._jinja = chat_template or type(self).chat_template or getattr(tokenizer, "chat_template", None)
        self._options: dict[str, Any] = {}

    def with_options(self, **options: Any) -> Template:
        """A copy whose chat template also sees ``options`` as variables (``enable_thinking=False``...).

        The names the renderer itself takes (``messages``, ``tools``,
        ``add_generation_prompt``...) are not options.

        Raises:
            InvalidInputError: such a name.
        """
        taken = sorted(set(options) & _RENDER_ARGUMENTS)
        if taken:
            raise InvalidInputError(
                f"chat template option {taken[0]!r} is invalid: it is an argument of the renderer itself"
                f" (reserved: {', '.join(sorted(_RENDER_ARGUMENTS))})."
            )
        clone = copy.copy(self)
        clone._options = {**getattr(self, "_options", {}), **options}
        return clone

    @property
    def options(self) -> dict[str, Any]:
        """The variables given with :meth:`with_options` (empty for the template as built)."""
        return dict(getattr(self, "_options", {}))

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], **kwargs: Any) -> Template:
        """Build the template from a local model folder's tokenizer."""
        return cls(load_tokenizer(model_dir), **kwargs)

    # -- properties ----------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's end-of-sequence id."""
        return getattr(self.tokenizer, "eos_token_id", None)

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer knows (added tokens included)."""
        return len(self.tokenizer)

    # -- encoding ------------------------------------------------------------------------
    def render(self, trajectory: Trajectory, add_generation_prompt: bool = True) -> str:
        """Render a conversation to the prompt text the model sees.

        Raises:
            TemplateError: the tokenizer has no chat template and none was set.
        """
        if self._jinja is None:
            raise TemplateError(
                f"The tokenizer {type(self.tokenizer).__name__} has no chat template, so a Trajectory cannot"
                " be encoded. Set one with sampler.set_template('chatml') (or another registered template),"
                " or pass InputFeature token ids."
            )
        messages = self._messages(trajectory)
        tools = [t.to_hf() for t in trajectory.tools] or None
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    chat_template=self._jinja,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **getattr(self, "_options", {}),
                )
            )
        except Exception as exc:  # jinja raises TemplateError/UndefinedError on malformed chats
            raise TemplateError(f"The chat template could not render this trajectory: {exc}") from exc

    def _messages(self, trajectory: Trajectory) -> list[dict[str, Any]]:
        """The messages as the chat template sees them: text only here (a processor-aware template keeps media)."""
        if trajectory.images or trajectory.videos:
            kind = "images" if trajectory.images else "videos"
            raise UnsupportedFeatureError(
                f"Trajectory.{kind} is set, but this model has no processor (no preprocessor_config.json or"
                " processor_config.json in its folder): it takes text only. Use a vision-language model."
            )
        return [_text_only(i, m.to_hf()) for i, m in enumerate(trajectory.messages)]

    def _check_parts(self, trajectory: Trajectory, max_tokens: int | None) -> None:
        """Refuse a conversation of more messages and tools than ``max_tokens``: each renders to a token at least."""
        parts = len(trajectory.messages) + len(trajectory.tools)
        if max_tokens is not None and parts > max_tokens:
            # No need to render a conversation of a million messages to know it cannot fit.
            raise PromptTooLongError(
                f"The conversation has {parts} messages and tools, each at least one token: more than the"
                f" {max_tokens} accepted.",
                index=0,
                length=parts,
                limit=max_tokens,
                at_least=True,
            )

    def encode(
        self,
        trajectory: Trajectory | dict[str, Any],
        add_generation_prompt: bool = True,
        *,
        max_tokens: int | None = None,
        keep_last: int | None = None,
    ) -> InputFeature:
        """Encode a conversation (tools passed to the template) into token ids.

        Args:
            trajectory: the conversation (a dict is converted).
            add_generation_prompt: end with the assistant header, ready to sample.
            max_tokens: refuse a conversation of more tokens, without tokenizing
                all of a text far longer than that (see :meth:`tokenize`).
            keep_last: keep only the last this many tokens (a prompt truncated
                at its start), tokenizing only the end of a longer text.

        Returns:
            An ``InputFeature`` whose ``extra`` keeps the trajectory's ``extra``.

        Raises:
            PromptTooLongError: more than ``max_tokens`` tokens (``index`` 0).
        """
        trajectory = _as_trajectory(trajectory)
        self._check_parts(trajectory, max_tokens)
        text = self.render(trajectory, add_generation_prompt)
        ids = self.tokenize(text, max_tokens=max_tokens, keep_last=keep_last)
        return InputFeature(input_ids=ids, extra=dict(trajectory.extra))

    def tokenize(
        self,
        text: str,
        *,
        max_tokens: int | None = None,
        keep_last: int | None = None,
        keep_first: int | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The token ids of ``text``, bounded: work in proportion to the tokens kept, not to the text.

        Args:
            text: the text (a rendered conversation, a completion prompt).
            max_tokens: more tokens than this is refused, after tokenizing only
                the start of the text (:mod:`twinkle_core.template.bounds`).
            keep_last: keep the last this many tokens (the start is cut).
            keep_first: keep the first this many tokens (the end is cut).
            add_special_tokens: as the tokenizer's ``encode`` takes it (a BOS token).

        Raises:
            PromptTooLongError: more than ``max_tokens`` tokens; ``length`` is
                the count (``at_least`` when the text was not tokenized whole).
        """

        def encode(part: str) -> list[int]:
            return [int(t) for t in self.tokenizer.encode(part, add_special_tokens=add_special_tokens)]

        if keep_last is not None or keep_first is not None:
            keep = int(keep_last if keep_last is not None else keep_first)  # type: ignore[arg-type]
            pick = last_tokens if keep_last is not None else first_tokens
            ids, _ = pick(encode, text, keep)
            return ids[-keep:] if keep_last is not None else ids[:keep]
        if max_tokens is None:
            return encode(text)
        ids, whole = first_tokens(encode, text, max_tokens + 1)
        if whole and len(ids) <= max_tokens:
            return ids
        count = "at least " * (not whole) + str(len(ids))
        raise PromptTooLongError(
            f"The text has {count} tokens, more than the {max_tokens} accepted.",
            index=0,
            length=len(ids),
            limit=max_tokens,
            at_least=not whole,
        )

    def decode(
        self, tokens: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Decode token ids to text."""
        if spaces_between_special_tokens:  # the tokenizers' default: not passed, for tokenizers without it
            return str(self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens))
        return str(
            self.tokenizer.decode(
                list(tokens), skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False
            )
        )

    def completion_text(self, tokens: list[int], params: Any, stop: str | int | None = None) -> str:
        """The text of a completion, as every engine reports it.

        Decoded with ``params.skip_special_tokens`` and
        ``params.spaces_between_special_tokens``; a completion that ended on
        the stop string ``stop`` is cut before it (after it with
        ``params.include_stop_str_in_output``). The stop string is the first
        one that ends after the text of the first ``params.min_tokens``
        tokens, since stop strings do not count before that.
        """
        options = {
            "skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens,
        }
        text = self.decode(tokens, **options)
        if not isinstance(stop, str) or not stop:
            return text
        start = 0
        if params.min_tokens:
            start = max(0, len(self.decode(tokens[: params.min_tokens], **options)) - len(stop) + 1)
        cut = text.find(stop, start)
        if cut < 0:
            return text
        return text[: cut + len(stop)] if params.include_stop_str_in_output else text[:cut]

    def training_feature(self, prompt: InputFeature | list[int], completion_tokens: list[int]) -> InputFeature:
        """Prompt + completion as one training feature, labels ``-100`` on the prompt.

        ``labels[i]`` is the token at position ``i`` (unshifted, the Hugging Face
        convention: the model shifts them when computing the loss).
        """
        prompt_ids = prompt.input_ids if isinstance(prompt, InputFeature) else prompt
        feature = training_feature(prompt_ids, completion_tokens)
        if isinstance(prompt, InputFeature) and prompt.multimodal is not None:  # the trainer's forward needs them too
            feature.multimodal = over_tokens(prompt.multimodal, len(feature.input_ids))
            feature.images = list(prompt.images)
        return feature


class ChatMLTemplate(Template):
    """ChatML (``<|im_start|>role ... <|im_end|>``), whatever the tokenizer ships."""

    chat_template = CHATML_JINJA
