"""The tiny models' chat template and training corpus: ChatML conversations drawn from a fixed seed.

Everything here shapes the built models: a change needs a new
:data:`~twinkle_core.testing.tiny_model.TINY_MODEL_VERSION`.
"""

from __future__ import annotations

import json
import random
from typing import Any

__all__ = [
    "NUM_CONVERSATIONS",
    "PROSE",
    "SEED",
    "TINY_CHAT_PROMPTS",
    "TINY_CHAT_TEMPLATE",
    "TINY_WEATHER_TOOL",
    "tiny_corpus",
]

#: The seed of every random draw of a build: the corpus, the batch order, the initial weights.
SEED = 20240601
NUM_CONVERSATIONS = 2400

#: ChatML with system / user / assistant / tool roles, ``add_generation_prompt``
#: and ``tools`` (listed in the system turn as JSON, one per line). Assistant
#: ``tool_calls`` are rendered as ``<tool_call>`` JSON blocks; message content
#: may be a string, ``None`` or a list of ``{"type": "text", "text": ...}`` parts.
TINY_CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(skip_first=false) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{{- render_content(messages[0].content) + '\\n\\n' -}}"
    "{%- set ns.skip_first = true -%}"
    "{%- endif -%}"
    "{{- 'Tools:\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and ns.skip_first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- set text = render_content(message.content) -%}"
    "{{- text -}}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- if tool_call.function is defined -%}{%- set call = tool_call.function -%}"
    "{%- else -%}{%- set call = tool_call -%}{%- endif -%}"
    "{%- if text or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' -}}'
    "{%- if call.arguments is string -%}{{- call.arguments -}}"
    "{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CAPITALS = [
    ("France", "Paris"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Canada", "Ottawa"),
    ("Norway", "Oslo"),
    ("Chile", "Santiago"),
    ("Greece", "Athens"),
    ("Poland", "Warsaw"),
]
_COLORS = [
    ("sky", "blue"),
    ("grass", "green"),
    ("banana", "yellow"),
    ("snow", "white"),
    ("coal", "black"),
    ("tomato", "red"),
    ("carrot", "orange"),
    ("plum", "purple"),
    ("cloud", "gray"),
    ("chocolate", "brown"),
]
_PEOPLE = [
    ("Alice", "baker", "Paris", "fresh bread", "She"),
    ("Bob", "farmer", "Lima", "green apples", "He"),
    ("Carol", "pilot", "Oslo", "old maps", "She"),
    ("Dave", "doctor", "Rome", "loud music", "He"),
    ("Erin", "teacher", "Cairo", "long books", "She"),
    ("Frank", "painter", "Tokyo", "small birds", "He"),
]
_ANIMALS = [
    ("cat", "meow"),
    ("dog", "woof"),
    ("cow", "moo"),
    ("duck", "quack"),
    ("sheep", "baa"),
    ("owl", "hoot"),
]
_NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly assistant. Answer briefly.",
]
_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
#: The tool the tiny model learnt to call (OpenAI chat shape), for tests that need a call from it.
TINY_WEATHER_TOOL = _WEATHER_TOOL
PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns simple facts, numbers and short answers.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 2024 3.14",
    "Punctuation: , . ; : ! ? ' \" ( ) [ ] { } < > / \\ - _ + = * & % $ # @",
    "Lines\nwith\ttabs and  double  spaces.\n\nEnd.",
]


