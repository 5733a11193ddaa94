"""The hooks a twinkle plugin may implement.

A plugin is a module named by an entry point of group ``twinkle``. It imports
only ``twinkle_core`` and registers *strings* (``"pkg.module:Class"``) so that
choosing one engine never imports another::

    from twinkle_core.plugins import hookimpl

    @hookimpl
    def register_samplers(register):
        register("myengine", "my_pkg.engine:MySampler", requires=["my_heavy_lib"])

``requires`` (optional) names the top-level modules the engine needs;
``twinkle engines`` looks them up on the import path, without importing
them, to say whether the engine is installed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import pluggy

__all__ = [
    "PROJECT",
    "Register",
    "hookimpl",
    "hookspec",
    "register_samplers",
    "register_templates",
    "register_tool_parsers",
]

PROJECT = "twinkle"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class Register(Protocol):
    """The ``register`` callback a ``register_*`` hook receives."""

    def __call__(self, name: str, target: Any, *, requires: Iterable[str] = ()) -> None:
        """Register ``target`` (a class or a ``"pkg.module:attr"`` string) as ``name``.

        Args:
            name: the name users select it by; no ``":"`` (that separates a
                distribution-qualified name, ``"my-dist:myengine"``).
            target: the object, or better its import path as a string.
            requires: top-level modules the target needs, checked for presence
                (never imported) when engines are listed.
        """


@hookspec
def register_samplers(register: Register) -> None:
    """Register sampler engines: call ``register(name, "pkg.module:Class")`` once per engine.

    The entry-point name need not equal the engine name: users select the
    name given to ``register``. A plugin module may register several engines.
    """


@hookspec
def register_templates(register: Register) -> None:
    """Register named chat templates: ``register(name, "pkg.module:TemplateClass")``."""


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers: ``register(name, "pkg.module:ParserClass")``.

    A parser turns a completion's text into ``Message.tool_calls``; see
    :class:`twinkle_core.tools.ToolCallParser`. Episodes and ``twinkle serve``
    select one by name (``tool_parser="hermes"``).
    """
