"""Weight names between a trainer's model and the checkpoint an engine serves: one declared table.

A trainer builds its policy with ``AutoModelForCausalLM`` and pushes its
``state_dict`` names: ``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``. A vision-language checkpoint (Qwen3.5 ships as
``Qwen3_5ForConditionalGeneration``) nests the same language model one level
down: ``model.language_model.layers.0.self_attn.q_proj.weight``, with the head
still at ``lm_head.weight``. ``transformers`` loads either layout as the text
model; an engine validates updates and adapters against the names it holds,
which may be either. :data:`NESTINGS` declares the correspondences (as vLLM
declares its ``WeightsMapper`` tables) and :func:`known_name` applies them, so
no engine does string surgery of its own: a name the engine knows is kept,
another is tried through each nesting, in either direction, and a name
neither side knows is returned as it came (the engine's validation then
names it, with its suggestions).

A mixture-of-experts layer is the other difference. ``transformers`` 5 holds
a layer's routed experts fused across experts, as 3-D tensors
(``model.layers.0.mlp.experts.gate_up_proj`` ``[experts, 2 x inter, hidden]``,
``...experts.down_proj`` ``[experts, hidden, inter]``), and that is what a
trainer's ``state_dict`` pushes; its ``save_pretrained`` writes them back one
tensor per expert (``...experts.3.gate_proj.weight`` ``[inter, hidden]``), as
the checkpoints on the hub are. :data:`EXPERT_FUSIONS` declares how one
layout lies in the other; :func:`expert_parts` lists a fused tensor's
per-expert names and rows, :func:`split_experts` splits fused tensors for an
engine that holds them per expert (views, nothing copied).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from twinkle_core.errors import WeightUpdateError

__all__ = [
    "EXPERT_FUSIONS",
    "NESTINGS",
    "PEFT_PREFIXES",
    "UNSERVED_PARTS",
    "expert_parts",
    "known_adapter_name",
    "known_name",
    "known_names",
    "split_experts",
    "trainer_spelling",
    "unserved_part",
]

T = TypeVar("T")

#: ``(trainer prefix, checkpoint prefix)``: where a checkpoint nests the language model a trainer holds at its root.
NESTINGS: tuple[tuple[str, str], ...] = (("model.", "model.language_model."),)

#: ``(prefix, kind, what it is)``: parts of a checkpoint an engine sampling its language model may not load.
#: Qwen3.5 checkpoints hold a multi-token-prediction block (``mtp.*``, read only for speculative decoding)
#: and a vision tower (``model.visual.*``); an engine that loaded the text model holds neither.
UNSERVED_PARTS: tuple[tuple[str, str, str], ...] = (
    ("mtp.", "mtp", "the multi-token-prediction block"),
    ("model.visual.", "vision", "the vision tower"),
    ("visual.", "vision", "the vision tower"),
)

#: ``(fused leaf, per-expert leaves)``: a fused expert tensor ``<layer>.experts.<fused leaf>`` is
#: ``[experts, rows, columns]``; expert ``e``'s rows are ``<layer>.experts.<e>.<leaf>`` for each
#: per-expert leaf in order, stacked (``gate_up_proj``: the gate projection's rows, then the up one's).
EXPERT_FUSIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight")),
    ("experts.down_proj", ("down_proj.weight",)),
)

#: What PEFT puts before a module's name in an adapter's tensor names.
PEFT_PREFIXES: tuple[str, ...] = ("base_model.model.", "base_model.")


def known_name(name: str, known: Container[str]) -> str:
    """``name`` as ``known`` spells it: itself where known, else its other spelling under a nesting that is.

    Args:
        name: a weight name, from a trainer or a checkpoint.
        known: the names the engine holds.

    Returns:
        The name to look up in ``known`` (``name`` itself when no spelling is known).
    """
    if name in known:
        return name
    for trainer, checkpoint in NESTINGS:
        if name.startswith(checkpoint):
            other = trainer + name[len(checkpoint) :]
        elif name.startswith(trainer):
            other = checkpoint + name[len(trainer) :]
        else:
            continue
        if other in known:
            return other
    return name


def trainer_spelling(name: str) -> str:
    """``name`` as a trainer spells it, whichever layout it came in: one key for the weight both spellings name.

    What keeps pushed tensors by name (the updates a remote sampler replays to
    a rebuilt replica, the tensors an update left in doubt) compares names by
    this key, so a push in one spelling supersedes or settles one in the other.
    """
    for trainer, checkpoint in NESTINGS:
        if name.startswith(checkpoint):
            return trainer + name[len(checkpoint) :]
    return name


def known_names(items: Iterable[tuple[str, T]], known: Container[str]) -> list[tuple[str, T]]:
    """``(name, value)`` pairs with each name as ``known`` spells it (see :func:`known_name`)."""
    return [(known_name(name, known), value) for name, value in items]


def known_adapter_name(name: str, known: Container[str]) -> str:
    """A PEFT adapter tensor's name with its module spelled as ``known`` spells the module's weight.

    ``base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight``
    and its ``model.language_model`` twin both target the layer whose weight
    ``known`` holds; the one it holds is returned (anything else as it came).
    """
    for prefix in PEFT_PREFIXES:
        if name.startswith(prefix):
            module, marker, leaf = name[len(prefix) :].partition(".lora_")
            if not marker:
                return name
            return prefix + known_name(f"{module}.weight", known).removesuffix(".weight") + marker + leaf
    return name


def unserved_part(name: str, kinds: Container[str] = ("mtp", "vision")) -> str | None:
    """What part of a checkpoint ``name`` belongs to, when it is one of the ``kinds`` of :data:`UNSERVED_PARTS`.

    Args:
        name: a weight name.
        kinds: the kinds of part to look for (``"mtp"``, ``"vision"``): those the engine did not load.

    Returns:
        ``"the vision tower (model.visual.*)"`` and the like, or ``None``.
    """
    for prefix, kind, part in UNSERVED_PARTS:
        if kind in kinds and name.startswith(prefix):
            return f"{part} ({prefix}*)"
    return None


def expert_parts(name: str, shape: Sequence[int]) -> list[tuple[str, int, int, int]]:
    """Where each per-expert tensor lies in a fused expert tensor (see :data:`EXPERT_FUSIONS`).

    Args:
        name: a weight name, e.g. ``model.layers.0.mlp.experts.gate_up_proj``.
        shape: its shape, ``[experts, rows, columns]``.

    Returns:
        ``(per-expert name, expert, first row, end row)`` for every expert and
        part, in order; empty where ``name`` is not a fused expert tensor of
        that shape.
    """
    for fused, leaves in EXPERT_FUSIONS:
        if name.endswith("." + fused) and len(shape) == 3 and shape[1] % len(leaves) == 0:
            head = name[: -len(fused)] + "experts."
            rows = shape[1] // len(leaves)
            return [
                (f"{head}{expert}.{leaf}", expert, part * rows, (part + 1) * rows)
                for expert in range(shape[0])
                for part, leaf in enumerate(leaves)
            ]
    return []


def _fused_shape(name: str, known: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """The fused shape ``known``'s per-expert tensors of the fused ``name`` add up to (``None``: it holds none)."""
    for fused, leaves in EXPERT_FUSIONS:
        if not name.endswith("." + fused):
            continue
        head = name[: -len(fused)] + "experts."
        first = known.get(known_name(f"{head}0.{leaves[0]}", known))
        if first is None:
            return None
        experts = 0
        while known_name(f"{head}{experts}.{leaves[0]}", known) in known:
            experts += 1
        rows, columns = tuple(first.shape)
        return experts, rows * len(leaves), columns
    return None


def split_experts(items: Iterable[tuple[str, Any]], known: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Fused expert tensors split into the per-expert tensors ``known`` holds; every other pair as it came.

    A fused tensor (``...experts.gate_up_proj``) that ``known`` does not hold
    but whose experts it holds one by one becomes those tensors, each a view
    of its rows, named as ``known`` spells them. Everything else is left to
    the engine's own validation.

    Args:
        items: ``(name, tensor)`` pairs.
        known: the engine's names, each with its ``shape``.

    Raises:
        WeightUpdateError: a fused tensor whose shape is not that of the experts ``known`` holds.
    """
    out: list[tuple[str, Any]] = []
    for name, value in items:
        want = None if known_name(name, known) in known else _fused_shape(name, known)
        if want is None:
            out.append((name, value))
            continue
        shape = tuple(getattr(value, "shape", ()))
        if shape != want:
            raise WeightUpdateError(
                f"update_weights: {name!r} has shape {shape}, expected {want} (this model's {want[0]} experts,"
                " fused as transformers holds them); nothing was updated."
            )
        out.extend((known_name(part, known), value[e, start:end]) for part, e, start, end in expert_parts(name, shape))
    return out
