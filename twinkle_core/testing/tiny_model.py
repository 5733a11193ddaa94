"""A tiny, deterministic causal language model for tests, built offline.

:func:`build_tiny_model` trains a byte-level BPE tokenizer and a two-layer
transformer (Llama or Qwen2 architecture, or a Qwen3.5 hybrid of Gated
DeltaNet and attention layers) on a small built-in corpus of chat
conversations, and saves both as a plain Hugging Face folder that
``transformers`` (``AutoModelForCausalLM`` / ``AutoTokenizer``) and vLLM's CPU
build load. The result is cached under ``$TWINKLE_CACHE`` (default
``~/.cache/twinkle``) in ``tiny-models/<arch>-v<VERSION>``, so only the first
call in a cache pays the build (well under a minute on two CPU cores).

The model is trained until its next-token distributions are sharply peaked on
in-distribution chat prompts (see :data:`TINY_CHAT_PROMPTS`): greedy decoding
produces real text ("The capital of France is Paris.") and the gap between the
top-1 and top-2 logits along greedy continuations is large, so greedy
comparisons between engines are not fragile.

Nothing heavy is imported at module import time: ``torch``, ``tokenizers`` and
``transformers`` are imported inside the functions that need them.

Run ``python -m twinkle_core.testing.tiny_model`` to build both variants and
check that vLLM (CPU) loads them and decodes greedily like ``transformers``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle_core.hub import build_cached_folder, cache_root

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tokenizers import Tokenizer

__all__ = [
    "TINY_ARCHS",
    "TINY_CHAT_PROMPTS",
    "TINY_CHAT_TEMPLATE",
    "TINY_MAX_MODEL_LEN",
    "TINY_MODEL_VERSION",
    "TINY_SPECIAL_TOKENS",
    "TINY_WEATHER_TOOL",
    "build_tiny_model",
    "perturbed_tiny_model",
    "tiny_corpus",
    "train_tiny_tokenizer",
    "write_tiny_model",
]

#: Bump whenever anything that changes the built files changes (corpus,
#: hyper-parameters, template, file layout): the cache folder name includes it,
#: so a new version is rebuilt instead of reusing a stale folder.
TINY_MODEL_VERSION = 4

#: Architectures :func:`build_tiny_model` can build.
TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3_5")

#: Context window of the tiny models (``max_position_embeddings``).
TINY_MAX_MODEL_LEN = 512

#: ``<|endoftext|>`` (id 0, padding), ``<|im_start|>`` (id 1), ``<|im_end|>`` (id 2, end of turn).
TINY_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_VOCAB_SIZE = 768
_SEED = 20240601
_NUM_CONVERSATIONS = 2400
_TRAIN_STEPS = 800
_BATCH_SIZE = 16
_LEARNING_RATE = 4e-3
_MARKER = "twinkle_tiny_model.json"

_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}

#: Architectures whose tokenizer copies ``transformers``' ``Qwen2Tokenizer`` pipeline
#: (``AutoTokenizer`` maps Qwen3.5's text model to a tokenizer of that pipeline too).
_QWEN_TOKENIZER_ARCHS = frozenset({"qwen2", "qwen3_5"})

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

# ---------------------------------------------------------------------------
# The built-in corpus
# ---------------------------------------------------------------------------

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
_PROSE = [
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


def tiny_corpus(num_conversations: int = _NUM_CONVERSATIONS) -> list[str]:
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
    rng = random.Random(_SEED)
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

# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def _check_arch(arch: str) -> str:
    """Validate an architecture name.

    Args:
        arch: the requested architecture.

    Returns:
        ``arch`` itself.

    Raises:
        ValueError: if ``arch`` is not one of :data:`TINY_ARCHS`.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; expected one of {list(TINY_ARCHS)}")
    return arch


