"""The tiny MoE hybrids (Qwen3.5-MoE, Qwen3-Next) start from the trained tiny Qwen3.5.

Training a Gated DeltaNet model from scratch on two CPU cores costs minutes
(``transformers`` runs the GDN layers in its pure-PyTorch kernels), and the
two MoE hybrids share every layer but the MLP with the tiny Qwen3.5. So they
are not trained from random weights: each starts from the trained
:func:`~twinkle_core.testing.build_tiny_model` ``("qwen3_5")`` folder, its
weights carried over exactly, and is then trained further, more briefly
(:data:`WARM_STEPS`), which is where the routed experts and the router learn.

The carry-over, layer by layer:

- attention, norms, embeddings, the head: the same names and shapes.
- the dense MLP becomes the **shared expert** (same width). Its gate starts
  at zero, so the shared expert's output is halved (``sigmoid(0)``); its
  ``down_proj`` is doubled to make up for it. The routed experts and the
  router keep ``transformers``' random initialisation: before training the
  model is the dense one plus what the fresh experts add. Only the routed
  experts, the router and the shared expert's gate are trained further: the
  carried-over layers stay as trained, so the answers stay as sharp as the
  tiny Qwen3.5's (training them all again brought near-ties into greedy
  decoding).
- Qwen3-Next fuses the GDN input projections, grouped per key head:
  ``in_proj_qkvz`` holds, for each key head, its query, its key, then its
  value heads and their gates; ``in_proj_ba`` each key head's ``b`` then
  ``a`` rows. Qwen3.5 keeps them apart (``in_proj_qkv`` = all queries, all
  keys, all values; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["WARM_ARCHS", "WARM_LEARNING_RATE", "WARM_STEPS", "warm_start"]

#: The architectures that start from the trained tiny Qwen3.5.
WARM_ARCHS = frozenset({"qwen3_5_moe", "qwen3_next"})

#: Optimizer steps after the warm start (a full build from scratch takes 800).
WARM_STEPS = 80
#: Their peak learning rate: a quarter of a build from scratch, so the carried-over layers are refined, not undone.
WARM_LEARNING_RATE = 1e-3


def _fused_gdn_projections(weights: dict[str, Any], prefix: str, config: Any) -> dict[str, Any]:
    """Qwen3.5's separate GDN input projections under ``prefix``, as Qwen3-Next's two fused ones."""
    import torch

    heads_k = config.linear_num_key_heads
    per_k = config.linear_num_value_heads // heads_k
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    qkv = weights.pop(prefix + "in_proj_qkv.weight")
    z = weights.pop(prefix + "in_proj_z.weight")
    b = weights.pop(prefix + "in_proj_b.weight")
    a = weights.pop(prefix + "in_proj_a.weight")
    q, k, v = qkv.split([heads_k * key_dim, heads_k * key_dim, heads_k * per_k * value_dim])
    hidden = qkv.shape[-1]
    qkvz = torch.cat(
        [t.reshape(heads_k, -1, hidden) for t in (q, k, v, z)], dim=1
    )  # [key heads, q + k + v + z rows, hidden]
    ba = torch.cat([t.reshape(heads_k, per_k, hidden) for t in (b, a)], dim=1)
    return {
        prefix + "in_proj_qkvz.weight": qkvz.reshape(-1, hidden),
        prefix + "in_proj_ba.weight": ba.reshape(-1, hidden),
    }


def warm_start(model: Any, arch: str, base: Path) -> None:
    """Load the trained tiny Qwen3.5 in ``base`` into ``model`` (a fresh ``arch`` model), in place.

    Args:
        model: a freshly initialised ``Qwen3_5MoeForCausalLM`` or ``Qwen3NextForCausalLM``.
        arch: ``"qwen3_5_moe"`` or ``"qwen3_next"``.
        base: the tiny Qwen3.5 folder.

    Raises:
        RuntimeError: a carried-over weight that the model does not have, or one it has that was not
            carried over and is not the MoE's own (a sign the two architectures drifted apart).
    """
    import torch
    from safetensors.torch import load_file

    weights: dict[str, Any] = load_file(str(base / "model.safetensors"))
    if arch == "qwen3_next":
        for name in [n for n in weights if n.endswith("linear_attn.in_proj_qkv.weight")]:
            weights.update(_fused_gdn_projections(weights, name.removesuffix("in_proj_qkv.weight"), model.config))
    carried: dict[str, Any] = {}
    for name, tensor in weights.items():
        if ".mlp." in name:
            scale = 2.0 if name.endswith("down_proj.weight") else 1.0  # sigmoid(0) halves the shared expert
            carried[name.replace(".mlp.", ".mlp.shared_expert.")] = tensor * scale
        else:
            carried[name] = tensor
    own = model.state_dict()
    for name, tensor in own.items():
        if name.endswith("shared_expert_gate.weight"):
            carried[name] = torch.zeros_like(tensor)
    unknown = sorted(set(carried) - set(own))
    moe_own = ("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")  # the routed experts, the router
    left = sorted(n for n in set(own) - set(carried) if not n.endswith(moe_own))
    if unknown or left:  # pragma: no cover - the two architectures' layouts drifted apart
        raise RuntimeError(f"warm start of {arch}: not in the model {unknown[:4]}, not carried over {left[:4]}")
    with torch.no_grad():
        for name, tensor in carried.items():
            own[name].copy_(tensor)
    # only the MoE's own weights train: the carried-over layers keep the trained model's sharp answers
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name not in carried or name.endswith("shared_expert_gate.weight"))
