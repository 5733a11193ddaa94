"""The tiny Qwen3.5-MoE on vLLM's CPU build: :mod:`test_moe_hybrid`'s own checks, on this family's engine.

Qwen3.5-MoE is the tiny Qwen3.5's Gated DeltaNet layers (their projections
unfused, as in Qwen3.5) with Qwen3-Next's experts (four routed, top two, and
a shared expert in every layer); vLLM serves it as ``Qwen3_5MoeForCausalLM``
in bfloat16, resolved by the engine itself. Here: greedy parity with the torch
engine in bfloat16 under the derived tolerance, and a trainer's 3-D experts
updating what is served (whole, one layer, half a layer refused). The shared
contract and policy suites run on Qwen3-Next's engine only
(:mod:`test_moe_hybrid`): the same mechanisms, and a second run of them would
cost this module's budget several times over.

The experts test runs after the parity test: it ends by pushing the base
model's bfloat16 ``state_dict``, whose ``A_log`` (held by vLLM in float32) is
then the checkpoint's rounded, a few thousandths of a nat away.
"""

from __future__ import annotations

import pytest

from .test_moe_hybrid import (
    hybrid_engine_args,
    hybrid_model,
    served,
    test_it_samples_in_bfloat16_and_matches_the_torch_engine,
    test_the_served_experts_take_a_trainers_fused_tensors,
)

__all__ = [  # test_moe_hybrid's fixtures and checks, collected again on this family
    "hybrid_engine_args",
    "hybrid_model",
    "served",
    "test_it_samples_in_bfloat16_and_matches_the_torch_engine",
    "test_the_served_experts_take_a_trainers_fused_tensors",
]


@pytest.fixture(scope="module")
def family() -> str:
    """The tiny model's family (``build_tiny_model``)."""
    return "qwen3_5_moe"
