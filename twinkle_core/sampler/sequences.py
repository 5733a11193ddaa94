"""The sequence builder: every ``SampledSequence`` a sampler returns is made here, once.

An engine reports what it generated (tokens, why it stopped, log-probs...);
the builder adds what is the same for every engine: the text (the template's
``completion_text`` under the call's text options), the weights version, the
adapter's name and the training feature. The empty sequences a call gets for
a prompt that generated nothing (aborted before it started, or no room left)
are made by :meth:`SequenceBuilder.empty`, the one place that knows which
per-token fields a call's parameters ask for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twinkle_core.data_format import InputFeature, SampledSequence, SamplingMask, SamplingParams, training_feature
from twinkle_core.sampler.templates import TemplateSlot

__all__ = ["SequenceBuilder"]


class SequenceBuilder:
    """Builds finished sequences with the sampler's template and weights version.

    Args:
        templates: the template slot (text and training features come from its template).
        version: returns the current ``weights_version`` (stable while a run holds the lock).
    """

    def __init__(self, templates: TemplateSlot, version: Callable[[], int]) -> None:
        self._templates = templates
        self._version = version

    def make(
        self,
        prompt: list[int] | InputFeature,
        tokens: list[int],
        *,
        stop_reason: str,
        adapter_name: str,
        params: SamplingParams | None = None,
        text: str | None = None,
        stop: str | int | None = None,
        logprobs: list[float] | None = None,
        top_logprobs: Any = None,
        weights_version: int | None = None,
        sampling_mask: SamplingMask | None = None,
        routed_experts: Any = None,
    ) -> SampledSequence:
        """A finished sequence: its text, version and training feature added to what was generated.

        The text, unless given, is the template's ``completion_text`` under
        ``params``' text options (cut at the stop string ``stop``), or the
        plain decode without ``params``. ``weights_version`` defaults to the
        current one. ``prompt``: its ids, or its feature, whose processed media
        inputs the training feature carries (the same arrays, not copies: a
        prompt's samples share them).
        """
        tokens = [int(t) for t in tokens]
        template = self._templates.current
        if text is None:  # the slot's own refusal when no template is set
            decoder = self._templates.template
            text = decoder.decode(tokens) if params is None else decoder.completion_text(tokens, params, stop)
        media = prompt.multimodal if isinstance(prompt, InputFeature) else None
        ids = list(prompt.input_ids) if isinstance(prompt, InputFeature) else prompt
        # a text prompt reaches the template as ids, as templates written before media were given them
        feature = (
            template.training_feature(prompt if media else ids, tokens)
            if template is not None
            else training_feature(ids, tokens)
        )
        if media and feature.multimodal is None:  # the trainer's forward reads them: never dropped
            feature.multimodal = dict(media)
        if media and not feature.images and isinstance(prompt, InputFeature):  # a resumed prompt's engine reads them
            feature.images = list(prompt.images)
        return SampledSequence(
            tokens=tokens,
            text=text,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            stop_reason=stop_reason,  # type: ignore[arg-type]
            stop=stop,
            weights_version=self._version() if weights_version is None else weights_version,
            adapter_name=adapter_name,
            training_feature=feature,
            sampling_mask=sampling_mask,
            routed_experts=routed_experts,
        )

    def empty(
        self, prompt: list[int] | InputFeature, params: SamplingParams, adapter_name: str, stop_reason: str
    ) -> SampledSequence:
        """A sequence that generated nothing, with the per-token fields ``params`` asks for, empty.

        Routed experts are left out: no forward ran for it.
        """
        return self.make(
            prompt,
            [],
            stop_reason=stop_reason,
            adapter_name=adapter_name,
            text="",
            logprobs=[] if params.logprobs is not None else None,
            top_logprobs=[] if params.logprobs else None,
            sampling_mask=SamplingMask.from_rows([]) if params.return_sampling_mask else None,
        )
