"""Token-exact multi-turn episodes: what the model sampled, kept as sampled.

The classic multi-turn bug re-renders the whole conversation through the chat
template before every turn and re-tokenizes it. The trainer then sees tokens
the model never produced (another BPE merge at a turn boundary, earlier
``<think>`` blocks stripped, whitespace normalised) and the log-probs no
longer line up. An :class:`Episode` never does that. It holds one token list
and only ever appends to it:

1. **The prompt**: the first trajectory, encoded once with the generation prompt.
2. **A sampled turn**: the engine's tokens, exactly as sampled (``loss_mask`` 1,
   with their log-probs and weights version). Its text is parsed for tool
   calls into the assistant message the template will render later.
3. **New messages** (tool results, user turns), as the template's *delta*,
   in two parts:

   * the **closing** of the sampled turn: the template renders an assistant
     message as ``<header>content<closing>`` (ChatML: closing ``<|im_end|>\\n``).
     The closing is found by rendering a sentinel content; whatever tail of it
     the model already sampled (``<|im_end|>`` when it stopped on its end of
     turn) is not repeated, the rest is appended (``\\n``; or all of
     ``<|im_end|>\\n`` when it stopped on length);
   * the **new messages and the next generation prompt**: the conversation is
     rendered before (``R_old``, ending with the assistant message) and after
     (``R_new``, with the new messages and the generation prompt); ``R_new``
     must start with ``R_old`` as text, and tokenizing ``R_old`` then the
     delta must give the tokens of ``R_new`` (no merge across the boundary).
     The delta's tokens are appended.

Images in new messages (a tool's screenshot) are expanded by the model's
processor in the delta, and every feature of the episode carries all its
images so far (:mod:`twinkle_core.episode_media`).

A template that fails either check is not prefix-preserving (Qwen3-style
templates drop earlier reasoning once a conversation moves on). It is
detected on the first append, and ``on_template_mismatch`` decides:
``"raise"`` (default) raises :class:`~twinkle_core.errors.TemplateError`;
``"keep_sampled"`` keeps every token already in the episode (what the model
actually saw and sampled) and encodes the new messages against a minimal
one-message context, recording the choice on the episode
(``Episode.template_mismatches``). Neither ever re-tokenizes earlier turns.

Sampling goes through :func:`_sample_turn` (``Sampler.sample``) and
:func:`_asample_turn` (``Sampler.asample``, which never blocks the event
loop), the only places this module calls the engine. Code that drives the
engine itself (the rollout server submits ``episode.prompt()`` with
:meth:`Episode.turn_params` to get an abortable handle) appends the result
with :meth:`Episode.extend_sampled` or :meth:`Episode.append_sampled`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

from twinkle_core.data_format import (
    IGNORE_INDEX,
    InputFeature,
    Message,
    SampleResponse,
    SamplingParams,
    Trajectory,
)
from twinkle_core.data_format.output import SampledSequence
from twinkle_core.episode_media import EpisodeMedia, inline_media, plain_message
from twinkle_core.episode_turns import Segment, Turn
from twinkle_core.errors import InvalidInputError, PromptTooLongError, TemplateError
from twinkle_core.template import Template
from twinkle_core.tools import ToolCallParser, get_tool_parser

__all__ = ["Episode", "OnTemplateMismatch", "Segment", "Turn", "asample_episodes", "sample_episodes"]

OnTemplateMismatch = Literal["raise", "keep_sampled"]
_MISMATCH_CHOICES = ("raise", "keep_sampled")
# Content no template rewrites, used to find where an assistant message's content ends.
_SENTINEL = "TWINKLE_CONTENT_SENTINEL_5f1c"


def _template_of(template_or_sampler: Any) -> Template:
    if isinstance(template_or_sampler, Template):
        return template_or_sampler
    template = getattr(template_or_sampler, "template", None)
    if isinstance(template, Template):
        return template
    raise InvalidInputError(
        f"Episode needs a Template or a sampler with one, got {type(template_or_sampler).__name__}."
    )


class Episode:
    """A conversation kept as the exact tokens sampled and appended.

    Args:
        template: the chat template (or a sampler, whose template is used).
        trajectory: the opening conversation (a dict is converted); it must
            not end with an assistant message: the episode starts by sampling one.
        tool_parser: how tool calls are read from completions: a registered
            name (``"hermes"``, ``"none"``), a parser class or instance.
        on_template_mismatch: what to do when the template is not
            prefix-preserving: ``"raise"`` (default) or ``"keep_sampled"``
            (see the module docstring).
        max_prompt_tokens: the most tokens the episode may hold (default: the
            sampler's ``max_model_len`` when a sampler is given, else no bound).
            Messages that would take it past this are refused without
            tokenizing all of a text far longer than that.

    Raises:
        InvalidInputError: a bad trajectory or option.
        TemplateError: the template cannot render the trajectory.
    """

    def __init__(
        self,
        template: Any,
        trajectory: Trajectory | dict[str, Any],
        *,
        tool_parser: str | ToolCallParser | type[ToolCallParser] = "hermes",
        on_template_mismatch: OnTemplateMismatch = "raise",
        max_prompt_tokens: int | None = None,
    ) -> None:
        if on_template_mismatch not in _MISMATCH_CHOICES:
            raise InvalidInputError(
                f"on_template_mismatch={on_template_mismatch!r} is invalid: expected one of"
                f" {', '.join(repr(c) for c in _MISMATCH_CHOICES)}."
            )
        if isinstance(trajectory, dict):
            trajectory = Trajectory.from_dict(trajectory)
        if not isinstance(trajectory, Trajectory):
            raise InvalidInputError(f"Episode expects a Trajectory, got {type(trajectory).__name__}.")
        if trajectory.messages[-1].role == "assistant":
            raise InvalidInputError(
                "The episode's opening trajectory ends with an assistant message; an episode starts by"
                " sampling the assistant's turn, so end it with a user, system or tool message."
            )
        self.template = _template_of(template)
        if max_prompt_tokens is None and not isinstance(template, Template):
            max_prompt_tokens = getattr(template, "max_model_len", None)
        self.max_prompt_tokens = max_prompt_tokens
        self.tool_parser = get_tool_parser(tool_parser)
        self.on_template_mismatch: OnTemplateMismatch = on_template_mismatch
        self.messages: list[Message] = inline_media(trajectory)  # Trajectory.images held in the messages
        self.tools = list(trajectory.tools)
        self.extra = dict(trajectory.extra)
        opening = self.template.encode(trajectory, add_generation_prompt=True, max_tokens=max_prompt_tokens)
        prompt, self._media = opening.input_ids, EpisodeMedia(opening)
        self.tokens: list[int] = list(prompt)
        self.loss_mask: list[int] = [0] * len(prompt)
        self.logprobs: list[float | None] = [None] * len(prompt)
        self.segments: list[Segment] = [Segment(kind="prompt", tokens=list(prompt))]
        self.turns: list[Turn] = []
        #: Why each append fell back to isolated encoding (``on_template_mismatch="keep_sampled"``).
        self.template_mismatches: list[str] = []
        #: What constrains the next sampled turn (a forced tool call, a response format), recorded on
        #: that turn (``Turn.constraint``) and cleared; set by whoever samples it (``twinkle serve``).
        self.constraint: dict[str, Any] | None = None
        self._awaiting = True

    # -- state -----------------------------------------------------------------------------
    @property
    def awaiting_sample(self) -> bool:
        """True when the tokens end with a generation prompt (the next step is sampling)."""
        return self._awaiting

    @property
    def last_turn(self) -> Turn | None:
        """The most recent sampled turn."""
        return self.turns[-1] if self.turns else None

    def trajectory(self) -> Trajectory:
        """The conversation so far as messages (sampled turns as their parsed messages)."""
        return Trajectory(messages=list(self.messages), tools=list(self.tools), extra=dict(self.extra))

    def prompt(self) -> InputFeature:
        """The tokens to sample the next turn from.

        Raises:
            InvalidInputError: the last turn was sampled and no message has been added since.
        """
        if not self.awaiting_sample:
            raise InvalidInputError(
                "The episode ends with a sampled turn: add the next message (add_messages, add_tool_result,"
                " add_user) before sampling again."
            )
        return InputFeature(input_ids=list(self.tokens), extra=dict(self.extra), **self._media.fields(len(self.tokens)))

    def fork(self) -> Episode:
        """An independent copy sharing everything so far; the two diverge from here."""
        twin = object.__new__(Episode)
        twin.template, twin.tool_parser = self.template, self.tool_parser
        twin.on_template_mismatch, twin.max_prompt_tokens = self.on_template_mismatch, self.max_prompt_tokens
        twin.messages, twin.tools, twin.extra = list(self.messages), list(self.tools), dict(self.extra)
        twin.tokens, twin.loss_mask, twin.logprobs = list(self.tokens), list(self.loss_mask), list(self.logprobs)
        twin.segments = [Segment(kind=s.kind, tokens=list(s.tokens)) for s in self.segments]
        twin.turns = list(self.turns)  # turns are never mutated once recorded
        twin.template_mismatches = list(self.template_mismatches)
        twin.constraint, twin._media, twin._awaiting = self.constraint, self._media.fork(), self._awaiting
        return twin

    # -- sampling --------------------------------------------------------------------------
    def sample(
        self,
        sampler: Any,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        adapter_name: str = "",
        *,
        num_samples: int | None = None,
    ) -> list[Episode]:
        """Sample the next assistant turn.

        With ``num_samples=n > 1`` the episode forks: this episode continues
        with the first completion and ``n - 1`` forks (sharing the prefix)
        continue with the others.

        Returns:
            ``[self, fork_1, ..., fork_{n-1}]``, each extended by one turn.
        """
        return sample_episodes(sampler, [self], sampling_params, adapter_name, num_samples=num_samples)[0]

    async def asample(
        self,
        sampler: Any,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        adapter_name: str = "",
        *,
        num_samples: int | None = None,
    ) -> list[Episode]:
        """:meth:`sample` for asyncio: many episodes can be in flight, each turn sent when it is ready."""
        return (await asample_episodes(sampler, [self], sampling_params, adapter_name, num_samples=num_samples))[0]

    def append_sampled(self, seq: SampledSequence) -> Turn:
        """Append a turn sampled outside :meth:`sample` (e.g. ``sampler.submit([episode.prompt()])``).

        The tokens are kept exactly as sampled, with their log-probs and
        version; the text is parsed for tool calls (malformed ones go to
        ``Turn.tool_call_errors``). An aborted sequence is kept too, as a turn
        with ``stop_reason="abort"``.

        Returns:
            The new turn.

        Raises:
            InvalidInputError: the episode ends with a sampled turn (append a message first).
        """
        if not self._awaiting:
            raise InvalidInputError(
                "This episode already ends with a sampled turn: add a tool result or a user message before"
                " appending another sampled turn."
            )
        parsed = self.tool_parser.parse(seq.text)
        message = Message(role="assistant", content=parsed.content, tool_calls=parsed.tool_calls or None)
        turn = Turn(
            start=len(self.tokens),
            tokens=list(seq.tokens),
            text=seq.text,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            stop_reason=seq.stop_reason,
            weights_version=seq.weights_version,
            adapter_name=seq.adapter_name,
            message=message,
            tool_call_errors=list(parsed.errors),
            top_logprobs=seq.top_logprobs,
            constraint=self.constraint,
            routed_experts=seq.routed_experts,
        )
        self.constraint = None
        self.tokens.extend(turn.tokens)
        self.loss_mask.extend([1] * len(turn.tokens))
        self.logprobs.extend(turn.logprobs if turn.logprobs is not None else [None] * len(turn.tokens))
        self.segments.append(Segment(kind="sampled", tokens=list(turn.tokens)))
        self.turns.append(turn)
        self.messages.append(message)
        self._awaiting = False
        return turn

    @staticmethod
    def turn_params(sampler: Any, sampling_params: SamplingParams) -> SamplingParams:
        """``sampling_params`` as a turn is sampled with on ``sampler`` (for code that submits :meth:`prompt`
        itself): the sampled log-probs are asked for when the engine gives them (the training feature needs them)."""
        if sampling_params.logprobs is None and "logprobs" in getattr(sampler, "supported_params", ()):
            return sampling_params.replace(logprobs=0)
        return sampling_params

    def extend_sampled(self, response: SampleResponse) -> list[Episode]:
        """Append the sequences of one reply to :meth:`prompt`: the first to this episode, each other to a fork
        (see :meth:`append_sampled`). Returns ``[self, fork_1, ..., fork_{n-1}]``, each extended by one turn."""
        forks = [self] + [self.fork() for _ in response.sequences[1:]]  # fork before extending
        for fork, seq in zip(forks, response.sequences):
            fork.append_sampled(seq)
        return forks

    # -- appending messages -------------------------------------------------------------------
    def add_messages(self, messages: Sequence[Message | dict[str, Any]]) -> list[int]:
        """Append tool results or user turns, then the next generation prompt, as the template's delta.

        Images in them (a tool's screenshot) are expanded by the model's
        processor as in the whole conversation, and the next prompt and the
        training feature carry them after the earlier ones (see
        :mod:`twinkle_core.episode_media`).

        Returns:
            The token ids appended (closing of the last turn, then the delta).

        Raises:
            InvalidInputError: no turn was sampled since the last append, or a message is malformed.
            InvalidMediaError: an image that cannot be used, named by its place (``messages[0].content[1]``).
            TemplateError: the template is not prefix-preserving (with ``on_template_mismatch="raise"``).
            PromptTooLongError: the episode would hold more than ``max_prompt_tokens``.
            Nothing is appended when any is raised.
        """
        if self.awaiting_sample:
            raise InvalidInputError(
                "The episode already ends with a generation prompt: sample the assistant's turn before adding"
                " more messages."
            )
        new = Trajectory(messages=list(messages)).messages  # validates and converts dicts
        if any(m.role == "assistant" for m in new):
            raise InvalidInputError(
                "add_messages takes tool, user or system messages; assistant turns come from sampling."
            )
        images = self._media.load(self.template, new)  # decoded and bounded before anything is appended
        closing = self._closing()
        before = self._render(self.messages, False)
        after = self._render(self.messages + new, True)
        self._check_room(after[len(before) :] if after.startswith(before) else after)
        problem = self._prefix_problem(before, after)
        if problem is None:
            delta_text = after[len(before) :]
        elif self.on_template_mismatch == "raise":
            raise TemplateError(
                f"The chat template is not prefix-preserving, so this episode cannot stay token-exact: {problem}"
                " Use a template that renders earlier turns unchanged, or pass"
                " on_template_mismatch='keep_sampled' to keep the sampled tokens and encode new messages"
                " on their own (see twinkle_core.episode)."
            )
        else:
            delta_text = self._isolated_delta(new)
        closing_ids = self._encode(closing) if closing else []
        delta_ids, processed = self._encode(delta_text) if delta_text else [], None
        if images:  # the delta's placeholders expanded, the room checked again on the expanded count
            bound = self.max_prompt_tokens
            room = None if bound is None else bound - len(self.tokens) - len(closing_ids)
            delta_ids, processed = self._media.expand(self.template, delta_text, images, room)
        if problem is not None:
            self.template_mismatches.append(problem)
        appended: list[int] = []
        for kind, ids in (("closing", closing_ids), ("delta", delta_ids)):
            if processed is not None and kind == "delta":
                self._media.add(len(self.tokens), processed, images)
            if ids:
                self.segments.append(Segment(kind=kind, tokens=ids))  # type: ignore[arg-type]
                self.tokens.extend(ids)
                self.loss_mask.extend([0] * len(ids))
                self.logprobs.extend([None] * len(ids))
                appended.extend(ids)
        self.messages.extend(new)
        self._awaiting = True
        return appended

    def add_tool_result(self, content: str | list[dict[str, Any]], tool_call_id: str | None = None) -> list[int]:
        """Append one ``tool`` message (the result of a call: text, or content parts with images) and the next
        generation prompt."""
        return self.add_messages([Message(role="tool", content=content, tool_call_id=tool_call_id)])

    def add_user(self, content: str | list[dict[str, Any]]) -> list[int]:
        """Append one ``user`` message (text, or content parts with images) and the next generation prompt."""
        return self.add_messages([Message(role="user", content=content)])

    # -- template helpers ----------------------------------------------------------------------
    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.template.render(Trajectory(messages=list(messages), tools=self.tools), add_generation_prompt)

    def _check_room(self, text: str) -> None:
        """Refuse new text of more tokens than the episode has room for, before it is tokenized whole.

        Raises:
            PromptTooLongError: naming the episode's length with the text, and its bound.
        """
        if self.max_prompt_tokens is None:
            return
        room = max(0, self.max_prompt_tokens - len(self.tokens))
        try:
            self.template.tokenize(text, max_tokens=room)
        except PromptTooLongError as exc:
            count = f"at least {exc.length}" if exc.at_least else str(exc.length)
            raise PromptTooLongError(
                f"The new messages have {count} tokens, but the episode holds {len(self.tokens)} of the"
                f" {self.max_prompt_tokens} it may: there is room for {room} more.",
                index=0,
                length=len(self.tokens) + exc.length,
                limit=self.max_prompt_tokens,
                at_least=exc.at_least,
            ) from None

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.template.tokenizer.encode(text, add_special_tokens=False)]

    def _closing(self) -> str:
        """The text the template puts after the last turn's content that the model did not sample."""
        before = self.messages[:-1]
        prompt = self._render(before, True)
        rendered = self._render([*before, Message(role="assistant", content=_SENTINEL)], False)
        at = rendered.find(_SENTINEL, len(prompt) if rendered.startswith(prompt) else 0)
        if at < 0:
            raise TemplateError(
                "The chat template drops the content of the last assistant message, so the end of a sampled"
                " turn cannot be found; an episode needs a template that renders it."
            )
        closing = rendered[at + len(_SENTINEL) :]
        sampled = self.template.decode(self.turns[-1].tokens, skip_special_tokens=False)
        # The longest head of the closing the model already produced (its end-of-turn token) is not repeated.
        for k in range(len(closing), 0, -1):
            if sampled.endswith(closing[:k]):
                return closing[k:]
        return closing

    def _prefix_problem(self, before: str, after: str) -> str | None:
        """Why ``after`` cannot be built by appending to ``before`` (``None`` if it can)."""
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            return (
                f"the conversation rendered with the new messages does not start with the conversation rendered"
                f" before them (they differ at character {at}: {before[max(0, at - 30) : at + 30]!r} became"
                f" {after[max(0, at - 30) : at + 30]!r})."
            )
        old_ids, delta_ids = self._encode(before), self._encode(after[len(before) :])
        if old_ids + delta_ids != self._encode(after):
            return (
                "the tokens of the longer rendering do not start with the tokens of the shorter one: the tokenizer"
                f" merges across the boundary at {before[-20:]!r} | {after[len(before) : len(before) + 20]!r}."
            )
        return None

    def _isolated_delta(self, new: list[Message]) -> str:
        """The delta of ``new`` against a minimal context (``on_template_mismatch="keep_sampled"``)."""
        base = [Message(role="user", content="")]
        before, after = self._render(base, False), self._render(base + new, True)
        if not after.startswith(before):
            raise TemplateError(
                "The chat template cannot encode new messages on their own either: rendering them after a"
                f" one-message context does not extend that context ({after[:80]!r} vs {before[:80]!r})."
            )
        return after[len(before) :]

    # -- the result ------------------------------------------------------------------------------
    def training_feature(self) -> InputFeature:
        """All tokens, labels (``-100`` except on sampled tokens) and the per-token data a trainer needs.

        ``extra`` holds ``loss_mask`` (1 exactly on sampled tokens), ``logprobs``
        (the sampled log-prob on sampled tokens, ``None`` elsewhere),
        ``weights_versions`` (the producing version on sampled tokens, ``None``
        elsewhere) and ``turns`` (each turn's span, version, adapter, stop reason
        and ``constraint``: what constrained it, ``None`` for nothing). ``multimodal`` and ``images`` hold
        every image of the episode, in order (see :mod:`twinkle_core.episode_media`).
        """
        versions: list[int | None] = [None] * len(self.tokens)
        for turn in self.turns:
            versions[turn.start : turn.end] = [turn.weights_version] * len(turn.tokens)
        return InputFeature(
            input_ids=list(self.tokens),
            labels=[t if m else IGNORE_INDEX for t, m in zip(self.tokens, self.loss_mask)],
            **self._media.fields(len(self.tokens)),
            extra={
                "loss_mask": list(self.loss_mask),
                "logprobs": list(self.logprobs),
                "weights_versions": versions,
                "turns": [
                    {
                        "start": t.start,
                        "end": t.end,
                        "weights_version": t.weights_version,
                        "adapter_name": t.adapter_name,
                        "stop_reason": t.stop_reason,
                        "tool_call_errors": list(t.tool_call_errors),
                        "constraint": t.constraint,
                    }
                    for t in self.turns
                ],
                "template_mismatches": list(self.template_mismatches),
            },
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record: the messages, the tools and the training feature (images as ``data:`` URLs)."""
        return {
            "messages": [plain_message(m) for m in self.messages],
            "tools": [t.to_hf() for t in self.tools],
            "feature": self.training_feature().to_dict(),
        }


def _sample_turn(
    sampler: Any, prompts: list[InputFeature], params: SamplingParams, adapter_name: str
) -> list[SampleResponse]:
    """The one call from episodes to the engine, blocking."""
    return list(sampler.sample(prompts, params, adapter_name))


async def _asample_turn(
    sampler: Any, prompts: list[InputFeature], params: SamplingParams, adapter_name: str
) -> list[SampleResponse]:
    """The same call for asyncio code: the sampler's own ``asample`` (the event loop is never blocked)."""
    asample = getattr(sampler, "asample", None)
    if asample is None:  # a sampler-like object without the asynchronous API
        return await asyncio.to_thread(_sample_turn, sampler, prompts, params, adapter_name)
    return list(await asample(prompts, params, adapter_name))


def _prepare(
    sampler: Any,
    episodes: list[Episode],
    sampling_params: SamplingParams | dict[str, Any] | None,
    num_samples: int | None,
) -> tuple[list[InputFeature], SamplingParams]:
    from twinkle_core.data_format.params import resolve_params

    if not isinstance(episodes, (list, tuple)) or not all(isinstance(e, Episode) for e in episodes):
        raise InvalidInputError(f"episodes={episodes!r:.80} is invalid: expected a list of Episode.")
    first: dict[int, int] = {}
    for i, episode in enumerate(episodes):
        j = first.setdefault(id(episode), i)
        if j != i:  # its one next turn cannot be sampled twice (use num_samples, or fork() it)
            raise InvalidInputError(
                f"episodes[{i}] is episodes[{j}]: an episode takes one turn per call; pass num_samples=, or"
                " episode.fork() for a second copy."
            )
    params = Episode.turn_params(sampler, resolve_params(sampling_params, num_samples))
    return [e.prompt() for e in episodes], params


def sample_episodes(
    sampler: Any,
    episodes: list[Episode],
    sampling_params: SamplingParams | dict[str, Any] | None = None,
    adapter_name: str = "",
    *,
    num_samples: int | None = None,
) -> list[list[Episode]]:
    """Sample the next turn of several episodes in one engine call.

    Returns:
        Per episode, ``[episode, forks...]`` (``num_samples`` of them), each extended by one turn.
    """
    prompts, params = _prepare(sampler, episodes, sampling_params, num_samples)
    responses = _sample_turn(sampler, prompts, params, adapter_name)
    return [episode.extend_sampled(response) for episode, response in zip(episodes, responses)]


async def asample_episodes(
    sampler: Any,
    episodes: list[Episode],
    sampling_params: SamplingParams | dict[str, Any] | None = None,
    adapter_name: str = "",
    *,
    num_samples: int | None = None,
) -> list[list[Episode]]:
    """:func:`sample_episodes` for asyncio (the engine call runs in a worker thread)."""
    prompts, params = _prepare(sampler, episodes, sampling_params, num_samples)
    responses = await _asample_turn(sampler, prompts, params, adapter_name)
    return [episode.extend_sampled(response) for episode, response in zip(episodes, responses)]
