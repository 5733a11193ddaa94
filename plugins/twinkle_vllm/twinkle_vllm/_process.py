"""vLLM's processes: started with the sampler's options, described, watched, and stopped (also on restart).

The engine holds one :class:`EngineProcess` for its life. It owns the private
event-loop thread and, while one runs, vLLM's ``AsyncLLM`` with the processes
behind it: where they bind their sockets, the files they leave behind when
killed, and the reaper that stops them if this process dies. A restart stops
them and boots new ones with the same arguments and environment; what the
sampler reads from a started engine (:class:`EngineFacts`) is read again then.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import attrs
from vllm.v1.engine.async_llm import AsyncLLM

from twinkle_core.errors import ConfigError
from twinkle_vllm._engine_args import environment
from twinkle_vllm._files import PREFIX, remove, session_folder, sweep_stale
from twinkle_vllm._loop import LoopThread
from twinkle_vllm._reaper import Reaper
from twinkle_vllm._reaper import snapshot as process_snapshot

__all__ = ["EngineFacts", "EngineProcess"]

#: How long close() lets vLLM's processes exit on their own before killing them.
#: vLLM's default (5 s) is shorter than a CPU worker takes to exit, which made
#: every close end in a force-kill.
_SHUTDOWN_GRACE_S = 30.0
#: Where vLLM's processes bind their ZMQ sockets (vLLM reads it; the user's setting wins).
_SOCKET_DIR_ENV = "VLLM_RPC_BASE_PATH"


@attrs.frozen
class EngineFacts:
    """What the sampler reads from a started engine's config (again after a restart)."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int
    #: vLLM's LoRA config, ``None`` with LoRA off
    lora_config: Any
    device_type: str
    world_size: int
    #: why a seeded request would kill this engine (``""``: it would not)
    seeds_crash: str
    #: the generation config's end-of-sequence ids (vLLM adds the tokenizer's)
    eos_token_ids: tuple[int, ...] = ()
    #: the model's dtype (a torch.dtype; EngineInfo keeps its name)
    dtype: Any = None

    @classmethod
    def read(cls, config: Any) -> EngineFacts:
        device_type = str(config.device_config.device_type)
        try:
            eos = config.model_config.try_get_generation_config().get("eos_token_id")
        except Exception:  # no generation config: the tokenizer's id only
            eos = None
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(int(t) for t in eos))
        return cls(
            eos_token_ids=eos_ids,
            max_model_len=int(config.model_config.max_model_len),
            vocab_size=int(config.model_config.get_vocab_size()),
            max_logprobs=int(config.model_config.max_logprobs),
            dtype=config.model_config.dtype,
            lora_config=config.lora_config,
            device_type=device_type,
            world_size=int(config.parallel_config.world_size),
            # See platform_defaults(): only a user who turned chunked prefill back on gets here.
            seeds_crash=(
                "on vLLM's CPU backend a seeded request in a chunked prefill kills the engine (vLLM 0.32);"
                " start the sampler without engine_args={'enable_chunked_prefill': True}, or drop the seed."
                if device_type == "cpu" and config.scheduler_config.enable_chunked_prefill
                else ""
            ),
        )


