"""vLLM's weight-transfer routes on ``twinkle serve``: a trainer in another process pushes weights in.

Enabled by ``--weight-transfer-config '{"backend": "gloo"}'`` (``serve(...,
weight_transfer={"backend": "gloo"})``); without it the routes answer 400
saying so, and ``/server_info`` reports ``weight_transfer_config: null``, as
vLLM's server does. The routes and bodies are vLLM's:

* ``POST /init_weight_transfer_engine {"init_info": {"master_address",
  "master_port", "rank_offset", "world_size"}}``: the server joins the
  trainer's group (the trainer is rank 0 and serves the TCP store there) as
  rank ``rank_offset``; it returns once both are in. ``/get_world_size`` is
  1 here: the server process is one rank, whatever its replicas.
* ``POST /start_weight_update``: a new update begins (anything staged is dropped).
* ``POST /update_weights {"update_info": {"names", "dtype_names",
  "shapes"}}``: the server receives those tensors, in that order, each a
  broadcast from rank 0, then one more int64 tensor holding their checksums
  (:func:`~twinkle_core.weights.block_checksum`, as signed 64-bit); it stages them.
  Tensors declared larger in all than the memory the machine has free are
  refused (a 400) before anything is allocated.
* ``POST /finish_weight_update {"weight_version": ...}``: the staged tensors
  go to ``Sampler.update_weights`` at once (validated, all or nothing; the
  version the optional ``weight_version`` names, else the next); the reply
  carries the new ``weights_version``.
* ``POST /shutdown_weight_transfer_engine``: leave the group.

:class:`twinkle_core.client.WeightClient` is the trainer's side. The
``gloo`` backend moves CPU tensors and is what CI runs; ``nccl`` (vLLM's
packed broadcast, which TRL's ``VLLMClient`` speaks) is refused with a
message until it is built and verified on GPUs.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

from fastapi import Body, FastAPI

from twinkle_core.errors import ConfigError
from twinkle_core.server.protocol import ApiError
from twinkle_core.server.state import ServerState
from twinkle_core.weights import TRANSFER_DTYPES

__all__ = ["BACKENDS", "add_weight_routes", "check_config"]

#: The backends ``--weight-transfer-config`` accepts on this server.
BACKENDS = ("gloo",)


def check_config(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The server's weight-transfer config, checked (``None``: the routes are off).

    Raises:
        ConfigError: an unknown backend or key, naming what is accepted.
    """
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise ConfigError(f"weight_transfer={config!r} is invalid: expected a mapping like {{'backend': 'gloo'}}.")
    unknown = sorted(set(config) - {"backend", "timeout_s"})
    if unknown:
        raise ConfigError(f"weight_transfer has unknown keys {unknown}: accepted are 'backend' and 'timeout_s'.")
    backend = config.get("backend", "gloo")
    if backend not in BACKENDS:
        raise ConfigError(
            f"weight_transfer backend {backend!r} is not supported by twinkle serve yet: accepted are"
            f" {', '.join(BACKENDS)} (nccl, vLLM's packed broadcast, is not built yet)."
        )
    timeout = config.get("timeout_s", 300)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"weight_transfer timeout_s={timeout!r} is invalid: expected seconds > 0.")
    return {"backend": backend, "timeout_s": float(timeout)}


