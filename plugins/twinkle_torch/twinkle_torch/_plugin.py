"""Entry point of the ``torch`` engine: registers a string, imports nothing heavy."""

from __future__ import annotations

from twinkle_core.plugins import hookimpl


@hookimpl
def register_samplers(register):  # type: ignore[no-untyped-def]
    """Register ``torch`` -> :class:`twinkle_torch.sampler.TorchSampler`."""
    register("torch", "twinkle_torch.sampler:TorchSampler", requires=["torch", "transformers", "peft"])
