"""The structured-outputs example on the tiny model: finished constrained calls are valid; the mask closes the gap."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("twinkle_torch")
pytest.importorskip("xgrammar")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tool_call_schema as example

from twinkle_core.testing import build_tiny_model


def test_schema_constrained_calls_are_valid_and_the_mask_replays_them() -> None:
    results = example.run(str(build_tiny_model("llama")), samples=2, max_tokens=40)
    free, schema = results["free"], results["schema"]
    # every finished constrained completion is a valid call (the tiny model often runs out of tokens first)
    assert schema["valid_calls"] == schema["finished"]
    assert schema["valid_calls"] >= free["valid_calls"]
    # unconstrained at temperature 1 the sampler's distribution is the full softmax: no gap either way
    assert free["mismatch_full_vocab"] < 1e-5 and free["mismatch_with_mask"] < 1e-5
    # constrained, the full vocabulary is off by the forbidden mass; over the mask it is rounding
    assert schema["mismatch_full_vocab"] > 1e-3 and schema["mismatch_with_mask"] < 1e-5


def test_the_checker_knows_a_call() -> None:
    assert example.is_valid_call('{"name": "multiply", "arguments": {"a": 2, "b": 3}}')
    assert not example.is_valid_call('{"name": "multiply", "arguments": {"a": 2}}')
    assert not example.is_valid_call('{"name": "add", "arguments": {"a": 2, "b": 3}}')
    assert not example.is_valid_call("multiply(2, 3)")
