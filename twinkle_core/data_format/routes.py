"""Routed experts: which experts each mixture-of-experts layer sent each token to.

An engine that records them (``SamplingParams.return_routed_experts``)
returns, per sequence, one integer array of shape
``[tokens, moe_layers, top_k]``: for every token the engine forwarded (the
prompt, then each generated token but the last, which no forward read: vLLM's
``num_tokens - 1``), for each MoE layer in model order, the ``top_k`` expert
ids in the router's order. The dtype is the smallest that holds the expert
ids (``uint8`` up to 256 experts, then ``uint16``, then ``int32``), as vLLM's.

On the wire (``to_dict``, the CLI's JSON lines, the server) the array is the
base64 text of its ``.npy`` bytes, as vLLM's server sends it::

    np.load(io.BytesIO(base64.b64decode(text)))

numpy is imported only when a route array is built or read, so the core stays
importable without it.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any

from twinkle_core.errors import InvalidInputError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["decode_routes", "encode_routes", "is_routes", "routes_dtype", "to_routes"]


def routes_dtype(num_experts: int) -> str:
    """The smallest integer dtype that holds expert ids below ``num_experts``."""
    if num_experts <= 256:
        return "uint8"
    if num_experts <= 65536:
        return "uint16"
    return "int32"


def is_routes(value: object) -> bool:
    """Whether ``value`` is a numpy array (without importing numpy)."""
    return type(value).__name__ == "ndarray" and type(value).__module__ == "numpy"


def encode_routes(routes: np.ndarray) -> str:
    """The base64 text of ``routes``' ``.npy`` bytes (JSON-safe)."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_routes(text: str) -> np.ndarray:
    """The array :func:`encode_routes` encoded."""
    import numpy as np

    try:
        return np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)  # type: ignore[no-any-return]
    except (ValueError, OSError) as exc:
        raise InvalidInputError(
            f"routed_experts={text!r:.40} is invalid: expected the base64 text of a .npy array ({exc})."
        ) from None


def to_routes(value: Any) -> np.ndarray | None:
    """A ``[tokens, layers, top_k]`` integer array from an array, its base64 ``.npy`` text or nested lists."""
    if value is None:
        return None
    import numpy as np

    array = decode_routes(value) if isinstance(value, str) else np.asarray(value)
    if array.size == 0 and array.ndim != 3:
        array = array.reshape(0, 0, 0)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise InvalidInputError(
            f"routed_experts of shape {array.shape} and dtype {array.dtype} is invalid: expected integers of shape"
            " [tokens, moe_layers, top_k]."
        )
    return array
