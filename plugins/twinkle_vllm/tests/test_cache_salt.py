"""The prefix cache is keyed by weights version and adapter: hits within a version, none across.

Observed through vLLM's own ``RequestOutput.num_cached_tokens`` (the prompt
tokens served from the prefix cache), recorded around the one coroutine that
talks to vLLM (``RunRequests.request``, the engine's request path).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from twinkle_core.data_format import InputFeature, SamplingParams
from twinkle_core.errors import WeightUpdateError

from .conftest import TEST_ENGINE_ARGS

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def _recording_sampler(model: Path) -> Any:
    from twinkle_core import Sampler
    from twinkle_vllm.engine import vLLMEngine

    s = Sampler(vLLMEngine, model, engine_args=dict(TEST_ENGINE_ARGS))
    cached: list[int] = []
    requests = s.engine._requests
    send = requests.request

    async def recording(*args: Any, **kwargs: Any) -> Any:
        out = await send(*args, **kwargs)
        cached.append(int(out.num_cached_tokens or 0))
        return out

    requests.request = recording
    s.engine.cached = cached
    return s


@pytest.fixture(scope="module")
def sampler(tiny_model: Path) -> Iterator[Any]:
    with _recording_sampler(tiny_model) as s:
        yield s


@pytest.fixture(scope="module")
def original(tiny_model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(tiny_model / "model.safetensors"))


def _cached(sampler: Any, prompt: InputFeature) -> int:
    sampler.engine.cached.clear()
    sampler.sample(prompt, ONE_TOKEN)
    (n,) = sampler.engine.cached
    return n


def _prompt(seed: int) -> InputFeature:
    # long enough to span several KV blocks; distinct per test so tests do not share cache entries
    gen = torch.Generator().manual_seed(seed)
    return InputFeature(input_ids=torch.randint(10, 700, (300,), generator=gen).tolist())


def test_a_prompt_is_prefilled_once_within_a_version(sampler: Any) -> None:
    prompt = _prompt(1)
    assert _cached(sampler, prompt) == 0
    assert _cached(sampler, prompt) > 0


def test_no_hit_across_a_weight_update_even_with_identical_weights(
    sampler: Any, original: dict[str, torch.Tensor]
) -> None:
    prompt = _prompt(2)
    _cached(sampler, prompt)
    assert _cached(sampler, prompt) > 0
    # the same values under a new version: the cache cannot know they are equal, so it must not reuse
    sampler.update_weights(original)
    assert _cached(sampler, prompt) == 0
    assert _cached(sampler, prompt) > 0  # and the new version caches again


def test_a_rejected_update_keeps_the_cache(sampler: Any, original: dict[str, torch.Tensor]) -> None:
    prompt = _prompt(3)
    _cached(sampler, prompt)
    name = next(iter(original))
    with pytest.raises(WeightUpdateError):
        sampler.update_weights([(name, torch.zeros(3))])  # refused before anything is sent
    assert _cached(sampler, prompt) > 0
