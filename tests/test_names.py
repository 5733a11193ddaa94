"""Weight names between a trainer and a checkpoint: one declared table, both directions, nothing guessed."""

from __future__ import annotations

import pytest

from twinkle_core.errors import IncompleteUpdateError
from twinkle_core.names import NESTINGS, known_adapter_name, known_name, known_names, trainer_spelling
from twinkle_core.sampler.policy import PolicyState

TRAINER = {"model.embed_tokens.weight", "model.layers.0.linear_attn.in_proj_qkv.weight", "lm_head.weight"}
CHECKPOINT = {
    "model.language_model.embed_tokens.weight",
    "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
    "model.visual.blocks.0.attn.qkv.weight",
    "lm_head.weight",
}


def test_the_table_declares_the_nested_language_model() -> None:
    assert ("model.", "model.language_model.") in NESTINGS


def test_a_trainers_names_reach_a_nested_checkpoint_and_back() -> None:
    for trainer, checkpoint in [
        ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
        (
            "model.layers.0.linear_attn.in_proj_qkv.weight",
            "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
        ),
    ]:
        assert known_name(trainer, CHECKPOINT) == checkpoint
        assert known_name(checkpoint, TRAINER) == trainer
    assert known_name("lm_head.weight", CHECKPOINT) == "lm_head.weight"  # the head is not nested


def test_known_names_stay_and_unknown_ones_come_back_as_given() -> None:
    assert known_name("model.layers.0.linear_attn.in_proj_qkv.weight", TRAINER).startswith("model.layers.")
    assert known_name("model.layers.9.mlp.up_proj.weight", CHECKPOINT) == "model.layers.9.mlp.up_proj.weight"
    assert known_name("model.visual.blocks.0.attn.qkv.weight", TRAINER) == "model.visual.blocks.0.attn.qkv.weight"
    assert known_names([("model.embed_tokens.weight", 1), ("x", 2)], CHECKPOINT) == [
        ("model.language_model.embed_tokens.weight", 1),
        ("x", 2),
    ]


def test_adapter_tensor_names_follow_their_modules() -> None:
    name = "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"
    nested = "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"
    assert known_adapter_name(name, CHECKPOINT) == nested
    assert known_adapter_name(nested, TRAINER) == name
    assert known_adapter_name(name, TRAINER) == name
    assert known_adapter_name("not.peft.name", TRAINER) == "not.peft.name"


def test_fused_experts_split_into_a_checkpoints_per_expert_tensors() -> None:
    """transformers 5's 3-D experts (a trainer's state_dict) against a checkpoint that stores one tensor per expert."""
    import numpy as np
    import pytest

    from twinkle_core.engine import TensorSpec
    from twinkle_core.errors import WeightUpdateError
    from twinkle_core.names import EXPERT_FUSIONS, expert_parts, split_experts

    assert ("experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight")) in EXPERT_FUSIONS
    experts, inter, hidden = 3, 4, 5
    known = {  # a VL checkpoint's nesting too: both mappings compose
        f"model.language_model.layers.0.mlp.experts.{e}.{leaf}": TensorSpec(shape, "float32")
        for e in range(experts)
        for leaf, shape in (
            ("gate_proj.weight", (inter, hidden)),
            ("up_proj.weight", (inter, hidden)),
            ("down_proj.weight", (hidden, inter)),
        )
    }
    gate_up = np.arange(experts * 2 * inter * hidden, dtype=np.float32).reshape(experts, 2 * inter, hidden)
    down = -np.arange(experts * hidden * inter, dtype=np.float32).reshape(experts, hidden, inter)
    other = ("model.norm.weight", np.ones(5))
    split = dict(
        split_experts(
            [
                ("model.layers.0.mlp.experts.gate_up_proj", gate_up),
                ("model.layers.0.mlp.experts.down_proj", down),
                other,
            ],
            known,
        )
    )
    assert set(split) == set(known) | {"model.norm.weight"}
    np.testing.assert_array_equal(split["model.language_model.layers.0.mlp.experts.2.gate_proj.weight"], gate_up[2, :4])
    np.testing.assert_array_equal(split["model.language_model.layers.0.mlp.experts.2.up_proj.weight"], gate_up[2, 4:])
    np.testing.assert_array_equal(split["model.language_model.layers.0.mlp.experts.1.down_proj.weight"], down[1])
    assert [p[1:] for p in expert_parts("x.experts.gate_up_proj", (2, 8, 5))] == [
        (0, 0, 4), (0, 4, 8), (1, 0, 4), (1, 4, 8)
    ]  # fmt: skip
    assert expert_parts("x.mlp.gate_up_proj.weight", (8, 5)) == []  # a dense MLP's fused projection is not experts
    with pytest.raises(WeightUpdateError, match=r"experts\.gate_up_proj' has shape \(2, 8, 5\), expected \(3, 8, 5\)"):
        split_experts([("model.layers.0.mlp.experts.gate_up_proj", gate_up[:2])], known)
    held = {"model.layers.0.mlp.experts.gate_up_proj": TensorSpec(gate_up.shape, "float32")}
    assert split_experts([("model.layers.0.mlp.experts.gate_up_proj", gate_up)], held)[0][1] is gate_up  # held fused


def test_either_spelling_settles_tensors_an_update_left_in_doubt() -> None:
    assert trainer_spelling("model.language_model.norm.weight") == trainer_spelling("model.norm.weight")
    assert trainer_spelling("mtp.fc.weight") == "mtp.fc.weight"
    state = PolicyState()
    state.doubt(3, ["model.language_model.layers.0.mlp.up_proj.weight", "lm_head.weight"], RuntimeError("lost"))
    state.settle(["model.layers.0.mlp.up_proj.weight"])  # the trainer's spelling of the first
    with pytest.raises(IncompleteUpdateError, match=r"'lm_head\.weight'") as info:
        state.require_settled()
    assert "up_proj" not in str(info.value)
    state.settle(["lm_head.weight"])
    state.require_settled()
