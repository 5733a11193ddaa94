"""Chat templates and their registry (``register_templates`` hook, ``set_template('name')``)."""

from __future__ import annotations

from typing import Any

from twinkle_core.errors import UnknownTemplateError
from twinkle_core.plugins.registry import PluginInfo, Registry
from twinkle_core.template.base import CHATML_JINJA, ChatMLTemplate, Template, load_tokenizer

__all__ = [
    "CHATML_JINJA",
    "ChatMLTemplate",
    "Template",
    "get_template",
    "list_templates",
    "load_tokenizer",
    "register_template",
    "template_registry",
]

template_registry: Registry[type[Template]] = Registry("template", "register_templates", UnknownTemplateError)
template_registry.register("hf", Template)
template_registry.register("chatml", ChatMLTemplate)


def register_template(name: str, target: Any = None, *, replace: bool = False) -> Any:
    """Register a template class (or ``"pkg.mod:Class"``) as ``name``; a decorator without ``target``."""
    return template_registry.register(name, target, replace=replace)


def get_template(name: str) -> type[Template]:
    """Resolve a registered template name to its class.

    Raises:
        UnknownTemplateError: no such name (with did-you-mean and the names available).
    """
    return template_registry.get(name)


def list_templates() -> list[PluginInfo]:
    """Every registered template name."""
    return template_registry.infos()
