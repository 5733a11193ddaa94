"""LoRA adapters: loading, replacing and removing them through the policy state's one change path.

Also the adapters ``sample(adapter_path=...)`` loads by folder, reloaded when
the folder's weights file changes (a trainer saving each step to one folder).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from twinkle_core.adapter_input import AdapterInput
from twinkle_core.engine import Engine
from twinkle_core.errors import IncompleteUpdateError, InvalidInputError
from twinkle_core.sampler.policy import Lifecycle, PolicyState

__all__ = ["Adapters"]


class Adapters:
    """The adapter changes of one sampler, on its engine and state."""

    def __init__(self, engine: Engine, state: PolicyState, lifecycle: Lifecycle) -> None:
        self._engine = engine
        self._state = state
        self._lifecycle = lifecycle
        # Adapters loaded by sample(adapter_path=...): the weights files' stamps they were loaded from.
        self._path_stamps: dict[str, tuple[tuple[str, int, int], ...]] = {}
        self._path_lock = threading.Lock()

    def add(
        self,
        adapter_name: str,
        config_or_dir: Any,
        *,
        weights: Any,
        version: int | None,
        check_finite: bool,
        in_flight: str,
        options: dict[str, Any],
    ) -> int:
        """``Sampler.add_adapter_to_model``: the new ``weights_version``."""
        self._lifecycle.check_open()
        if not isinstance(adapter_name, str) or not adapter_name:
            raise InvalidInputError(f"adapter_name={adapter_name!r} is invalid: expected a non-empty string.")
        # Tensors in memory are checked now, before in_flight acts; a folder is read when the engine asks.
        adapter = AdapterInput(
            adapter_name, config_or_dir, weights, check_finite=check_finite, into=self._engine.info.weights_dtype
        )

        def record(new_version: int, source: Any) -> None:
            self._state.record_adapter(adapter_name, new_version, adapter.source if source is None else source)

        def load(new_version: int) -> str:
            with self._doubting(new_version, f"add_adapter_to_model({adapter_name!r})"):
                return self._engine.load_adapter(adapter, version=new_version, **options)

        return self._state.change(in_flight, version, load, record)

    def remove(self, adapter_name: str, *, in_flight: str) -> None:
        """``Sampler.remove_adapter``."""
        self._lifecycle.check_open()

        def remove(version: int) -> None:
            self._state.require_adapter(adapter_name)
            with self._doubting(version, f"remove_adapter({adapter_name!r})"):
                self._engine.remove_adapter(adapter_name)

        self._state.change(in_flight, None, remove, lambda _v, _r: self._state.drop_adapter(adapter_name), bump=False)

    @contextmanager
    def _doubting(self, version: int, change: str) -> Iterator[None]:
        """An adapter change the engine could not apply whole, nor undo (a merge interrupted twice).

        The engine names the weights it may have left part-changed in an
        ``IncompleteUpdateError``; sampling is refused until they are pushed again.
        """
        try:
            yield
        except IncompleteUpdateError as exc:
            if exc.tensors:
                self._state.doubt(version, list(exc.tensors), exc, change=change)
            raise

    def from_path(self, adapter_name: str, adapter_path: str | os.PathLike[str] | None) -> str:
        """The adapter name a call uses: ``adapter_name``, or the folder ``adapter_path`` loaded under its own name."""
        if adapter_path is None:
            return adapter_name
        if adapter_name:
            raise InvalidInputError(
                f"sample() got adapter_name={adapter_name!r} and adapter_path={str(adapter_path)!r}: give one of them."
            )
        if not isinstance(adapter_path, (str, os.PathLike)):
            raise InvalidInputError(f"adapter_path={adapter_path!r} is invalid: expected a PEFT adapter folder.")
        folder = Path(adapter_path).expanduser().resolve()
        name = f"path:{folder}"
        stamp = tuple(
            (f.name, f.stat().st_mtime_ns, f.stat().st_size)
            for f in sorted(folder.glob("adapter_model.*"))
            if f.is_file()
        )
        with self._path_lock:
            if not self._state.has_adapter(name) or self._path_stamps.get(name) != stamp:
                self.add(name, str(folder), weights=None, version=None, check_finite=True, in_flight="wait", options={})
                self._path_stamps[name] = stamp
        return name
