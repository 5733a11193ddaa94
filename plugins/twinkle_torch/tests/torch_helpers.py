"""Helpers of the torch engine's tests (a module name no other test folder uses)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_lora(model_dir: Path, out: Path, *, seed: int, targets: list[str], rank: int = 8) -> Path:
    """Write a PEFT LoRA adapter folder with random (fixed-seed) A and B matrices."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(str(out))
    return out


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int, **kw: Any) -> list[list[int]]:
    """HF ``generate`` greedy, batched with left padding; each output cut after its first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            **kw,
        )
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    result = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        result.append(row[:cut])
    return result