def train_tiny_tokenizer(arch: str = "llama") -> Tokenizer:
    """Train the byte-level BPE tokenizer of a tiny model.

    The ``llama`` variant uses the GPT-2 style byte-level pipeline (no
    normaliser, so every string round-trips exactly). The ``qwen2`` and
    ``qwen3_5`` variants copy the pipeline (NFC normaliser, split regex, byte-level decoder) from
    ``transformers``' own ``Qwen2Tokenizer``, because ``AutoTokenizer``
    rebuilds any ``qwen2`` tokenizer around that pipeline and would otherwise
    encode differently from the trained one.

    Args:
        arch: one of :data:`TINY_ARCHS`.

    Returns:
        A ``tokenizers.Tokenizer`` with :data:`TINY_SPECIAL_TOKENS` at ids 0, 1, 2.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _check_arch(arch)
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    if arch in _QWEN_TOKENIZER_ARCHS:
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

        reference: Any = Qwen2Tokenizer()._tokenizer
        tokenizer.normalizer = reference.normalizer
        tokenizer.pre_tokenizer = reference.pre_tokenizer
        tokenizer.decoder = reference.decoder
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_corpus() + _PROSE, trainer=trainer)
    for index, token in enumerate(TINY_SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != index:  # pragma: no cover - tokenizers contract
            raise RuntimeError(f"special token {token!r} did not get id {index}")
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, arch: str, folder: Path) -> None:
    """Save a trained tokenizer as a Hugging Face tokenizer folder.

    Args:
        tokenizer: the trained tokenizer.
        arch: one of :data:`TINY_ARCHS` (selects ``tokenizer_class``).
        folder: where to write ``tokenizer.json`` and ``tokenizer_config.json``.
    """
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=TINY_MAX_MODEL_LEN,
        padding_side="left",
    )
    wrapped.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(
        {
            "tokenizer_class": "Qwen2Tokenizer" if arch in _QWEN_TOKENIZER_ARCHS else "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": TINY_MAX_MODEL_LEN,
            "chat_template": TINY_CHAT_TEMPLATE,
        }
    )
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # Keep the template in one place (tokenizer_config.json), not also in a side file.
    (folder / "chat_template.jinja").unlink(missing_ok=True)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def _model_config(arch: str, vocab_size: int) -> Any:
    """Build the ``transformers`` config of a tiny model.

    Args:
        arch: one of :data:`TINY_ARCHS`.
        vocab_size: the tokenizer's size (``len(tokenizer)``).

    Returns:
        A ``LlamaConfig``, ``Qwen2Config`` or ``Qwen3_5TextConfig``.
    """
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=TINY_MAX_MODEL_LEN,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        use_cache=True,
        architectures=[_ARCH_CLASSES[arch]],
        dtype="float32",
    )
    if arch == "qwen3_5":
        return _qwen3_5_config(common)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False)
    from transformers import LlamaConfig

    return LlamaConfig(**common, attention_bias=False, mlp_bias=False)


def _qwen3_5_config(common: dict[str, Any]) -> Any:
    """The tiny Qwen3.5 text model: the real family's 3:1 hybrid, at sizes vLLM's CPU kernels take.

    Four layers, three Gated DeltaNet then one gated full attention (the
    real ``full_attention_interval`` of 4). The GDN heads are 64 wide for
    keys and values alike (vLLM's CPU prefill kernel takes ``Dk == Dv`` in
    {64, 128} only), with one key head shared by two value heads as in the
    real checkpoints, and the convolution is 4 wide (the packed CPU path's
    only width). Attention keeps the other tiny models' 2 query heads and 1
    KV head of 64 (a CPU attention head size). The rotary embedding is the
    real one's shape scaled down: a quarter of each head rotated, with the
    interleaved multimodal sections summing to that quarter's frequencies.
    """
    from transformers import Qwen3_5TextConfig

    rotary_pairs = common["head_dim"] // 4 // 2
    return Qwen3_5TextConfig(
        **{**common, "num_hidden_layers": 4},
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [rotary_pairs - 2 * (rotary_pairs // 3), rotary_pairs // 3, rotary_pairs // 3],
        },
    )


def _batches(token_lists: list[list[int]], steps: int, batch_size: int) -> Iterator[list[list[int]]]:
    """Yield ``steps`` batches in a fixed order (reshuffled each epoch from a fixed seed).

    Args:
        token_lists: the tokenized corpus.
        steps: how many batches to yield.
        batch_size: sequences per batch.

    Yields:
        Lists of ``batch_size`` token lists.
    """
    rng = random.Random(_SEED + 1)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            epoch = list(range(len(token_lists)))
            rng.shuffle(epoch)
            order += epoch
        yield [token_lists[i] for i in order[:batch_size]]
        del order[:batch_size]


def _train(model: Any, token_lists: list[list[int]], steps: int, pad_id: int) -> list[float]:
    """Train ``model`` in place on the tokenized corpus, deterministically.

    Args:
        model: a freshly initialised causal LM (float32, CPU).
        token_lists: the tokenized corpus.
        steps: optimizer steps.
        pad_id: the padding token id.

    Returns:
        The loss of every step.
    """
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=_LEARNING_RATE, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses = []
    for batch in _batches(token_lists, steps, _BATCH_SIZE):
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
        labels = input_ids.masked_fill(attention == 0, -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())
    model.eval()
    return losses


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count.

    Args:
        count: the thread count to use inside the block.

    Yields:
        Nothing.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_tiny_model(
    folder: str | os.PathLike[str], arch: str = "llama", *, train_steps: int = _TRAIN_STEPS
) -> dict[str, Any]:
    """Build a tiny model into ``folder`` without any caching.

    Most callers want :func:`build_tiny_model`, which caches the result. This
    function exists for tests that check determinism with fewer steps.

    Args:
        folder: the output folder (created; existing files are overwritten).
        arch: one of :data:`TINY_ARCHS`.
        train_steps: optimizer steps (0 leaves the random initialisation).

    Returns:
        Build metadata, also written to ``twinkle_tiny_model.json``: version,
        arch, steps, first and last loss, seconds taken, hashes.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    _check_arch(arch)
    start = time.perf_counter()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)

    raw_tokenizer = train_tiny_tokenizer(arch)
    _save_tokenizer(raw_tokenizer, arch, out)
    vocab_size = raw_tokenizer.get_vocab_size(with_added_tokens=True)
    token_lists = [enc.ids for enc in raw_tokenizer.encode_batch(tiny_corpus())]
    too_long = max(len(ids) for ids in token_lists)
    if too_long > TINY_MAX_MODEL_LEN:  # pragma: no cover - corpus invariant
        raise RuntimeError(f"corpus conversation of {too_long} tokens exceeds the context")

    config = _model_config(arch, vocab_size)
    # One thread: float sums are identical whatever the machine's core count,
    # and on a busy machine it is ~10x faster than oversubscribed OpenMP threads
    # for a model this small. fork_rng leaves the caller's random state untouched.
    with _torch_threads(1), torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        losses = _train(model, token_lists, train_steps, pad_id=0) if train_steps > 0 else []
    model.config.architectures = [_ARCH_CLASSES[arch]]
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(out))

    weights = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        weights.update(name.encode())
        weights.update(tensor.detach().contiguous().numpy().tobytes())
    meta = {
        "version": TINY_MODEL_VERSION,
        "arch": arch,
        "architecture": _ARCH_CLASSES[arch],
        "vocab_size": vocab_size,
        "train_steps": train_steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "build_seconds": round(time.perf_counter() - start, 2),
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "weights_sha256": weights.hexdigest(),
    }
    (out / _MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    for path in out.iterdir():  # safetensors are written 0600; a shared cache wants 0644
        path.chmod(0o644)
    return meta


def build_tiny_model(arch: str = "llama", cache_dir: str | Path | None = None) -> Path:
    """Return the folder of a tiny causal LM, building and caching it on first use.

    The model is a two-layer ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``
    (hidden 128, 2 query heads and 1 KV head of size 64, float32, untied
    embeddings, context 512), or a four-layer hybrid ``Qwen3_5ForCausalLM``
    (three Gated DeltaNet layers, then one attention layer of those sizes),
    with a byte-level BPE tokenizer of 768 tokens, a ChatML chat template and a ``generation_config.json`` whose
    ``eos_token_id`` is ``<|im_end|>``. Building is deterministic and offline.

    The folder is ``<cache_dir>/tiny-models/<arch>-v<TINY_MODEL_VERSION>``. It
    is built in a temporary sibling folder and renamed into place, under a
    file lock, so processes racing to build it are safe and a half-written
    folder is never seen.

    Args:
        arch: one of :data:`TINY_ARCHS`.
        cache_dir: the cache root; defaults to :func:`twinkle_core.hub.cache_root`
            (``$TWINKLE_CACHE`` or ``~/.cache/twinkle``).

    Returns:
        The model folder, loadable with ``from_pretrained`` and by vLLM.

    Raises:
        ValueError: if ``arch`` is unknown.
    """
    _check_arch(arch)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = root / "tiny-models" / f"{arch}-v{TINY_MODEL_VERSION}"

    def build(out: Path) -> None:
        write_tiny_model(out, arch)

    return build_cached_folder(final, _MARKER, build)


def perturbed_tiny_model(arch: str = "llama", seed: int = 1, scale: float = 0.05) -> Path:
    """The tiny model with every weight nudged: a second model for checking that tests do not lean on luck.

    A test whose expectation holds only because the tiny model's greedy
    decoding emitted (or did not emit) one particular token passes on the CPU
    it was written on and fails on a CPU whose kernels round a near-tie the
    other way. Running the same test on this model (each tensor plus
    ``scale x std(tensor)`` Gaussian noise from ``seed``: the same tokenizer
    and template, different near-ties everywhere) shows such a test on the
    developer's own machine. Cached next to the base model.

    Args:
        arch: one of :data:`TINY_ARCHS`.
        seed: the noise's seed; each seed is another model.
        scale: the noise relative to each tensor's standard deviation.

    Returns:
        The model folder, loadable like :func:`build_tiny_model`'s.
    """
    base = build_tiny_model(arch)
    final = base.parent / f"{base.name}-perturbed-{int(seed)}-{scale:g}"

    def build(out: Path) -> None:
        import shutil

        import torch
        from safetensors.torch import load_file, save_file

        for path in base.iterdir():
            if path.name not in ("model.safetensors", _MARKER):
                shutil.copy2(path, out / path.name)
        gen = torch.Generator().manual_seed(int(seed))
        weights = load_file(str(base / "model.safetensors"))
        nudged = {
            name: (t + scale * t.float().std() * torch.randn(t.shape, generator=gen)).to(t.dtype).contiguous()
            for name, t in sorted(weights.items())
        }
        save_file(nudged, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "model.safetensors").chmod(0o644)
        meta = json.loads((base / _MARKER).read_text(encoding="utf-8"))
        meta["perturbed"] = {"seed": int(seed), "scale": scale}
        (out / _MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")  # last: marks it complete

    return build_cached_folder(final, _MARKER, build)


# ---------------------------------------------------------------------------
# Manual check: python -m twinkle_core.testing.tiny_model
# ---------------------------------------------------------------------------


def _hf_greedy(
    folder: Path, prompts: list[list[dict[str, Any]]], max_new_tokens: int
) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """Greedy-decode chat prompts with ``transformers``.

    Args:
        folder: the model folder.
        prompts: chat conversations.
        max_new_tokens: the generation budget.

    Returns:
        ``(prompt_ids, completion_ids, margins)`` where ``margins`` are the
        top-1 minus top-2 logit gaps over every generated position.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    prompt_ids: list[list[int]] = []
    completions: list[list[int]] = []
    margins: list[float] = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        completions.append(out.sequences[0, len(ids) :].tolist())
        prompt_ids.append(ids)
        for scores in out.scores:
            top = torch.topk(scores[0], 2).values
            margins.append(float(top[0] - top[1]))
    return prompt_ids, completions, margins


def _main() -> None:  # pragma: no cover - manual check, needs vLLM
    """Build both variants, then compare HF and vLLM (CPU) greedy decoding."""
    import statistics

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for arch in TINY_ARCHS:
        start = time.perf_counter()
        folder = build_tiny_model(arch)
        print(f"[{arch}] folder {folder} ready in {time.perf_counter() - start:.1f}s")
        print(json.loads((folder / _MARKER).read_text()))
        prompt_ids, hf_out, margins = _hf_greedy(folder, TINY_CHAT_PROMPTS, 48)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        for ids in hf_out[:4]:
            print(f"[{arch}] HF greedy: {tokenizer.decode(ids)!r}")
        print(
            f"[{arch}] margins: min {min(margins):.3f} median {statistics.median(margins):.3f} "
            f"share>1: {sum(m > 1 for m in margins) / len(margins):.2f}"
        )
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        llm = LLM(
            model=str(folder),
            dtype="float32",
            max_model_len=TINY_MAX_MODEL_LEN,
            enforce_eager=True,
            kv_cache_memory_bytes=256 * 1024**2,
            seed=0,
        )
        print(f"[{arch}] vLLM engine start {time.perf_counter() - start:.1f}s")
        params = SamplingParams(temperature=0.0, max_tokens=48)
        results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params)
        same = [list(r.outputs[0].token_ids) == hf for r, hf in zip(results, hf_out, strict=True)]
        print(f"[{arch}] vLLM == HF greedy: {same}")
        del llm


if __name__ == "__main__":  # pragma: no cover
    _main()
