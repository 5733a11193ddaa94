"""Named registries of engines and templates, filled in process and by plugins.

Resolution of a name, in order:

1. in-process registrations (``register_sampler``);
2. names registered by entry-point plugins (group ``twinkle``, each a pluggy
   plugin module), scanned once on first need and cached;
3. a distribution-qualified name, ``"<distribution>:<name>"`` (e.g.
   ``"twinkle-echo:echo"``): that distribution's registration of ``name``,
   the way to choose when two distributions register one name;
4. a ``"pkg.module:attr"`` string, imported directly;
5. otherwise a ``LookupError`` subclass with a did-you-mean, the names
   available and the install hint.

Plugins are pluggy plugins all the way: each entry-point module is registered
with one :class:`pluggy.PluginManager`, ``TWINKLE_PLUGINS`` (an allow-list of
entry-point or distribution names) blocks the others with
:meth:`~pluggy.PluginManager.set_blocked` before they are imported, and the
``register_*`` hooks are called through pluggy, one plugin at a time, so each
registration is attributed to the distribution that made it.
``TWINKLE_DISABLE_PLUGIN_AUTOLOAD=1`` loads none; ``TWINKLE_TRACE_PLUGINS=1``
logs every step to stderr.

All entry-point modules are loaded on the first lookup (they only register
strings, so this is cheap): that is what lets two distributions claiming one
name be reported, naming both, instead of one silently winning. There is one
exception, so that no third-party package can take a first-party name away:
when a name has a first-party owner (``torch`` is ``twinkle-torch``'s) and
that distribution registers it, its registration wins and selecting the name
warns, saying how to select the other one.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from importlib.machinery import ModuleSpec
from importlib.metadata import EntryPoint, entry_points
from typing import Any, ClassVar, Generic, TypeVar

import attrs
import pluggy

import twinkle_core.plugins.hookspecs as hookspecs
from twinkle_core.errors import DuplicateSamplerError, PluginLoadError, TwinkleError, did_you_mean

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "Registry",
    "load_target",
    "module_installed",
    "plugin_manager",
    "plugins_scanned",
    "reset_plugins",
]

ENTRY_POINT_GROUP = "twinkle"
T = TypeVar("T")

_OFF = ("", "0", "false", "False", "no")


def _switch(name: str) -> bool:
    return os.environ.get(name, "").strip() not in _OFF


def _trace(msg: str) -> None:
    if _switch("TWINKLE_TRACE_PLUGINS"):
        print(f"[twinkle plugins] {msg}", file=sys.stderr)


def _norm(dist: str | None) -> str:
    """A distribution name as PEP 503 compares them (``Twinkle_Echo`` == ``twinkle-echo``)."""
    return re.sub(r"[-_.]+", "-", dist or "").lower()


def load_target(target: str) -> Any:
    """Import ``"pkg.module:attr"`` (or ``"pkg.module.attr"``) and return the attribute.

    Raises:
        PluginLoadError: the module or attribute cannot be imported (cause chained).
    """
    module_name, attr = _split_target(target)
    if not module_name or not attr:
        raise PluginLoadError(f"Invalid target {target!r}: expected 'package.module:Attribute'.")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # any failure in a plugin's import is the plugin's load error
        raise PluginLoadError(f"Could not import {target!r}: {type(exc).__name__}: {exc}") from exc
    return obj


def _split_target(target: str) -> tuple[str, str]:
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    return module_name, attr


def _is_module_path(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def _spec(name: str) -> ModuleSpec | None:
    """The spec of module ``name``, found without executing it or any package above it.

    ``importlib.util.find_spec("a.b")`` imports ``a`` first; a plugin's package
    may be heavy, so submodules are looked up in the parent's search path by
    the import system's own finders instead.
    """
    if name in sys.modules:
        return getattr(sys.modules[name], "__spec__", None) or ModuleSpec(name, None)
    parent, _, _ = name.rpartition(".")
    if not parent:
        try:
            return importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
    parent_spec = _spec(parent)
    search = parent_spec.submodule_search_locations if parent_spec is not None else None
    if search is None:
        return None
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec: ModuleSpec | None = find(name, list(search))
        except Exception:  # a third-party finder's failure means "not found here"
            continue
        if spec is not None:
            return spec
    return None


def module_installed(name: str) -> bool:
    """Whether module ``name`` can be found on the import path, without importing it."""
    return _spec(name) is not None


@attrs.define
class PluginInfo:
    """One registered name, as listings show it.

    Attributes:
        name: the registered name (``"echo"``), or for a name several
            distributions register, the distribution-qualified name that
            selects one of them (``"twinkle-echo:echo"``).
        target: a ``"pkg.module:Class"`` string, or the object itself.
        distribution: the distribution that registered it (``None`` in process).
        version: that distribution's version.
        error: why it cannot be used, if it cannot (load failure, duplicate).
        exception: the exception behind ``error``.
        requires: top-level modules the target needs (declared at registration),
            checked by :meth:`Registry.problem` without importing them.
        candidates: for a name several distributions register, each one's claim.
        shadowed: for a first-party name that won, the other distributions' claims.
    """

    name: str
    target: Any
    distribution: str | None = None
    version: str | None = None
    error: str | None = None
    exception: BaseException | None = attrs.field(default=None, repr=False, eq=False)
    requires: tuple[str, ...] = ()
    candidates: list[PluginInfo] = attrs.field(factory=list, repr=False)
    shadowed: list[PluginInfo] = attrs.field(factory=list, repr=False)

    @property
    def available(self) -> bool:
        """Whether selecting this name can work, as far as is known without importing (no load error, no clash)."""
        return self.error is None

    @property
    def target_path(self) -> str:
        """The target as ``"pkg.module:Class"`` (objects registered directly included)."""
        t = self.target
        if t is None or isinstance(t, str):
            return t or ""
        return f"{getattr(t, '__module__', '?')}:{getattr(t, '__qualname__', repr(t))}"

    def describe(self) -> str:
        """``"twinkle-echo 0.1.0 (twinkle_echo.engine:EchoSampler)"``, for messages."""
        who = self.distribution or "in process"
        if self.version:
            who += f" {self.version}"
        return f"{who} ({self.target_path})"


@attrs.define
class _Loaded:
    entry_point: str
    distribution: str | None
    version: str | None
    error: BaseException | None = None


class _PluginScan:
    """Loads entry-point plugin modules once into one pluggy manager; calls their hooks."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.done = False
        self.lock = threading.RLock()
        #: pluggy plugin name ("<distribution>:<entry point>") -> what happened to it
        self.loaded: dict[str, _Loaded] = {}

    def ensure(self) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            if _switch("TWINKLE_DISABLE_PLUGIN_AUTOLOAD"):
                _trace("autoload disabled by TWINKLE_DISABLE_PLUGIN_AUTOLOAD")
                return
            allow = _allow_list()
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                self._load(ep, allow)

    def _load(self, ep: EntryPoint, allow: set[str] | None) -> None:
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        # Distinct per distribution, so two distributions' entry points of one name both load
        # (and their clash can be reported) instead of pluggy refusing the second.
        plugin_name = f"{dist}:{ep.name}"
        if plugin_name in self.loaded:  # one distribution found twice on sys.path
            return
        if allow is not None and ep.name not in allow and _norm(dist) not in allow:
            self.pm.set_blocked(plugin_name)
        if self.pm.is_blocked(plugin_name):
            _trace(f"skipping {ep.name} ({dist}): blocked, not in TWINKLE_PLUGINS")
            return
        _trace(f"loading {ep.name} = {ep.value} from {dist} {version}")
        record = _Loaded(ep.name, dist, version)
        self.loaded[plugin_name] = record
        try:
            self.pm.register(ep.load(), name=plugin_name)
        except Exception as exc:
            _trace(f"failed to load {ep.name}: {exc!r}")
            record.error = exc

    def implementations(self, hook: str) -> list[tuple[str, object]]:
        """``(plugin name, plugin)`` of every loaded plugin implementing ``hook``."""
        caller: pluggy.HookCaller = getattr(self.pm.hook, hook)
        return [(impl.plugin_name, impl.plugin) for impl in caller.get_hookimpls()]

    def call_one(self, hook: str, plugin: object, register: Callable[..., None]) -> None:
        """Call ``hook(register=register)`` on ``plugin`` alone, through pluggy."""
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        self.pm.subset_hook_caller(hook, remove_plugins=others)(register=register)


