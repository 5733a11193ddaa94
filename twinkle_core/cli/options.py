"""The sampling options of ``twinkle sample``: one flag per ``SamplingParams`` field, and ``--param``."""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from typing import Any

import attrs
import click

from twinkle_core.data_format import SamplingParams

__all__ = ["FIELD_DEST", "json_or_text", "params_from", "sampling_options", "with_sampling_options"]


def _field_docs(cls: type) -> dict[str, str]:
    """``field -> first sentence`` of its entry in the class docstring's ``Attributes:`` section."""
    docs: dict[str, str] = {}
    text = inspect.getdoc(cls) or ""
    body = text.split("Attributes:", 1)[1] if "Attributes:" in text else ""
    current: str | None = None
    for line in body.splitlines():
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            current = m.group(1)
            docs[current] = m.group(2)
        elif current and line.startswith("        "):
            docs[current] += " " + line.strip()
        elif line.strip():
            current = None
    first = {k: v.replace("``", "").split(". ")[0].rstrip(".") for k, v in docs.items()}
    return {k: v[:1].upper() + v[1:] for k, v in first.items()}


def _click_type(hint: Any) -> tuple[click.ParamType[Any, Any] | None, bool]:
    """The click type of one ``SamplingParams`` field and whether the option repeats.

    ``None`` means a flag (a ``bool``). Types not handled here take a JSON value.
    """
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _click_type(args[0])  # Optional[X]: an unset option already means "the default"
    if hint is bool:
        return None, False
    if hint in (int, float, str):
        scalar: dict[Any, click.ParamType[Any, Any]] = {int: click.INT, float: click.FLOAT, str: click.STRING}
        return scalar[hint], False
    if typing.get_origin(hint) is typing.Literal:
        return click.Choice([str(a) for a in typing.get_args(hint)]), False
    if typing.get_origin(hint) in (tuple, list) and args and args[0] in (int, float, str):
        return _click_type(args[0])[0], True
    return _JSON, False


class _JsonValue(click.ParamType):  # type: ignore[type-arg]  # generic only in newer clicks: no [] at run time
    """A value parsed as JSON, or taken as a plain string when it is not JSON."""

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return json_or_text(value) if isinstance(value, str) else value


_JSON = _JsonValue()


def json_or_text(text: str) -> Any:
    """``text`` parsed as JSON, or ``text`` itself when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


#: Extra spellings of some sampling options (kept from earlier releases).
_SHORT_FLAGS = {"num_samples": ["-n"]}
#: Option names taken by ``twinkle sample`` itself: a field so named is set with --param.
_RESERVED = {
    "engine",
    "model",
    "prompt",
    "input",
    "system",
    "config",
    "adapter",
    "template",
    "output",
    "batch_size",
    "full",
    "format",
    "no_progress",
    "param",
    "help",
}
FIELD_DEST = "sp_"


def sampling_options(params_cls: type = SamplingParams) -> list[click.Option]:
    """One option per field of ``params_cls`` (an attrs class), typed from the field.

    This is where ``twinkle sample`` gets its sampling flags: a field added to
    ``SamplingParams`` becomes an option with no change here. Each option's
    value lands under ``"sp_<field>"``; unset options are ``None``.
    """
    hints = typing.get_type_hints(params_cls)
    docs = _field_docs(params_cls)
    options = []
    for field in attrs.fields(params_cls):
        if field.name in _RESERVED or field.name.startswith("_"):
            continue
        flag = "--" + field.name.replace("_", "-")
        ptype, multiple = _click_type(hints.get(field.name, Any))
        help_text = docs.get(field.name, f"SamplingParams.{field.name}") + (" (repeatable)." if multiple else ".")
        decls = [flag, *_SHORT_FLAGS.get(field.name, []), FIELD_DEST + field.name]
        if ptype is None:
            decls[0] = f"{flag}/--no-{flag[2:]}"
            options.append(click.Option(decls, default=None, help=help_text))
        else:
            options.append(click.Option(decls, type=ptype, multiple=multiple, default=None, help=help_text))
    return options


def with_sampling_options(command: click.Command) -> click.Command:
    """Add the generated ``SamplingParams`` options to ``command`` (after its own)."""
    command.params.extend(sampling_options())
    return command


def params_from(config_params: dict[str, Any], pairs: tuple[str, ...], flags: dict[str, Any]) -> SamplingParams:
    """Merge the config file's ``sampling_params``, ``--param`` pairs and the flags (later wins)."""
    aliases = SamplingParams._aliases  # n, max_new_tokens: each layer names a field its own way
    merged: dict[str, Any] = {}
    for key, value in config_params.items():
        canonical = aliases.get(key, key)
        if canonical in merged:
            raise click.UsageError(f"The config's sampling_params set {canonical} twice (as {key} and its alias).")
        merged[canonical] = value
    from_pairs: dict[str, str] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} (expected KEY=VALUE, e.g. top_p=0.9)", param_hint="--param")
        key = aliases.get(key, key)
        if key in from_pairs:
            raise click.BadParameter(f"{key!r} given twice ({from_pairs[key]!r} and {pair!r})", param_hint="--param")
        from_pairs[key] = pair
        merged[key] = json_or_text(text)
    for dest, value in flags.items():
        if value is None or value == ():
            continue
        key = dest[len(FIELD_DEST) :]
        if key in from_pairs:
            flag = "--" + key.replace("_", "-")
            raise click.UsageError(f"{key} is set twice: by {flag} and by --param {from_pairs[key]}.")
        merged[key] = list(value) if isinstance(value, tuple) else value
    # unknown keys get SamplingParams' own error: the did-you-mean and the accepted keys
    return SamplingParams.from_dict(merged)
