"""Named registries of engines and templates, filled in process and by plugins.

Resolution of a name, in order:

1. in-process registrations (``register_sampler``);
2. a ``"pkg.module:attr"`` string, imported directly;
3. entry points of group ``twinkle`` (each a pluggy plugin module), scanned
   once on first need and cached; ``TWINKLE_PLUGINS`` (comma-separated
   entry-point names) limits which are loaded, ``TWINKLE_DISABLE_PLUGIN_AUTOLOAD=1``
   loads none, ``TWINKLE_TRACE_PLUGINS=1`` logs every step to stderr;
4. otherwise a ``LookupError`` subclass with a did-you-mean, the names
   available and the install hint.

All entry-point modules are loaded on the first lookup (they only register
strings, so this is cheap): that is what lets two distributions claiming one
name be reported, naming both, instead of one silently winning.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import threading
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

import attrs
import pluggy

from twinkle_core.errors import DuplicateSamplerError, PluginLoadError, TwinkleError
from twinkle_core.plugins import hookspecs

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "Registry",
    "load_target",
    "plugin_manager",
    "reset_plugins",
]

ENTRY_POINT_GROUP = "twinkle"
T = TypeVar("T")


def _trace(msg: str) -> None:
    if os.environ.get("TWINKLE_TRACE_PLUGINS", "") not in ("", "0", "false", "False"):
        print(f"[twinkle plugins] {msg}", file=sys.stderr)


def load_target(target: str) -> Any:
    """Import ``"pkg.module:attr"`` (or ``"pkg.module.attr"``) and return the attribute.

    Raises:
        PluginLoadError: the module or attribute cannot be imported (cause chained).
    """
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise PluginLoadError(f"Invalid target {target!r}: expected 'package.module:Attribute'.")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # any failure in a plugin's import is the plugin's load error
        raise PluginLoadError(f"Could not import {target!r}: {type(exc).__name__}: {exc}") from exc
    return obj


@attrs.define
class PluginInfo:
    """One registered name, as listings show it.

    Attributes:
        name: the registered name.
        target: a ``"pkg.module:Class"`` string, or the object itself.
        distribution: the distribution that registered it (``None`` in process).
        version: that distribution's version.
        error: why it cannot be used, if it cannot (load failure, duplicate).
        exception: the exception behind ``error``.
    """

    name: str
    target: Any
    distribution: str | None = None
    version: str | None = None
    error: str | None = None
    exception: BaseException | None = attrs.field(default=None, repr=False, eq=False)
    claimed_by: list[str] = attrs.field(factory=list)

    @property
    def available(self) -> bool:
        """Whether selecting this name can work (no load error, no duplicate)."""
        return self.error is None


class _PluginScan:
    """Loads entry-point plugin modules once and feeds every registry."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.done = False
        self.lock = threading.RLock()
        #: "dist:entry-point" -> (distribution, version, error or None)
        self.loaded: dict[str, tuple[str | None, str | None, BaseException | None]] = {}

    def _allowed(self, ep: EntryPoint) -> bool:
        allow = os.environ.get("TWINKLE_PLUGINS", "").strip()
        if not allow:
            return True
        names = {n.strip() for n in allow.split(",") if n.strip()}
        dist = ep.dist.name if ep.dist is not None else None
        return ep.name in names or (dist is not None and dist in names)

    def ensure(self) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            if os.environ.get("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0", "false", "False"):
                _trace("autoload disabled by TWINKLE_DISABLE_PLUGIN_AUTOLOAD")
                return
            seen: set[tuple[str, str]] = set()
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                dist = ep.dist.name if ep.dist is not None else None
                version = ep.dist.version if ep.dist is not None else None
                if (ep.name, ep.value) in seen:  # one dist found twice on sys.path
                    continue
                seen.add((ep.name, ep.value))
                if not self._allowed(ep):
                    _trace(f"skipping {ep.name} ({dist}): not in TWINKLE_PLUGINS")
                    continue
                _trace(f"loading {ep.name} = {ep.value} from {dist} {version}")
                try:
                    module = ep.load()
                    self.pm.register(module, name=f"{dist}:{ep.name}")
                    self.loaded[f"{dist}:{ep.name}"] = (dist, version, None)
                except Exception as exc:
                    _trace(f"failed to load {ep.name}: {exc!r}")
                    self.loaded[f"{dist}:{ep.name}"] = (dist, version, exc)

    def dist_of(self, plugin: object) -> tuple[str | None, str | None]:
        key = self.pm.get_name(plugin) or ""
        info = self.loaded.get(key)
        return (info[0], info[1]) if info else (None, None)


