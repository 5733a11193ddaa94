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
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import TypeVar

__all__ = [
    "NESTINGS",
    "PEFT_PREFIXES",
    "UNSERVED_PARTS",
    "known_adapter_name",
    "known_name",
    "known_names",
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