class _Transfer:
    """The server's side of one trainer's group, and the update being staged."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.group: Any = None
        self.store: Any = None
        self.staged: list[tuple[str, Any]] | None = None
        self.lock = threading.Lock()  # one transfer step at a time

    def join(self, info: Mapping[str, Any]) -> None:
        from twinkle_core.transport.collective import open_group

        try:
            host, port = str(info["master_address"]), int(info["master_port"])
            rank, world = int(info.get("rank_offset", 1)), int(info["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ApiError(
                400,
                f"init_info={dict(info)!r} is invalid: expected master_address, master_port, world_size"
                f" (and rank_offset) ({type(exc).__name__}: {exc}).",
                param="init_info",
            ) from exc
        if info.get("packed"):
            raise ApiError(400, "init_info.packed=true: the gloo backend moves tensors unpacked.", param="init_info")
        if not 1 <= rank < world:
            raise ApiError(400, f"rank_offset={rank} does not fit world_size={world}.", param="init_info")
        if not 1 <= port <= 65535:  # checked before the group in use is dropped: a refused init changes nothing
            raise ApiError(400, f"master_port={port} is invalid: expected 1 to 65535.", param="init_info")
        self.shutdown()
        self.store, self.group = open_group(
            host, port, rank=rank, world_size=world, backend=self.config["backend"], timeout_s=self.config["timeout_s"]
        )

    def receive(self, info: Mapping[str, Any]) -> int:
        import torch

        from twinkle_core.weights import tensor_checksum

        names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ApiError(400, "update_info needs the lists names, dtype_names and shapes.", param="update_info")
        if not len(names) == len(dtypes) == len(shapes):
            raise ApiError(
                400,
                f"update_info lists differ in length: {len(names)} names, {len(dtypes)} dtype_names,"
                f" {len(shapes)} shapes.",
                param="update_info",
            )
        for dtype in dtypes:
            if dtype not in TRANSFER_DTYPES:
                raise ApiError(400, f"dtype {dtype!r} is invalid: expected one of {', '.join(TRANSFER_DTYPES)}.")
        for name, shape in zip(names, shapes):
            if not isinstance(name, str) or not (
                isinstance(shape, list)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
            ):
                raise ApiError(
                    400,
                    f"update_info entry {name!r:.80} with shape {shape!r:.80} is invalid: expected a string name and"
                    " a list of sizes (integers >= 0).",
                    param="update_info",
                )
        declared = sum(
            math.prod(shape) * getattr(torch, dtype).itemsize for dtype, shape in zip(dtypes, shapes)
        )  # Python integers: a shape of any size is counted, not overflowed
        free = _available_memory()
        if free is not None and declared > free * 0.9:
            raise ApiError(
                400,
                f"update_info declares {declared:,} bytes of tensors, more than this machine has free"
                f" ({free:,} bytes): nothing was staged. Push the weights in smaller updates.",
                param="update_info",
            )
        if self.group is None:
            raise ApiError(400, "No weight-transfer group: call /init_weight_transfer_engine first.")
        if self.staged is None:
            raise ApiError(400, "No update in progress: call /start_weight_update first.")
        got = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self.group.broadcast(tensor, 0).wait()
            got.append((str(name), tensor))
        sums = torch.empty(len(got), dtype=torch.int64)
        self.group.broadcast(sums, 0).wait()
        for (name, tensor), expected in zip(got, sums.tolist()):
            if tensor_checksum(tensor) != expected:
                self.staged = None
                raise ApiError(400, f"{name!r} arrived with a wrong checksum; the update was dropped.")
        self.staged += got
        return len(got)

    def shutdown(self) -> None:
        self.group = self.store = None
        self.staged = None


def _available_memory() -> int | None:
    """Bytes of memory the machine can still give (Linux's MemAvailable; else free pages; else unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def add_weight_routes(app: FastAPI, state: ServerState, config: dict[str, Any] | None) -> None:
    """Add vLLM's weight-transfer routes to ``app`` (off when ``config`` is ``None``)."""
    sampler = state.sampler
    transfer = _Transfer(config) if config is not None else None

    def need() -> _Transfer:
        if transfer is None:
            raise ApiError(
                400,
                "This server takes no weights over the network: start it with"
                """ --weight-transfer-config '{"backend": "gloo"}'.""",
            )
        return transfer

    async def locked(fn: Any, *args: Any) -> Any:
        t = need()

        def run() -> Any:
            with t.lock:
                return fn(*args)

        return await asyncio.to_thread(run)

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(init_info: dict[str, Any] = Body(embed=True)) -> dict[str, Any]:  # noqa: B008
        await locked(need().join, init_info)
        return {"message": "Weight transfer initialized"}

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, Any]:
        await locked(need().shutdown)
        return {"message": "Weight transfer shut down"}

    @app.post("/start_weight_update")
    async def start_weight_update() -> dict[str, Any]:
        t = need()

        def start() -> None:
            t.staged = []

        await locked(start)
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(update_info: dict[str, Any] = Body(embed=True)) -> dict[str, Any]:  # noqa: B008
        count = await locked(need().receive, update_info)
        return {"message": "Weights updated", "received": count}

    @app.post("/finish_weight_update")
    async def finish_weight_update(weight_version: Any = Body(None, embed=True)) -> dict[str, Any]:  # noqa: B008
        t = need()
        version: int | None = None
        if weight_version is not None:
            if isinstance(weight_version, bool) or not isinstance(weight_version, int):
                raise ApiError(400, f"weight_version={weight_version!r} is invalid: twinkle versions are integers.")
            version = weight_version

        def finish() -> int:
            staged, t.staged = t.staged, None
            if not staged:
                raise ApiError(400, "No tensors staged: call /start_weight_update and /update_weights first.")
            in_flight = "keep" if state.pause_mode == "keep" else "wait"
            return int(sampler.update_weights(staged, version=version, in_flight=in_flight))

        new = await locked(finish)
        return {"message": "Weight update finished", "weights_version": new}
