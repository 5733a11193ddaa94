"""LoRA adapters served by vLLM's LoRA kernels: loaded, replaced, removed, replayed after a restart.

The engine holds one :class:`LoraAdapters`. Merging (``merge=True``) is the
core's ``AdapterMerger``; this part gives it what it needs from vLLM: the
unmerged loads and removals, the adapter's tensors checked against the model,
and the base values a merge replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.lora.request import LoRARequest

from twinkle_core.engine import AdapterInput
from twinkle_core.errors import AdapterError, EngineDeadError, UnsupportedFeatureError, WeightUpdateError
from twinkle_vllm._lora import LoraSlots, adapts_lm_head, cpu_tensors, lora_config
from twinkle_vllm._process import EngineProcess
from twinkle_vllm._push import WeightPush
from twinkle_vllm._recovery import EngineRecovery, ReplayStore
from twinkle_vllm._sync import SyncChannel

__all__ = ["LoraAdapters"]


class LoraAdapters:
    """The adapters loaded in vLLM, by name (``slots``), and how each was loaded (in ``replay``).

    Args:
        process: the engine's vLLM processes (facts and worker calls; a restart replaces the engine).
        push: the engine's weight pushes (the model's weight spec, and the base values a push replaced).
        replay: what a restart replays; every load and removal is recorded there.
        channel: the bucket channel in-memory adapters go through (``None`` once closed).
        recovery: the engine's restarts (a removal that fails on a dead engine).
        guard: turns a failed change on a dead engine into ``EngineDeadError`` (the engine's).
    """

    def __init__(
        self,
        process: EngineProcess,
        push: WeightPush,
        replay: ReplayStore,
        channel: Callable[[], SyncChannel | None],
        recovery: EngineRecovery,
        guard: Callable[[str, BaseException], None],
    ) -> None:
        self.slots = LoraSlots()
        self._process = process
        self._push = push
        self._replay = replay
        self._channel = channel
        self._recovery = recovery
        self._guard = guard

    def merge_input(self, adapter: AdapterInput) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        """The config and CPU tensors of an adapter to merge, refused if it does not fit the model."""
        config, tensors = lora_config(adapter), cpu_tensors(adapter)
        self._check(adapter, unmerged=False)
        return config, tensors

    def read_base(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The engine's values of ``names`` and of the rest of their fused layers (none of them is merged).

        A tensor a push replaced is read from its replay copy, which holds what
        the last push sent (cloned: later pushes write over the copies); any
        other from the checkpoint.
        """
        spec = self._push.spec
        wanted = list(dict.fromkeys(member for name in names for member in spec.group_of(name)))
        held, unknown = self._push.held_values(wanted, replaced=self._push.updated)
        if unknown:
            raise AdapterError(
                f"merge=True needs the base values of {sorted(unknown)[:3]}, which update_weights replaced, and this"
                " sampler keeps no copy of them (replay_weights=False). Merge first and update after (the merged"
                " adapter's base values are kept), start the sampler with replay_weights=True, or load the adapter"
                " with merge=False."
            )
        # MergedLoRA keeps these; the replay copies are written over by later pushes.
        return {name: value.clone() if value is self._replay.tensors.get(name) else value for name, value in held}

    def load(self, adapter: AdapterInput) -> str:
        """Load ``adapter`` into vLLM's LoRA slots, or replace the one of that name; returns its source."""
        name = adapter.name
        facts = self._process.facts
        if facts.lora_config is None:
            raise AdapterError(
                f"Cannot load adapter {name!r}: LoRA is off in this engine. Build the sampler with"
                " engine_args={'enable_lora': True, 'max_lora_rank': <your rank>} (and 'max_loras' /"
                " 'max_cpu_loras' for several adapters)."
            )
        old = self.slots.get(name)
        capacity = int(facts.lora_config.max_cpu_loras or facts.lora_config.max_loras)
        if old is None and len(self.slots) >= capacity:
            raise AdapterError(
                f"Cannot load adapter {name!r}: {len(self.slots)} adapter(s) are loaded and the engine holds"
                f" {capacity} (engine option max_cpu_loras). Remove one, or raise max_cpu_loras."
            )
        # A fresh vLLM id on every load: no cache keyed on the old id can serve stale weights.
        lora_id = self.slots.new_id()
        replaces = old.lora_int_id if old is not None else None
        try:
            config, tensors = lora_config(adapter), cpu_tensors(adapter)
            self._check(adapter, unmerged=True)
            if adapter.folder is not None:  # vLLM reads the folder itself
                folder = adapter.folder.resolve()
                how: tuple[Any, ...] = ("folder", str(folder))
                path, source = self._load_folder(name, lora_id, str(folder), replaces), str(folder)
            else:
                # Copies for a restart: the caller's tensors may change in place after this call.
                how = ("memory", config, [(key, t.clone()) for key, t in tensors])
                path, source = self._load_memory(name, lora_id, config, tensors, replaces), adapter.source
        except Exception as exc:
            self._guard(f"add_adapter_to_model({name!r})", exc)
            raise
        self.slots.put(LoRARequest(name, lora_id, path), lm_head=adapts_lm_head(tensors))
        self._replay.record_adapter(name, how)
        return source

    def refuse_prompt_scores(self, what: str) -> None:
        """Refuse ``what`` (it scores prompts) where vLLM's CPU build would die doing so under lm_head LoRA.

        Prompt logits go through the LoRA logits op with one index per request
        of the step for one request's prompt rows; twinkle skips the op while
        no adapter has lm_head LoRA (``_cpu_lora_ops._fix_prompt_logits``), but with
        one loaded the op runs and its worker raises, ending the engine. Any
        call can share a step with another, so none may score prompts then.
        """
        heads = self.slots.lm_head_names()
        if heads and self._process.facts.device_type == "cpu":
            raise UnsupportedFeatureError(
                f"{what} cannot be used while adapter(s) {heads} with lm_head LoRA are"
                " loaded on vLLM's CPU build: its LoRA logits op fails on prompt rows and ends the engine (vLLM"
                " 0.32). Remove them first, load them with merge=True (no LoRA kernels), or score on the torch engine."
            )

    def _check(self, adapter: AdapterInput, *, unmerged: bool) -> None:
        """Refuse an adapter that does not fit the model (vLLM would load it silently), or ``unmerged`` its LoRA."""
        try:
            spec = self._push.spec
        except UnsupportedFeatureError:  # no safetensors checkpoint to read shapes from
            return
        spec.check_lora(adapter, unmerged=unmerged)

    def _load_folder(self, name: str, lora_id: int, folder: str, replaces: int | None) -> str:
        results = self._process.rpc("twinkle_add_lora_folder", lora_id, name, folder, replaces)
        failed = [r for r in results if not r.get("ok")]
        if failed:
            raise AdapterError(f"vLLM could not load adapter {name!r} from {folder}: {failed[0]['error']}")
        return folder

    def _load_memory(
        self,
        name: str,
        lora_id: int,
        config: dict[str, Any],
        tensors: list[tuple[str, torch.Tensor]],
        replaces: int | None,
    ) -> str:
        channel = self._channel()
        assert channel is not None
        try:
            channel.push("lora", tensors, {"lora_id": lora_id, "config": config, "replaces": replaces})
        except WeightUpdateError as exc:
            raise AdapterError(f"Cannot load adapter {name!r}: {exc}") from exc
        return f"twinkle-memory://{name}/{lora_id}"

    def remove(self, name: str) -> None:
        """Unload an adapter served by vLLM's LoRA kernels (harmless if it is not loaded)."""
        request = self.slots.pop(name)
        how = self._replay.adapters.get(name)
        self._replay.record_adapter(name, None)
        if request is None:
            return
        try:
            self._process.rpc("twinkle_remove_lora", request.lora_int_id)
        except Exception as exc:
            generation = self._recovery.generation
            try:
                self._guard(f"remove_adapter({name!r})", exc)
            except EngineDeadError:
                if self._recovery.generation != generation and not self._recovery.engine_dead():
                    return  # restarted without the adapter: the removal holds
                raise
            finally:
                if self._recovery.generation == generation or self._recovery.engine_dead():
                    # Not removed: keep the sampler's tables in step with the engine (and with
                    # the base's adapter table, which keeps the name when this raises).
                    self.slots.put(request)
                    self._replay.record_adapter(name, how)
            raise

    def replay(self, name: str, how: tuple[Any, ...]) -> None:
        """Load ``name`` again, as it was loaded, into a restarted engine (under its vLLM id)."""
        request = self.slots.get(name)
        assert request is not None
        if how[0] == "folder":
            self._load_folder(name, request.lora_int_id, how[1], None)
        else:
            self._load_memory(name, request.lora_int_id, how[1], how[2], None)
