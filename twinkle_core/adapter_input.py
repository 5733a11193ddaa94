"""One reader of LoRA adapter input, for every engine and for the merge path.

``add_adapter_to_model`` takes a PEFT adapter folder, or a ``peft.LoraConfig``
(or its dict) together with ``weights=`` (a dict, or ``(name, tensor)`` pairs,
by PEFT name). :func:`read_adapter` turns any of those into one
:class:`AdapterInput`, or refuses it with an ``AdapterError`` that names the
bad value and what is accepted; an engine then loads what it was given and
never parses the input again.

Tensor names are the saved PEFT spelling (``...q_proj.lora_A.weight``): the
in-model spelling ``...q_proj.lora_A.<adapter>.weight`` (a live PEFT model's
``state_dict``) is accepted and renamed.

Torch is imported only when an adapter is read (tensors cannot exist without it).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from twinkle_core.errors import AdapterError
from twinkle_core.weights import find_non_finite, find_not_floating

__all__ = ["MEMORY_SOURCE", "AdapterInput", "peft_pattern_value", "read_adapter"]

#: The source an adapter loaded from tensors in memory reports (``AdapterInfo.source``).
MEMORY_SOURCE = "<memory>"

_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_ADAPTER_SEGMENTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


@attrs.frozen
class _Read:
    config: dict[str, Any]
    tensors: list[tuple[str, Any]]
    folder: Path | None
    peft_config: Any


class AdapterInput:
    """A LoRA adapter as ``add_adapter_to_model`` was given it, read and checked once, on first use.

    The sampler hands one to the engine's ``_load_adapter``. Tensors in
    memory are read when it is made (a bad one is refused before anything
    else happens); a folder when the engine first asks for a field, so an
    engine that cannot load adapters at all says so first.

    Attributes:
        name: the name it is loaded under.
        config: its config as a JSON-safe dict (``adapter_config.json``'s content).
        tensors: ``(saved PEFT name, tensor)`` pairs, detached, floating point
            (and finite, unless read with ``check_finite=False``).
        folder: the folder it was read from, or ``None`` for tensors in memory.
        peft_config: the ``peft.PeftConfig`` object the caller passed, if it passed one.
        source: where it came from: the folder, or ``"<memory>"`` (known without reading).

    Raises:
        AdapterError: (on reading) see :func:`read_adapter`.
    """

    def __init__(
        self, name: str, config_or_dir: Any, weights: Any = None, *, check_finite: bool = True, into: str | None = None
    ) -> None:
        self.name = name
        self._given = (config_or_dir, weights, check_finite, into)
        self._read: _Read | None = None
        if not isinstance(config_or_dir, (str, os.PathLike)):
            self._load()

    def _load(self) -> _Read:
        if self._read is None:
            self._read = _read(self.name, *self._given)
        return self._read

    def read(self) -> AdapterInput:
        """Read and check it now (if not yet); returns itself."""
        self._load()
        return self

    @property
    def config(self) -> dict[str, Any]:
        return self._load().config

    @property
    def tensors(self) -> list[tuple[str, Any]]:
        return self._load().tensors

    @property
    def folder(self) -> Path | None:
        return self._load().folder

    @property
    def peft_config(self) -> Any:
        return self._load().peft_config

    @property
    def source(self) -> str:
        config_or_dir, weights, _, _ = self._given
        if weights is None and isinstance(config_or_dir, (str, os.PathLike)):
            return str(Path(config_or_dir).expanduser())
        return MEMORY_SOURCE

    def rank_of(self, module: str) -> Any:
        """The LoRA rank of ``module`` (dotted, without PEFT's prefix): ``rank_pattern``'s, else ``r``."""
        return peft_pattern_value(self.config.get("rank_pattern"), module, self.config.get("r"))

    def state_dict(self) -> dict[str, Any]:
        """The tensors as a dict by saved PEFT name."""
        return dict(self.tensors)


def peft_pattern_value(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """The value of ``module`` in a PEFT ``rank_pattern`` / ``alpha_pattern``, else ``default``.

    As PEFT matches them: a key (a regular expression) matches the end of the
    module's dotted name, starting at a dot; the first matching key wins.
    """
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


def read_adapter(name: str, config_or_dir: Any, weights: Any = None, *, check_finite: bool = True) -> AdapterInput:
    """Read and check an adapter given as ``add_adapter_to_model`` takes it.

    Args:
        name: the adapter's name, for messages.
        config_or_dir: a PEFT adapter folder, or a ``peft.LoraConfig`` (or its dict) with ``weights``.
        weights: a mapping or ``(name, tensor)`` pairs, or ``None`` with a folder.
        check_finite: refuse tensors holding NaN or infinity.

    Raises:
        AdapterError: a missing or unreadable folder, a folder together with
            weights, a config without weights (or of the wrong type), weights
            that are empty, not tensors, not floating point or not finite.
    """
    return AdapterInput(name, config_or_dir, weights, check_finite=check_finite).read()


def _read(name: str, config_or_dir: Any, weights: Any, check_finite: bool, into: str | None) -> _Read:
    if isinstance(config_or_dir, (str, os.PathLike)):
        if weights is not None:
            raise AdapterError(
                f"Adapter {name!r}: pass either an adapter folder or a config with weights=, not a folder and weights."
            )
        folder = Path(config_or_dir).expanduser()
        config, raw = _read_folder(folder)
        label = f"Adapter {name!r} from {str(folder)!r}"
        _check_config(label, config)
        return _Read(config, _checked_tensors(label, raw, check_finite, into), folder, None)
    peft_config = config_or_dir if hasattr(config_or_dir, "to_dict") else None
    if peft_config is None and not isinstance(config_or_dir, Mapping):
        raise AdapterError(
            f"Adapter {name!r}: config_or_dir={config_or_dir!r:.80} is invalid: expected a PEFT adapter folder, or a"
            " peft.LoraConfig (or its dict) together with weights=."
        )
    if weights is None:
        raise AdapterError(
            f"Adapter {name!r} was given a config without weights: pass weights= (tensors by PEFT name, as"
            " get_peft_model_state_dict returns) or an adapter folder."
        )
    config = _json_safe(config_or_dir.to_dict() if peft_config is not None else config_or_dir)
    _check_config(f"Adapter {name!r}", config)
    return _Read(config, _checked_tensors(f"Adapter {name!r}", weights, check_finite, into), None, peft_config)


def _read_folder(folder: Path) -> tuple[dict[str, Any], Any]:
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise AdapterError(
            f"Adapter folder {str(folder)!r} {what}: pass a folder written by PEFT's save_pretrained"
            " (adapter_config.json + adapter_model.safetensors), or a LoraConfig with weights=."
        )
    if not (folder / "adapter_config.json").is_file():
        raise AdapterError(
            f"Adapter folder {str(folder)!r} has no adapter_config.json: it is not a PEFT adapter folder"
            " (written by save_pretrained)."
        )
    if not any((folder / f).is_file() for f in _WEIGHT_FILES):
        raise AdapterError(f"Adapter folder {str(folder)!r} has no adapter_model.safetensors (or adapter_model.bin).")
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        if (folder / _WEIGHT_FILES[0]).is_file():
            from safetensors.torch import load_file

            raw: Any = load_file(str(folder / _WEIGHT_FILES[0]))
        else:
            import torch

            raw = torch.load(str(folder / _WEIGHT_FILES[1]), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise AdapterError(f"Adapter folder {str(folder)!r} is unreadable: {type(exc).__name__}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"Adapter folder {str(folder)!r}: adapter_config.json holds no JSON object.")
    return config, raw


def _checked_tensors(label: str, weights: Any, check_finite: bool, into: str | None) -> list[tuple[str, Any]]:
    import torch

    try:
        items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    except TypeError:
        raise AdapterError(
            f"{label}: weights={weights!r:.60} is invalid: expected a dict or (name, tensor) pairs."
        ) from None
    out: list[tuple[str, Any]] = []
    for entry in items:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise AdapterError(f"{label}: weights must be a dict or (name, tensor) pairs, got {entry!r:.60}.")
        key, tensor = entry
        if not isinstance(tensor, torch.Tensor):
            raise AdapterError(f"{label}: {key!r} is a {type(tensor).__name__}, expected a torch.Tensor.")
        parts = key.split(".")
        if len(parts) >= 3 and parts[-3] in _ADAPTER_SEGMENTS:  # in-model spelling: lora_A.<adapter>.weight
            parts = parts[:-2] + parts[-1:]
        out.append((".".join(parts), tensor.detach()))
    if not out:
        raise AdapterError(f"{label}: weights is empty; pass the adapter's lora_A / lora_B tensors.")
    bad = find_not_floating(out) or (find_non_finite(out, into) if check_finite else None)
    if bad is not None:
        raise AdapterError(f"{label}: {bad}; nothing was loaded.")
    return out


def _check_config(label: str, config: Mapping[str, Any]) -> None:
    """Refuse a rank that is not a positive integer and a scale (``lora_alpha``) that is not a finite number.

    Both the defaults and their per-module patterns: PEFT would take a NaN
    alpha and the model would compute NaN.
    """

    def check(key: str, value: Any, rule: str) -> None:
        if rule == "rank":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            want = "a positive integer"
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            want = "a finite number"
        if not ok:
            raise AdapterError(f"{label}: {key}={value!r:.60} is invalid: expected {want}.")

    for key, rule in (("r", "rank"), ("lora_alpha", "scale")):
        if key in config and config[key] is not None:
            check(key, config[key], rule)
    for key, rule in (("rank_pattern", "rank"), ("alpha_pattern", "scale")):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, Mapping):
            raise AdapterError(f"{label}: {key}={patterns!r:.60} is invalid: expected a mapping of module patterns.")
        for pattern, value in patterns.items():
            check(f"{key}[{pattern!r}]", value, rule)


def _json_safe(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as plain JSON values: sets become sorted lists, other objects their ``str``."""
    text = json.dumps(dict(config), default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o))
    return dict(json.loads(text))
