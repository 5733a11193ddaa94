"""Plugin machinery: hookspecs, the engine and template registries, entry-point loading."""

from twinkle_core.plugins.hookspecs import hookimpl, hookspec
from twinkle_core.plugins.registry import (
    ENTRY_POINT_GROUP,
    PluginInfo,
    Registry,
    load_target,
    module_installed,
    plugins_scanned,
    reset_plugins,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "Registry",
    "hookimpl",
    "hookspec",
    "load_target",
    "module_installed",
    "plugins_scanned",
    "reset_plugins",
]
