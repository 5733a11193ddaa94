"""twinkle engine on vLLM.

``import twinkle_vllm`` is cheap: :class:`vLLMSampler` (and with it vLLM and
torch) is imported on first use of the name, and so are :class:`vLLMEngine`
(the engine it holds, ``twinkle_core.engine``'s contract) and :class:`ReplayStore`
(what a restarted engine is brought back to; see ``vLLMSampler(replay_store=)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["IPC_TIMEOUT_ENV", "ReplayStore", "vLLMEngine", "vLLMSampler"]

#: The per-message timeout of the weight-sync channel, in seconds (default 300).
IPC_TIMEOUT_ENV = "TWINKLE_VLLM_IPC_TIMEOUT_S"

if TYPE_CHECKING:  # pragma: no cover
    from twinkle_vllm._recovery import ReplayStore
    from twinkle_vllm.engine import vLLMEngine
    from twinkle_vllm.sampler import vLLMSampler


def __getattr__(name: str) -> Any:
    if name == "vLLMSampler":
        from twinkle_vllm.sampler import vLLMSampler

        return vLLMSampler
    if name == "vLLMEngine":
        from twinkle_vllm.engine import vLLMEngine

        return vLLMEngine
    if name == "ReplayStore":
        from twinkle_vllm._recovery import ReplayStore

        return ReplayStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
