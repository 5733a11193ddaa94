"""Weight names between a trainer and a checkpoint: one declared table, both directions, nothing guessed."""

from __future__ import annotations

from twinkle_core.names import NESTINGS, known_adapter_name, known_name, known_names

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
