"""``EchoEngine``: a complete twinkle engine around the pure-Python toy model.

Everything a user calls (``sample``, input checks, errors, versions) comes
from the :class:`twinkle_core.Sampler` that holds the engine. This module only
supplies what :mod:`twinkle_core.engine` asks of an engine: an ``EngineInfo``
(name, context window, vocabulary, the fields it honours) and ``generate``,
the decoding loop. ``twinkle_echo.EchoSampler(...)`` is ``Sampler(EchoEngine, ...)``.
"""

from __future__ import annotations

import random
from typing import Any

from twinkle_core.data_format import InputFeature, SampledSequence, SampleResponse, SamplingParams, TopLogprobs
from twinkle_core.engine import BatchEngine, EngineContext, EngineInfo
from twinkle_core.errors import ConfigError
from twinkle_echo.model import EchoModel
from twinkle_echo.processing import choose, log_softmax, top_alternatives
from twinkle_echo.tokenizer import NUM_BYTES, SPECIAL_TOKENS, EchoTokenizer

__all__ = ["SUPPORTED_PARAMS", "EchoEngine"]

# Listed by name, never derived from SamplingParams: a field added later is refused until honoured here.
SUPPORTED_PARAMS = frozenset(
    {
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
        "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logprobs_mode", "num_samples",
    }
)  # fmt: skip


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"EchoEngine {name}={value!r} is invalid: expected an integer >= {minimum}.")
    return value


class EchoEngine(BatchEngine):
    """A deterministic toy engine: echoes the latest user message, honours every sampling option.

    Built by the sampler that holds it: ``Sampler(EchoEngine, model_id, ...)``
    or ``create_sampler("echo", ...)`` (the sampler passes ``context``).

    Args:
        context: what the engine may use of its sampler (the template, building sequences).
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
      seeded with the pair ``(s, i)``, whatever else is batched (not ``s + i``:
      then seeds ``s`` and ``s + 1`` would share samples);
    * stop strings are matched on the decoded completion after every token;
      ``text`` is cut before the match, ``tokens`` keep the token that
      completed it. EOS and ``stop_token_ids`` stay in ``tokens`` but not in
      ``text`` (as in vLLM);
    * prompt log-probs are those of the raw logits, whatever
      ``logprobs_mode`` says (as in vLLM: prompt tokens are not sampled, so
      no sampling processors apply to them).
    """

    def __init__(
        self,
        context: EngineContext,
        model_id: str | None = None,
        *,
        vocab_size: int = 300,
        max_model_len: int = 256,
        seed: int = 0,
        template: Any = None,
    ) -> None:
        super().__init__(context)
        if model_id is not None and not isinstance(model_id, str):
            raise ConfigError(f"EchoEngine model_id={model_id!r} is invalid: expected a string or None.")
        _check_int("vocab_size", vocab_size, NUM_BYTES + len(SPECIAL_TOKENS))
        _check_int("max_model_len", max_model_len, 2)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"EchoEngine seed={seed!r} is invalid: expected an integer.")
        self.model_id = model_id
        self._model = EchoModel(vocab_size, seed=seed, name=model_id or "")
        # A real engine passes its model folder and the sampler loads the tokenizer.
        context.init_template(template, tokenizer=EchoTokenizer(vocab_size))
        # Pure Python with no shared mutable state: runs may go on in parallel threads.
        self.info = EngineInfo(
            name="echo",
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            supported_params=SUPPORTED_PARAMS,
            concurrent=True,
        )

    def __repr__(self) -> str:
        return (
            f"EchoEngine(model_id={self.model_id!r}, vocab_size={self.info.vocab_size},"
            f" max_model_len={self.info.max_model_len})"
        )

    # -- the one method an engine must have (BatchEngine turns runs into these calls) -----
    def generate(self, prompts: list[InputFeature], params: SamplingParams, adapter_name: str) -> list[SampleResponse]:
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
        # A string seed of the pair: random.Random(int) would give seeds -s and s one stream.
        rng = random.Random(f"{params.seed}:{index}") if params.seed is not None else random.Random()
        template = self.context.template
        budget = min(params.max_tokens, self.info.max_model_len - len(prompt))
        eos = template.eos_token_id
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
                stop, text = token, template.decode(tokens[:-1])
                break
            if params.stop:
                matched = self._find_stop(template.decode(tokens), params.stop)
                if matched is not None:
                    stop, text = matched
                    break
        return self.context.make_sequence(
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
