"""Choosing an engine by name: ``create_sampler("vllm", ...)``, ``list_samplers()``."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import attrs

from twinkle_core.engine import Engine
from twinkle_core.errors import ConfigError, PluginLoadError
from twinkle_core.plugins.engines import INSTALL_HINTS, sampler_registry
from twinkle_core.sampler import Sampler, require_engine_class

__all__ = [
    "INSTALL_HINTS",
    "NamedSampler",
    "SamplerInfo",
    "build_sampler",
    "create_sampler",
    "get_sampler_class",
    "list_samplers",
    "load_config",
    "register_sampler",
    "sampler_registry",
]


def register_sampler(name: str, target: Any = None, *, replace: bool = False) -> Any:
    """Register an engine class (or ``"pkg.module:Class"``) under ``name``, in process.

    Without ``target`` it is a class decorator::

        @register_sampler("mine")
        class MyEngine(twinkle_core.engine.Engine): ...
    """
    return sampler_registry.register(name, target, replace=replace)


def get_sampler_class(name: str) -> type[Sampler] | type[Engine]:
    """Resolve an engine name (or ``"pkg.module:Class"``) to its class.

    The class is a :class:`twinkle_core.engine.Engine` (which
    :func:`build_sampler` wraps in a ``Sampler``) or, for an engine written
    the older way, a ``Sampler`` subclass.

    Raises:
        UnknownSamplerError: no such engine (did-you-mean, available names, install hint).
        DuplicateSamplerError: two distributions register the name.
        PluginLoadError: the engine failed to import (cause chained).
    """
    cls = sampler_registry.get(name)
    if not (isinstance(cls, type) and issubclass(cls, (Sampler, Engine))):
        raise PluginLoadError(
            f"Sampler {name!r} resolved to {cls!r}, which is not a twinkle Sampler subclass nor a"
            " twinkle_core.engine.Engine."
        )
    return cls


def build_sampler(
    engine: type[Sampler] | type[Engine], /, *args: Any, remote_group: str | None = None, **kwargs: Any
) -> Sampler:
    """The sampler of an engine class: ``Sampler(engine, ...)`` for an ``Engine``, else ``engine(...)``.

    With ``remote_group=`` (in ``"ray"`` mode, after ``twinkle_core.initialize``)
    the engine runs as Ray replicas behind a ``RemoteSampler``; in ``"local"``
    mode it is built here, in this process.
    """
    if not (isinstance(engine, type) and issubclass(engine, (Sampler, Engine))):
        raise ConfigError(
            f"build_sampler() got {engine!r}: expected a twinkle_core.engine.Engine subclass or a named sampler"
            " class (a Sampler subclass such as TorchSampler)."
        )
    if remote_group is not None:
        from twinkle_core.remote.sampler import build_remote

        # an Engine runs as Sampler(engine, ...) in each replica; a named sampler as itself
        call = (Sampler, (engine, *args)) if issubclass(engine, Engine) else (engine, args)
        built: Sampler = build_remote(call[0], remote_group, call[1], kwargs)
        return built
    if issubclass(engine, Engine):
        return Sampler(engine, *args, **kwargs)
    return engine(*args, **kwargs)


class NamedSampler(Sampler):
    """A ``Sampler`` named after its engine: ``TorchSampler(...)`` is ``Sampler(TorchEngine, ...)``.

    A subclass sets ``engine_class`` and may name, in ``engine_accessors``,
    the engine's own attributes and methods the sampler reads through
    (``TorchSampler(...).model`` is its engine's ``model``; setting one sets
    the engine's). Its constructor takes the engine's arguments, and ``remote_group=``:
    then it returns the Ray replicas :func:`build_sampler` builds (a
    ``RemoteSampler``, not an instance of the subclass). ``help()`` and
    ``inspect.signature`` show the engine's arguments.
    """

    #: The engine this sampler builds (``engine_class(context, *args, **kwargs)``).
    engine_class: ClassVar[type[Engine]]
    #: The engine's attributes and methods read (and set) through the sampler.
    engine_accessors: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        engine = cls.__dict__.get("engine_class")
        if engine is None:
            raise TypeError(f"{cls.__name__}(NamedSampler) must set engine_class to its Engine subclass.")
        require_engine_class(engine)
        cls.__signature__ = _signature_of(engine)  # type: ignore[attr-defined]

    def __new__(cls, *args: Any, remote_group: str | None = None, **kwargs: Any) -> Any:
        if remote_group is not None:
            # not an instance of cls: Python then skips __init__
            return build_sampler(cls, *args, remote_group=remote_group, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, remote_group: str | None = None, **kwargs: Any) -> None:
        super().__init__(type(self).engine_class, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only for names the class does not have
        if name in type(self).engine_accessors and "_engine" in self.__dict__:
            return getattr(self.__dict__["_engine"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self).engine_accessors:
            setattr(self.engine, name, value)
        else:
            super().__setattr__(name, value)


def _signature_of(engine: type[Engine]) -> inspect.Signature:
    """``engine``'s constructor arguments after its context, and ``remote_group``."""
    params = list(inspect.signature(engine.__init__).parameters.values())[2:]  # self, context
    remote = inspect.Parameter("remote_group", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None")
    if any(p.name == "remote_group" for p in params):
        return inspect.Signature(params)
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    return inspect.Signature([*params[:at], remote, *params[at:]])


@attrs.frozen
class SamplerInfo:
    """One engine as ``list_samplers()`` reports it.

    Attributes:
        name: what to select it by; a name several distributions register
            also appears once per distribution as ``"<distribution>:<name>"``.
        distribution: the distribution that registered it (``None`` in process).
        version: that distribution's version.
        available: ``list_samplers()``: the plugin loaded, the name is not
            contested, and the engine's module and the modules it declares it
            needs are installed (looked up, not imported).
            ``list_samplers(load=True)``: the engine class imports.
        error: why it is not available.
        target: the engine as ``"pkg.module:Class"``.
        imported: whether ``available`` was established by importing the engine.
    """

    name: str
    distribution: str | None
    version: str | None
    available: bool
    error: str | None
    target: str
    imported: bool = False


def list_samplers(*, load: bool = False) -> list[SamplerInfo]:
    """Every known engine: name, distribution, version, availability and the reason it is unavailable.

    Args:
        load: import each engine to check it (seconds for vLLM). Without it no
            engine module is imported: entry-point modules are loaded (they
            register strings only) and the engines' modules are looked up on
            the import path. An engine that is installed but fails at import
            then shows as available; selecting it raises ``PluginLoadError``.
    """
    out = []
    for info in sampler_registry.infos():
        # loading replaces the look-up: the import's own error is the better answer
        error = info.error if load else sampler_registry.problem(info)
        if error is None and load:
            try:
                get_sampler_class(info.name)
            except Exception as exc:
                cause = exc.__cause__ or exc
                error = f"{type(cause).__name__}: {cause}"
        out.append(
            SamplerInfo(info.name, info.distribution, info.version, error is None, error, info.target_path, load)
        )
    return out


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict.

    Raises:
        ConfigError: the file is missing, unreadable or not a mapping.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"Cannot read config file {str(p)!r}: {exc}") from exc
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:
        raise ConfigError(
            f"Config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(p)!r} must hold a mapping, got {type(data).__name__}.")
    _check_names(data, f"Config file {str(p)!r}")
    return data


def _check_names(config: dict[Any, Any], where: str) -> None:
    """Refuse a key that is not a string: keys are option names (a YAML ``1: 2`` reads as an int key)."""
    odd = [k for k in config if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"{where}: key {odd[0]!r} is not a name; keys are option names (strings).")


def _is_config_path(value: str) -> bool:
    return value.endswith((".yaml", ".yml", ".json")) and ("/" in value or os.path.exists(value))


def create_sampler(
    name_or_config: str | dict[str, Any] | type[Sampler] | type[Engine], model_id: Any = None, /, **kwargs: Any
) -> Sampler:
    """Build an engine chosen by a string, a config mapping or a config file.

    Args:
        name_or_config: an engine name (``"vllm"``), a ``"pkg.module:Class"``
            path, an ``Engine`` or ``Sampler`` subclass, a mapping with a ``"sampler"`` key
            (the other keys are constructor arguments), or the path of a YAML
            or JSON file holding such a mapping.
        model_id: the model, as a second positional argument
            (``create_sampler("vllm", "builtin://smollm2-135m-instruct")``);
            the same as ``model_id=``.
        **kwargs: constructor arguments; they override the config's.

    Returns:
        The sampler.

    Raises:
        UnknownSamplerError: unknown engine name.
        ConfigError: a config without ``sampler``, one with ``sampling_params``
            (``twinkle sample --config`` reads those; the message shows the
            Python equivalent), or an unreadable file.
    """
    if model_id is not None:
        if "model_id" in kwargs:
            raise TypeError("create_sampler() got the model twice: as its second argument and as model_id=.")
        kwargs["model_id"] = model_id
    if isinstance(name_or_config, str) and _is_config_path(name_or_config):
        name_or_config = load_config(name_or_config)
    if isinstance(name_or_config, dict):
        config = dict(name_or_config)
        _check_names(config, "Sampler config")
        if "sampler" not in config:
            raise ConfigError(
                f"Sampler config {sorted(config)} has no 'sampler' key: add e.g. sampler: vllm (one of"
                f" {', '.join(sampler_registry.names()) or 'the installed engines'})."
            )
        if "sampling_params" in config:
            # a sampler takes its parameters per call, so create_sampler has nowhere to keep them; the CLI samples
            raise ConfigError(
                f"Sampler config has 'sampling_params' ({config['sampling_params']!r:.80}): `twinkle sample --config`"
                " reads them, create_sampler does not (a sampler takes its parameters per sample() call). In"
                " Python: config = twinkle_core.factory.load_config(path); params = config.pop('sampling_params');"
                " sampler = create_sampler(config); sampler.sample(inputs, params)."
            )
        name = config.pop("sampler")
        config.update(kwargs)
        kwargs = config
    else:
        name = name_or_config
    cls = name if isinstance(name, type) else get_sampler_class(name)
    return build_sampler(cls, **kwargs)
