"""vLLM's CPU LoRA ops, replaced in a worker: per-adapter matrix products, and base rows left alone.

The worker extension calls :func:`install` once per worker process, when the
engine starts (``TwinkleWorkerExtension.twinkle_describe``). See its
docstring for what is wrong with the ops it replaces and how the replacement
is checked before it is used.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install"]


#: The CPU backend's per-token LoRA ops (vllm.lora.ops.torch_ops), which the prefill ops call too.
_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def install() -> str:
    """Replace the LoRA ops of vLLM's CPU backend with per-adapter matrix products.

    Two problems with vLLM 0.32's PyTorch ops, which serve every LoRA token on CPU:

    * **Speed.** Each op gathers every token's adapter matrix
      (``weights[indices]``, a tokens x out x in copy) and multiplies row by
      row: for a 2,400-token prefill through a 1536x16 matrix that is 0.13 s
      where one matrix product takes 0.002 s, for each adapted layer. A GRPO
      step of SmolLM2 with its adapter unmerged spent 18 s sampling this way.
    * **Correctness.** Tokens without an adapter carry slot index -1; the GPU
      kernels skip them, but the gather reads -1 as the *last* slot, so in a
      batch that mixes base and LoRA requests the base requests silently get
      an adapter applied (vllm-project/vllm#48421, open against 0.32).

    The replacement groups the rows by adapter slot and does one matrix
    product per slot; rows without an adapter get an exact zero delta. It is
    installed only if a probe shows it computes what the original ops compute
    (with those rows' delta zero), so a vLLM whose ops changed meaning is
    left alone; then, if the probe shows the -1 bug, only that is fixed.

    Returns:
        ``"grouped"``, ``"zero-rows"`` (the bug fix alone) or ``""`` (nothing
        installed) in this process.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # pragma: no cover - layout changed; nothing to fix here
        return ""
    installed: str = getattr(lora_ops, "_twinkle_ops", "")
    if installed:
        return installed
    _fix_prompt_logits(punica_cpu.PunicaWrapperCPU)
    originals = {name: getattr(lora_ops, name, None) for name in _LORA_OPS}
    if any(op is None for op in originals.values()):  # pragma: no cover - layout changed
        return ""
    fixed = {name: _zero_rows_without_lora(op) for name, op in originals.items()}
    grouped = _grouped_lora_ops(fixed)
    if _lora_ops_agree(grouped, fixed):
        chosen, kind = grouped, "grouped"
    elif _negative_index_bug(originals["bgmv_shrink"]):  # pragma: no cover - only if vLLM's ops change
        chosen, kind = fixed, "zero-rows"
    else:  # pragma: no cover - likewise
        return ""
    for name, op in chosen.items():
        setattr(lora_ops, name, op)  # the sgmv_* prefill ops call these module globals
        if getattr(punica_cpu, name, None) is originals[name]:
            setattr(punica_cpu, name, op)
    lora_ops._twinkle_ops = kind
    return kind


def _fix_prompt_logits(wrapper: Any) -> None:
    """Let prompt log-probs run on an engine with LoRA enabled (vLLM 0.32's CPU build killed the engine).

    For prompt log-probs vLLM computes the logits of one request's prompt rows
    through the LoRA logits processor, whose indices hold one row per request
    of the step: with two or more requests the shapes disagree and the worker
    raises, so a ``prompt_logprobs`` call of several prompts on an engine
    started with ``enable_lora`` ended the engine. The
    logits delta is ``B @ A`` of an adapter's ``lm_head`` LoRA; where no adapter
    the step's requests use has one (their ``B`` is zero) it is zero, and those
    rows are left as they are. Otherwise vLLM's own op runs (and raises as
    before): the sampler refuses prompt log-probs while an adapter with
    ``lm_head`` LoRA is loaded, so it is not reached.
    """
    original = getattr(wrapper, "add_lora_logits", None)
    if original is None or getattr(original, "_twinkle_fixed", False):  # pragma: no cover - layout changed
        return

    def add_lora_logits(
        self: Any, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, *args: Any, **kw: Any
    ) -> Any:
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        indices = self.sampler_indices
        if rows != indices.shape[0]:
            # Only the slots this step's requests use count: a removed adapter's slot keeps its weights.
            used = indices[indices >= 0].unique().long()
            if not bool(lora_b[used].any()):
                return None  # updated in place on CPU: nothing to add
        return original(self, y, x, lora_a, lora_b, *args, **kw)

    add_lora_logits._twinkle_fixed = True  # type: ignore[attr-defined]
    wrapper.add_lora_logits = add_lora_logits


def _negative_index_bug(shrink: Any) -> bool:
    """Whether ``shrink`` gives a token with slot index -1 the last slot's adapter."""
    weights = torch.zeros(2, 1, 1, 2)
    weights[1] = 1.0  # only the last slot is non-zero
    out = torch.zeros(1, 1)
    shrink(torch.ones(1, 2), weights, out, torch.tensor([-1]), 1.0)
    return bool(out.any())


def _zero_rows_without_lora(op: Any) -> Any:
    """``op`` with the rows of tokens without an adapter (index -1) entering as zeros: their delta is zero."""

    def wrapper(
        inputs: torch.Tensor,
        weights: torch.Tensor,
        output: torch.Tensor,
        indices: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        no_lora = indices < 0
        if inputs.shape[0] == indices.shape[0] and bool(no_lora.any()):
            inputs = inputs.masked_fill(no_lora.view(-1, *([1] * (inputs.dim() - 1))), 0)
        return op(inputs, weights, output, indices, *args, **kwargs)

    wrapper.__wrapped__ = op  # type: ignore[attr-defined]
    return wrapper


def _per_slot_product(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> Any:
    """Row ``r`` of ``inputs`` times ``weights[indices[r]]`` transposed, one matrix product per slot.

    ``weights`` is ``(slots, out, in)`` or ``(slots, 1, out, in)``; a negative
    index gives a zero row. ``None`` when the shapes are not the ones this
    handles (the caller then runs the original op).
    """
    stacked = weights.squeeze(1) if weights.dim() == 4 else weights
    if inputs.dim() != 2 or stacked.dim() != 3 or indices.dim() != 1 or indices.shape[0] != inputs.shape[0]:
        return None
    x = inputs.to(dtype)
    slots = torch.unique(indices).tolist()
    if len(slots) == 1 and slots[0] >= 0:  # one adapter for the whole batch: the common case
        return x @ stacked[slots[0]].to(dtype).T
    out = torch.zeros(x.shape[0], stacked.shape[1], dtype=dtype, device=x.device)
    for slot in slots:
        if slot >= 0:
            rows = (indices == slot).nonzero().squeeze(1)
            out.index_copy_(0, rows, x.index_select(0, rows) @ stacked[slot].to(dtype).T)
    return out


def _grouped_lora_ops(fallback: dict[str, Any]) -> dict[str, Any]:
    """The three ops computed by :func:`_per_slot_product`, writing their output as vLLM's do.

    * ``bgmv_shrink``: ``output[:, :r] = scaling * delta``;
    * ``bgmv_expand``: ``output[:, :w] (+)= delta[:, :w]``, ``w`` the narrower
      width (the two sides may pad differently); a one-row delta applies to
      every output row;
    * ``bgmv_expand_slice``: ``output[:, offset:offset + size] (+)= delta``.

    Shapes the product does not handle go to ``fallback``.
    """

    def shrink(
        inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, indices: torch.Tensor, scaling: float = 1.0
    ) -> None:
        delta = _per_slot_product(inputs, weights, indices, output.dtype)
        if delta is None:
            fallback["bgmv_shrink"](inputs, weights, output, indices, scaling)
            return
        output[:, : delta.shape[1]] = scaling * delta

    def expand(
        inputs: torch.Tensor,
        weights: torch.Tensor,
        output: torch.Tensor,
        indices: torch.Tensor,
        add_inputs: bool = True,
    ) -> None:
        delta = _per_slot_product(inputs, weights, indices, output.dtype)
        if delta is None:
            fallback["bgmv_expand"](inputs, weights, output, indices, add_inputs)
            return
        width = min(delta.shape[1], output.shape[1])
        rows = 1 if delta.shape[0] == 1 and output.shape[0] != 1 else output.shape[0]
        _write(output[:, :width], delta[:rows, :width], add_inputs)

    def expand_slice(
        inputs: torch.Tensor,
        weights: torch.Tensor,
        output: torch.Tensor,
        indices: torch.Tensor,
        slice_offset: int,
        slice_size: int,
        add_inputs: bool = True,
    ) -> None:
        delta = _per_slot_product(inputs, weights, indices, output.dtype)
        if delta is None:
            fallback["bgmv_expand_slice"](inputs, weights, output, indices, slice_offset, slice_size, add_inputs)
            return
        _write(output[:, slice_offset : slice_offset + slice_size], delta, add_inputs)

    ops = {"bgmv_shrink": shrink, "bgmv_expand": expand, "bgmv_expand_slice": expand_slice}
    for name, op in ops.items():
        op.__wrapped__ = fallback[name]  # type: ignore[attr-defined]
    return ops


def _write(target: torch.Tensor, delta: torch.Tensor, add: bool) -> None:
    if add:
        target += delta
    else:
        target.copy_(delta)


def _lora_ops_agree(ops: dict[str, Any], reference: dict[str, Any]) -> bool:
    """Whether ``ops`` compute what ``reference`` does, on a batch mixing two adapters and no adapter."""
    gen = torch.Generator().manual_seed(0)
    tokens, width, rank, out_width = 7, 12, 3, 10
    indices = torch.tensor([0, 1, -1, 1, 0, -1, 1])
    x = torch.randn(tokens, width, generator=gen)
    a = torch.randn(2, 1, rank, width, generator=gen)
    b = torch.randn(2, 1, out_width, rank, generator=gen)
    mid = torch.randn(tokens, rank, generator=gen)
    try:
        for add in (True, False):
            calls = [
                ("bgmv_shrink", (x, a, torch.zeros(tokens, rank + 2)), (indices, 0.5)),
                ("bgmv_expand", (mid, b, torch.randn(tokens, out_width + 3, generator=gen)), (indices, add)),
                ("bgmv_expand", (mid[:1], b, torch.randn(tokens, out_width, generator=gen)), (indices[1:2], add)),
                (
                    "bgmv_expand_slice",
                    (mid, b, torch.randn(tokens, 3 * out_width, generator=gen)),
                    (indices, 5, out_width, add),
                ),
            ]
            for name, (inputs, weights, output), rest in calls:
                mine, theirs = output.clone(), output.clone()
                ops[name](inputs, weights, mine, rest[0], *rest[1:])
                reference[name](inputs, weights, theirs, rest[0], *rest[1:])
                if not torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5):
                    return False
    except Exception:  # pragma: no cover - an op whose signature changed
        return False
    return True
