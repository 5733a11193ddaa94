"""Test support shared by every engine: the conformance suite and the tiny model.

Importing this package does not import pytest or torch; the names load on use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from twinkle_core.testing.contract import CONTRACT_PROMPTS, SamplerContractTests
    from twinkle_core.testing.policy import PolicyContractTests
    from twinkle_core.testing.tiny_model import TINY_CHAT_PROMPTS, build_tiny_model

__all__ = ["CONTRACT_PROMPTS", "TINY_CHAT_PROMPTS", "PolicyContractTests", "SamplerContractTests", "build_tiny_model"]


def __getattr__(name: str) -> Any:
    if name in ("SamplerContractTests", "CONTRACT_PROMPTS"):
        from twinkle_core.testing import contract

        return getattr(contract, name)
    if name == "PolicyContractTests":
        from twinkle_core.testing import policy

        return policy.PolicyContractTests
    if name in ("build_tiny_model", "TINY_CHAT_PROMPTS"):
        from twinkle_core.testing import tiny_model

        return getattr(tiny_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