def _allow_list() -> set[str] | None:
    raw = os.environ.get("TWINKLE_PLUGINS", "").strip()
    if not raw:
        return None
    names = {n.strip() for n in raw.split(",") if n.strip()}
    return names | {_norm(n) for n in names}


_scan = _PluginScan()


def plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager holding every loaded entry-point plugin (scans on first call)."""
    _scan.ensure()
    return _scan.pm


def plugins_scanned() -> bool:
    """Whether the entry points have been scanned yet in this process (``import twinkle_core`` scans none)."""
    return _scan.done


def reset_plugins() -> None:
    """Forget the entry-point scan so the next lookup scans again (tests, after a pip install)."""
    global _scan
    with _scan.lock:
        _scan = _PluginScan()
        for reg in Registry.all_registries:
            reg._forget_plugins()


class Registry(Generic[T]):
    """Names -> lazily imported objects (engine classes, template classes).

    Args:
        kind: what it holds, for messages (``"sampler"``).
        hook: the hookspec name that fills it (``"register_samplers"``).
        unknown_error: the error raised for an unknown name.
        install_hint: ``name -> "pip install ..."`` hints for known first-party names.
        first_party: ``name -> distribution`` owning that name: when the owner
            registers it, its registration wins over any other distribution's.
    """

    all_registries: ClassVar[list[Registry[Any]]] = []

    def __init__(
        self,
        kind: str,
        hook: str,
        unknown_error: type[TwinkleError],
        install_hint: dict[str, str] | None = None,
        first_party: dict[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self.hook = hook
        self.unknown_error = unknown_error
        self.install_hint = install_hint or {}
        self.first_party = first_party or {}
        self._local: dict[str, PluginInfo] = {}
        self._plugin_entries: dict[str, PluginInfo] | None = None
        self._claims: dict[str, list[PluginInfo]] = {}
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

    def _forget_plugins(self) -> None:
        with self._lock:
            self._plugin_entries = None
            self._claims = {}
            self._cache.clear()

    # -- plugins -----------------------------------------------------------------------
    def _plugins(self) -> dict[str, PluginInfo]:
        entries = self._plugin_entries
        if entries is not None:
            return entries
        with self._lock:
            if self._plugin_entries is not None:
                return self._plugin_entries
            scan = _scan
            scan.ensure()
            claims: dict[str, list[PluginInfo]] = {}
            entries = {}
            for plugin_name, plugin in scan.implementations(self.hook):
                record = scan.loaded.get(plugin_name)
                dist, version = (record.distribution, record.version) if record else (None, None)
                try:
                    scan.call_one(self.hook, plugin, self._collector(claims, dist, version))
                except Exception as exc:
                    _trace(f"{dist}.{self.hook} raised {exc!r}")
                    entries[f"<{dist}>"] = PluginInfo(
                        f"<{dist}>", None, dist, version, f"{self.hook} failed: {type(exc).__name__}: {exc}", exc
                    )
            for name, claimed in claims.items():
                entries.update(self._resolve_claims(name, claimed))
            # entry points that failed to import show up under their entry-point name
            for record in scan.loaded.values():
                failure = record.error
                if failure is not None and record.entry_point not in entries:
                    entries[record.entry_point] = PluginInfo(
                        record.entry_point,
                        None,
                        record.distribution,
                        record.version,
                        f"plugin failed to import: {type(failure).__name__}: {failure}",
                        failure,
                    )
            self._claims = claims
            self._plugin_entries = entries
            return entries

    def _collector(
        self, claims: dict[str, list[PluginInfo]], dist: str | None, version: str | None
    ) -> Callable[..., None]:
        """The ``register`` callback handed to one distribution's hook."""

        def register(name: str, target: Any, *, requires: Iterable[str] = ()) -> None:
            if not isinstance(name, str) or not name or ":" in name:
                raise ValueError(f"A {self.kind} name must be a non-empty string without ':', got {name!r}.")
            if target is None or (isinstance(target, str) and not all(_split_target(target))):
                raise ValueError(f"{self.kind.capitalize()} {name!r}: target {target!r} is not 'package.module:Class'.")
            needs = (requires,) if isinstance(requires, str) else tuple(requires)
            if not all(isinstance(r, str) and _is_module_path(r) for r in needs):
                raise ValueError(f"{self.kind.capitalize()} {name!r}: requires={requires!r} must be module names.")
            mine = [c for c in claims.get(name, []) if _norm(c.distribution) == _norm(dist)]
            if mine:  # the same distribution again (say, found twice on sys.path): one claim
                return
            claims.setdefault(name, []).append(PluginInfo(name, target, dist, version, requires=needs))

        return register

    def _resolve_claims(self, name: str, claimed: list[PluginInfo]) -> dict[str, PluginInfo]:
        """The listing rows for one name: itself, plus the qualified names when it is contested."""
        if len(claimed) == 1:
            return {name: claimed[0]}
        qualified = {f"{c.distribution}:{name}": attrs.evolve(c, name=f"{c.distribution}:{name}") for c in claimed}
        owner = self.first_party.get(name)
        winner = next((c for c in claimed if owner and _norm(c.distribution) == _norm(owner)), None)
        if winner is not None:
            others = [c for c in claimed if c is not winner]
            _trace(f"{name!r}: first-party {winner.describe()} wins over {', '.join(c.describe() for c in others)}")
            return {name: attrs.evolve(winner, shadowed=others), **qualified}
        choices = " or ".join(repr(q) for q in qualified)
        error = (
            f"{self.kind.capitalize()} {name!r} is registered by {len(claimed)} distributions:"
            f" {'; '.join(c.describe() for c in claimed)}. Select one by its distribution-qualified name,"
            f" {choices} (create_sampler, a config's 'sampler:' key or 'twinkle sample --engine'),"
            f" or uninstall all but one."
        )
        return {name: PluginInfo(name, None, error=error, candidates=list(claimed)), **qualified}

    # -- lookup ------------------------------------------------------------------------
    def infos(self) -> list[PluginInfo]:
        """Every registered name (in process first, then plugins), sorted by name.

        A name several distributions register is listed once under its own
        name and once per distribution under ``"<distribution>:<name>"``.
        """
        merged = dict(self._plugins())
        merged.update(self._local)
        return [merged[k] for k in sorted(merged)]

    def names(self) -> list[str]:
        """Every registered name."""
        return [i.name for i in self.infos()]

    def info(self, name: str) -> PluginInfo | None:
        """What is registered under ``name`` (a plain or distribution-qualified name), or ``None``."""
        if name in self._local:
            return self._local[name]
        found = self._plugins().get(name)
        if found is None and ":" in name:
            found = self._qualified(name)
        return found

    def _qualified(self, name: str) -> PluginInfo | None:
        """``"<distribution>:<name>"``: that distribution's claim, whether or not the name is contested.

        A contested name is listed under its qualified names already; an
        uncontested one is not, yet the qualified form must still select it
        (a config written on a machine with a second claimant must keep
        working where there is only one).
        """
        prefix, _, short = name.rpartition(":")
        with self._lock:
            self._plugins()
            mine = [c for c in self._claims.get(short, []) if _norm(c.distribution) == _norm(prefix)]
        return attrs.evolve(mine[0], name=name) if mine else None

    def problem(self, info: PluginInfo) -> str | None:
        """Why ``info`` cannot be used, as far as is known without importing its target.

        Checks the registration itself (plugin import, duplicates), that the
        target's module is installed and that the modules it ``requires`` are:
        all by looking them up on the import path, never by running them. An
        engine that is installed but fails when imported passes this check;
        :meth:`get` finds that out.
        """
        if info.error is not None:
            return info.error
        if not isinstance(info.target, str):
            return None
        module = _split_target(info.target)[0]
        if not module_installed(module):
            return f"not installed: no module named {module!r} (for {info.target!r})"
        missing = [r for r in info.requires if not module_installed(r)]
        if missing:
            short = info.name.rpartition(":")[2]
            hint = self.install_hint.get(short)
            needs = f"needs {', '.join(repr(m) for m in missing)}, not installed"
            return needs + (f"; to install: {hint}" if hint else "")
        return None

    def get(self, name: str) -> T:
        """Resolve ``name`` to the registered object, importing it if needed.

        ``name`` is a registered name, a distribution-qualified name
        (``"twinkle-echo:echo"``) or a ``"pkg.module:Class"`` path.

        Raises:
            LookupError: unknown name (with did-you-mean and the install hint)
                or a name claimed by several distributions (saying how to pick one).
            PluginLoadError: the plugin or its target failed to import.
        """
        if not isinstance(name, str):
            raise self.unknown_error(f"{self.kind.capitalize()} name must be a string, got {name!r}.")
        if name in self._cache:
            return self._cache[name]
        with self._lock:
            info = self.info(name)
            if info is None and ":" in name:
                prefix, _, short = name.rpartition(":")
                contested = self._plugins().get(short)
                if contested is not None and not _is_module_path(prefix):
                    known = contested.candidates or [contested, *contested.shadowed]
                    raise self.unknown_error(
                        f"No distribution {prefix!r} registers {self.kind} {short!r}; it is registered by"
                        f" {'; '.join(c.describe() for c in known)}."
                    )
                obj: T = load_target(name)
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
            if info.shadowed:
                others = "; ".join(f"{c.describe()}, selected as '{c.distribution}:{name}'" for c in info.shadowed)
                warnings.warn(
                    f"{self.kind.capitalize()} {name!r} is registered by its first-party distribution"
                    f" {info.describe()} and also by {others}. Using {info.distribution}'s.",
                    UserWarning,
                    stacklevel=3,
                )
            obj = load_target(info.target) if isinstance(info.target, str) else info.target
            self._cache[name] = obj
            return obj

    def _unknown_message(self, name: str) -> str:
        available = [i.name for i in self.infos() if i.available]
        msg = f"Unknown {self.kind} {name!r}."
        # a known-but-not-installed first-party name gets its install hint, not a suggestion
        if name not in self.install_hint:
            msg += did_you_mean(name, set(available) | set(self.install_hint))
        msg += f" Available: {', '.join(available) if available else '(none)'}."
        if name in self.install_hint:
            return msg + f" To install it: {self.install_hint[name]}"
        missing = {k: v for k, v in sorted(self.install_hint.items()) if k not in available}
        if missing:
            msg += " Not installed: " + "; ".join(f"{k}: {v}" for k, v in missing.items())
        return msg
