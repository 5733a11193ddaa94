"""The template slot: the chat template and tokenizer a sampler encodes and decodes with.

The engine fills it while it is built (``EngineContext.init_template``);
``Sampler.set_template`` replaces the template later, under the sampler's
lock held exclusively, and tells the engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from twinkle_core.data_format import InputFeature, Trajectory
from twinkle_core.errors import TemplateError, TwinkleError
from twinkle_core.locks import ReadWriteLock
from twinkle_core.sampler.policy import AppliedWithError
from twinkle_core.template import Template, get_template, load_tokenizer
from twinkle_core.template.processor import ProcessorTemplate, has_processor

__all__ = ["TemplateSlot"]

logger = logging.getLogger(__name__)


class TemplateSlot:
    """Holds the template (and the tokenizer it wraps); empty until the engine sets it up."""

    def __init__(self, lock: ReadWriteLock) -> None:
        self._lock = lock
        self._template: Template | None = None
        self._tokenizer: Any = None

    @property
    def current(self) -> Template | None:
        """The template, or ``None`` before the engine has set one up."""
        return self._template

    @property
    def template(self) -> Template:
        """The template; an error before one is set."""
        if self._template is None:
            raise TwinkleError("No template is set: call set_template(...) first.")
        return self._template

    def encode(
        self, item: InputFeature | Trajectory, *, max_tokens: int | None = None, keep_last: int | None = None
    ) -> InputFeature:
        """The prompt feature of one input (trajectories go through the template).

        ``max_tokens`` and ``keep_last`` bound the work on a trajectory, as
        :meth:`Template.encode` takes them; a feature is returned as it is.
        """
        if isinstance(item, InputFeature):
            return item
        return self.template.encode(item, add_generation_prompt=True, max_tokens=max_tokens, keep_last=keep_last)

    def init(self, template: Any, model_dir: str | os.PathLike[str] | None = None, *, tokenizer: Any = None) -> None:
        """Set up the tokenizer and the template, as an engine's constructor asks (``EngineContext.init_template``)."""
        if isinstance(template, Template):
            self.set(template, {}, None)
            return
        if tokenizer is None and template is None and model_dir is not None and has_processor(model_dir):
            # a model with a processor (images, video): its template expands media through that processor
            try:
                processing = ProcessorTemplate.from_pretrained(model_dir)
            except Exception as exc:  # a processor this machine cannot build (Qwen2-VL's needs torchvision)
                logger.warning(
                    "The processor of %s could not be loaded (%s: %.200s); prompts are text only.",
                    model_dir,
                    type(exc).__name__,
                    exc,
                )
            else:
                self.set(processing, {}, None)
                return
        if tokenizer is not None:
            self._tokenizer = tokenizer
        elif model_dir is not None:
            self._tokenizer = load_tokenizer(model_dir)
        self.set(template if template is not None else Template, {}, None)

    def set(
        self, template: type[Template] | Template | str, options: dict[str, Any], changed: Callable[[], None] | None
    ) -> None:
        """Replace the template (a registered name, a class built with ``options``, or an instance).

        Waits for the runs in progress; ``changed`` (the engine's
        ``template_changed``) runs with the lock held, and a failure there puts
        the previous template back.

        Raises:
            UnknownTemplateError: an unknown name (with did-you-mean).
            TemplateError: anything else that is not a template, or options its class does not take.
        """
        if isinstance(template, str):
            template = get_template(template)
        if isinstance(template, type) and issubclass(template, Template):
            tokenizer = self._tokenizer if self._tokenizer is not None else getattr(self._template, "tokenizer", None)
            if tokenizer is None:
                raise TwinkleError("This sampler has no tokenizer to build the template with; pass an instance.")
            cls = template
            try:
                template = cls(tokenizer, **options)
            except TypeError as exc:  # an option the class does not take
                raise TemplateError(f"set_template({cls.__name__}, **{options!r:.80}): {exc}.") from None
        elif options:
            raise TemplateError(f"set_template got keyword arguments {sorted(options)} with a Template instance.")
        if not isinstance(template, Template):
            raise TemplateError(
                f"set_template expects a registered name, a Template subclass or instance; got {template!r:.80}."
            )
        with self._lock.write():
            previous = (self._template, self._tokenizer)
            self._template = template
            self._tokenizer = template.tokenizer
            try:
                if changed is not None:
                    changed()
            except AppliedWithError as applied:  # kept: the engine applied it, not cleanly
                raise applied.error from None
            except BaseException:
                self._template, self._tokenizer = previous
                raise
