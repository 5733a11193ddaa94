"""``StructuredOutputs``: constrain a completion to a JSON schema, a regex, a choice or a grammar.

The shape is vLLM's ``StructuredOutputsParams`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``; exactly one). Every engine compiles
it with the same grammar library, xgrammar (vLLM's default backend), through
:func:`compile_structured`, so the engines allow the same tokens at every step:
the torch engine uses the compiled grammar itself, the vLLM engine checks it
here before any work and hands the same specification to vLLM.

Importing this module imports nothing heavy; xgrammar is imported by the
first compile (``pip install xgrammar``; the vLLM install brings it).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from twinkle_core.data_format._base import Record
from twinkle_core.errors import InvalidSamplingParams, UnknownSamplingParamError, UnsupportedFeatureError

__all__ = ["MAX_SPEC_CHARS", "StructuredOutputs", "compile_structured", "no_token_left"]

#: The longest schema, regex or grammar accepted (a compile is roughly linear in it).
MAX_SPEC_CHARS = 100_000
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(value: Any, accepted: str) -> InvalidSamplingParams:
    return InvalidSamplingParams(
        f"SamplingParams.structured_outputs={value!r:.200} is invalid: expected {accepted}.", field="structured_outputs"
    )


def _schema(value: Any) -> str | None:
    """A JSON schema (a mapping, or its JSON text) as canonical JSON text."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _bad({"json": value}, f"a JSON schema (its text does not parse: {exc})") from None
    if not isinstance(value, (dict, bool)):
        raise _bad({"json": value}, "a JSON schema: a mapping (or its JSON text)")
    return json.dumps(value, sort_keys=True)


def _choices(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
        raise _bad({"choice": value}, "a non-empty list of non-empty strings")
    return tuple(dict.fromkeys(value))


def _text(kind: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _bad({kind: value}, f"a non-empty {kind} string")
    return value


def _regex(value: Any) -> str | None:
    return _text("regex", value)


def _grammar(value: Any) -> str | None:
    return _text("grammar", value)


@attrs.frozen(kw_only=True)
class StructuredOutputs(Record):
    """What the completion must match; set exactly one field (vLLM's ``StructuredOutputsParams``).

    Attributes:
        json: a JSON schema (a mapping, or its JSON text): the completion is a
            JSON value it accepts.
        regex: a regular expression the whole completion matches.
        choice: the completion is one of these strings.
        grammar: an EBNF (GBNF) grammar, or a Lark one, whose ``root`` the completion is.
        json_object: the completion is any JSON object.

    The completion ends when the constraint is complete and the model draws an
    end-of-sequence token (the only tokens allowed then). One that does not
    complete within ``max_tokens`` ends with ``stop_reason="length"``, holding
    a prefix of a match. ``ignore_eos`` does not apply once the constraint
    is complete: nothing else can follow.
    """

    _error = InvalidSamplingParams
    _unknown_error = UnknownSamplingParamError

    json: str | None = attrs.field(default=None, converter=_schema)
    regex: str | None = attrs.field(default=None, converter=_regex)
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    grammar: str | None = attrs.field(default=None, converter=_grammar)
    json_object: bool = attrs.field(default=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise _bad({"json_object": self.json_object}, "json_object True or False")
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _bad(
                {k: getattr(self, k) for k in given},
                f"exactly one of {', '.join(_KINDS)} (got {len(given)}: {', '.join(given) or 'none'})",
            )
        kind, spec = self.spec()
        if len(spec) > MAX_SPEC_CHARS:
            asked = self.kind  # a choice is compiled as a grammar: its limit is that grammar's length
            written = f"{spec[:80]}..." if asked == kind else f"{len(self.choice or ())} choices"
            limit = f"at most {MAX_SPEC_CHARS} characters" + ("" if asked == kind else " as a grammar")
            raise _bad({asked: written}, f"a {asked} of {limit}")

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputs | None:
        """A ``StructuredOutputs``, its dict, or ``None``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            if value.get("json_object") is False and all(value.get(k) is None for k in _KINDS if k != "json_object"):
                # named, not reported as {}: False asks for no constraint (a record's to_dict() writes it beside one)
                raise _bad(value, "json_object true when it is the constraint (leave structured_outputs out for none)")
            try:
                return cls.from_dict(value)
            except InvalidSamplingParams as exc:
                if exc.field is not None:
                    raise
                # an unknown key: say where it was, so a server can name the field
                raise InvalidSamplingParams(
                    f"SamplingParams.structured_outputs: {exc}", field="structured_outputs"
                ) from None
        raise _bad(value, "None, a StructuredOutputs or a mapping such as {'regex': '[0-9]+'}")

    @property
    def kind(self) -> str:
        """Which constraint it is: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> tuple[str, str]:
        """``(kind, text)``: the schema, regex or grammar text (a choice as vLLM's EBNF grammar)."""
        kind = self.kind
        if kind == "json":
            return kind, str(self.json)
        if kind == "json_object":
            return kind, '{"type": "object"}'
        if kind == "choice":
            assert self.choice is not None
            return "grammar", "root ::= " + " | ".join(f'"{_ebnf_escape(c)}"' for c in self.choice)
        return kind, str(getattr(self, kind))

    def to_vllm(self) -> dict[str, Any]:
        """The keyword arguments of vLLM's ``StructuredOutputsParams``."""
        kind = self.kind
        if kind == "json_object":
            return {"json_object": True}
        if kind == "choice":
            return {"choice": list(self.choice or ())}
        return {kind: getattr(self, kind)}


def _ebnf_escape(text: str) -> str:
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
    return "".join(escapes.get(ch, f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch) for ch in text)


_compilers: dict[tuple[int, int], Any] = {}
_lock = threading.Lock()


def _compiler(tokenizer: Any, vocab: int) -> Any:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise UnsupportedFeatureError(
            "SamplingParams.structured_outputs needs the xgrammar library: pip install xgrammar"
            " (the vLLM install brings it)."
        ) from exc
    key = (id(tokenizer), vocab)
    with _lock:
        found = _compilers.get(key)
        if found is None or found[0] is not tokenizer:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
            found = _compilers[key] = (tokenizer, xgr.GrammarCompiler(info, cache_enabled=True))
    return found[1]


def compile_structured(structured: StructuredOutputs, tokenizer: Any, vocab: int, stop_ids: Sequence[int]) -> Any:
    """A fresh xgrammar ``GrammarMatcher`` for ``structured`` (one per sequence), compiled as vLLM compiles it.

    ``stop_ids`` are the tokens that may end a complete match (vLLM passes
    every stop id of the request: the end-of-sequence ids and ``stop_token_ids``).

    Raises:
        InvalidSamplingParams: the schema, regex or grammar does not compile.
        UnsupportedFeatureError: xgrammar is not installed.
    """
    import xgrammar as xgr

    compiled = compiled_grammar(structured, tokenizer, vocab)
    return xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_ids)) or None)


