"""Entry point of the ``vllm`` engine: registers a string, imports nothing heavy."""

from __future__ import annotations

from twinkle_core.plugins import hookimpl


@hookimpl
def register_samplers(register):  # type: ignore[no-untyped-def]
    """Register ``vllm`` -> :class:`twinkle_vllm.sampler.vLLMSampler`."""
    register("vllm", "twinkle_vllm.sampler:vLLMSampler", requires=["vllm"])
