"""An episode over a Ray ``remote_group`` sampler: it is just another Sampler."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("twinkle_torch")

import twinkle_core as tw
from twinkle_core import DeviceGroup, DeviceMesh, SamplingParams
from twinkle_core.episode import Episode
from twinkle_core.testing import build_tiny_model
from twinkle_core.testing.tiny_model import TINY_WEATHER_TOOL as WEATHER


def test_episode_through_ray_matches_local() -> None:
    from twinkle_torch.sampler import TorchSampler

    model = str(build_tiny_model("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=48)
    opening: dict[str, Any] = {
        "messages": [{"role": "user", "content": "What is the weather in Cairo?"}],
        "tools": [WEATHER],
    }
    episodes = []
    tw.initialize("ray", groups=[DeviceGroup(name="episode", ranks=1, device_type="cpu")], num_cpus=2)
    try:
        with (
            tw.create_sampler(
                "torch", model_id=model, device_mesh=DeviceMesh.from_sizes(dp_size=1), remote_group="episode"
            ) as remote,
            TorchSampler(model) as local,
        ):
            for sampler in (remote, local):
                ep = Episode(sampler, opening)
                ep.sample(sampler, params)
                ep.add_tool_result("30 degrees and sunny")
                ep.sample(sampler, params)
                episodes.append(ep)
    finally:
        tw.shutdown()
    remote_ep, local_ep = episodes
    # a real tool loop (a call, then its result) whichever city the tiny model names; equal to the local one
    assert remote_ep.turns[0].tool_calls and len(remote_ep.turns) == 2
    assert remote_ep.turns[0].tool_calls[0]["function"] == local_ep.turns[0].tool_calls[0]["function"]
    assert remote_ep.tokens == local_ep.tokens and remote_ep.loss_mask == local_ep.loss_mask
    assert remote_ep.logprobs == pytest.approx(local_ep.logprobs, abs=1e-4)
