"""Shared machinery of the data formats: dict round trips and key checking."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, ClassVar, TypeVar

import attrs

from twinkle_core.data_format.media import is_image_object, to_data_url
from twinkle_core.data_format.routes import encode_routes, is_routes
from twinkle_core.errors import InvalidInputError, TwinkleError, UnknownFieldError, did_you_mean

__all__ = ["Record"]

R = TypeVar("R", bound="Record")


class _RecordType(type):
    """The records' metaclass: the constructor takes the aliases as keywords, as ``from_dict`` takes them as keys.

    attrs writes ``__init__`` from the fields alone, so the alias is renamed to
    its field here, before that ``__init__`` runs (``__new__`` sees the keywords
    but cannot change what ``__init__`` receives).
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        aliases: dict[str, str] = getattr(cls, "_aliases", {})
        if aliases and not aliases.keys().isdisjoint(kwargs):
            kwargs = _canonical_keys(cls, kwargs, aliases, "keyword")
        return super().__call__(*args, **kwargs)


def _canonical_keys(cls: Any, data: dict[str, Any], aliases: dict[str, str], what: str) -> dict[str, Any]:
    """``data`` with each alias renamed to its field; a field given under both names is refused."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        field = aliases.get(key, key)
        if field in out:
            raise cls._error(f"{cls.__name__} {what} {field!r} given twice (as {key!r} and its alias).")
        out[field] = value
    return out


class Record(metaclass=_RecordType):
    """Mixin for attrs classes that round-trip through plain (JSON) dicts.

    Subclasses set ``_error`` to the error class of their bad values,
    ``_unknown_error`` to that of unknown keys (a subclass of ``_error`` and of
    ``TypeError``), and may set ``_aliases`` (accepted alternative name -> field
    name, as a keyword of the constructor and as a key of :meth:`from_dict`).
    An unknown keyword to the constructor raises ``_unknown_error`` naming the
    accepted ones, as :meth:`from_dict` does for an unknown key, rather than
    Python's bare ``TypeError``.
    """

    _error: ClassVar[type[TwinkleError]] = InvalidInputError
    _unknown_error: ClassVar[type[TwinkleError]] = UnknownFieldError
    _aliases: ClassVar[dict[str, str]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # attrs writes __init__; its keyword check would be a bare TypeError. Every
        # construction passes through here first, so the names are checked here.
        if kwargs:
            names = cls._init_names()
            for key in kwargs:
                if key not in names:
                    raise cls._unknown_error(cls._unknown_message(key, "keyword", names))
        return super().__new__(cls)

    @classmethod
    @functools.cache
    def _init_names(cls) -> dict[str, None]:
        """The constructor's keywords, in order (a dict: one lookup per keyword); once per class."""
        return dict.fromkeys(f.alias for f in attrs.fields(cls) if f.init)  # type: ignore[arg-type]

    @classmethod
    def _unknown_message(cls, key: object, what: str, names: Iterable[str]) -> str:
        hint = did_you_mean(str(key), [*names, *cls._aliases])
        return f"Unknown {cls.__name__} {what} {key!r}.{hint} Accepted {what}s: {', '.join(names)}."

    def to_dict(self) -> dict[str, Any]:
        """Return a plain, JSON-serialisable dict of this record."""
        return attrs.asdict(self, recurse=True, value_serializer=_serialise)  # type: ignore[arg-type]

    @classmethod
    def _field_names(cls) -> list[str]:
        return [f.name for f in attrs.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def _check_keys(cls, data: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise cls._error(f"{cls.__name__}.from_dict expects a dict, got {type(data).__name__}: {data!r}")
        names = cls._field_names()
        for key in data:
            if cls._aliases.get(key, key) not in names:
                raise cls._unknown_error(cls._unknown_message(key, "key", names))
        return _canonical_keys(cls, data, cls._aliases, "key")

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any]) -> R:
        """Build the record from a dict such as :meth:`to_dict` returns.

        Raises:
            TwinkleError: a ``ValueError`` subclass naming any unknown key.
        """
        fields = cls._check_keys(data)
        try:
            return cls(**fields)
        except TypeError as exc:  # a required key is missing (attrs says so in a TypeError)
            raise cls._error(f"{cls.__name__}.from_dict({data!r:.80}) is invalid: {exc}.") from None


def _serialise(_inst: Any, _field: Any, value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if is_routes(value):  # routed experts: the base64 text of their .npy bytes, as vLLM's server sends them
        return encode_routes(value)
    if isinstance(value, (bytes, bytearray)) or is_image_object(value):  # media: a data: URL, lossless
        return to_data_url(value)
    return value


def check_extra(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``extra`` (user data carried along) is a dict."""
    if not isinstance(value, dict):
        raise InvalidInputError(
            f"{type(inst).__name__}.{attribute.name}={value!r:.80} is invalid: expected a dict (user data carried"
            " along)."
        )
