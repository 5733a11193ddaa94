"""twinkle's vLLM worker extension: weight sync, in-memory LoRA, a debug hook (CPU LoRA ops: ``_cpu_lora_ops``).

vLLM mixes this class into its worker class (``worker_extension_cls``); the
sampler calls its methods with ``collective_rpc``, so each runs once in every
worker process (every tensor-parallel rank), between engine steps.

Base weights are applied with vLLM's layerwise reload (the path behind its own
``reload_weights``): each layer is rebuilt from checkpoint-format tensors and
re-processed (CPU GEMM repacking, online quantization), so an update works on
every platform, not just where parameters are plain tensors.
"""

from __future__ import annotations

import os
import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import zmq

from twinkle_vllm._cpu_lora_ops import install as install_cpu_lora_ops
from twinkle_vllm._wire import (
    CANCEL_FILE,
    POLL_S,
    Item,
    StagingBuffer,
    dtype_from_str,
    open_buffer,
    socket_address,
)

__all__ = ["TwinkleWorkerExtension"]


class _SessionGone(Exception):
    """The driver cancelled the session or stopped talking."""


class _Channel:
    """The worker end of one session: a REP socket and the staging buffer."""

    def __init__(self, session: dict[str, Any], rank: int, buffer: StagingBuffer) -> None:
        self.folder = session["folder"]
        self.timeout_s = float(session["timeout_s"])
        self.buffer = buffer
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(socket_address(self.folder, rank))
        self.owes_reply = False
        #: Views of the slot still held after their bucket, in buckets whose slot is not refilled.
        self._in_slot: list[weakref.ref[torch.Tensor]] = []
        #: Seconds spent per phase (reported to the driver for diagnostics).
        self.timings: dict[str, float] = {"wait": 0.0, "checksum": 0.0, "copy": 0.0, "apply": 0.0, "finalize": 0.0}

    def cancelled(self) -> bool:
        return not os.path.isdir(self.folder) or os.path.exists(os.path.join(self.folder, CANCEL_FILE))

    def recv(self) -> dict[str, Any]:
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.sock.poll(round(POLL_S * 1000)):  # whole milliseconds
                message: dict[str, Any] = self.sock.recv_pyobj()
                self.owes_reply = True
                self.timings["wait"] += time.perf_counter() - started
                return message
            if self.cancelled() or time.monotonic() > deadline:
                raise _SessionGone

    def reply(self, **fields: Any) -> None:
        if self.owes_reply:
            self.sock.send_pyobj(fields)
            self.owes_reply = False

    def sleep(self, seconds: float) -> None:
        """Stall (debug hook) without ignoring a reset: a cancelled session ends the stall."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.cancelled():
                raise _SessionGone
            time.sleep(min(POLL_S, max(end - time.monotonic(), 0)))

    def keep_views(self, views: list[weakref.ref[torch.Tensor]], *, slot_refilled: bool) -> None:
        """Views of the slot a consumer still holds after their bucket: copy them out if the slot is refilled.

        The driver refills a slot two buckets later; in the last two buckets of
        a session it never does, so what is held there (a layer finished only
        at commit, the consumer's loop variable) is read in place until
        :meth:`release_views`.
        """
        for ref in views:
            held = ref()
            if held is None:
                continue
            if slot_refilled:
                held.data = held.clone()
            else:
                self._in_slot.append(ref)
            held = None

    def release_views(self) -> None:
        """Copy out whatever still holds the slot at the end of a session (the next one refills it)."""
        views, self._in_slot = self._in_slot, []
        self.keep_views(views, slot_refilled=True)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()


def _packed_slices(model: Any, packed: dict[str, Any]) -> dict[str, int]:
    """Each fused layer's count of output slices, where it differs from its count of checkpoint modules.

    Qwen3.5's ``in_proj_qkvz`` fuses two modules (``in_proj_qkv``, ``in_proj_z``) into four slices (q, k, v,
    z): vLLM's LoRA loader splits a member's adapter over the slices it covers, which constrains what an
    adapter may leave out (:meth:`twinkle_vllm._weights.WeightSpec.check_lora`).
    """
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        fused = name.rpartition(".")[2]
        if fused not in packed or fused in out:
            continue
        sizes = getattr(module, "output_sizes", None) or getattr(
            getattr(module, "base_layer", None), "output_sizes", None
        )
        if sizes is not None and len(sizes) != len(packed[fused]):
            out[fused] = len(sizes)
    return out


class TwinkleWorkerExtension:
    """Methods twinkle calls on every vLLM worker (through ``collective_rpc``)."""

    # Set by twinkle_debug_stall_next_sync: seconds to stall before answering the first bucket.
    _twinkle_stall_s: float = 0.0
    _twinkle_stall_at: int = 0
    # The driver's staging buffer, mapped once and kept (the driver reuses it too).
    _twinkle_buffer: StagingBuffer | None = None
    _twinkle_buffer_key: str = ""

    # -- description ----------------------------------------------------------------------
    def twinkle_describe(self) -> dict[str, Any]:
        """What the driver needs to validate updates (fused-module names, dtype, rank) and to clean up after the engine.

        Called once right after the engine starts, before any request; it also
        installs the CPU LoRA ops (see :func:`twinkle_vllm._cpu_lora_ops.install`).
        """
        lora_ops = install_cpu_lora_ops()
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        slices = _packed_slices(model, packed)
        lora_manager = getattr(self.model_runner, "lora_manager", None)  # type: ignore[attr-defined]
        # A file:// rendezvous is a file vLLM leaves behind when the engine is killed: the driver removes it then.
        init = str(getattr(self, "distributed_init_method", "") or "")
        return {
            "rendezvous": init.removeprefix("file://") if init.startswith("file://") else None,
            "rank": int(self.rank),  # type: ignore[attr-defined]
            "device": str(self.device),  # type: ignore[attr-defined]
            "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),  # type: ignore[attr-defined]
            "packed_modules_mapping": {k: list(v) for k, v in packed.items()},
            "packed_slices": slices,
            "lora": lora_manager is not None,
            "cpu_lora_ops": lora_ops,
        }

    def twinkle_watch_driver(self, driver_pid: int) -> bool:
        """Stop this engine if the driver process dies (see :func:`twinkle_vllm._reaper.watch_driver`)."""
        from twinkle_vllm._reaper import watch_driver

        return watch_driver(int(driver_pid))

    def twinkle_debug_stall_next_sync(self, seconds: float, at_bucket: int = 0) -> bool:
        """Test hook: make the next sync stall ``seconds`` before bucket ``at_bucket`` (0: the first, -1: the last).

        The stall is real (the worker does not answer), but it ends early when the
        driver resets the channel, like a slow worker that still honours a reset.
        The buckets before ``at_bucket`` are applied as usual.
        """
        self._twinkle_stall_s = float(seconds)
        self._twinkle_stall_at = int(at_bucket)
        return True

    # -- sessions -------------------------------------------------------------------------
    def twinkle_sync(self, session: dict[str, Any]) -> dict[str, Any]:
        """Take part in one sync session; return ``{"ok": ...}`` (never raises)."""
        folder = session["folder"]
        if not os.path.isdir(folder) or os.path.exists(os.path.join(folder, CANCEL_FILE)):
            return {"ok": False, "error": "the session was cancelled before this worker joined"}
        try:
            channel = _Channel(session, int(self.rank), self._twinkle_staging(session["buffer"]))  # type: ignore[attr-defined]
        except Exception as exc:
            return {"ok": False, "error": f"could not open the channel: {exc!r}"}
        try:
            kind = session["kind"]
            if kind == "weights":
                count = self._twinkle_receive_weights(channel)
            elif kind == "lora":
                count = self._twinkle_receive_lora(channel, session["extra"])
            else:
                raise ValueError(f"unknown session kind {kind!r}")
            return {"ok": True, "tensors": count, "timings": channel.timings}
        except _SessionGone:
            return {"ok": False, "error": "the driver cancelled the session or stopped answering"}
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            try:
                channel.reply(ok=False, error=error)
            except Exception:
                pass
            return {"ok": False, "error": error, "traceback": traceback.format_exc()}
        finally:
            self._twinkle_stall_s = 0.0
            channel.release_views()
            channel.close()

    def _twinkle_staging(self, description: dict[str, Any]) -> StagingBuffer:
        key = repr(sorted((k, v) for k, v in description.items() if k != "handle"))
        if description.get("handle") is not None:
            key += str(hash(description["handle"]))
        if self._twinkle_buffer is None or self._twinkle_buffer_key != key:
            if self._twinkle_buffer is not None:
                self._twinkle_buffer.close()
            self._twinkle_buffer = open_buffer(description)
            self._twinkle_buffer_key = key
        return self._twinkle_buffer

    def _twinkle_stream(
        self, channel: _Channel, device: torch.device | None, *, keep: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the session's tensors in order, verifying and answering each bucket.

        A bucket is answered once all its tensors have been consumed and the
        next one is requested, so the driver never refills a slot a reader
        still uses. On a CPU worker the tensors are views of the slot, not
        copies: loading copies them into the model anyway. A layer whose
        processing is deferred (padded vocabularies, attention) keeps its
        tensors past the bucket; those, and only those, are moved out of the
        slot before answering. With ``keep`` (or a GPU worker) every tensor is
        copied out at once.

        Args:
            channel: the session.
            device: copy tensors to this device (``None``: a CPU worker).
            keep: the caller keeps the tensors (LoRA): always copy.
        """
        partial: dict[str, tuple[torch.Tensor, int]] = {}
        while True:
            message = channel.recv()
            op = message["op"]
            if op == "hello":
                channel.reply(ok=True)
                continue
            if op == "commit":
                if partial:
                    raise ValueError(f"commit with incomplete tensors: {sorted(partial)}")
                return  # answered by the caller, after finalising
            if op != "bucket":
                raise ValueError(f"unexpected message {op!r}")
            stall_at = self._twinkle_stall_at + (message["count"] if self._twinkle_stall_at < 0 else 0)
            if self._twinkle_stall_s and message["index"] >= stall_at:
                stall, self._twinkle_stall_s = self._twinkle_stall_s, 0.0
                channel.sleep(stall)
            base, nbytes = message["offset"], message["nbytes"]
            clock = time.perf_counter()
            got = channel.buffer.checksum(base, nbytes)
            channel.timings["checksum"] += time.perf_counter() - clock
            if got != message["checksum"]:
                raise ValueError(
                    f"checksum mismatch in bucket {message['index'] + 1}/{message['count']}:"
                    f" expected {message['checksum']:#x}, got {got:#x}"
                )
            clock = time.perf_counter()
            ready: list[tuple[str, torch.Tensor]] = []
            views: list[weakref.ref[torch.Tensor]] = []
            piece = data = tensor = staged = None
            item: Item
            for item in message["items"]:
                piece = channel.buffer.view(base + item.offset, item.nbytes)
                if item.whole:
                    if device is not None:
                        data = piece.to(device, copy=True)
                    elif keep:
                        data = piece.clone()
                    else:
                        data = piece
                    tensor = data.view(dtype_from_str(item.dtype)).view(item.shape)
                    if data is piece:
                        views.append(weakref.ref(tensor))
                    ready.append((item.name, tensor))
                    continue
                staged, filled = partial.get(item.name, (None, 0))
                if staged is None:
                    staged = torch.empty(item.total, dtype=torch.uint8, device=device or piece.device)
                staged[item.start : item.start + item.nbytes].copy_(piece)
                filled += item.nbytes
                if filled >= item.total:
                    partial.pop(item.name, None)
                    ready.append((item.name, staged.view(dtype_from_str(item.dtype)).view(item.shape)))
                else:
                    partial[item.name] = (staged, filled)
            # Drop this frame's own references, so only the consumer's are left below.
            piece = data = tensor = staged = None
            channel.timings["copy"] += time.perf_counter() - clock
            clock = time.perf_counter()
            yield from ready
            del ready
            # Whatever still holds a view of the slot (a deferred layer; the consumer's
            # loop variable) gets its own copy before the slot can be refilled.
            channel.keep_views(views, slot_refilled=message["index"] + 2 < message["count"])
            if channel.buffer.tensor.is_cuda or (device is not None and device.type == "cuda"):
                # GPU copies are asynchronous: they must have read the slot before we release it.
                torch.cuda.synchronize()
            channel.timings["apply"] += time.perf_counter() - clock
            channel.reply(ok=True)

    def _twinkle_receive_weights(self, channel: _Channel) -> int:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        # A GPU worker copies each tensor straight to its own device (it never keeps
        # data on the driver's GPU); a CPU worker reads them in place (see _twinkle_stream).
        device = torch.device(self.device)  # type: ignore[attr-defined]
        target = None if device.type == "cpu" else device
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in self._twinkle_stream(channel, target):
                count += 1
                yield name, tensor

        with set_current_vllm_config(self.vllm_config), torch.no_grad(), _repacking_cpu_experts(model):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)
            try:
                model.load_weights(counted())
            except BaseException:
                # Layers only partly received must not be rebuilt from half-filled
                # buffers: forget their pending loads so they keep their old tensors.
                _forget_partial_loads(model)
                raise
            finally:
                clock = time.perf_counter()
                finalize_layerwise_reload(model, runner.model_config)
                channel.release_views()
                channel.timings["finalize"] += time.perf_counter() - clock
        channel.reply(ok=True, tensors=count)
        return count

    # -- LoRA -----------------------------------------------------------------------------
    def _twinkle_receive_lora(self, channel: _Channel, extra: dict[str, Any]) -> int:
        tensors = dict(self._twinkle_stream(channel, None, keep=True))
        lora = self._twinkle_build_lora(int(extra["lora_id"]), dict(extra["config"]), tensors)
        self._twinkle_install_lora(lora, extra.get("replaces"))
        channel.reply(ok=True, tensors=len(tensors))
        return len(tensors)

    def twinkle_add_lora_folder(self, lora_id: int, name: str, path: str, replaces: int | None) -> dict[str, Any]:
        """Load a PEFT folder as adapter ``lora_id`` (replacing ``replaces``) and pin it."""
        from vllm.lora.request import LoRARequest

        try:
            manager = self._twinkle_lora_manager()
            lora = manager._load_adapter(LoRARequest(name, lora_id, path))
            self._twinkle_install_lora(lora, replaces)
            return {"ok": True}
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def twinkle_remove_lora(self, lora_id: int) -> bool:
        """Unpin and drop adapter ``lora_id``."""
        return bool(self._twinkle_lora_manager().remove_adapter(lora_id))

    def _twinkle_lora_manager(self) -> Any:
        manager = getattr(self.model_runner, "lora_manager", None)  # type: ignore[attr-defined]
        if manager is None:
            raise RuntimeError("LoRA is not enabled in this engine (engine option enable_lora=True)")
        return manager

    def _twinkle_build_lora(self, lora_id: int, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

        manager = self._twinkle_lora_manager()
        adapter_manager = manager._adapter_manager
        config = dict(config)
        config["vllm_max_position_embeddings"] = manager.max_position_embeddings
        helper = PEFTHelper.from_dict(config)
        helper.validate_legal(manager.lora_config)
        model = adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapper = mapper.get_rename_mapper()
        # The modules this model can put LoRA on, fused names expanded to their parts.
        expected: set[str] = set()
        for module in adapter_manager.supported_lora_modules:
            expected.update(adapter_manager.packed_modules_mapping.get(module, [module]))
        allowed = expected | set(helper.modules_to_save or ())
        unexpected = sorted(
            {
                module
                for name in tensors
                if not is_base_embedding_weights(name)
                for module in [parse_fine_tuned_lora_name(name, mapper)[0]]
                if module.rsplit(".", 1)[-1] not in allowed and ".experts" not in module
            }
        )
        if unexpected:
            raise ValueError(
                f"the adapter has weights for modules {unexpected}; this model supports LoRA on {sorted(expected)}"
            )
        return LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )

    def _twinkle_install_lora(self, lora: Any, replaces: int | None) -> None:
        """Register a built adapter, dropping the one it replaces, and pin it in the CPU cache.

        Pinned, vLLM never evicts it, so it never tries to reload it from a path
        (in-memory adapters have none). Only the CPU cache is pinned: device
        slots stay shared by LRU among the adapters a batch uses.
        """
        manager = self._twinkle_lora_manager()
        adapter_manager = manager._adapter_manager
        registered = adapter_manager._registered_adapters
        if replaces is not None and replaces in manager.list_adapters():
            manager.remove_adapter(replaces)  # vLLM's cache unpins what it deletes
        if len(adapter_manager) >= adapter_manager.capacity:
            raise RuntimeError(f"all {adapter_manager.capacity} adapter slots are taken (engine option max_cpu_loras)")
        adapter_manager.add_adapter(lora)
        registered.pin(lora.id)


