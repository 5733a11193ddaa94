"""What an engine may use of the sampler around it: an ``EngineContext`` made of the sampler's parts.

It is built before the engine (the engine's constructor receives it) from
the parts that exist by then: the template slot, the sequence builder and
the policy state. It holds no ``Sampler``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from twinkle_core.data_format import SampledSequence
from twinkle_core.engine import EngineContext
from twinkle_core.placement import current_replica
from twinkle_core.sampler.policy import PolicyState
from twinkle_core.sampler.sequences import SequenceBuilder
from twinkle_core.sampler.templates import TemplateSlot
from twinkle_core.template import Template

__all__ = ["PartsContext"]


class PartsContext(EngineContext):
    """The :class:`~twinkle_core.engine.EngineContext` a ``Sampler`` hands its engine."""

    def __init__(self, templates: TemplateSlot, sequences: SequenceBuilder, state: PolicyState) -> None:
        self._templates = templates
        self._sequences = sequences
        self._state = state

    def init_template(self, template: Any, model_dir: Any = None, *, tokenizer: Any = None) -> None:
        self._templates.init(template, model_dir, tokenizer=tokenizer)

    @property
    def template(self) -> Template:
        return self._templates.template

    @property
    def tokenizer(self) -> Any:
        return self._templates.template.tokenizer

    @property
    def weights_version(self) -> int:
        return self._state.version

    def make_sequence(self, prompt_ids: list[int], tokens: list[int], **fields: Any) -> SampledSequence:
        # the contract's keywords (EngineContext.make_sequence), but never a weights version: the sampler states it
        if "weights_version" in fields:
            raise TypeError("make_sequence() takes no weights_version: each sequence carries the sampler's own.")
        return self._sequences.make(prompt_ids, tokens, **fields)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._state.lock.write():
            yield

    def restore_version(self, version: int) -> None:
        self._state.restore_version(version)

    @property
    def placement(self) -> Any:
        return current_replica()
