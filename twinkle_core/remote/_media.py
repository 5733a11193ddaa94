"""A prompt's media cross Ray once per call, both ways.

Every sequence of a prompt with images carries, on its training feature, the
prompt's processed media inputs (``InputFeature.multimodal``) and images: the
same objects, shared by the prompt's ``num_samples`` sequences, as the
sequence builder makes them. Pickled one by one as each sequence streams back
from its replica, they would cross ``num_samples`` times and arrive as that
many copies. So a replica sends a sequence without them when they are its
prompt's own (:func:`shed_prompt_media`), and the driver gives it back its
own copy of the prompt's, which every sample of that prompt shares
(:func:`restore_prompt_media`). Media a template made anew for a sequence are
sent as they are.
"""

from __future__ import annotations

import attrs

from twinkle_core.data_format import InputFeature, SampledSequence

__all__ = ["restore_prompt_media", "shed_prompt_media"]


def _same_objects(a: list[object], b: list[object]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def shed_prompt_media(sequence: SampledSequence, prompt: InputFeature) -> tuple[SampledSequence, bool]:
    """``sequence`` without its prompt's media, and whether they were shed (the driver restores them then)."""
    feature, media = sequence.training_feature, prompt.multimodal
    if not media or feature is None or feature.multimodal is None:
        return sequence, False
    own = feature.multimodal
    if own.keys() != media.keys() or not _same_objects([own[k] for k in media], list(media.values())):
        return sequence, False
    if not _same_objects(feature.images, prompt.images):
        return sequence, False
    return attrs.evolve(sequence, training_feature=attrs.evolve(feature, multimodal=None, images=[])), True


def restore_prompt_media(sequence: SampledSequence, prompt: InputFeature) -> SampledSequence:
    """``sequence`` with ``prompt``'s media on its training feature again (the prompt's arrays, not copies)."""
    feature = sequence.training_feature
    assert feature is not None and prompt.multimodal is not None
    media = attrs.evolve(feature, multimodal=dict(prompt.multimodal), images=list(prompt.images))
    return attrs.evolve(sequence, training_feature=media)