class EngineProcess:
    """One ``AsyncLLM`` at a time on a private loop thread, and what its processes leave to clean up.

    Args:
        engine_args: the ``vllm.AsyncEngineArgs`` every boot starts from (copied: vLLM may fill them in).
        spawn_env: the environment vLLM's processes are spawned with.
        model_dir: the model's folder (named in a start failure).
    """

    #: read from the engine's config by every boot
    facts: EngineFacts

    def __init__(self, engine_args: Any, spawn_env: dict[str, str], model_dir: Path) -> None:
        self.engine: AsyncLLM | None = None
        self.reaper: Reaper | None = None
        #: where this engine's processes bind vLLM's ZMQ sockets (None: the user set VLLM_RPC_BASE_PATH)
        self.socket_dir: str | None = None
        #: files of the engine's that vLLM leaves behind when it is killed (its rendezvous file)
        self.engine_files: list[str] = []
        #: what ``twinkle_describe`` says about every worker
        self.workers: list[Any] = []
        #: the ``vllm.AsyncEngineArgs`` every boot starts from (read only: each boot starts from a copy)
        self.engine_args = engine_args
        self._spawn_env = spawn_env
        self._model_dir = model_dir
        self.loop: LoopThread | None = LoopThread()

    def boot(self) -> None:
        """Start the engine and its reaper; read what the sampler needs from it (also on restart)."""
        assert self.loop is not None
        # Files of samplers whose process was killed before they could remove them.
        sweep_stale()
        before = process_snapshot()
        env = dict(self._spawn_env)
        # (another engine of this process may be starting with its own folder set: not the user's)
        if os.path.basename(os.environ.get(_SOCKET_DIR_ENV, PREFIX)).startswith(PREFIX):
            # vLLM binds its sockets in the temporary folder and leaves them there when it stops;
            # in a folder of ours they go with the engine (and with the reaper's or sweep's cleanup).
            self.socket_dir = env[_SOCKET_DIR_ENV] = session_folder()
        try:
            # A copy: vLLM may fill in the arguments it is given, and a restart needs them as they were.
            with environment(env):
                self.engine = self.loop.run(self._start_engine(copy.deepcopy(self.engine_args)))
        except BaseException:
            self._remove_socket_dir()
            raise
        self.facts = EngineFacts.read(self.engine.vllm_config)
        self.workers = self.rpc("twinkle_describe")
        # Files vLLM removes on a clean shutdown only: ours to remove after a killed engine, the reaper's if we die.
        self.engine_files = sorted({w["rendezvous"] for w in self.workers if w.get("rendezvous")})
        # If this process is killed, the reaper stops the engine's processes and removes their files.
        self.reaper = Reaper.start(before, files=self.engine_files)
        # A second line behind the reaper: the workers stop the engine if this process dies.
        self.rpc("twinkle_watch_driver", os.getpid())

    async def _start_engine(self, args: Any) -> AsyncLLM:
        try:
            return AsyncLLM.from_engine_args(args)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"vLLM could not start an engine for {self._model_dir}: {exc}") from exc

    def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every worker and wait for their answers."""
        assert self.loop is not None and self.engine is not None
        return list(self.loop.run(self.engine.collective_rpc(method, args=args)))

    def errored(self) -> bool:
        """Whether there is no engine, or vLLM marked it dead."""
        return self.engine is None or bool(getattr(self.engine, "errored", False))

    def stop(self) -> None:
        """Stop the engine's processes (a dead engine included), keeping the loop."""
        engine, self.engine = self.engine, None
        loop = self.loop
        if engine is not None and loop is not None and loop.alive:

            async def stop() -> None:
                engine.shutdown(timeout=_SHUTDOWN_GRACE_S)

            try:
                loop.run(stop(), timeout=_SHUTDOWN_GRACE_S + 30)
            except Exception:  # pragma: no cover - best effort
                engine.shutdown(timeout=_SHUTDOWN_GRACE_S)
        elif engine is not None:  # pragma: no cover
            engine.shutdown(timeout=_SHUTDOWN_GRACE_S)
        if self.reaper is not None:
            self.reaper.stop()
            self.reaper = None
        self._remove_socket_dir()
        for path in self.engine_files:
            remove(path, plain_file=True)
        self.engine_files = []

    def stop_loop(self) -> None:
        """Stop the loop thread (after :meth:`stop`): nothing runs on this part again."""
        loop, self.loop = self.loop, None
        if loop is not None:
            loop.stop()

    def _remove_socket_dir(self) -> None:
        folder, self.socket_dir = self.socket_dir, None
        if folder is not None:
            remove(folder)
