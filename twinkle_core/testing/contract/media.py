"""Images in prompts: an engine either samples from the image (its outputs depend on it, every sample carries it
for the trainer) or refuses it by name, before any work; it never samples with the image dropped.

The image cases run where the engine declares ``"image"`` in ``EngineInfo.media`` and are skipped, with the
reason, elsewhere; the refusal runs where it does not. A vision-language engine's test module runs them by
subclassing :class:`MediaContractTests` with its ``sampler`` fixture (they ask nothing else of the model).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.errors import UnsupportedFeatureError
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase, engine_label
from twinkle_core.testing.contract.prompts import greedy_params, traj

__all__ = ["MediaContractTests", "contract_image", "image_prompt"]


def contract_image(seed: int) -> Any:
    """A 64 x 48 RGB image of seeded noise: two seeds give images no processor's resize makes alike."""
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(48, 64, 3), dtype=np.uint8))


def image_prompt(seed: int | None) -> Trajectory:
    """One user turn asking about an image (``seed``'s), or the same text with no image (``None``)."""
    text = "What is in the picture?"
    if seed is None:
        return Trajectory(messages=[{"role": "user", "content": text}])
    return Trajectory(messages=[{"role": "user", "content": "<image>" + text}], images=[contract_image(seed)])


def _takes_images(sampler: Sampler) -> bool:
    return "image" in sampler.engine.info.media


class MediaContractTests(ContractBase):
    """Images in prompts, on an engine that takes them, and the refusal on one that does not."""

    def _needs_images(self, sampler: Sampler) -> None:
        if not _takes_images(sampler):
            label = engine_label(sampler)
            pytest.skip(f"the {label} engine does not declare images (EngineInfo.media): its model takes none")

    def test_an_engine_that_takes_no_images_refuses_one_by_name(self, sampler: Sampler) -> None:
        if _takes_images(sampler):
            pytest.skip(f"the {engine_label(sampler)} engine's model takes images: the image cases apply")
        with pytest.raises(UnsupportedFeatureError, match=r"inputs\[1\] holds an image.*does not pass images"):
            sampler.sample([traj(0), image_prompt(1)], greedy_params(max_tokens=4))

    def test_the_image_decides_the_output(self, sampler: Sampler) -> None:
        """The same text with one image, another, and none: three answers (an engine that ignored the image,
        or sent one prompt's image with another, would give two alike)."""
        self._needs_images(sampler)
        one, other, none = self.greedy_tokens(sampler, [image_prompt(1), image_prompt(2), image_prompt(None)])
        assert one != other and one != none and other != none

    def test_every_sample_of_an_image_prompt_carries_the_image_for_the_trainer(self, sampler: Sampler) -> None:
        """``num_samples`` rows of one image prompt: each training feature holds the prompt's expanded ids and
        the processed image arrays as ``encode`` gives them, and the image itself."""
        self._needs_images(sampler)
        prompt = image_prompt(1)
        feature = sampler.encode(prompt)
        assert feature.multimodal, "an image prompt's feature carries the processed image"
        params = SamplingParams(temperature=1.0, max_tokens=6, num_samples=3, seed=7, ignore_eos=True)
        (response,) = sampler.sample(prompt, params)
        assert len(response.sequences) == 3
        for sequence in response.sequences:
            replay = sequence.training_feature
            assert replay is not None and replay.multimodal is not None
            assert replay.input_ids == [*feature.input_ids, *sequence.tokens]
            assert replay.images is not None and len(replay.images) == 1
            for name, array in feature.multimodal.items():
                if name in ("mm_token_type_ids", "token_type_ids"):  # one per token: zeros over the completion
                    width = len(feature.input_ids)
                    assert np.array_equal(np.asarray(replay.multimodal[name])[..., :width], array), name
                else:
                    assert np.array_equal(np.asarray(replay.multimodal[name]), array), name
