"""``EchoSampler``: a complete twinkle engine around the pure-Python toy model.

Everything a user calls (``sample``, input checks, errors, versions) comes
from :class:`twinkle_core.Sampler`. This module only supplies the hooks: the
context window, the vocabulary size and ``_generate``, the decoding loop.
"""

from __future__ import annotations

import random
from typing import Any

from twinkle_core import InputFeature, SampledSequence, Sampler, SampleResponse, SamplingParams
from twinkle_core.data_format import TopLogprobs
from twinkle_core.errors import ConfigError
from twinkle_echo.model import EchoModel
from twinkle_echo.processing import choose, log_softmax, top_alternatives
from twinkle_echo.tokenizer import NUM_BYTES, SPECIAL_TOKENS, EchoTokenizer

__all__ = ["EchoSampler"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"EchoSampler {name}={value!r} is invalid: expected an integer >= {minimum}.")
    return value


class EchoSampler(Sampler):
    """A deterministic toy engine: echoes the latest user message, honours every sampling option.

    Args:
        model_id: a label for the "model"; it is mixed into the seed, so two
            ids behave like two different models. ``None`` is the default model.
        vocab_size: token ids the model knows (bytes, ChatML specials, then
            reserved ids); at least 259.
        max_model_len: the context window (prompt + completion), in tokens.
        seed: picks the model's noise table (not the sampling seed: that is
            ``SamplingParams.seed``).
        template: a registered template name, a ``Template`` class or
            instance; default: the tokenizer's own ChatML template.

    Raises:
        ConfigError: a bad ``vocab_size``, ``max_model_len`` or ``seed``.

    Sampling follows twinkle's contract exactly (see ``SamplingParams``):

    * sample ``i`` of a request with ``seed=s`` draws from its own stream
      seeded with ``s + i`` (vLLM's convention), whatever else is batched;
    * stop strings are matched on the decoded completion after every token;
      ``text`` is cut before the match, ``tokens`` keep the token that
      completed it. EOS and ``stop_token_ids`` stay in ``tokens`` but not in
      ``text`` (as in vLLM);
    * prompt log-probs are those of the raw logits, whatever
      ``logprobs_mode`` says (as in vLLM: prompt tokens are not sampled, so
      no sampling processors apply to them).
    """

    engine_name = "echo"
    # Listed by name, never derived from SamplingParams: a field added later is refused until honoured here.
    supported_params = frozenset(
        {
            "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
            "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logprobs_mode", "num_samples",
        }
    )  # fmt: skip
    #: Pure Python with no shared mutable state: calls may run in parallel threads.
    concurrent_samples = True

    def __init__(
        self,
        model_id: str | None = None,
        *,
        vocab_size: int = 300,
        max_model_len: int = 256,
        seed: int = 0,
        template: Any = None,
    ) -> None:
        super().__init__()
        if model_id is not None and not isinstance(model_id, str):
            raise ConfigError(f"EchoSampler model_id={model_id!r} is invalid: expected a string or None.")
        _check_int("vocab_size", vocab_size, NUM_BYTES + len(SPECIAL_TOKENS))
        self._max_model_len = _check_int("max_model_len", max_model_len, 2)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"EchoSampler seed={seed!r} is invalid: expected an integer.")
        self.model_id = model_id
        self._vocab_size = vocab_size
        self._model = EchoModel(vocab_size, seed=seed, name=model_id or "")
        # A real engine passes its model folder and the base loads the tokenizer.
        self._init_template(template, tokenizer=EchoTokenizer(vocab_size))

    def __repr__(self) -> str:
        return (
            f"EchoSampler(model_id={self.model_id!r}, vocab_size={self._vocab_size},"
            f" max_model_len={self._max_model_len})"
        )

    # -- engine hooks ------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion, in tokens."""
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model accepts."""
        return self._vocab_size

    def _generate(self, prompts: list[InputFeature], params: SamplingParams, adapter_name: str) -> list[SampleResponse]:
        responses = []
        for prompt in prompts:
            ids = list(prompt.input_ids)
            prompt_logprobs, prompt_top = self._score_prompt(ids, params.prompt_logprobs)
            sequences = [self._complete(ids, params, adapter_name, i) for i in range(params.num_samples)]
            responses.append(
                SampleResponse(
                    prompt_token_ids=ids,
                    sequences=sequences,
                    prompt_logprobs=prompt_logprobs,
                    prompt_top_logprobs=prompt_top,
                )
            )
        return responses

    # -- decoding ------------------------------------------------------------------------
    def _complete(self, prompt: list[int], params: SamplingParams, adapter_name: str, index: int) -> SampledSequence:
        """Decode one completion: sample ``index`` of its request."""
        # A string seed: random.Random(int) would give seeds -s and s one stream.
        rng = random.Random(f"{params.seed + index}") if params.seed is not None else random.Random()
        budget = min(params.max_tokens, self.max_model_len - len(prompt))
        eos = self.template.eos_token_id
        stop_ids = frozenset(params.stop_token_ids)
        context = list(prompt)
        tokens: list[int] = []
        logprobs: list[float] | None = [] if params.logprobs is not None else None
        top: TopLogprobs | None = [] if params.logprobs else None
        stop: str | int | None = None
        text: str | None = None
        while len(tokens) < budget:
            choice = choose(self._model.logits(context), params, context, rng)
            token = choice.token
            tokens.append(token)
            context.append(token)
            if logprobs is not None:
                logprobs.append(choice.logprob)
            if top is not None and params.logprobs:
                top.append(top_alternatives(choice.logprobs, params.logprobs))
            if (token == eos and not params.ignore_eos) or token in stop_ids:
                stop, text = token, self.template.decode(tokens[:-1])
                break
            if params.stop:
                matched = self._find_stop(self.template.decode(tokens), params.stop)
                if matched is not None:
                    stop, text = matched
                    break
        return self._make_sequence(
            prompt,
            tokens,
            stop_reason="length" if stop is None else "stop",
            stop=stop,
            text=text,
            adapter_name=adapter_name,
            logprobs=logprobs,
            top_logprobs=top,
        )

    @staticmethod
    def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str] | None:
        """The earliest stop string in ``text`` and the text before it, if any.

        The whole decoded completion is searched after every token, so a stop
        string spanning several tokens (or part of a multi-byte character) is
        found on the token that completes it.
        """
        best: tuple[int, str] | None = None
        for s in stops:
            at = text.find(s)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        return best[1], text[: best[0]]

    def _score_prompt(self, ids: list[int], k: int | None) -> tuple[list[float | None] | None, TopLogprobs | None]:
        """Log-prob of each prompt token given those before it (raw logits)."""
        if k is None:
            return None, None
        scores: list[float | None] = [None]
        tops: list[list[tuple[int, float]] | None] = [None]
        for i in range(1, len(ids)):
            row = log_softmax(self._model.logits(ids[:i]))
            scores.append(row[ids[i]])
            tops.append(top_alternatives(row, k))
        return scores, (tops if k > 0 else None)  # type: ignore[return-value]
