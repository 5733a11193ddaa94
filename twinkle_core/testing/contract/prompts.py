"""The suite's inputs: short chat conversations, greedy parameters, and ids and words spread over a vocabulary."""

from __future__ import annotations

from typing import Any

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.sampler import Sampler

__all__ = ["CONTRACT_PROMPTS", "greedy_params", "some_words", "spread_ids", "traj"]

#: Short, varied conversations (different lengths, so order mix-ups show).
CONTRACT_PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello! What is two plus two?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a short story about a cat and a dog who become friends."},
    ],
    [{"role": "user", "content": "Count to five."}],
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
]


def traj(i: int) -> Trajectory:
    return Trajectory(messages=CONTRACT_PROMPTS[i % len(CONTRACT_PROMPTS)])


def greedy_params(**kw: Any) -> SamplingParams:
    base: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    base.update(kw)
    return SamplingParams(**base)


def spread_ids(vocab: int, n: int, salt: int) -> list[int]:
    """``n`` distinct token ids spread over the vocabulary (none of the first few, often special)."""
    return sorted({4 + (k * 7919 + salt * 104729) % (vocab - 4) for k in range(1, n + 1)})


def some_words(sampler: Sampler, n: int) -> list[str]:
    """``n`` words of the model's own vocabulary: the text of single tokens."""
    words: list[str] = []
    for t in spread_ids(sampler.vocab_size or 256, 8 * n, 3):
        text = sampler.template.decode([t]).strip()
        if text.isalpha() and text not in words:
            words.append(text)
        if len(words) == n:
            break
    return words