def _forget_partial_loads(model: torch.nn.Module) -> None:
    """Drop buffered loads of layers that did not receive all their tensors."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - vLLM moved it
        return
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        total = info.load_numel_total or 0
        if 0 < info.load_numel < total:
            info.loaded_weights = []
            info.load_numel = 0


@contextmanager
def _repacking_cpu_experts(model: torch.nn.Module) -> Iterator[None]:
    """While weights reload, lay each reloaded CPU experts layer out as its kernel reads it (vLLM 0.32 does so
    only at the first load).

    vLLM's CPU experts kernel reads ``w13_weight`` / ``w2_weight`` padded and prepacked into its grouped-GEMM
    layout, done once after the checkpoint loads. A reload's post-processing takes itself for a weight update
    and skips that step, and the reload copies the checkpoint's plain layout into the prepacked tensors: the
    engine then computed every expert from misplaced values (pushing a model's own experts back moved its
    log-probs by 0.12 nats). Here each such layer's post-processing is followed by the kernel's own layout
    step, before the reload copies the result into the tensors the engine runs.
    """
    wrapped: list[Any] = []
    for layer in model.modules():
        method: Any = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or not type(experts).__module__.endswith(".cpu_moe"):
            continue
        if "process_weights_after_loading" in vars(method):
            continue  # already wrapped (a layer sharing its method)

        def process(
            target: torch.nn.Module, _original: Any = method.process_weights_after_loading, _experts: Any = experts
        ) -> None:
            _original(target)
            _experts.process_weights_after_loading(target)

        method.process_weights_after_loading = process
        wrapped.append(method)
    try:
        yield
    finally:
        for method in wrapped:
            del method.process_weights_after_loading
