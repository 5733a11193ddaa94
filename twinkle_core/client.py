"""Push weights and adapters into a ``twinkle serve`` in another process: the trainer's side.

::

    from twinkle_core.client import WeightClient

    client = WeightClient("http://sampler-host:8000")   # started with --weight-transfer-config '{"backend": "gloo"}'
    client.init_communicator()                          # once: the trainer and the server form a group
    version = client.update_weights(model.state_dict()) # every round; returns the server's new weights_version
    client.load_adapter("policy", "/shared/adapters/round-12")
    client.close()

It speaks vLLM's weight-transfer routes (see :mod:`twinkle_core.server.weights`):
the trainer serves the group's TCP store as rank 0, the server joins as rank
1, and each tensor is a broadcast from the trainer, announced first by name,
dtype and shape, checked by checksum, applied all at once when the update
finishes. Needs torch and httpx (``pip install "twinkle-core[server]"``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from twinkle_core.errors import ConfigError, WeightUpdateError
from twinkle_core.net import check_port, check_timeout
from twinkle_core.transport.collective import local_address, open_group
from twinkle_core.weights import TRANSFER_DTYPES, check_tensor, tensor_checksum

__all__ = ["WeightClient"]


class WeightClient:
    """A trainer's handle on a server's weights.

    Args:
        base_url: the server (``http://host:port``).
        api_key: the server's key, if it has one.
        host: the address the server reaches this process at (default: this
            machine's address; ``127.0.0.1`` when the server is on the same machine).
        port: the group's TCP port here (0: a free one).
        timeout_s: the longest any step waits (forming the group, one update).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        host: str | None = None,
        port: int = 0,
        timeout_s: float = 300.0,
    ) -> None:
        import httpx

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url={base_url!r} is invalid: expected the server's http:// or https:// address.")
        if host is not None and (not isinstance(host, str) or not host):
            raise ConfigError(f"host={host!r} is invalid: expected an address the server can reach, or None.")
        check_port(port)
        timeout_s = check_timeout(timeout_s)
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self.host = host
        self.port = port
        self.timeout_s = float(timeout_s)
        self._store: Any = None
        self._group: Any = None
        self._pushing = threading.Lock()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self._http.post(path, json=body)
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except Exception:
                message = r.text
            raise WeightUpdateError(f"{self.base_url}{path} answered {r.status_code}: {message}")
        out: dict[str, Any] = r.json()
        return out

    def init_communicator(self) -> None:
        """Form the group with the server (call once; again after :meth:`close`).

        Raises:
            ConfigError: the server takes no weights (started without ``--weight-transfer-config``).
            WeightSyncTimeoutError: the server did not join within the timeout.
        """
        info = self._http.get("/server_info").json()
        config = info.get("vllm_config", {}).get("weight_transfer_config")
        if not config:
            raise ConfigError(
                f"The server at {self.base_url} takes no weights: start it with"
                """ --weight-transfer-config '{"backend": "gloo"}'."""
            )
        world = int(self._http.get("/get_world_size").json()["world_size"]) + 1
        port = self.port or _free_port()
        host = self.host or local_address()
        init_info = {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": world}
        answer: list[BaseException] = []

        def ask() -> None:
            try:
                self._post("/init_weight_transfer_engine", {"init_info": init_info})
            except BaseException as exc:
                answer.append(exc)

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()  # the server blocks in the rendezvous while we join it
        self._store, self._group = open_group(
            host, port, rank=0, world_size=world, backend=config.get("backend", "gloo"), timeout_s=self.timeout_s
        )
        thread.join(self.timeout_s)
        if answer:
            self.close()
            raise answer[0]

    def update_weights(
        self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], *, version: int | None = None
    ) -> int:
        """Send new base weights; the server applies them all at once. Returns its new ``weights_version``.

        Raises:
            WeightUpdateError: the server refused them (a bad name, shape or
                dtype, a checksum): its weights and version are unchanged.
        """

        if self._group is None:
            raise WeightUpdateError("update_weights: call init_communicator() first.")
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        for name, tensor in items:
            check_tensor(name, tensor)
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in TRANSFER_DTYPES:  # the server would refuse it and never join the broadcast
                raise WeightUpdateError(
                    f"update_weights: {name!r} is {dtype}; the server takes {', '.join(TRANSFER_DTYPES)}. Cast it"
                    " first (the server casts to the model's dtype); nothing was sent."
                )
        with self._pushing:  # one push at a time: two interleaved would mismatch the broadcasts
            return self._push(items, version)

    def _push(self, items: list[tuple[str, Any]], version: int | None) -> int:
        import torch

        tensors = [(name, t.detach().to("cpu").contiguous()) for name, t in items]
        update_info = {
            "names": [n for n, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
        }
        self._post("/start_weight_update", {})
        answer: list[Any] = []

        def ask() -> None:
            try:
                answer.append(self._post("/update_weights", {"update_info": update_info}))
            except BaseException as exc:
                answer.append(exc)

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()  # the server receives while we broadcast
        for _name, tensor in tensors:
            self._group.broadcast(tensor, 0).wait()
        sums = [tensor_checksum(tensor) for _name, tensor in tensors]
        self._group.broadcast(torch.tensor(sums, dtype=torch.int64), 0).wait()
        thread.join(self.timeout_s)
        if answer and isinstance(answer[0], BaseException):
            raise answer[0]
        body: dict[str, Any] = {} if version is None else {"weight_version": version}
        return int(self._post("/finish_weight_update", body)["weights_version"])

    def load_adapter(self, name: str, folder: str, *, replace: bool = True) -> int:
        """Load (or replace) a LoRA adapter from a folder the server can read; returns the new version."""
        body = {"lora_name": name, "lora_path": folder, "load_inplace": replace}
        return int(self._post("/v1/load_lora_adapter", body)["weights_version"])

    def close(self) -> None:
        """Leave the group (the server drops its side too)."""
        if self._group is not None:
            try:
                self._post("/shutdown_weight_transfer_engine", {})
            except Exception:  # the server is gone: nothing to tell it
                pass
        self._group = self._store = None

    def __enter__(self) -> WeightClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._http.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
