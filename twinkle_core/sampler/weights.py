"""New base weights: checked before anything is applied, then applied through the policy state's one change path."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from twinkle_core.engine import Engine
from twinkle_core.errors import IncompleteUpdateError, TwinkleError, WeightUpdateError
from twinkle_core.sampler.policy import AppliedWithError, PolicyState
from twinkle_core.weights import check_pair, find_non_finite

__all__ = ["update_weights"]


def _checked_stream(
    pairs: Iterable[Any], check_finite: bool, into: str | None, seen: list[str]
) -> Iterator[tuple[str, Any]]:
    """``pairs`` read lazily, each checked as a list is checked; at least one.

    ``into``: the engine's weights dtype (see :func:`find_non_finite`). The
    name of each pair handed on is appended to ``seen``.
    """
    count = 0
    for i, item in enumerate(pairs):
        check_pair(i, item)
        if check_finite:
            bad = find_non_finite([item], into)
            if bad is not None:
                raise WeightUpdateError(f"update_weights: {bad}; nothing was updated.")
        count += 1
        seen.append(item[0])
        yield item
    if not count:
        raise WeightUpdateError("update_weights got no tensors.")


def _checked(named_tensors: Any, engine: Engine, check_finite: bool, names: list[str]) -> Any:
    """What the engine is handed: a checked list, or a stream checked as it is read (``names`` fills as it goes)."""
    info = engine.info
    if isinstance(named_tensors, Mapping):
        items = list(named_tensors.items())
    elif not isinstance(named_tensors, Iterable) or isinstance(named_tensors, (str, bytes)):
        raise WeightUpdateError(
            f"update_weights got {type(named_tensors).__name__} {named_tensors!r:.60}: expected a mapping of"
            " names to tensors, or (name, tensor) pairs; nothing was updated."
        )
    elif isinstance(named_tensors, (list, tuple)) or not info.streams_weights:
        items = list(named_tensors)
    else:  # a stream the engine reads once, as it goes: each pair is checked as it comes
        return _checked_stream(named_tensors, check_finite, info.weights_dtype, names)
    for i, item in enumerate(items):
        check_pair(i, item)
    if not items:
        raise WeightUpdateError("update_weights got no tensors.")
    if check_finite:
        bad = find_non_finite(items, info.weights_dtype)
        if bad is not None:
            raise WeightUpdateError(f"update_weights: {bad}; nothing was updated.")
    names.extend(name for name, _ in items)
    return items


def update_weights(
    engine: Engine,
    state: PolicyState,
    named_tensors: Any,
    *,
    version: int | None,
    check_finite: bool,
    in_flight: str,
) -> int:
    """``Sampler.update_weights``: check, then apply under ``in_flight``; the new version.

    A refusal (a twinkle error) changed nothing; any other failure, or an
    ``IncompleteUpdateError``, leaves the handed tensors in doubt until pushed again.
    """
    names: list[str] = []  # what the engine was handed (of a stream: what it read)
    items = _checked(named_tensors, engine, check_finite, names)

    def apply(new_version: int) -> None:
        try:
            engine.update_weights(items, version=new_version)
        except AppliedWithError:  # applied everywhere in the end
            state.settle(names)
            raise
        except IncompleteUpdateError as exc:
            state.doubt(new_version, names, exc)
            raise
        except TwinkleError:  # a refusal: the engine changed nothing (the contract)
            raise
        except BaseException as exc:  # an interrupt or the engine's own failure, maybe part-way
            state.doubt(new_version, names, exc)
            raise
        state.settle(names)

    return state.change(in_flight, version, apply, lambda _version, _result: None)
