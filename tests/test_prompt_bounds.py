"""A prompt that cannot fit is refused before it is tokenized whole; one truncated is cut from a window of it.

Before these bounds, a 64 MiB chat message cost ``sample()`` 166 s and 16 GB of
resident memory to learn that 33 million tokens do not fit a context of 8k
(``bench/bench_oversized.py``). Here the real tokenizer of the tiny model is
wrapped to record the longest text it is handed: what a user notices (time,
memory) follows from that length.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from twinkle_core import InvalidSamplingParams, PromptTooLongError, SamplingParams
from twinkle_core.episode import Episode
from twinkle_core.template import Template

#: A message of 8 MiB: no tokenizer pass over all of it may happen.
HUGE = "a " * (4 * 2**20)
#: The most characters any one tokenizer call may see when a prompt is refused or cut (the windows at one end).
WINDOW_BOUND = 64 * 2**10


class _Recording:
    """The real tokenizer, recording the length of every text it encodes."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.longest = 0

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.longest = max(self.longest, len(text))
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


@pytest.fixture(scope="module")
def template() -> Template:
    from twinkle_core.testing import build_tiny_model

    return Template.from_pretrained(build_tiny_model("llama"))


@pytest.fixture(scope="module")
def sampler() -> Iterator[Any]:
    from twinkle_core.testing import build_tiny_model
    from twinkle_torch.sampler import TorchSampler

    with TorchSampler(build_tiny_model("llama"), device="cpu") as s:
        yield s


@pytest.fixture
def recording(sampler: Any) -> Iterator[_Recording]:
    real = sampler.template.tokenizer
    spy = _Recording(real)
    sampler.template.tokenizer = spy
    try:
        yield spy
    finally:
        sampler.template.tokenizer = real


def _texts(seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    pieces = ["hello", " world", "\n", "  ", "<|im_start|>", "é", "日本", "1234567", "===", "aaaa", "\t", " the", "."]
    for n in (3, 40, 400, 4000, 20000):
        yield "".join(rng.choice(pieces) for _ in range(n))


@pytest.mark.parametrize("seed", range(4))
def test_the_ends_of_a_text_are_its_whole_tokenization_cut(template: Template, seed: int) -> None:
    """Whatever the text, the windows give exactly the tokens that tokenizing it whole and cutting would."""
    for text in _texts(seed):
        whole = template.tokenize(text)
        for k in (1, 7, 100, 900):
            assert template.tokenize(text, keep_last=k) == whole[-k:]
            assert template.tokenize(text, keep_first=k) == whole[:k]
            if len(whole) <= k:
                assert template.tokenize(text, max_tokens=k) == whole
            else:
                with pytest.raises(PromptTooLongError) as info:
                    template.tokenize(text, max_tokens=k)
                assert k < info.value.length <= len(whole) and info.value.limit == k


def test_an_oversized_chat_is_refused_from_a_window(sampler: Any, recording: _Recording) -> None:
    with pytest.raises(PromptTooLongError, match=r"inputs\[1\] has more than \d+ prompt tokens") as info:
        sampler.sample(
            [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "user", "content": HUGE}]}]
        )
    assert info.value.index == 1 and info.value.at_least and info.value.length > info.value.limit
    assert recording.longest < WINDOW_BOUND
    # skipped, the other input is still sampled
    out = sampler.sample(
        [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "user", "content": HUGE}]}],
        {"max_tokens": 3},
        on_invalid="skip",
    )
    assert out[0].sequences and out[1].error and "more than" in out[1].error


def test_more_messages_than_the_context_has_tokens_is_refused_unrendered(sampler: Any) -> None:
    """Each message renders to a token at least: counting them is enough (rendering a million takes seconds)."""
    many = [{"role": "user", "content": "a"}] * (sampler.max_model_len + 1)
    with pytest.raises(PromptTooLongError, match=r"inputs\[0\] has more than") as info:
        sampler.sample({"messages": many})
    assert info.value.at_least and info.value.length == len(many)


def test_truncating_an_oversized_chat_reads_only_its_end(sampler: Any, recording: _Recording) -> None:
    """The kept tokens are those of the whole text's tokenization (a text small enough to check against)."""
    from twinkle_core import Trajectory

    question = [{"role": "user", "content": "a " * 2**17 + "What is the capital of France?"}]
    keep = 40
    out = sampler.sample({"messages": question}, {"max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": keep})
    assert recording.longest < WINDOW_BOUND
    whole = sampler.template.tokenize(sampler.template.render(Trajectory(messages=question)))
    assert out[0].prompt_token_ids == whole[-keep:]


def test_an_episode_refuses_messages_it_has_no_room_for(sampler: Any, recording: _Recording) -> None:
    episode = Episode(sampler, {"messages": [{"role": "user", "content": "hi"}]})
    episode.sample(sampler, {"max_tokens": 3, "temperature": 0})
    tokens = list(episode.tokens)
    with pytest.raises(PromptTooLongError, match="room for"):
        episode.add_user(HUGE)
    assert recording.longest < WINDOW_BOUND
    assert episode.tokens == tokens  # nothing appended: the episode goes on
    episode.add_user("and now?")
    assert episode.sample(sampler, {"max_tokens": 3}) is not None
    with pytest.raises(PromptTooLongError):
        Episode(sampler, {"messages": [{"role": "user", "content": HUGE}]})


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [
        ("stop", ["x" * 20_000], "16384 characters"),
        ("stop", [f"s{i}" for i in range(2000)], "at most 1024"),
        ("bad_words", ["y" * 20_000], "16384 characters"),
    ],
)
def test_oversized_stop_strings_and_bad_words_are_refused_briefly(field: str, value: Any, bound: str) -> None:
    """The bound is named, and the message shows a short head of the value, not all of it."""
    with pytest.raises(InvalidSamplingParams, match=bound) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and len(str(info.value)) < 1000
