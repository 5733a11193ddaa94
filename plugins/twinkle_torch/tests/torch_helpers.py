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


def forward_gap(results: list[Any], model: Any) -> tuple[float, int, bool]:
    """Against one full forward per sequence: the largest log-prob gap, how many compared, whether greedy held."""
    worst, compared, greedy = 0.0, 0, True
    for result in results:
        prompt = result.prompt_token_ids
        for seq in result.sequences:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + seq.tokens])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
            want = logprobs.gather(-1, torch.tensor(seq.tokens).unsqueeze(-1)).squeeze(-1).tolist()
            worst = max(worst, *(abs(a - b) for a, b in zip(want, seq.logprobs)))
            compared += len(want)
            greedy = greedy and logprobs.argmax(-1).tolist() == seq.tokens
            if result.prompt_logprobs is not None:
                full = torch.log_softmax(logits, dim=-1)
                want_prompt = [full[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
                got_prompt = result.prompt_logprobs[1:]
                worst = max(worst, *(abs(a - b) for a, b in zip(want_prompt, got_prompt)))
    return worst, compared, greedy


def state_bytes_per_row(model: Any) -> int:
    """The bytes of recurrent state one row of ``model`` holds in the engine's cache after a prefill and a step."""
    from twinkle_torch.cache import make_cache
    from twinkle_torch.state import StateLayer

    cache = make_cache(model.config, 8)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9]] * 2), past_key_values=cache, use_cache=True)
        model(input_ids=torch.tensor([[5]] * 2), past_key_values=cache, use_cache=True)
    tensors = [t for layer in cache.layers if isinstance(layer, StateLayer) for pair in layer.states() for t in pair]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None) // 2


def replayed_logprobs(model: Any, sequence: Any) -> tuple[list[int], list[float]]:
    """What a trainer computes from a sampled sequence's training feature, as it gets it (through JSON).

    One HF forward over the feature's ``input_ids`` and media inputs, as they
    are; returns the trained tokens (labels not ``-100``) and their log-probs.
    """
    import json

    from twinkle_core.data_format import IGNORE_INDEX, InputFeature

    assert sequence.training_feature is not None
    replayed = InputFeature.from_dict(json.loads(json.dumps(sequence.training_feature.to_dict())))
    assert replayed.multimodal is not None and replayed.labels is not None
    media = {k: torch.from_numpy(v) for k, v in replayed.multimodal.items()}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([replayed.input_ids]), **media).logits[0].float()
    labels = torch.tensor(replayed.labels)
    trained = (labels != IGNORE_INDEX).nonzero()[:, 0]
    logprobs = logits[trained - 1].log_softmax(-1).gather(-1, labels[trained][:, None])[:, 0]
    return labels[trained].tolist(), logprobs.tolist()


def patterned_image(seed: int, size: tuple[int, int] = (64, 48)) -> Any:
    """A deterministic RGB image of ``size`` whose pixels depend on ``seed`` (the media tests' inputs)."""
    from PIL import Image

    data = bytes((seed * 53 + i * 11) % 256 for i in range(size[0] * size[1] * 3))
    return Image.frombytes("RGB", size, data)


def image_chat(image: Any) -> list[dict[str, Any]]:
    """One user turn: ``image`` as an image block, then a question."""
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]
