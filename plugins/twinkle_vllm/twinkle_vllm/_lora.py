"""LoRA on vLLM: the adapters in the engine's LoRA slots, and an adapter's input as vLLM takes it.

Adapters are read and checked by the core (``twinkle_core.engine.AdapterInput``);
this module holds what is vLLM's own: the slot table (a fresh vLLM id on every
load, so no cache keyed on an old id can serve a replaced adapter) and the
config and tensors in the form the worker extension loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from vllm.lora.request import LoRARequest

from twinkle_core.engine import AdapterInput
from twinkle_core.errors import AdapterError

__all__ = ["LoraSlots", "adapts_lm_head", "cpu_tensors", "lora_config"]


class LoraSlots:
    """The adapters loaded into vLLM's LoRA slots, by name, and which of them adapt ``lm_head``."""

    def __init__(self) -> None:
        self._requests: dict[str, LoRARequest] = {}
        # A name counts while it has a request: a failed removal puts the request back with its flag.
        self._lm_head: set[str] = set()
        self._next_id = 1

    def new_id(self) -> int:
        """A vLLM adapter id never used before in this engine."""
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return lora_id

    def get(self, name: str) -> LoRARequest | None:
        return self._requests.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._requests))

    def put(self, request: LoRARequest, *, lm_head: bool | None = None) -> None:
        """Record ``request`` under its name; ``lm_head``: whether it adapts ``lm_head`` (``None``: as before)."""
        self._requests[request.lora_name] = request
        if lm_head is True:
            self._lm_head.add(request.lora_name)
        elif lm_head is False:
            self._lm_head.discard(request.lora_name)

    def pop(self, name: str) -> LoRARequest | None:
        return self._requests.pop(name, None)

    def lm_head_names(self) -> list[str]:
        """The loaded adapters with ``lm_head`` LoRA, sorted."""
        return sorted(name for name in self._lm_head if name in self._requests)


def lora_config(adapter: AdapterInput) -> dict[str, Any]:
    """The adapter's config, with the keys vLLM's LoRA loader needs (PEFT defaults would hide a typo)."""
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in adapter.config:
            raise AdapterError(f"Adapter {adapter.name!r}: the LoRA config has no {key!r}.")
    return adapter.config


def cpu_tensors(adapter: AdapterInput) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors on the CPU, contiguous (what the engine's channel sends)."""
    return [(key, t.to("cpu").contiguous()) for key, t in adapter.tensors]


def adapts_lm_head(tensors: list[tuple[str, Any]]) -> bool:
    """Whether any of the (PEFT name, tensor) pairs adapts ``lm_head``."""
    return any(".lm_head." in f".{key}" for key, _ in tensors)
