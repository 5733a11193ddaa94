"""The hooks a twinkle plugin may implement.

A plugin is a module named by an entry point of group ``twinkle``. It imports
only ``twinkle_core`` and registers *strings* (``"pkg.module:Class"``) so that
choosing one engine never imports another::

    from twinkle_core.plugins import hookimpl

    @hookimpl
    def register_samplers(register):
        register("myengine", "my_pkg.engine:MySampler")
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec", "register_samplers", "register_templates"]

PROJECT = "twinkle"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: ``register(name, target)``: target is a class or a ``"pkg.module:attr"`` string.
Register = Callable[[str, Any], None]


@hookspec
def register_samplers(register: Register) -> None:
    """Register sampler engines: call ``register(name, "pkg.module:Class")`` once per engine."""


@hookspec
def register_templates(register: Register) -> None:
    """Register named chat templates: ``register(name, "pkg.module:TemplateClass")``."""
