"""``SampledSequence.routed_experts``: a compact integer array that survives dicts, JSON and pickling (Ray)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from twinkle_core.data_format import SampledSequence, SamplingParams
from twinkle_core.data_format.routes import decode_routes, routes_dtype
from twinkle_core.errors import InvalidInputError, InvalidSamplingParams


def _seq(routes: object) -> SampledSequence:
    return SampledSequence(tokens=[4, 5], text="ab", routed_experts=routes)


def test_routes_round_trip_through_json_and_pickle() -> None:
    routes = np.random.default_rng(0).integers(0, 300, size=(6, 3, 2)).astype(routes_dtype(300))
    seq = _seq(routes)
    text = json.dumps(seq.to_dict())  # JSON-safe as it is: base64 .npy, as vLLM's server sends it
    again = SampledSequence.from_dict(json.loads(text))
    assert again.routed_experts.dtype == np.uint16 and again == seq
    np.testing.assert_array_equal(decode_routes(seq.to_dict()["routed_experts"]), routes)
    assert pickle.loads(pickle.dumps(seq)) == seq  # what a Ray replica sends back
    assert _seq(routes[:, :1]) != seq


def test_bad_routes_are_refused_by_name() -> None:
    for bad in ([[1, 2]], np.zeros((2, 2, 2), dtype=np.float32), "not base64 at all!"):
        with pytest.raises(InvalidInputError, match="routed_experts"):
            _seq(bad)
    with pytest.raises(InvalidSamplingParams, match="return_routed_experts"):
        SamplingParams(return_routed_experts="yes")  # type: ignore[arg-type]


def test_trl_generation_kwargs_ask_for_routes() -> None:
    from types import SimpleNamespace

    from twinkle_core.integrations.trl import trl_sampling_params

    args = SimpleNamespace(
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, max_completion_length=8,
        generation_kwargs={"return_routed_experts": True},
    )  # fmt: skip
    assert trl_sampling_params(args).return_routed_experts is True
