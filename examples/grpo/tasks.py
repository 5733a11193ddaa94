"""Verifiable toy tasks for the GRPO example: prompts and a reward function each.

* ``digits`` (tiny test model): "answer with numbers". The reward of a completion
  is the share of its non-space characters that are digits. It is learnable in
  minutes on a CPU because the reward is dense (every digit counts) and the
  base model already emits digits at temperature 1 for some prompts (it was
  trained on counting and sums), so from the first step some samples of each
  group score higher than others and the group-normalised advantage has signal.
* ``compare``: "Is 17 greater than 25? Answer yes or no." The reward is 1 when
  the completion starts with the right yes/no. Not a good task for the 135M
  model: it mostly answers "No", so RL collapses onto "always No" within a step
  (reward 0.5, then no signal left in any group). Kept as a cautionary example.
* ``extract`` (SmolLM2-135M-Instruct, its config's task): "Sam has 42 coins.
  How many coins does Sam have? Reply with just the number." The reward is 1
  when the completion's first number is the one in the question. The 135M model
  can read the number but mostly chats instead of answering: at temperature 1
  about a quarter of its answers are right and every group of 8 samples holds
  right and wrong ones, so each step has signal; RL teaches it to answer.
* ``arithmetic``: "What is 17 + 25? Answer with just the number." (reward 1 for
  the right sum first). Too hard for the 135M model to learn on a CPU budget;
  kept for larger models.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

__all__ = ["TASKS", "Task", "make_task"]

Prompt = list[dict[str, str]]


class Task:
    """A named set of prompts with a reward function.

    Args:
        name: the task's name.
        prompts: a function ``rng -> (messages, info)`` drawing one prompt.
        reward: ``(completion_text, info) -> float`` in [0, 1].
    """

    def __init__(
        self,
        name: str,
        prompts: Callable[[random.Random], tuple[Prompt, dict[str, Any]]],
        reward: Callable[[str, dict[str, Any]], float],
    ) -> None:
        self.name = name
        self._prompts = prompts
        self.reward = reward

    def batch(self, rng: random.Random, n: int) -> list[tuple[Prompt, dict[str, Any]]]:
        """Draw ``n`` prompts."""
        return [self._prompts(rng) for _ in range(n)]


_DIGIT_QUESTIONS = [
    "Count from {a} to {b}.",
    "What is {a} plus {c}?",
    "Write {a} in words.",
    "Tell me a story about a cat.",
    "What is the capital of France?",
    "List three colors.",
]


def _digits_prompt(rng: random.Random) -> tuple[Prompt, dict[str, Any]]:
    a = rng.randrange(1, 12)
    q = rng.choice(_DIGIT_QUESTIONS).format(a=a, b=a + rng.randrange(2, 6), c=rng.randrange(1, 7))
    return [{"role": "user", "content": q}], {}


def _digits_reward(text: str, info: dict[str, Any]) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def _arith_prompt(rng: random.Random) -> tuple[Prompt, dict[str, Any]]:
    a, b = rng.randrange(2, 30), rng.randrange(2, 30)
    q = f"What is {a} + {b}? Answer with just the number."
    return [{"role": "user", "content": q}], {"answer": a + b}


def _compare_prompt(rng: random.Random) -> tuple[Prompt, dict[str, Any]]:
    a, b = rng.sample(range(1, 100), 2)
    word = rng.choice(["greater", "smaller"])
    q = f"Is {a} {word} than {b}? Answer yes or no."
    truth = (a > b) if word == "greater" else (a < b)
    return [{"role": "user", "content": q}], {"answer": "yes" if truth else "no"}


def _compare_reward(text: str, info: dict[str, Any]) -> float:
    m = re.match(r"\W*(yes|no)\b", text.strip().lower())
    return 1.0 if m is not None and m.group(1) == info["answer"] else 0.0


_NOUNS = ["apples", "books", "cats", "coins", "chairs", "pens", "birds", "cups"]
_NAMES = ["Sam", "Ana", "Li", "Omar", "Kim", "Eva"]


def _extract_prompt(rng: random.Random) -> tuple[Prompt, dict[str, Any]]:
    n, noun, name = rng.randrange(2, 99), rng.choice(_NOUNS), rng.choice(_NAMES)
    q = f"{name} has {n} {noun}. How many {noun} does {name} have? Reply with just the number."
    return [{"role": "user", "content": q}], {"answer": n}


def _first_number_reward(text: str, info: dict[str, Any]) -> float:
    m = re.search(r"-?\d+", text)
    return 1.0 if m is not None and int(m.group()) == info["answer"] else 0.0


TASKS = {
    "digits": Task("digits", _digits_prompt, _digits_reward),
    "arithmetic": Task("arithmetic", _arith_prompt, _first_number_reward),
    "compare": Task("compare", _compare_prompt, _compare_reward),
    "extract": Task("extract", _extract_prompt, _first_number_reward),
}


def make_task(name: str) -> Task:
    """Look a task up by name."""
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}: expected one of {', '.join(TASKS)}.")
    return TASKS[name]
