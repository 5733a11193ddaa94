"""LoRA adapters injected into a plain ``transformers`` model with PEFT.

Several adapters live in the model at once, each under an internal name
(``twinkle_<id>_<n>``, as PEFT names must be valid module keys); one is made
active per ``sample()`` call, or all are switched off for the base model.
The model is never wrapped in a ``PeftModel``: the decode loop calls the
``transformers`` model directly and the PEFT layers inside it route through
the active adapter.

Replacing an adapter loads the new one under a fresh internal name first and
deletes the old one only once that succeeded, so a failed replacement leaves
the old adapter serving. When the last adapter goes, the PEFT layers are
unwrapped and the model is back to its original modules.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from twinkle_core.engine import AdapterInput
from twinkle_core.errors import AdapterError, did_you_mean
from twinkle_core.names import known_adapter_name

__all__ = ["AdapterSet"]


def _tuner_layer_cls() -> Any:  # peft is not type-checked (see pyproject.toml): its class is Any to us
    from peft.tuners.tuners_utils import BaseTunerLayer

    return BaseTunerLayer


def _peft_config(adapter: AdapterInput) -> Any:
    """The ``peft.PeftConfig`` of ``adapter``: the caller's object, or one built from its config dict."""
    from peft import PeftConfig

    if isinstance(adapter.peft_config, PeftConfig):
        return adapter.peft_config
    where = f"Adapter folder {str(adapter.folder)!r}" if adapter.folder is not None else f"Adapter {adapter.name!r}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns of unknown keys and drops them: refused below instead
            config = PeftConfig.from_peft_type(**PeftConfig.check_kwargs(**{"peft_type": "LORA", **adapter.config}))
    except Exception as exc:
        raise AdapterError(f"{where}: the config {adapter.config!r:.300} is invalid: {exc}") from exc
    # A key this PEFT does not know (a typo, or a feature of a newer PEFT such as a new LoRA variant) would be
    # dropped, and the adapter run as something else than it is.
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(adapter.config) - known)
    if unknown:
        import peft

        hint = did_you_mean(unknown[0], known)
        raise AdapterError(
            f"{where}: the config has key(s) {unknown} that {type(config).__name__} of the installed peft"
            f" {peft.__version__} does not take.{hint} Remove them, or install the peft that wrote them."
        )
    return config


class AdapterSet:
    """The LoRA adapters of one model, by user-facing name.

    Args:
        model: the ``transformers`` model the adapters are injected into (in place).
        device: where the model's weights live.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._internal: dict[str, str] = {}  # user name -> PEFT adapter name
        self._counter = 0
        self._layers: list[Any] = []
        self._active: str | None = None  # internal name, "" for the base model, None: unknown

    def __contains__(self, name: str) -> bool:
        return name in self._internal

    @property
    def names(self) -> list[str]:
        """The loaded adapters' names."""
        return list(self._internal)

    @property
    def empty(self) -> bool:
        """Whether no adapter is loaded."""
        return not self._internal

    def _refresh_layers(self) -> None:
        layer_cls = _tuner_layer_cls()
        self._layers = [m for m in self.model.modules() if isinstance(m, layer_cls)]
        self._active = None

    # -- loading ------------------------------------------------------------------------------
    def load(self, adapter: AdapterInput) -> str:
        """Load (or replace) ``adapter`` under its name.

        Returns:
            Where it came from: the folder, or ``"<memory>"``.

        Raises:
            AdapterError: a bad config, or weights that do not fit the model
                (unknown, missing or misshapen tensors).
        """
        name, folder = adapter.name, adapter.folder
        config = _peft_config(adapter)
        # a checkpoint's nested module names or a trainer's: as this model spells them (twinkle_core.names)
        weights = self._weight_names()
        state = {known_adapter_name(key, weights): value for key, value in adapter.tensors}
        if getattr(config, "is_prompt_learning", False):
            raise AdapterError(
                f"Adapter {name!r} is a prompt-learning PEFT method ({config.peft_type}); only injectable adapters"
                " such as LoRA are supported."
            )
        self._counter += 1
        internal = f"twinkle_{self._counter}"
        label = f"Adapter {name!r}" + (f" from {str(folder)!r}" if folder is not None else "")
        self._inject(internal, config, state, label)
        old = self._internal.get(name)
        self._internal[name] = internal
        if old is not None:
            self._delete(old)
        self._refresh_layers()
        return adapter.source

    def _weight_names(self) -> set[str]:
        """The model's own weight names (PEFT's layers looked through)."""
        return {name.replace(".base_layer.", ".") for name in self.model.state_dict()}

    def _inject(self, internal: str, config: Any, state: dict[str, torch.Tensor], label: str) -> None:
        from peft import inject_adapter_in_model, set_peft_model_state_dict

        config.inference_mode = True
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Already found a peft_config attribute": intended
                inject_adapter_in_model(config, self.model, adapter_name=internal)
                result = set_peft_model_state_dict(self.model, state, adapter_name=internal)
        except Exception as exc:
            self._delete(internal)
            lines = str(exc).replace(f".{internal}", "").strip().splitlines()
            if len(lines) > 4:
                lines = [*lines[:4], f"... and {len(lines) - 4} more"]
            detail = "\n".join(lines)
            raise AdapterError(f"{label} does not fit this model: {detail}") from exc
        marker = f".{internal}."
        missing = [k for k in result.missing_keys if marker in k]
        unexpected = list(result.unexpected_keys)
        if missing or unexpected:
            self._delete(internal)
            problems = []
            if unexpected:
                problems.append(f"unexpected tensors {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}")
            if missing:
                shown = [k.replace(marker, ".") for k in missing[:3]]
                problems.append(f"missing tensors {shown}{' ...' if len(missing) > 3 else ''}")
            raise AdapterError(f"{label} does not fit this model: {'; '.join(problems)}.")

    # -- removing -----------------------------------------------------------------------------
    def remove(self, name: str) -> None:
        """Unload adapter ``name`` (unknown names are ignored)."""
        internal = self._internal.pop(name, None)
        if internal is not None:
            self._delete(internal)
            self._refresh_layers()

    def _delete(self, internal: str) -> None:
        layer_cls = _tuner_layer_cls()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Setting active adapter to ...": we pick one per call anyway
            for module in self.model.modules():
                if isinstance(module, layer_cls):
                    module.delete_adapter(internal)
        configs = getattr(self.model, "peft_config", None)
        if isinstance(configs, dict):
            configs.pop(internal, None)
        if not self._internal:
            self._unwrap()

    def _unwrap(self) -> None:
        """Put the original modules back once no adapter is left."""
        layer_cls = _tuner_layer_cls()
        for parent in list(self.model.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, layer_cls) and not isinstance(parent, layer_cls):
                    setattr(parent, child_name, child.get_base_layer())
        if hasattr(self.model, "peft_config"):
            del self.model.peft_config
        self._layers = []
        self._active = None

    # -- selecting ----------------------------------------------------------------------------
    def activate(self, name: str) -> None:
        """Route the model through adapter ``name``, or through no adapter for ``""``."""
        internal = self._internal[name] if name else ""
        if internal == self._active:
            return
        for layer in self._layers:
            if internal:
                layer.enable_adapters(True)
                layer.set_adapter(internal, inference_mode=True)
            else:
                layer.enable_adapters(False)
        self._active = internal