def _qa_pair(rng: random.Random) -> tuple[str, str]:
    """Draw one deterministic question and its answer.

    Args:
        rng: the random source (seeded by the caller).

    Returns:
        ``(question, answer)``.
    """
    kind = rng.randrange(11)
    if kind == 0:
        country, capital = rng.choice(_CAPITALS)
        return f"What is the capital of {country}?", f"The capital of {country} is {capital}."
    if kind == 1:
        thing, color = rng.choice(_COLORS)
        return f"What color is the {thing}?", f"The {thing} is {color}."
    if kind == 2:
        a, b = rng.randrange(1, 7), rng.randrange(1, 7)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 3:
        start = rng.randrange(1, 15)
        end = start + rng.randrange(2, 7)
        return f"Count from {start} to {end}.", ", ".join(str(i) for i in range(start, end + 1)) + "."
    if kind == 4:
        n = rng.randrange(len(_NUMBER_WORDS))
        return f"Write {n} in words.", f"{n} is {_NUMBER_WORDS[n]}."
    if kind == 5:
        name, job, city, likes, pronoun = rng.choice(_PEOPLE)
        return (
            f"Tell me about {name}.",
            f"{name} is a {job} who lives in {city}. {pronoun} likes {likes}.",
        )
    if kind == 6:
        animal, sound = rng.choice(_ANIMALS)
        return f"What does the {animal} say?", f"The {animal} says {sound}."
    if kind == 7:
        animal, sound = rng.choice(_ANIMALS)
        return (
            f"Tell me a story about a {animal}.",
            f"Once upon a time, a little {animal} lived on a farm. Every morning the {animal} "
            f"said {sound} to the sun. One day the {animal} found a friend, and they played "
            "until night. The end.",
        )
    if kind == 8:
        return rng.choice(["Hello!", "Hi!", "Good morning!"]), "Hello! How can I help you today?"
    if kind == 9:
        return rng.choice(["Thank you!", "Thanks!"]), "You are welcome!"
    return rng.choice(
        [
            ("List three colors.", "Red, green and blue."),
            ("List three animals.", "Cat, dog and cow."),
            ("What is your name?", "I am a tiny test model."),
            ("Say something in French.", "Bonjour! Comment ça va?"),
        ]
    )


def _conversation(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Draw one chat conversation (and its tools, if any) from the corpus.

    Args:
        rng: the random source (seeded by the caller).

    Returns:
        ``(messages, tools)``; ``tools`` is ``None`` unless the conversation calls one.
    """
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.35:
        messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
    if rng.random() < 0.08:
        city = rng.choice(_CAPITALS)[1]
        degrees = rng.randrange(5, 35)
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": city}},
                    }
                ],
            },
            {"role": "tool", "content": f"{degrees} degrees and sunny"},
            {"role": "assistant", "content": f"It is {degrees} degrees and sunny in {city}."},
        ]
        return messages, [_WEATHER_TOOL]
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        question, answer = _qa_pair(rng)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    return messages, None


def tiny_corpus(num_conversations: int = NUM_CONVERSATIONS) -> list[str]:
    """Render the built-in training corpus through :data:`TINY_CHAT_TEMPLATE`.

    The corpus is generated from a fixed seed, so it is identical on every call
    and every machine.

    Args:
        num_conversations: how many conversations to draw.

    Returns:
        One ChatML string per conversation.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    template = env.from_string(TINY_CHAT_TEMPLATE)
    rng = random.Random(SEED)
    texts = []
    for _ in range(num_conversations):
        messages, tools = _conversation(rng)
        texts.append(template.render(messages=messages, tools=tools, add_generation_prompt=False))
    return texts


#: Short chat conversations, all ending in a user turn, used as generation
#: prompts by tests. They are drawn from the training distribution, so both tiny
#: models answer them fluently, and along their greedy answers the top-1 logit
#: beats the top-2 by far more than float32 noise (at least ~0.4, median ~9;
#: the closest calls are sums and counting), so greedy decoding agrees across
#: engines.
TINY_CHAT_PROMPTS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Count from 3 to 8."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me about Carol."},
    ],
    [{"role": "user", "content": "Tell me a story about a duck."}],
    [
        {"role": "user", "content": "What color is the sky?"},
        {"role": "assistant", "content": "The sky is blue."},
        {"role": "user", "content": "What does the cow say?"},
    ],
    [{"role": "user", "content": "What is 4 plus 3?"}],
    [
        {"role": "system", "content": "You are a friendly assistant. Answer briefly."},
        {"role": "user", "content": "Write 12 in words."},
        {"role": "assistant", "content": "12 is twelve."},
        {"role": "user", "content": "What is the capital of Japan?"},
        {"role": "assistant", "content": "The capital of Japan is Tokyo."},
        {"role": "user", "content": "Tell me about Frank."},
    ],
    [{"role": "user", "content": "List three animals."}],
    [
        {"role": "user", "content": "Thanks!"},
    ],
]