_scan = _PluginScan()


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager holding every loaded entry-point plugin (scans on first call)."""
    _scan.ensure()
    return _scan.pm


def reset_plugins() -> None:
    """Forget the entry-point scan so the next lookup scans again (tests, after a pip install)."""
    global _scan
    with _scan.lock:
        _scan = _PluginScan()
        for reg in Registry.all_registries:
            reg._plugin_entries = None
            reg._cache.clear()


class Registry(Generic[T]):
    """Names -> lazily imported objects (engine classes, template classes).

    Args:
        kind: what it holds, for messages (``"sampler"``).
        hook: the hookspec name that fills it (``"register_samplers"``).
        unknown_error: the error raised for an unknown name.
        install_hint: ``name -> "pip install ..."`` hints for known first-party names.
    """

    all_registries: list[Registry[Any]] = []

    def __init__(
        self,
        kind: str,
        hook: str,
        unknown_error: type[TwinkleError],
        install_hint: dict[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self.hook = hook
        self.unknown_error = unknown_error
        self.install_hint = install_hint or {}
        self._local: dict[str, PluginInfo] = {}
        self._plugin_entries: dict[str, PluginInfo] | None = None
        self._cache: dict[str, T] = {}
        self._lock = threading.RLock()
        Registry.all_registries.append(self)

    # -- registration ------------------------------------------------------------------
    def register(self, name: str, target: Any = None, *, replace: bool = False) -> Any:
        """Register ``target`` (an object or a ``"pkg.module:attr"`` string) as ``name``.

        Without ``target`` it returns a decorator. Registering a name that is
        already registered in process raises unless ``replace=True``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"A {self.kind} name must be a non-empty string, got {name!r}.")
        if target is None:

            def decorator(obj: Any) -> Any:
                self.register(name, obj, replace=replace)
                return obj

            return decorator
        with self._lock:
            if name in self._local and not replace and self._local[name].target is not target:
                raise DuplicateSamplerError(
                    f"{self.kind.capitalize()} {name!r} is already registered in process"
                    f" (as {self._local[name].target!r}); pass replace=True to override it."
                )
            self._local[name] = PluginInfo(name=name, target=target)
            self._cache.pop(name, None)
        return target

    def unregister(self, name: str) -> None:
        """Remove an in-process registration (no error if absent)."""
        with self._lock:
            self._local.pop(name, None)
            self._cache.pop(name, None)

    # -- plugins -----------------------------------------------------------------------
    def _plugins(self) -> dict[str, PluginInfo]:
        if self._plugin_entries is not None:
            return self._plugin_entries
        with self._lock:
            if self._plugin_entries is not None:
                return self._plugin_entries
            pm = plugin_manager()
            entries: dict[str, PluginInfo] = {}
            for plugin in pm.get_plugins():
                dist, version = _scan.dist_of(plugin)
                impl = getattr(plugin, self.hook, None)
                if impl is None:
                    continue

                def register(name: str, target: Any, _d: str | None = dist, _v: str | None = version) -> None:
                    if name in entries:
                        prev = entries[name]
                        prev.claimed_by.append(_d or "?")
                        prev.error = (
                            f"{self.kind.capitalize()} {name!r} is registered by several distributions:"
                            f" {', '.join(prev.claimed_by)}. Uninstall all but one, or select one"
                            f" explicitly with its 'package.module:Class' path."
                        )
                        return
                    entries[name] = PluginInfo(name, target, _d, _v, claimed_by=[_d or "?"])

                try:
                    impl(register=register)
                except Exception as exc:
                    _trace(f"{dist}.{self.hook} raised {exc!r}")
                    entries.setdefault(
                        f"<{dist}>",
                        PluginInfo(f"<{dist}>", None, dist, version, f"{type(exc).__name__}: {exc}", exc),
                    )
            # entry points that failed to import show up under their entry-point name
            for key, (dist, version, exc) in _scan.loaded.items():
                ep_name = key.partition(":")[2]
                if exc is not None and ep_name not in entries:
                    entries[ep_name] = PluginInfo(
                        ep_name, None, dist, version, f"plugin failed to import: {type(exc).__name__}: {exc}", exc
                    )
            self._plugin_entries = entries
            return entries

    # -- lookup ------------------------------------------------------------------------
    def infos(self) -> list[PluginInfo]:
        """Every registered name (in process first, then plugins), sorted by name."""
        merged = dict(self._plugins())
        merged.update(self._local)
        return [merged[k] for k in sorted(merged)]

    def names(self) -> list[str]:
        """Every registered name."""
        return [i.name for i in self.infos()]

    def _info(self, name: str) -> PluginInfo | None:
        if name in self._local:
            return self._local[name]
        return self._plugins().get(name)

    def get(self, name: str) -> T:
        """Resolve ``name`` to the registered object, importing it if needed.

        Raises:
            LookupError: unknown name (with did-you-mean and the install hint)
                or a name claimed by two distributions.
            PluginLoadError: the plugin or its target failed to import.
        """
        if not isinstance(name, str):
            raise self.unknown_error(f"{self.kind.capitalize()} name must be a string, got {name!r}.")
        if name in self._cache:
            return self._cache[name]
        with self._lock:
            info = self._info(name)
            if info is None and ":" in name:
                obj = load_target(name)
                self._cache[name] = obj
                return obj
            if info is None:
                raise self.unknown_error(self._unknown_message(name))
            if info.error is not None:
                if info.exception is not None:
                    raise PluginLoadError(
                        f"{self.kind.capitalize()} {name!r} from {info.distribution} cannot be loaded: {info.error}"
                    ) from info.exception
                raise DuplicateSamplerError(info.error)
            obj = load_target(info.target) if isinstance(info.target, str) else info.target
            self._cache[name] = obj
            return obj

    def _unknown_message(self, name: str) -> str:
        available = [i.name for i in self.infos() if i.available]
        known = sorted(set(available) | set(self.install_hint))
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        suggest = bool(close) and close[0] != name  # a known-but-not-installed name gets its hint, not a suggestion
        msg = f"Unknown {self.kind} {name!r}." + (f" Did you mean {close[0]!r}?" if suggest else "")
        msg += f" Available: {', '.join(available) if available else '(none)'}."
        hint = self.install_hint.get(close[0] if close and close[0] not in available else name)
        if hint:
            msg += f" To install it: {hint}"
        elif self.install_hint and not close:
            msg += " Engines ship as plugins: " + "; ".join(f"{k}: {v}" for k, v in sorted(self.install_hint.items()))
        return msg