def compiled_grammar(structured: StructuredOutputs, tokenizer: Any, vocab: int) -> Any:
    """The xgrammar ``CompiledGrammar`` of ``structured`` (cached by xgrammar)."""
    compiler = _compiler(tokenizer, vocab)
    kind, spec = structured.spec()
    try:
        if kind in ("json", "json_object"):
            return compiler.compile_json_schema(spec, any_whitespace=True)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if _likely_lark(spec):
            return compiler.compile_lark(spec)
        return compiler.compile_grammar(spec)
    except (RuntimeError, ValueError) as exc:
        lines = str(exc).strip().splitlines()
        # xgrammar prefixes "[time] file.cc:line: "
        message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[-1]) if lines else type(exc).__name__
        raise InvalidSamplingParams(
            f"SamplingParams.structured_outputs {kind}={spec[:200]!r} does not compile: {message}",
            field="structured_outputs",
        ) from None


def no_token_left(structured: StructuredOutputs, generated: int | None = None) -> InvalidSamplingParams:
    """The error for a constraint that compiled but admits no token at some position (``generated``: after how many).

    A rule that only refers to itself, an empty character class, or a grammar
    whose next tokens the other constraints all remove; every engine reports it so.
    """
    kind, spec = structured.spec()
    where = "" if generated is None else f" after {generated} token(s)"
    return InvalidSamplingParams(
        f"SamplingParams.structured_outputs {structured.kind}={spec[:200]!r} leaves no token to draw{where}: its"
        f" {kind} admits no token that allowed_token_ids, bad_words and min_tokens also allow (or none at all, as"
        " a rule that only refers to itself does).",
        field="structured_outputs",
    )


def _likely_lark(grammar: str) -> bool:
    """vLLM's test: a grammar with no ``::=`` rule outside comments is Lark."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.split("\n"))
    return not any("::=" in line for line in lines)
