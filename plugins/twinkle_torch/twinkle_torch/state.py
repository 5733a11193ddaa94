"""The per-row state of a hybrid model's recurrent layers, carried like keys and values.

Two kinds of mixer keep one, each in a ``transformers`` ``LinearAttentionLayer``
of its own (one per ``"linear_attention"`` entry of ``layer_types``):

- a **Gated DeltaNet** layer (Qwen3.5, Qwen3-Next): a convolution state
  ``[conv_dim, kernel]`` in the model's dtype (the last ``kernel`` inputs of its
  short causal convolution) and a recurrent state ``[heads, key_dim,
  value_dim]`` in float32;
- a **Mamba-2** layer (Granite 4.0 hybrid, Bamba): a convolution state
  ``[heads x head_dim + 2 x groups x state_size, kernel]`` in the model's dtype
  and an SSM state ``[heads, head_dim, state_size]`` in float32 (its chunked
  scan computes in float32, and the decode step keeps that dtype).

A **short-convolution** layer (LFM2's ``"conv"`` layers) keeps only a
convolution state, ``[hidden_size, conv_L_cache]`` in the model's dtype, in a
``LinearAttentionLayer`` of its own as well.

All are constant in the sequence's length, and none can be rolled back: a
token once folded in stays. ``transformers``' ``LinearAttentionLayer`` holds
them for one ``generate`` call; :class:`StateLayer` is that layer plus what the
decode loop does to rows (:mod:`twinkle_torch.cache` speaks to both kinds of
layer):

- **select**: keep, drop or repeat rows (finished rows pruned, one prefill
  shared by its samples). The state has no columns, so the leading columns
  an attention layer trims do not concern it.
- **join**: the rows of a new prefill appended to the running batch's.
  Attention layers right-align their columns; a state is simply stacked.
- **gather**: one batch's state built from prefills run in several chunks.

Left padding is exact: both mixers zero the hidden states of padded positions
before their input projection (which has no bias in these families) and the
convolution's output there, so a pad adds nothing to either state (its
convolution inputs are the zeros an empty state starts with). What the loop
never does to a state is rewind it: a row that must go back (an out-of-memory
eviction, an abort that is resumed) is prefilled again from its tokens.

A layer that holds a state *and* keys and values (``transformers``'
``LinearAttentionAndFullAttentionLayer``, the ``"hybrid"`` layers of Falcon-H1
and Zamba2) is not carried: :func:`carries_state` refuses such a model, as it
does one whose mixer is neither kind (its state's size, which the budget
must count, is unknown here).

The state is part of a row's memory, like its keys and values, and the
batch's token budget counts it: :func:`state_tokens_per_row` converts its
bytes into the KV-cache tokens that would take as much memory.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

__all__ = [
    "StateLayer",
    "carries_state",
    "gather_states",
    "kv_bytes_per_token",
    "row_state_bytes",
    "state_tokens_per_row",
    "uncarried_state",
]

#: The config fields of a Gated DeltaNet mixer: what :func:`row_state_bytes` reads.
_GDN_FIELDS = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)

#: The config fields of a Mamba-2 mixer, as Granite 4.0 hybrid and Bamba spell them: heads, head
#: dim, state size, groups, convolution kernel. Nemotron-H spells them otherwise and stays refused:
#: its own cached decode in ``transformers`` 5.19 drifts from its full forward (see docs/hybrid-models.md).
_MAMBA2_FIELDS = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv")

#: Layer types that keep no keys and values (``transformers`` gives the last two an empty state layer).
_NO_KV_TYPES = frozenset({"linear_attention", "conv", "mlp", "moe"})

StateTensors = list[tuple[torch.Tensor | None, torch.Tensor | None]]


class StateLayer(LinearAttentionLayer):  # type: ignore[misc]  # transformers' class is untyped (Any) to mypy
    """One linear-attention layer's conv and recurrent states, one row per sequence of the batch.

    It reads and writes as ``transformers``' ``LinearAttentionLayer`` does
    (the model's own layer calls ``update_conv_state`` and
    ``update_recurrent_state`` and, in a single-token step, updates the conv
    state in place), and adds the row operations of the decode loop.
    """

    def states(self) -> StateTensors:
        """Per state index, its ``(conv, recurrent)`` tensors (``None`` where not written yet)."""
        return [(self.conv_states[i], self.recurrent_states[i]) for i in range(self.number_of_states)]

    def rows(self) -> int:
        """How many rows the layer holds (0 before its first forward)."""
        for conv, recurrent in self.states():
            for tensor in (conv, recurrent):
                if tensor is not None:
                    return int(tensor.shape[0])
        return 0

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) the rows ``rows``, in that order."""
        self.adopt([(_take(conv, rows), _take(recurrent, rows)) for conv, recurrent in self.states()])

    def joined(self, other: StateLayer) -> StateTensors:
        """The rows of this layer then those of ``other``; :meth:`adopt` installs them.

        Two steps, as :meth:`twinkle_torch.cache.PreallocatedLayer.joined`: running
        out of memory halfway through a cache leaves every layer as it was.
        """
        out: StateTensors = []
        for (conv_a, rec_a), (conv_b, rec_b) in zip(self.states(), other.states()):
            out.append((_stack(conv_a, conv_b), _stack(rec_a, rec_b)))
        return out

    def adopt(self, states: StateTensors) -> None:
        """Take ``states`` (from :meth:`joined`, :meth:`select` or a gather) as this layer's, as after a prefill."""
        for index, (conv, recurrent) in enumerate(states):
            self.conv_states[index] = conv
            self.recurrent_states[index] = recurrent
            self.is_conv_states_initialized[index] = conv is not None
            self.is_recurrent_states_initialized[index] = recurrent is not None
            # a state that was written holds the rows' past: the next forward continues it
            self.has_previous_state[index] = conv is not None or recurrent is not None
            if conv is not None:
                self.dtype, self.device = conv.dtype, conv.device
                self.conv_kernel_size[index] = int(conv.shape[-1])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        count = self.rows()
        if count:
            self.select(torch.arange(count, device=self.device).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select(beam_idx)

    @property
    def is_croppable(self) -> bool:
        return False  # a recurrent state cannot be rolled back: a row that must go back is prefilled again

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("a linear-attention state cannot be cropped: prefill the row again from its tokens")


def _take(tensor: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor.index_select(0, rows.to(tensor.device))


def _stack(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    if first is None or second is None:
        assert first is None and second is None, "joined caches must have run the same layers"
        return None
    return torch.cat([first, second])


def gather_states(
    layer: StateLayer, buffers: StateTensors | None, rows: int, src: torch.Tensor, dest: torch.Tensor
) -> StateTensors:
    """Copy rows ``src`` of ``layer`` into rows ``dest`` of ``buffers`` (allocated for ``rows`` rows on first use)."""
    states = layer.states()
    if buffers is None:
        buffers = [
            (
                None if conv is None else conv.new_empty(rows, *conv.shape[1:]),
                None if rec is None else rec.new_empty(rows, *rec.shape[1:]),
            )
            for conv, rec in states
        ]
    for (new_conv, new_rec), (conv, rec) in zip(buffers, states):
        if new_conv is not None and conv is not None:
            new_conv[dest] = conv[src]
        if new_rec is not None and rec is not None:
            new_rec[dest] = rec[src]
    return buffers


def carries_state(config: Any) -> bool:
    """Whether :class:`StateLayer` can carry every stateful layer ``transformers`` builds for ``config``."""
    return uncarried_state(config) is None


def uncarried_state(config: Any) -> str | None:
    """Why :class:`StateLayer` cannot carry the state of a model of ``config``; ``None`` when it can.

    It can for a model whose recurrent layers are Gated DeltaNet (Qwen3.5,
    Qwen3-Next) or Mamba-2 mixers (Granite 4.0 hybrid, Bamba), or LFM2's short
    convolutions, each kept in a plain ``LinearAttentionLayer``. A model whose layers hold a state and keys
    and values in one (``LinearAttentionAndFullAttentionLayer``: Falcon-H1,
    Zamba2), or a state of a shape not known here (Mamba-1, RWKV...), stays
    refused, as does a Mamba-2 mixer whose input projection has a bias (its
    padded positions would feed that bias into the convolution: left padding
    would not be exact).
    """
    text = config.get_text_config(decoder=True)
    layers = DynamicCache(config=config).layers
    mixed = sorted(
        {type(layer).__name__ for layer in layers if type(layer) not in (DynamicLayer, LinearAttentionLayer)}
    )
    if mixed:
        return f"its cache has layers the engine cannot carry ({', '.join(mixed)})"
    if not layers or _state_shape(text) is None:
        return "its state is of a kind the engine does not know the shape of"
    if _mamba2_shape(text) is not None and getattr(text, "mamba_proj_bias", False):
        return "its Mamba-2 input projection has a bias (mamba_proj_bias), which padded positions would fold in"
    return None


def _layer_types(text: Any) -> list[str]:
    return list(getattr(text, "layer_types", None) or ["full_attention"] * int(text.num_hidden_layers))


def _gdn_shape(text: Any) -> tuple[int, int, int] | None:
    """A Gated DeltaNet layer's ``(conv channels, conv kernel, float32 recurrent elements)``, per row."""
    if not all(isinstance(getattr(text, field, None), int) for field in _GDN_FIELDS):
        return None
    k_dim, v_dim = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
    k_heads, v_heads = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
    return 2 * k_heads * k_dim + v_heads * v_dim, int(text.linear_conv_kernel_dim), v_heads * k_dim * v_dim


def _mamba2_shape(text: Any) -> tuple[int, int, int] | None:
    """A Mamba-2 layer's ``(conv channels, conv kernel, float32 SSM elements)``, per row."""
    values = [getattr(text, field, None) for field in _MAMBA2_FIELDS]
    if not all(isinstance(v, int) for v in values):  # absent, or "auto" left unresolved
        return None
    heads, head_dim, state, groups, kernel = (int(v) for v in values if isinstance(v, int))
    return heads * head_dim + 2 * groups * state, kernel, heads * head_dim * state


def _short_conv_shape(text: Any) -> tuple[int, int, int] | None:
    """A short-convolution layer's ``(conv channels, conv kernel, 0)``, per row: LFM2 keeps no recurrent state."""
    kernel = getattr(text, "conv_L_cache", None)
    if not isinstance(kernel, int) or "conv" not in _layer_types(text):
        return None
    return int(text.hidden_size), kernel, 0


def _state_shape(text: Any) -> tuple[int, int, int] | None:
    return _gdn_shape(text) or _mamba2_shape(text) or _short_conv_shape(text)


def _state_layers(text: Any) -> int:
    """How many layers keep a state: the ``"linear_attention"`` ones, or LFM2's ``"conv"`` ones."""
    kind = "conv" if _short_conv_shape(text) is not None else "linear_attention"
    return sum(1 for layer in _layer_types(text) if layer == kind)


def row_state_bytes(config: Any, dtype: torch.dtype) -> int:
    """The bytes one row's recurrent state takes (constant in its length); 0 for a model without one.

    Per ``"linear_attention"`` layer: the conv state, ``channels x kernel`` in
    ``dtype`` (Gated DeltaNet: ``2 x key heads x key dim + value heads x value
    dim`` channels; Mamba-2: ``heads x head dim + 2 x groups x state size``),
    and the recurrent state in float32 (Gated DeltaNet: ``value heads x key dim
    x value dim``; Mamba-2: ``heads x head dim x state size``). Per LFM2
    ``"conv"`` layer: the conv state alone, ``hidden size x conv_L_cache`` in ``dtype``.
    """
    text = config.get_text_config(decoder=True)
    shape = _state_shape(text)
    if shape is None:
        return 0
    channels, kernel, recurrent = shape
    return _state_layers(text) * (channels * kernel * _itemsize(dtype) + recurrent * 4)


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """The bytes one token's keys and values take over the model's attention layers."""
    text = config.get_text_config(decoder=True)
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    layers = sum(1 for kind in _layer_types(text) if kind not in _NO_KV_TYPES)
    return layers * 2 * heads * head_dim * _itemsize(dtype)


def state_tokens_per_row(config: Any, dtype: torch.dtype) -> int:
    """A row's linear-attention state in KV-cache tokens of the same memory: what the batch budget charges it."""
    state = row_state_bytes(config, dtype)
    if not state:
        return 0
    return math.ceil(state / max(1, kv_bytes_per_token(config, dtype)))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
