"""What a run asks of the decode loop and what it gets back, and the rows it is split into.

A run (one ``sample()``) is a :class:`Job`: its prompts, parameters and
:class:`RunControl`, and the results its rows hand back. Each completion being
generated is a :class:`Row`; the decode loop (:mod:`twinkle_torch.decoding`)
queues, prefills and decodes rows, and a finished row becomes a
:class:`SequenceResult`. How the rows of the running batch are laid out
in the cache is :mod:`twinkle_torch.batch`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs
import numpy as np

from twinkle_core.data_format import SamplingMask, SamplingParams
from twinkle_torch.routes import RouteRecorder
from twinkle_torch.stopping import StopStringMatcher

__all__ = ["Job", "PromptScores", "Row", "RunControl", "SequenceResult", "TopList"]

TopList = list[list[tuple[int, float]]]


@attrs.define
class SequenceResult:
    """One finished completion, before it becomes a ``SampledSequence``."""

    tokens: list[int]
    stop_reason: str
    stop: str | int | None = None
    text: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: TopList | None = None
    sampling_mask: SamplingMask | None = None
    routed_experts: np.ndarray | None = None


@attrs.define
class RunControl:
    """What a run may vary per prompt, and how it is stopped and streamed.

    Attributes:
        max_tokens: per prompt, the most tokens to generate.
        sample_base: per prompt, the sample index of its first completion (seeds use it).
        generated: per prompt, tokens generated before this run (seeded draws are keyed on the position).
        stopped: called between steps; ``True`` ends every unfinished row with ``"abort"``.
        on_finish: called with ``(prompt_index, sample_index, result)`` as each completion ends
            (from the decode loop's thread).
        activate: called (from the decode loop's thread) before the first forward of a batch
            that starts with this run's rows: selects the run's adapter.
        adapter: the adapter the run samples; rows of different adapters never share a batch.
    """

    max_tokens: list[int]
    sample_base: list[int]
    generated: list[int]
    stopped: Callable[[], bool] = lambda: False
    on_finish: Callable[[int, int, SequenceResult], None] | None = None
    activate: Callable[[], None] = lambda: None
    adapter: str = ""

    @classmethod
    def plain(cls, prompts: int, params: SamplingParams) -> RunControl:
        """Every prompt with ``params.max_tokens``, fresh sequences, no early stop."""
        return cls([params.max_tokens] * prompts, [0] * prompts, [0] * prompts)


@attrs.define
class PromptScores:
    """Prompt log-probs of one prompt (the first entry ``None``)."""

    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


class Job:
    """One run's rows, scores and completion (its results go to ``control.on_finish``).

    ``media``: per prompt, its processed media inputs (``InputFeature.multimodal``) or ``None``.
    """

    def __init__(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        control: RunControl,
        eos_token_ids: Sequence[int],
        media: Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        self.prompts = prompts
        self.media = list(media) if media is not None else [None] * len(prompts)
        self.params = params
        self.control = control
        self.scores: dict[int, PromptScores] = {}
        self.pending = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.interrupted = False  # the caller stopped waiting (Ctrl-C): end the rows as an abort would
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(eos_token_ids)
        self.stop_ids = stop_ids
        try:
            hash(params)
            self.group: Hashable = params  # runs with equal parameters sample as one group
        except TypeError:
            self.group = id(self)


@attrs.define(eq=False)
class Row:
    """One completion being generated: where it belongs, what it has, when it ends."""

    job: Job
    prompt: int
    sample: int
    limit: int  # the most tokens it may hold in all (the ones it had when queued included)
    seed: int | None
    position0: int  # completion position of its first token in this run (seeded draws are keyed on it)
    score_only: bool = False  # a prompt-scoring row: prefilled, never decoded
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[float] | None = None
    top: TopList | None = None
    kept: list[list[int]] | None = None
    routes: list[np.ndarray] | None = None  # with return_routed_experts: [positions, layers, top_k] per forward
    matcher: StopStringMatcher | None = None
    grammar: Any = None  # with structured_outputs: its xgrammar matcher
    done: bool = False

    @property
    def ids(self) -> list[int]:
        """What a prefill of this row reads: its prompt and what it generated before."""
        return self.job.prompts[self.prompt] + self.tokens

    @property
    def media(self) -> dict[str, Any] | None:
        """Its prompt's processed media inputs (a prefill of this row reads them), or ``None``."""
        return self.job.media[self.prompt]

    @property
    def output(self) -> list[int]:
        """Its whole completion so far: what an earlier run generated (the prompt's tail) and its tokens."""
        prompt = self.job.prompts[self.prompt]
        return prompt[len(prompt) - self.position0 :] + self.tokens if self.position0 else self.tokens

    @property
    def span(self) -> int:
        """The most cache columns it can need: prompt plus budget."""
        return len(self.job.prompts[self.prompt]) + self.limit

    def routed_experts(self, recorder: RouteRecorder) -> np.ndarray:
        """Its routes once finished: one per token it forwarded, all but its last token (which no forward read)."""
        assert self.routes is not None
        wanted = len(self.ids) - 1
        if not self.routes:
            return np.zeros((0, recorder.layers, recorder.top_k), dtype=recorder.dtype)
        routes: np.ndarray = np.concatenate(self.routes)[:wanted]
        return routes
