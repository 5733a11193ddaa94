"""Checks of a weight update that every engine shares: one wording, engine rules on top.

An engine describes what it accepts as a mapping of name -> :class:`TensorSpec`
and calls :func:`check_update`; it adds only its own rules (vLLM: layers that
must arrive together). :func:`find_non_finite` is what ``update_weights`` and
``add_adapter_to_model`` run before anything reaches an engine; the latter
also runs :func:`find_not_floating` on in-memory adapter tensors.

Torch is imported only when a check runs (tensors cannot exist without it).
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from twinkle_core.errors import WeightUpdateError, did_you_mean
from twinkle_core.names import unserved_part

__all__ = [
    "TRANSFER_DTYPES",
    "TensorSpec",
    "block_checksum",
    "check_pair",
    "check_tensor",
    "check_update",
    "find_non_finite",
    "find_not_floating",
    "tensor_checksum",
]


#: The dtypes a tensor may have on the wire of the server's weight-transfer routes (gloo broadcasts).
TRANSFER_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


@attrs.frozen
class TensorSpec:
    """What one named tensor of an update must look like.

    Attributes:
        shape: the exact shape.
        dtype: the dtype name without ``torch.`` (``"float32"``, ``"int64"``).
    """

    shape: tuple[int, ...]
    dtype: str


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def check_update(
    named_tensors: Sequence[tuple[str, Any]],
    spec: Mapping[str, TensorSpec],
    *,
    float_dtype: str | None = None,
) -> dict[str, Any]:
    """Check an update against ``spec``; return it as a dict in the given order.

    Args:
        named_tensors: ``(name, tensor)`` pairs.
        spec: every name the engine accepts.
        float_dtype: the dtype floating-point tensors must have (an engine that
            runs in one dtype). ``None``: any floating-point dtype is accepted
            for a floating-point weight (the engine casts on copy).

    Raises:
        WeightUpdateError: an unknown or repeated name, a value that is not a
            tensor or holds no data (``meta`` device), a wrong shape or dtype.
            The message names the tensor and what was expected; nothing is applied.
    """

    out: dict[str, Any] = {}
    for name, value in named_tensors:
        if name in out:
            raise WeightUpdateError(f"update_weights: {name!r} is given twice; nothing was updated.")
        if name not in spec:
            part = unserved_part(name)
            if part is not None:
                raise WeightUpdateError(
                    f"update_weights: {name!r} belongs to {part} of the checkpoint, which this engine does not run"
                    " (it loaded the language model only); leave those tensors out of the update. Nothing was updated."
                )
            example = next(iter(spec), "")
            raise WeightUpdateError(
                f"update_weights: {name!r} is not a weight of this model.{did_you_mean(name, spec)}"
                f" Names are the model's Hugging Face state_dict keys, e.g. {example!r}; nothing was updated."
            )
        check_tensor(name, value)
        want = spec[name]
        if tuple(value.shape) != tuple(want.shape):
            raise WeightUpdateError(
                f"update_weights: {name!r} has shape {tuple(value.shape)}, expected {tuple(want.shape)};"
                " nothing was updated."
            )
        got = _dtype_name(value)
        if _is_float(want.dtype) and float_dtype is not None:
            expected, ok = float_dtype, got == float_dtype
        elif _is_float(want.dtype):
            expected, ok = f"{want.dtype} (or another floating-point dtype)", _is_float(got)
        else:
            expected, ok = want.dtype, got == want.dtype
        if not ok:
            raise WeightUpdateError(
                f"update_weights: {name!r} has dtype {got}, expected {expected};"
                f" send tensor.to(torch.{expected.split()[0]})."
                " Nothing was updated."
            )
        out[name] = value
    return out


def check_pair(index: int, item: Any) -> tuple[str, Any]:
    """``item`` as a ``(name, value)`` pair, else a :class:`WeightUpdateError` naming ``named_tensors[index]``."""
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
        raise WeightUpdateError(f"named_tensors[{index}] is invalid: expected a (name, tensor) pair.")
    return item


def check_tensor(name: str, value: Any) -> None:
    """Refuse a value that is not a torch tensor holding data (a ``meta`` tensor holds none).

    Raises:
        WeightUpdateError: naming the tensor; nothing is applied.
    """
    import torch

    if not isinstance(value, torch.Tensor):
        raise WeightUpdateError(
            f"update_weights: {name!r} is a {type(value).__name__}, expected a torch.Tensor; nothing was updated."
        )
    if value.device.type == "meta":
        raise WeightUpdateError(
            f"update_weights: {name!r} is on the 'meta' device and holds no data; nothing was updated."
        )


def find_not_floating(named_tensors: Iterable[Any]) -> str | None:
    """Describe the first torch tensor that is not floating point (adapter weights), or return ``None``."""
    if "torch" not in sys.modules:  # no tensor can exist
        return None
    import torch

    for entry in named_tensors:
        tensor = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else None
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
            return f"{entry[0]!r} has dtype {tensor.dtype}; expected a floating-point tensor"
    return None


def find_non_finite(named_tensors: Iterable[Any], into: str | None = None) -> str | None:
    """Describe the first floating-point tensor holding NaN or infinity, or return ``None``.

    ``named_tensors`` holds ``(name, value)`` pairs; values that are not
    torch tensors are left to the engine's own checks. ``into``: the dtype
    (its name) the engine casts values to; a value is checked as it will be
    after that cast when the cast narrows its range (finite in float64,
    infinite as float32).
    """
    if "torch" not in sys.modules:  # no tensor can exist
        return None
    import torch

    target = getattr(torch, into, None) if into else None
    target = target if isinstance(target, torch.dtype) and target.is_floating_point else None

    for entry in named_tensors:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            continue
        name, value = entry
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.device.type == "meta":
            continue
        sent = value = value.detach()  # a trainer's parameter: reading it needs no graph (and torch warns otherwise)
        if target is not None and torch.finfo(target).max < torch.finfo(value.dtype).max:
            value = value.to(target)  # the engine's cast may overflow: check what it will hold
        elif value.element_size() == 1:  # float8: no reductions of its own; float32 holds every value
            value = value.float()
        # One reduction first: a finite sum proves every element finite (NaN and inf propagate);
        # only a non-finite sum (which an overflow could also cause) pays for the exact check.
        if math.isfinite(float(value.sum())):
            continue
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            at = int((~finite).reshape(-1).nonzero()[0])
            first, given = value.reshape(-1)[at].item(), sent.reshape(-1)[at].item()
            what = (
                f"non-finite value(s) (first: {first})"
                if not math.isfinite(given)
                else f"value(s) beyond {into}'s range (first: {given:g}, which becomes {first} as {into})"
            )
            return f"{name!r} holds {bad} {what}; pass check_finite=False to skip this check"
    return None


def block_checksum(data: Any, block: int = 4096) -> int:
    """A 64-bit checksum of a uint8 tensor, computed where the tensor lives.

    The bytes are read as 64-bit words, summed per block of ``block`` words,
    and the block sums are added with weights 1, 2, 3...: any changed word
    changes the sum, and so does moving data between blocks (a wrong offset).
    Integer sums wrap deterministically, so both sides agree bit for bit. It
    runs at memory speed with torch's reductions (about three times CRC-32 on
    a CPU, and on the GPU without a host round trip).
    """
    import torch

    whole = data.numel() // 8 * 8
    words = data[:whole].view(torch.int64)
    nblocks = words.numel() // block
    sums = words[: nblocks * block].view(nblocks, block).sum(dim=1)
    weights = torch.arange(1, nblocks + 1, dtype=torch.int64, device=data.device)
    total = int((sums * weights).sum().item()) + int(words[nblocks * block :].sum().item())
    tail = bytes(data[whole:].cpu().tolist())
    return (total ^ zlib.crc32(tail)) & 0xFFFFFFFFFFFFFFFF


def tensor_checksum(tensor: Any) -> int:
    """:func:`block_checksum` of a contiguous tensor's bytes, as a signed 64-bit integer (0 when empty).

    Signed, so a list of them fits an ``int64`` tensor (how the server's
    weight routes receive them).
    """
    import torch

    if not tensor.numel():
        return 0
    raw = block_checksum(tensor.reshape(-1).view(torch.uint8))
    return raw - (1 << 64) if raw >= 1 << 63 else raw
