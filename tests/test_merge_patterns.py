"""PEFT's per-module patterns, read the way PEFT reads them (twinkle_core.adapter_input.peft_pattern_value)."""

from __future__ import annotations

import pytest

from twinkle_core.adapter_input import peft_pattern_value

MODULE = "model.layers.10.self_attn.v_proj"


@pytest.mark.parametrize(
    ("patterns", "expected"),
    [
        ({}, 8),
        (None, 8),
        ({"v_proj": 2}, 2),
        ({"self_attn.v_proj": 2}, 2),
        ({"proj": 2}, 8),  # a key matches whole dotted parts, not the end of one
        ({"q_proj|v_proj": 2}, 2),  # an alternation covers both modules
        ({r"layers\.1\..*": 3}, 8),  # layer 1, not layer 10
        ({r"layers\.10\..*": 3, "v_proj": 2}, 3),  # the first matching key wins
    ],
)
def test_pattern_keys_match_the_end_of_the_module_name(patterns: dict[str, int] | None, expected: int) -> None:
    assert peft_pattern_value(patterns, MODULE, 8) == expected
