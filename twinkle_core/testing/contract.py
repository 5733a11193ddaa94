"""``SamplerContractTests``: the behaviour every engine must show, as pytest tests.

Subclass it in an engine's test module and provide a ``sampler`` fixture
(module- or class-scoped: building an engine is slow)::

    class TestMyEngine(SamplerContractTests):
        @pytest.fixture(scope="class")
        @classmethod
        def sampler(cls):
            with MySampler(build_tiny_model()) as s:
                yield s

The tests are model-agnostic: they derive every expectation from the
engine's own outputs (greedy text, its tokens) rather than hard-coding one.
They assume a chat template, a vocabulary of a few hundred tokens or more,
and a model whose greedy continuations run for at least a dozen tokens.

The numbers are checked too: for each sampling field alone and all of them
together, an engine's processed log-probs (the sampled token's and the top-k
alternatives') must match :mod:`twinkle_core.testing.reference` computed from
the same engine's raw log-probs, and each field must change what is sampled.
That asks of the engine that it returns log-prob alternatives for up to
``vocab_size`` tokens (``logprobs`` and ``prompt_logprobs`` up to the whole
vocabulary: vLLM needs ``max_logprobs`` at least the vocabulary size) and that
prompt log-probs asked with ``logprobs_mode="raw"`` are the raw log-softmax.
Fields an engine does not declare in ``supported_params`` must be refused
with ``UnsupportedFeatureError`` instead.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from twinkle_core.data_format import IGNORE_INDEX, InputFeature, SamplingParams, Trajectory, bad_word_token_ids
from twinkle_core.data_format.structured import compile_structured
from twinkle_core.errors import (
    InvalidInputError,
    InvalidSamplingParams,
    PromptTooLongError,
    TwinkleError,
    UnknownAdapterError,
    UnknownTemplateError,
    UnsupportedFeatureError,
)
from twinkle_core.inputs import CORE_FIELDS
from twinkle_core.sampler import Sampler
from twinkle_core.testing.reference import (
    NEG_INF,
    Completion,
    ambiguous_tokens,
    fit_logit_offsets,
    processed_logprobs,
    reference_error,
)

__all__ = ["CONTRACT_PROMPTS", "SamplerContractTests"]

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


def _traj(i: int) -> Trajectory:
    return Trajectory(messages=CONTRACT_PROMPTS[i % len(CONTRACT_PROMPTS)])


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


def _greedy(**kw: Any) -> SamplingParams:
    base: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    base.update(kw)
    return SamplingParams(**base)


def _spread_ids(vocab: int, n: int, salt: int) -> list[int]:
    """``n`` distinct token ids spread over the vocabulary (none of the first few, often special)."""
    return sorted({4 + (k * 7919 + salt * 104729) % (vocab - 4) for k in range(1, n + 1)})


def _some_words(sampler: Sampler, n: int) -> list[str]:
    """``n`` words of the model's own vocabulary: the text of single tokens."""
    words: list[str] = []
    for t in _spread_ids(sampler.vocab_size or 256, 8 * n, 3):
        text = sampler.template.decode([t]).strip()
        if text.isalpha() and text not in words:
            words.append(text)
        if len(words) == n:
            break
    return words


#: One value per sampling field the reference covers, strong enough to bind on a small model
#: (a function of the sampler where it depends on the vocabulary).
_FIELD_VALUES: dict[str, Any] = {
    "temperature": 0.6,
    "top_k": 4,
    "top_p": 0.7,
    "min_p": 0.15,
    "repetition_penalty": 1.8,
    "presence_penalty": 1.5,
    "frequency_penalty": 1.2,
    "logit_bias": lambda s: dict.fromkeys(_spread_ids(s.vocab_size or 256, 12, 1), 6.0),
    "allowed_token_ids": lambda s: _spread_ids(s.vocab_size or 256, 40, 2),
}

#: The fields of each reference case: every field alone, then combinations (a temperature
#: above 2 and a penalty below 1 too, which some engines emulate).
_REFERENCE_CASES: dict[str, dict[str, Any]] = {
    **{name: {name: value} for name, value in _FIELD_VALUES.items()},
    "min_tokens": {"min_tokens": 3, "temperature": 1.5},
    "bad_words": {"bad_words": lambda s: _some_words(s, 12), "temperature": 1.5},
    "greedy-repetition_penalty": {"temperature": 0.0, "repetition_penalty": 1.8},
    "greedy-constraints": {
        "temperature": 0.0,
        "repetition_penalty": 1.4,
        "presence_penalty": 0.7,
        "frequency_penalty": 0.4,
        "logit_bias": lambda s: dict.fromkeys(_spread_ids(s.vocab_size or 256, 20, 4), -3.0),
        "min_tokens": 2,
    },
    "structured_outputs": {"structured_outputs": {"regex": "[a-z ]{2,40}"}, "temperature": 1.3},
    "structured_outputs-combined": {
        "structured_outputs": {"json": {"type": "object", "properties": {"city": {"type": "string"}}}},
        "temperature": 0.9,
        "top_k": 30,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
    },
    "combined": {"temperature": 0.8, "top_k": 12, "top_p": 0.85, "min_p": 0.05, "repetition_penalty": 1.3},
    "combined-hot": {"temperature": 2.5, "top_k": 40, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 0.8},
    "combined-constraints": {
        "temperature": 0.9,
        "top_k": 20,
        "top_p": 0.9,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.8,
        "frequency_penalty": 0.5,
        "logit_bias": lambda s: dict.fromkeys(_spread_ids(s.vocab_size or 256, 10, 5), 4.0),
        "allowed_token_ids": lambda s: _spread_ids(s.vocab_size or 256, 60, 6),
        "bad_words": lambda s: [s.template.decode([t]).strip() for t in _spread_ids(s.vocab_size or 256, 60, 6)[:3]],
        "min_tokens": 2,
    },
}


def _resolve(fields: dict[str, Any], sampler: Sampler) -> dict[str, Any]:
    """``fields`` with each value that depends on the sampler computed for it."""
    out = {name: value(sampler) if callable(value) else value for name, value in fields.items()}
    if "bad_words" in out:
        out["bad_words"] = [w for w in out["bad_words"] if w.strip()] or ["the"]
    return out


#: A value other than the default for every ``SamplingParams`` field.
_NON_DEFAULT: dict[str, Any] = {
    "max_tokens": 3,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "seed": 3,
    "stop": ("\n\n",),
    "stop_token_ids": (0,),
    "ignore_eos": True,
    "logprobs": 1,
    "prompt_logprobs": 1,
    "logprobs_mode": "raw",
    "num_samples": 2,
    "return_sampling_mask": True,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "min_tokens": 1,
    "logit_bias": {1: 1.0},
    "allowed_token_ids": (1, 2, 3),
    "bad_words": ("the",),
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 4,
    "structured_outputs": {"regex": "[0-9]+"},
}


def _non_default(name: str) -> Any:
    """A valid non-default value of a ``SamplingParams`` field (a field added later: its flipped bool)."""
    if name in _NON_DEFAULT:
        return _NON_DEFAULT[name]
    default = attrs.fields_dict(SamplingParams)[name].default
    if isinstance(default, bool):
        return not default
    pytest.skip(f"no known non-default value for the new field {name!r}: add one to _NON_DEFAULT")


def _undeclared(sampler: Sampler, params: SamplingParams) -> list[str]:
    """The fields ``params`` sets away from their defaults that ``sampler`` does not declare."""
    supported = getattr(sampler, "supported_params", None)
    if supported is None:  # an engine from before field declarations: it claims every field
        return []
    defaults = SamplingParams()
    return [
        f.name
        for f in attrs.fields(SamplingParams)
        if f.name not in supported
        and f.name not in CORE_FIELDS
        and getattr(params, f.name) != getattr(defaults, f.name)
    ]


class SamplerContractTests:
    """The engine-independent contract. Subclasses provide the ``sampler`` fixture."""

    #: Tolerance when one engine's log-probs are compared with each other.
    logprob_atol: float = 1e-4
    #: Tolerance when processed log-probs are compared with the reference computed from
    #: the engine's raw ones (raw log-probs come from a separate scoring pass).
    reference_atol: float = 1e-3
    #: Top-k alternatives asked for in the reference checks.
    reference_top_logprobs: int = 8
    #: Tokens generated per sequence in the reference checks.
    reference_max_tokens: int = 4

    @pytest.fixture
    def sampler(self) -> Sampler:  # pragma: no cover - always overridden
        raise NotImplementedError("Subclasses of SamplerContractTests must provide a 'sampler' fixture.")

    # -- helpers ---------------------------------------------------------------------------
    def greedy_tokens(self, sampler: Sampler, inputs: Any, **kw: Any) -> list[list[int]]:
        return [r.sequences[0].tokens for r in sampler.sample(inputs, _greedy(**kw))]

    def assert_still_works(self, sampler: Sampler) -> None:
        out = sampler.sample(_traj(0), _greedy(max_tokens=4))
        assert len(out) == 1 and len(out[0].sequences[0].tokens) == 4

    def refused_if_undeclared(self, sampler: Sampler, params: SamplingParams) -> bool:
        """Check that ``params`` is refused if it sets a field the engine does not declare.

        Returns:
            Whether it was (the caller then has nothing more to check).
        """
        undeclared = _undeclared(sampler, params)
        if not undeclared:
            return False
        with pytest.raises(UnsupportedFeatureError, match=undeclared[0]):
            sampler.sample(_traj(0), params)
        return True

    def held_back_ids(self, sampler: Sampler, params: SamplingParams) -> set[int]:
        """What ``min_tokens`` holds back: ``stop_token_ids`` and the end-of-sequence ids.

        The default reads the engine's ``eos_token_ids`` where the sampler
        has them, else the tokenizer's ``eos_token_id``; override it for an
        engine whose generation config adds others.
        """
        eos = getattr(sampler, "eos_token_ids", None)
        if eos is None:
            single = getattr(sampler.tokenizer, "eos_token_id", None)
            eos = () if single is None else (single,)
        return set(eos) | set(params.stop_token_ids)

    def grammar_allows(self, sampler: Sampler, params: SamplingParams, tokens: list[int]) -> list[Any]:
        """Per position of ``tokens``, the ids ``params.structured_outputs`` allows there (``None``: no grammar).

        Computed with the same grammar library the engines use, fed the tokens one by one.
        """
        if params.structured_outputs is None:
            return [None] * len(tokens)
        import torch
        import xgrammar as xgr

        vocab = sampler.vocab_size or 0
        held = sorted(self.held_back_ids(sampler, params))
        matcher = compile_structured(params.structured_outputs, sampler.tokenizer, vocab, held)
        out: list[Any] = []
        for token in tokens:
            bitmask = xgr.allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(bitmask, 0)
            scores = torch.zeros(1, vocab)
            xgr.apply_token_bitmask_inplace(scores, bitmask, vocab_size=vocab)
            out.append(frozenset(torch.isfinite(scores[0]).nonzero().flatten().tolist()))
            assert matcher.accept_token(token), f"the engine drew token {token}, which the grammar refuses"
        return out

    def raw_logprob_rows(self, sampler: Sampler, pairs: list[tuple[list[int], list[int]]]) -> list[list[list[float]]]:
        """The engine's raw log-probs over the whole vocabulary before each completion token.

        Scores prompt + completion in one scoring-only call with
        ``prompt_logprobs=vocab_size`` and ``logprobs_mode="raw"``.

        Args:
            pairs: ``(prompt, completion)`` token ids.

        Returns:
            Per pair, per completion token, one log-prob per token id.
        """
        vocab = sampler.vocab_size
        features = [InputFeature(input_ids=prompt + completion) for prompt, completion in pairs]
        scored = sampler.sample(features, SamplingParams(max_tokens=0, prompt_logprobs=vocab, logprobs_mode="raw"))
        out = []
        for (prompt, completion), resp in zip(pairs, scored):
            assert resp.prompt_top_logprobs is not None
            rows = []
            for j in range(len(completion)):
                entry = resp.prompt_top_logprobs[len(prompt) + j]
                assert entry is not None and len(entry) == vocab, (
                    f"prompt_logprobs={vocab} (the vocabulary size) returned {entry and len(entry)} alternatives"
                )
                row = [NEG_INF] * vocab
                for token, value in entry:
                    row[token] = value
                rows.append(row)
            out.append(rows)
        return out

    def reference_mismatches(self, sampler: Sampler, params: SamplingParams, inputs: list[Any]) -> list[str]:
        """Sample ``inputs`` with ``params`` and list where the processed log-probs leave the reference.

        ``params`` must ask for ``logprobs=k > 0`` in processed mode.
        """
        k = params.logprobs
        assert k and params.logprobs_mode == "processed"
        held_back = self.held_back_ids(sampler, params)
        bad_ids = bad_word_token_ids(sampler.tokenizer, params.bad_words, sampler.vocab_size or 0)
        out = sampler.sample(inputs, params)
        pairs = [(r.prompt_token_ids, s.tokens) for r in out for s in r.sequences]
        seqs = [s for r in out for s in r.sequences]
        problems: list[str] = []
        for n, ((prompt, tokens), seq, rows) in enumerate(zip(pairs, seqs, self.raw_logprob_rows(sampler, pairs))):
            assert seq.logprobs is not None and seq.top_logprobs is not None
            assert len(seq.logprobs) == len(tokens) == len(seq.top_logprobs) == len(rows)
            allows = self.grammar_allows(sampler, params, tokens)
            for j, (token, raw) in enumerate(zip(tokens, rows)):
                where = f"sequence {n}, position {j} (token {token})"
                context = prompt + tokens[:j]
                done = Completion(tokens[:j], held_back, bad_ids, allows[j])
                top = seq.top_logprobs[j]
                observed: dict[int, float] = dict(top)
                observed[token] = seq.logprobs[j]
                found: list[str] = []
                # an offset the observed tokens cannot tell from the best one may be the true one: try each
                values = [v for _, v in top]
                for offset in fit_logit_offsets(raw, params, context, observed, done, self.reference_atol, values):
                    found = self._position_mismatches(where, raw, params, context, done, offset, token, top, observed)
                    if not found:
                        break
                problems += found
        return problems

    # -- shape of the output -----------------------------------------------------------------
    def test_empty_input_returns_empty_list(self, sampler: Sampler) -> None:
        assert sampler.sample([], _greedy()) == []

    def test_one_response_per_input_in_order(self, sampler: Sampler) -> None:
        trajs = [_traj(i) for i in range(4)]
        features = [sampler.template.encode(t) for t in trajs]
        mixed: list[Any] = [trajs[0], features[1], trajs[2], features[3]]
        out = sampler.sample(mixed, _greedy(max_tokens=3))
        assert [r.prompt_token_ids for r in out] == [f.input_ids for f in features]
        assert all(len(r.sequences) == 1 for r in out)
        # a single input (not a list) is one input
        single = sampler.sample(trajs[1], _greedy(max_tokens=3))
        assert len(single) == 1 and single[0].prompt_token_ids == features[1].input_ids

    def test_num_samples_keyword_params_and_dict(self, sampler: Sampler) -> None:
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
        out = sampler.sample([_traj(0), _traj(1)], params, num_samples=3)
        assert [len(r.sequences) for r in out] == [3, 3]
        out = sampler.sample([_traj(2)], params.replace(num_samples=2))
        assert len(out[0].sequences) == 2
        out = sampler.sample([_traj(2)], {"max_tokens": 2, "n": 2})
        assert len(out[0].sequences) == 2 and all(len(s.tokens) <= 2 for s in out[0].sequences)
        with pytest.raises(InvalidSamplingParams, match="num_samples"):
            sampler.sample([_traj(0)], params.replace(num_samples=2), num_samples=3)
        self.assert_still_works(sampler)

    def test_max_tokens_and_length_stop_reason(self, sampler: Sampler) -> None:
        for n in (1, 7):
            seq = sampler.sample(_traj(1), _greedy(max_tokens=n))[0].sequences[0]
            assert len(seq.tokens) == n
            assert seq.stop_reason == "length"
            assert seq.stop is None

    def test_sequence_metadata_and_training_feature(self, sampler: Sampler) -> None:
        resp = sampler.sample(_traj(3), _greedy(max_tokens=6))[0]
        seq = resp.sequences[0]
        assert seq.weights_version == sampler.weights_version
        assert seq.adapter_name == ""
        assert seq.text == sampler.template.decode(seq.tokens)
        feat = seq.training_feature
        assert feat is not None
        assert feat.input_ids == resp.prompt_token_ids + seq.tokens
        assert feat.labels == [IGNORE_INDEX] * len(resp.prompt_token_ids) + seq.tokens

    # -- stopping ----------------------------------------------------------------------------
    def test_stop_token_ids(self, sampler: Sampler) -> None:
        tokens = self.greedy_tokens(sampler, _traj(1), max_tokens=12)[0]
        stop_id = tokens[4]
        first = tokens.index(stop_id)
        seq = sampler.sample(_traj(1), _greedy(max_tokens=12, stop_token_ids=[stop_id]))[0].sequences[0]
        assert seq.tokens == tokens[: first + 1]
        assert seq.stop_reason == "stop"
        assert seq.stop == stop_id

    def test_stop_string_spanning_tokens(self, sampler: Sampler) -> None:
        tokens = self.greedy_tokens(sampler, _traj(1), max_tokens=16)[0]
        full = sampler.template.decode(tokens)
        # character boundaries between tokens; pick a stop string straddling one
        bounds = [len(sampler.template.decode(tokens[:k])) for k in range(1, len(tokens))]
        stop, cut = None, 0
        for b in bounds:
            if 2 <= b <= len(full) - 2:
                cand = full[b - 2 : b + 2]
                if cand.strip() and full.find(cand) == b - 2:
                    stop, cut = cand, b - 2
                    break
        if stop is None:
            pytest.skip("the greedy text has no unique cross-token substring to stop on")
        seq = sampler.sample(_traj(1), _greedy(max_tokens=16, stop=[stop]))[0].sequences[0]
        assert seq.stop_reason == "stop"
        assert seq.stop == stop
        assert seq.text == full[:cut]
        # the tokens are what the model emitted, up to the token that completed the stop string
        emitted = sampler.template.decode(seq.tokens)
        assert emitted.startswith(full[:cut] + stop)
        assert seq.tokens == tokens[: len(seq.tokens)]
        assert len(sampler.template.decode(seq.tokens[:-1])) < cut + len(stop)

    def test_eos_stops_unless_ignored(self, sampler: Sampler) -> None:
        eos = sampler.template.eos_token_id
        if eos is None:
            pytest.skip("the tokenizer has no EOS token")
        # Force EOS through stop detection of the model's own EOS: a sequence that
        # reaches EOS ends there with reason 'stop'; with ignore_eos it runs on.
        outs = sampler.sample([_traj(i) for i in range(4)], SamplingParams(temperature=0.0, max_tokens=48))
        ended = [r.sequences[0] for r in outs if r.sequences[0].stop_reason == "stop"]
        for seq in ended:
            assert seq.tokens[-1] == seq.stop
            assert seq.stop not in seq.tokens[:-1]
        for r in outs:
            seq = r.sequences[0]
            if seq.stop_reason == "length":
                assert len(seq.tokens) == 48
        ignored = sampler.sample(
            [_traj(i) for i in range(4)], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        )
        assert all(len(r.sequences[0].tokens) == 48 and r.sequences[0].stop_reason == "length" for r in ignored)
        for a, b in zip(outs, ignored):
            n = len(a.sequences[0].tokens)
            assert b.sequences[0].tokens[:n] == a.sequences[0].tokens

    # -- determinism -------------------------------------------------------------------------
    def test_greedy_is_deterministic_alone_and_batched(self, sampler: Sampler) -> None:
        alone = self.greedy_tokens(sampler, [_traj(2)])[0]
        assert self.greedy_tokens(sampler, [_traj(2)])[0] == alone
        batched = self.greedy_tokens(sampler, [_traj(1), _traj(2), _traj(0), _traj(3)])
        assert batched[1] == alone

    def test_seeded_sampling_is_reproducible(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1234)
        alone = sampler.sample([_traj(2)], params)[0].sequences[0].tokens
        again = sampler.sample([_traj(2)], params)[0].sequences[0].tokens
        assert again == alone
        # whatever else is in the batch
        batched = sampler.sample([_traj(0), _traj(2), _traj(1)], params)[1].sequences[0].tokens
        assert batched == alone

    def test_different_seeds_differ(self, sampler: Sampler) -> None:
        def run(seed: int) -> list[list[int]]:
            params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=seed)
            return [r.sequences[0].tokens for r in sampler.sample([_traj(i) for i in range(4)], params)]

        assert run(1) != run(2)

    def test_a_top_k_beyond_the_vocabulary_keeps_every_token(self, sampler: Sampler) -> None:
        """``top_k`` of the vocabulary size or more (up to any integer) is the same as no top-k."""
        params = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, seed=11, num_samples=2, logprobs=0)
        off = sampler.sample([_traj(0), _traj(1)], params)
        for top_k in (2**20, 2**64):  # wider than any vocabulary
            wide = sampler.sample([_traj(0), _traj(1)], params.replace(top_k=top_k))
            assert [[s.tokens for s in r.sequences] for r in wide] == [[s.tokens for s in r.sequences] for r in off]
        self.assert_still_works(sampler)

    def test_consecutive_seeds_share_no_samples(self, sampler: Sampler) -> None:
        """An RL loop that seeds step ``t`` with ``t`` must not get step ``t``'s sample ``i`` again as
        step ``t + 1``'s sample ``i - 1`` (as an engine seeding sample ``i`` with ``seed + i`` would).

        A peaked model may repeat a sample by chance; the fault repeats every one of them, shifted.
        """
        n = 6
        runs = {}
        for seed in (40, 41, 2**80, 2**80 + 1):  # any integer is a seed
            params = SamplingParams(temperature=3.0, max_tokens=12, ignore_eos=True, seed=seed, num_samples=n)
            runs[seed] = [tuple(s.tokens) for s in sampler.sample(_traj(1), params)[0].sequences]
        for seed in (40, 2**80):
            shifted = [runs[seed][i] == runs[seed + 1][i - 1] for i in range(1, n)]
            assert not all(shifted), f"sample i of seed {seed} is sample i - 1 of seed {seed + 1}: {runs[seed]}"

    def test_samples_of_one_prompt_differ(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=7)
        seqs = sampler.sample(_traj(1), params, num_samples=4)[0].sequences
        assert len({tuple(s.tokens) for s in seqs}) > 1

    # -- the log-prob contract ---------------------------------------------------------------
    def test_no_logprobs_unless_asked(self, sampler: Sampler) -> None:
        resp = sampler.sample(_traj(0), _greedy(max_tokens=3))[0]
        assert resp.sequences[0].logprobs is None and resp.sequences[0].top_logprobs is None
        assert resp.prompt_logprobs is None

    def test_sampled_token_logprob_every_position(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=3, logprobs=0)
        seq = sampler.sample(_traj(1), params)[0].sequences[0]
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert all(isinstance(x, float) and math.isfinite(x) and x <= 1e-6 for x in seq.logprobs)
        assert seq.top_logprobs is None

    def test_greedy_token_has_top_logprob_and_topk_sorted(self, sampler: Sampler) -> None:
        seq = sampler.sample(_traj(3), _greedy(max_tokens=8, logprobs=3))[0].sequences[0]
        assert seq.logprobs is not None and seq.top_logprobs is not None
        assert len(seq.top_logprobs) == len(seq.tokens)
        for tok, lp, top in zip(seq.tokens, seq.logprobs, seq.top_logprobs):
            assert len(top) == 3
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            assert top[0][0] == tok
            assert lp == pytest.approx(top[0][1], abs=self.logprob_atol)

    def test_sampled_logprob_present_when_outside_topk(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=3.0, max_tokens=24, ignore_eos=True, seed=11, logprobs=1)
        seqs = sampler.sample([_traj(i) for i in range(4)], params)
        outside = 0
        for r in seqs:
            seq = r.sequences[0]
            assert seq.logprobs is not None and seq.top_logprobs is not None
            assert len(seq.logprobs) == len(seq.tokens)
            for tok, lp, top in zip(seq.tokens, seq.logprobs, seq.top_logprobs):
                if top[0][0] != tok:
                    outside += 1
                    assert lp <= top[0][1] + self.logprob_atol
        assert outside > 0, "at temperature 3 some sampled tokens should fall outside the top-1"

    def test_processed_equals_raw_without_processing(self, sampler: Sampler) -> None:
        base = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=5, logprobs=0)
        proc = sampler.sample(_traj(1), base)[0].sequences[0]
        raw = sampler.sample(_traj(1), base.replace(logprobs_mode="raw"))[0].sequences[0]
        assert proc.tokens == raw.tokens
        assert proc.logprobs == pytest.approx(raw.logprobs, abs=self.logprob_atol)

    def test_processed_logprobs_follow_the_sampling_distribution(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=0.7, top_k=3, max_tokens=8, ignore_eos=True, seed=9, logprobs=3)
        proc = sampler.sample(_traj(2), params)[0].sequences[0]
        raw = sampler.sample(_traj(2), params.replace(logprobs_mode="raw"))[0].sequences[0]
        assert proc.tokens == raw.tokens
        assert proc.top_logprobs is not None and raw.top_logprobs is not None
        for top_p, top_r in zip(proc.top_logprobs, raw.top_logprobs):
            # after top-k=3 the three survivors carry all the probability mass
            assert sum(math.exp(v) for _, v in top_p if v > -math.inf) == pytest.approx(1.0, abs=1e-3)
            assert sum(math.exp(v) for _, v in top_r) < 1.0 + 1e-6
        assert proc.logprobs is not None and raw.logprobs is not None
        # a renormalised distribution gives the sampled token at least its raw... up to temperature
        assert any(abs(a - b) > 1e-3 for a, b in zip(proc.logprobs, raw.logprobs))

    def test_prompt_logprobs_and_scoring_only(self, sampler: Sampler) -> None:
        gen = sampler.sample(_traj(0), _greedy(max_tokens=6, logprobs=0, logprobs_mode="raw"))[0]
        seq = gen.sequences[0]
        full = InputFeature(input_ids=gen.prompt_token_ids + seq.tokens)
        scored = sampler.sample(full, SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        assert len(scored.sequences) == 1 and scored.sequences[0].tokens == []
        assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(full.input_ids)
        assert scored.prompt_logprobs[0] is None
        tail = scored.prompt_logprobs[len(gen.prompt_token_ids) :]
        assert tail == pytest.approx(seq.logprobs, abs=1e-3)
        assert all(x is not None and x <= 1e-6 for x in scored.prompt_logprobs[1:])
        topk = sampler.sample(full, SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
        assert topk.prompt_top_logprobs is not None and topk.prompt_top_logprobs[0] is None
        for entry in topk.prompt_top_logprobs[1:]:
            assert entry is not None and len(entry) == 2 and entry[0][1] >= entry[1][1]

    def _position_mismatches(
        self,
        where: str,
        raw: list[float],
        params: SamplingParams,
        context: list[int],
        done: Completion,
        offset: float,
        token: int,
        top: list[tuple[int, float]],
        observed: dict[int, float],
    ) -> list[str]:
        """Where one position's processed log-probs leave the reference under the logit offset ``offset``."""
        k = params.logprobs or 0
        problems: list[str] = []
        ref = processed_logprobs(raw, params, context, logit_offset=offset, completion=done)
        unsure = ambiguous_tokens(raw, params, context, logit_offset=offset, completion=done)
        if ref[token] == NEG_INF and token not in unsure:
            problems.append(f"{where}: sampled a token the processing removes")
        if params.greedy and ref[token] < max(ref) - self.reference_atol:
            problems.append(f"{where}: greedy token is not the argmax ({ref[token]:.4f} < {max(ref):.4f})")
        if unsure:  # a token on a threshold: the normaliser is not pinned down
            return problems
        for tok, value in sorted(observed.items()):
            if reference_error(ref, {tok: value}) > self.reference_atol:
                problems.append(f"{where}: token {tok} has processed log-prob {value:.5f}, reference {ref[tok]:.5f}")
        want = sorted(ref, reverse=True)[:k]
        got = [v for _, v in top]
        if len(got) != len(want) or reference_error(want, dict(enumerate(got))) > self.reference_atol:
            problems.append(f"{where}: top-{k} log-probs {_fmt(got)}, reference {_fmt(want)}")
        return problems

    # -- the numbers: processed log-probs against the reference ----------------------------------
    @pytest.mark.parametrize("case", list(_REFERENCE_CASES))
    def test_processed_logprobs_match_the_reference(self, sampler: Sampler, case: str) -> None:
        params = SamplingParams(
            max_tokens=self.reference_max_tokens,
            ignore_eos=True,
            seed=1234,
            logprobs=self.reference_top_logprobs,
            **_resolve(_REFERENCE_CASES[case], sampler),
        )
        if self.refused_if_undeclared(sampler, params):
            pytest.skip(f"the engine does not declare {_undeclared(sampler, params)} (and refuses them)")
        problems = self.reference_mismatches(sampler, params, [_traj(1), _traj(3)])
        assert not problems, f"{len(problems)} mismatches with the reference, e.g.:\n" + "\n".join(problems[:6])

    @pytest.mark.parametrize("field", list(_FIELD_VALUES))
    def test_each_sampling_field_changes_the_samples(self, sampler: Sampler, field: str) -> None:
        base = SamplingParams(max_tokens=8, ignore_eos=True, seed=21, logprobs=0)
        changed = base.replace(**_resolve({field: _FIELD_VALUES[field]}, sampler))
        if self.refused_if_undeclared(sampler, changed):
            pytest.skip(f"the engine does not declare {field} (and refuses it)")
        inputs = [_traj(i) for i in range(4)]
        before = [s for r in sampler.sample(inputs, base) for s in r.sequences]
        after = [s for r in sampler.sample(inputs, changed) for s in r.sequences]
        differs = False
        for a, b in zip(before, after):
            assert a.logprobs is not None and b.logprobs is not None
            if a.tokens != b.tokens or any(abs(x - y) > self.reference_atol for x, y in zip(a.logprobs, b.logprobs)):
                differs = True
        assert differs, f"{field}={getattr(changed, field)!r} changed neither the tokens nor their log-probs"

    def test_undeclared_fields_are_refused(self, sampler: Sampler) -> None:
        supported = getattr(sampler, "supported_params", None)
        fields = [f.name for f in attrs.fields(SamplingParams)]
        undeclared = [
            name for name in fields if supported is not None and name not in supported and name not in CORE_FIELDS
        ]
        if not undeclared:
            pytest.skip("the engine declares every SamplingParams field")
        for name in undeclared:
            with pytest.raises(UnsupportedFeatureError, match=name):
                sampler.sample(_traj(0), SamplingParams(**{name: _non_default(name)}))
        self.assert_still_works(sampler)

    def test_ids_beyond_the_vocabulary_are_refused(self, sampler: Sampler) -> None:
        vocab = sampler.vocab_size
        if vocab is None:
            pytest.skip("the engine states no vocabulary size")
        cases = [
            ("logprobs", SamplingParams(max_tokens=2, logprobs=vocab + 1)),
            ("prompt_logprobs", SamplingParams(max_tokens=0, prompt_logprobs=vocab + 1)),
            ("stop_token_ids", SamplingParams(max_tokens=2, stop_token_ids=[vocab])),
            ("allowed_token_ids", SamplingParams(max_tokens=2, allowed_token_ids=[1, vocab])),
            ("logit_bias", SamplingParams(max_tokens=2, logit_bias={vocab + 5: 1.0})),
        ]
        for name, params in cases:
            if name not in sampler.supported_params:
                continue  # refused as undeclared instead (test_undeclared_fields_are_refused)
            with pytest.raises(InvalidSamplingParams) as info:
                sampler.sample(_traj(0), params)
            assert name in str(info.value) and str(vocab) in str(info.value)
            assert isinstance(info.value, ValueError)
        self.assert_still_works(sampler)
        # the whole vocabulary is not beyond it
        seq = sampler.sample(_traj(0), _greedy(max_tokens=1, logprobs=vocab))[0].sequences[0]
        assert seq.top_logprobs is not None and len(seq.top_logprobs[0]) == vocab

    # -- bad input: typed errors, and the sampler keeps working --------------------------------
    @pytest.mark.parametrize(
        "bad",
        [
            {"temperature": -0.1},
            {"top_p": 0.0},
            {"top_p": 1.5},
            {"top_k": 0},
            {"top_k": -2},
            {"max_tokens": -1},
            {"num_samples": 0},
            {"logprobs": -1},
            {"seed": "abc"},
            {"stop": 5},
            {"max_new_token": 5},
            {"presence_penalty": 2.5},
            {"frequency_penalty": -3},
            {"min_tokens": -1},
            {"min_tokens": 20, "max_tokens": 10},
            {"logit_bias": {1: 500}},
            {"logit_bias": {"one": 1.0}},
            {"allowed_token_ids": []},
            {"bad_words": [""]},
            {"truncate_prompt_tokens": 0},
            {"skip_special_tokens": "yes"},
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            {"structured_outputs": {"json": "{not json"}},
        ],
        ids=lambda d: next(iter(d)),
    )
    def test_bad_sampling_params(self, sampler: Sampler, bad: dict[str, Any]) -> None:
        key, _value = next(iter(bad.items()))
        with pytest.raises(InvalidSamplingParams) as info:
            sampler.sample(_traj(0), bad)
        assert key in str(info.value)
        assert isinstance(info.value, ValueError)
        self.assert_still_works(sampler)

    @pytest.mark.parametrize(
        "bad_input",
        [
            {"messages": []},
            {"messages": [{"content": "no role"}]},
            {"messages": [{"role": "wizard", "content": "hi"}]},
            {"input_ids": []},
            "just a string",
        ],
        ids=["empty", "no-role", "unknown-role", "no-tokens", "string"],
    )
    def test_bad_inputs(self, sampler: Sampler, bad_input: Any) -> None:
        with pytest.raises(InvalidInputError):
            sampler.sample([_traj(0), bad_input], _greedy(max_tokens=2))
        self.assert_still_works(sampler)

    def test_prompt_too_long_names_the_input(self, sampler: Sampler) -> None:
        tok = sampler.template.encode(_traj(0)).input_ids[0]
        too_long = InputFeature(input_ids=[tok] * (sampler.max_model_len + 1))
        with pytest.raises(PromptTooLongError, match=r"inputs\[1\]") as info:
            sampler.sample([_traj(0), too_long, _traj(1)], _greedy(max_tokens=2))
        assert info.value.index == 1
        self.assert_still_works(sampler)
        # asked to, the other inputs are not lost
        out = sampler.sample([_traj(0), too_long, _traj(1)], _greedy(max_tokens=2), on_invalid="skip")
        assert [len(r.sequences) for r in out] == [1, 0, 1]
        assert out[1].error is not None and "inputs[1]" in out[1].error
        assert out[0].error is None and out[2].error is None

    def test_unknown_adapter(self, sampler: Sampler) -> None:
        with pytest.raises(UnknownAdapterError, match="no-such-adapter"):
            sampler.sample(_traj(0), _greedy(max_tokens=2), adapter_name="no-such-adapter")
        with pytest.raises(UnknownAdapterError):
            sampler.remove_adapter("no-such-adapter")
        self.assert_still_works(sampler)

    def test_unknown_template(self, sampler: Sampler) -> None:
        with pytest.raises(UnknownTemplateError, match="no-such-template"):
            sampler.set_template("no-such-template")
        self.assert_still_works(sampler)

    def test_errors_share_a_base_class(self, sampler: Sampler) -> None:
        with pytest.raises(TwinkleError):
            sampler.sample(_traj(0), {"temperature": -1})

    # -- sampling masks (SamplingParams.return_sampling_mask) -----------------------------
    # Kept in one block at the end so the suite's other additions merge cleanly.
    def _needs_mask(self, sampler: Sampler) -> None:
        if "return_sampling_mask" not in sampler.supported_params:
            pytest.skip(f"the {_label(sampler)} engine does not declare return_sampling_mask")

    def test_sampling_mask_refused_unless_declared(self, sampler: Sampler) -> None:
        if "return_sampling_mask" in sampler.supported_params:
            pytest.skip(f"the {_label(sampler)} engine declares return_sampling_mask")
        with pytest.raises(UnsupportedFeatureError, match="return_sampling_mask"):
            sampler.sample(_traj(0), _greedy(max_tokens=2, return_sampling_mask=True))
        self.assert_still_works(sampler)

    def test_routed_experts_refused_unless_declared(self, sampler: Sampler) -> None:
        if "return_routed_experts" in sampler.supported_params:
            pytest.skip(f"the {_label(sampler)} engine declares return_routed_experts")
        with pytest.raises(UnsupportedFeatureError, match="return_routed_experts"):
            sampler.sample(_traj(0), _greedy(max_tokens=2, return_routed_experts=True))
        self.assert_still_works(sampler)

    def test_sampling_mask_under_top_k_is_the_top_k_set(self, sampler: Sampler) -> None:
        self._needs_mask(sampler)
        k = 4
        params = SamplingParams(
            max_tokens=8, top_k=k, temperature=1.3, seed=5, num_samples=2, logprobs=k, return_sampling_mask=True
        )
        for response in sampler.sample([_traj(0), _traj(1)], params):
            for seq in response.sequences:
                mask = seq.sampling_mask
                assert mask is not None and len(mask) == len(seq.tokens)
                assert seq.top_logprobs is not None and seq.logprobs is not None
                for i, token in enumerate(seq.tokens):
                    kept = mask.kept(i)
                    # the processed top-k alternatives are exactly the kept set, and they carry all the mass
                    assert sorted(kept) == sorted(t for t, _ in seq.top_logprobs[i]), f"position {i}"
                    assert token in kept
                    assert math.log(sum(math.exp(lp) for _, lp in seq.top_logprobs[i])) == pytest.approx(
                        0.0, abs=self.logprob_atol
                    )

    def test_sampling_mask_greedy_rows_are_empty_and_samples_unchanged(self, sampler: Sampler) -> None:
        self._needs_mask(sampler)
        greedy = sampler.sample(_traj(0), _greedy(return_sampling_mask=True))[0].sequences[0]
        assert greedy.sampling_mask is not None
        assert len(greedy.sampling_mask) == len(greedy.tokens) and greedy.sampling_mask.token_ids == []
        params = SamplingParams(max_tokens=8, top_p=0.8, temperature=1.2, seed=11, num_samples=3)
        plain = sampler.sample(_traj(1), params)[0].sequences
        masked = sampler.sample(_traj(1), params.replace(return_sampling_mask=True))[0].sequences
        assert [s.tokens for s in plain] == [s.tokens for s in masked]
        assert all(s.sampling_mask is None for s in plain)

    # -- sampling breadth: constraints, bias, completion penalties, text and prompt options ------
    def _declares(self, sampler: Sampler, *fields: str) -> None:
        missing = [f for f in fields if f not in sampler.supported_params and f not in CORE_FIELDS]
        if missing:
            pytest.skip(f"the {_label(sampler)} engine does not declare {missing}")

    def test_min_tokens_holds_back_stop_ids_and_strings(self, sampler: Sampler) -> None:
        self._declares(sampler, "min_tokens")
        greedy = self.greedy_tokens(sampler, _traj(0), max_tokens=8)[0]
        first = greedy[0]
        stopped = sampler.sample(_traj(0), _greedy(max_tokens=8, stop_token_ids=[first]))[0].sequences[0]
        assert stopped.tokens == [first] and stopped.stop_reason == "stop"
        held = sampler.sample(_traj(0), _greedy(max_tokens=8, stop_token_ids=[first], min_tokens=4))[0].sequences[0]
        assert len(held.tokens) >= 4 and first not in held.tokens[:3], held.tokens
        # a stop string does not end the sequence before min_tokens either
        text = sampler.template.decode(greedy[:1])
        if text.strip():
            early = _greedy(max_tokens=8, stop=[text.strip()], min_tokens=3)
            seq = sampler.sample(_traj(0), early)[0].sequences[0]
            assert len(seq.tokens) >= 3, seq.tokens
        self.assert_still_works(sampler)

    def test_logit_bias_and_allowed_token_ids_steer_the_draw(self, sampler: Sampler) -> None:
        self._declares(sampler, "logit_bias", "allowed_token_ids")
        greedy = self.greedy_tokens(sampler, _traj(1), max_tokens=6)[0]
        pushed = next(t for t in _spread_ids(sampler.vocab_size or 256, 5, 7) if t != greedy[0])
        down = self.greedy_tokens(sampler, _traj(1), max_tokens=6, logit_bias={greedy[0]: -100})[0]
        assert down[0] != greedy[0]
        up = self.greedy_tokens(sampler, _traj(1), max_tokens=6, logit_bias={pushed: 100})[0]
        assert up[0] == pushed
        allowed = _spread_ids(sampler.vocab_size or 256, 5, 8)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True, allowed_token_ids=allowed)
        for seq in sampler.sample([_traj(0), _traj(2)], params.replace(num_samples=2))[0].sequences:
            assert set(seq.tokens) <= set(allowed), seq.tokens
        # allowing only what min_tokens holds back leaves nothing to draw: a typed error, and the engine goes on
        held = sorted(self.held_back_ids(sampler, SamplingParams()))
        if held and "min_tokens" in sampler.supported_params:
            with pytest.raises(InvalidSamplingParams, match="allowed_token_ids"):
                sampler.sample(_traj(0), _greedy(max_tokens=4, allowed_token_ids=held, min_tokens=2))
        self.assert_still_works(sampler)

    def test_bad_words_over_the_sequence_limit_are_refused(self, sampler: Sampler) -> None:
        """Words that pass ``SamplingParams`` (at most 128) but tokenize to more sequences than that
        (a word and its leading-space form) are an ``InvalidSamplingParams`` on every engine."""
        self._declares(sampler, "bad_words")
        vocab = sampler.vocab_size or 0
        words = None
        for t in _spread_ids(vocab or 256, 60, 40):
            word = sampler.template.decode([t]).strip()
            if word and len(bad_word_token_ids(sampler.tokenizer, [word], vocab)) == 2:
                words = [word] + [f"{word}{k}" for k in range(127)]  # 128 words, at least 129 sequences
                break
        if words is None:
            pytest.skip("no word of this tokenizer has a distinct leading-space form")
        with pytest.raises(InvalidSamplingParams, match=r"tokenizes to \d+ token sequences") as info:
            sampler.sample(_traj(0), SamplingParams(max_tokens=4, bad_words=words))
        assert info.value.field == "bad_words"
        self.assert_still_works(sampler)

    def test_bad_words_are_never_completed(self, sampler: Sampler) -> None:
        self._declares(sampler, "bad_words")
        vocab = sampler.vocab_size or 0
        greedy = self.greedy_tokens(sampler, _traj(3), max_tokens=12)[0]
        word, banned = None, []
        for t in greedy:  # a word the model writes: some of its token sequences occur in the greedy completion
            candidate = sampler.template.decode([t]).strip()
            if not candidate:
                continue
            seqs = bad_word_token_ids(sampler.tokenizer, [candidate], vocab)
            if any(_occurs(seq, greedy) for seq in seqs):
                word, banned = candidate, seqs
                break
        assert word is not None, f"no token of the greedy completion {greedy} is a word of its own"
        for params in (
            _greedy(max_tokens=12, bad_words=[word]),
            SamplingParams(max_tokens=12, seed=2, bad_words=[word]),
        ):
            for seq in sampler.sample(_traj(3), params.replace(num_samples=2))[0].sequences:
                hits = [ids for ids in banned if _occurs(ids, seq.tokens)]
                assert not hits, f"bad word {word!r} ({hits}) completed in {seq.tokens}"

    def test_truncate_prompt_tokens_keeps_the_last_tokens(self, sampler: Sampler) -> None:
        prompt = sampler.encode(_traj(1)).input_ids
        assert len(prompt) > 6
        cut = sampler.sample(_traj(1), _greedy(max_tokens=4, truncate_prompt_tokens=6))[0]
        assert cut.prompt_token_ids == prompt[-6:]
        direct = sampler.sample(InputFeature(input_ids=prompt[-6:]), _greedy(max_tokens=4))[0]
        assert cut.sequences[0].tokens == direct.sequences[0].tokens
        whole = sampler.sample(_traj(1), _greedy(max_tokens=1, truncate_prompt_tokens=-1))[0]
        assert whole.prompt_token_ids == prompt

    def test_include_stop_str_in_output_keeps_the_stop_string(self, sampler: Sampler) -> None:
        self._declares(sampler, "include_stop_str_in_output")
        text = sampler.sample(_traj(0), _greedy(max_tokens=12))[0].sequences[0].text
        stop = next(
            (text[i : i + 3] for i in range(2, len(text) - 3) if text[i : i + 3].strip() == text[i : i + 3]), None
        )
        assert stop is not None, f"no stop string to cut the greedy text {text!r} at"
        cut = sampler.sample(_traj(0), _greedy(max_tokens=12, stop=[stop]))[0].sequences[0]
        kept = sampler.sample(_traj(0), _greedy(max_tokens=12, stop=[stop], include_stop_str_in_output=True))
        with_stop = kept[0].sequences[0]
        assert cut.stop == stop and with_stop.tokens == cut.tokens and with_stop.text == cut.text + stop

    def test_skip_special_tokens_and_spaces_between_special_tokens_shape_the_text(self, sampler: Sampler) -> None:
        self._declares(sampler, "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids")
        special = sorted(self.held_back_ids(sampler, SamplingParams()))
        assert special, "no end-of-sequence id to write"
        params = _greedy(max_tokens=3, allowed_token_ids=special[:1] + _spread_ids(sampler.vocab_size or 256, 1, 9))
        params = params.replace(logit_bias={special[0]: 50.0}) if "logit_bias" in sampler.supported_params else params
        plain = sampler.sample(_traj(0), params)[0].sequences[0]
        assert special[0] in plain.tokens, plain.tokens
        shown = sampler.sample(_traj(0), params.replace(skip_special_tokens=False))[0].sequences[0]
        assert plain.tokens == shown.tokens
        assert plain.text == sampler.template.decode(plain.tokens) != shown.text
        assert shown.text == sampler.template.decode(shown.tokens, skip_special_tokens=False)
        tight = params.replace(skip_special_tokens=False, spaces_between_special_tokens=False)
        joined = sampler.sample(_traj(0), tight)[0].sequences[0]
        want = sampler.template.decode(joined.tokens, skip_special_tokens=False, spaces_between_special_tokens=False)
        assert joined.text == want

    # -- structured outputs ----------------------------------------------------------------
    def _grammar_accepts(self, sampler: Sampler, params: SamplingParams, seq: Any) -> Any:
        """Feed ``seq``'s tokens to a fresh matcher of its constraint: it must take every one; the matcher."""
        assert params.structured_outputs is not None
        held = sorted(self.held_back_ids(sampler, params))
        matcher = compile_structured(params.structured_outputs, sampler.tokenizer, sampler.vocab_size or 0, held)
        for i, token in enumerate(seq.tokens):
            assert matcher.accept_token(token), f"token {i} ({token}) of {seq.tokens} breaks the constraint"
        return matcher

    @pytest.mark.parametrize(
        "constraint",
        [
            {"regex": "[a-c]{3,6}"},
            {"choice": ["yes", "no", "maybe so"]},
            {"grammar": 'root ::= "(" [0-9]+ " + " [0-9]+ ")"'},
            {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
        ],
        ids=["regex", "choice", "grammar", "json"],
    )
    def test_structured_outputs_constrain_every_completion(self, sampler: Sampler, constraint: dict[str, Any]) -> None:
        self._declares(sampler, "structured_outputs")
        import json
        import re

        params = SamplingParams(max_tokens=48, temperature=1.0, seed=3, num_samples=3, structured_outputs=constraint)
        finished = 0
        for response in sampler.sample([_traj(0), _traj(2)], params):
            for seq in response.sequences:
                matcher = self._grammar_accepts(sampler, params, seq)
                if seq.stop_reason != "stop":
                    assert seq.stop_reason == "length" and len(seq.tokens) == 48
                    continue
                finished += 1
                assert matcher.is_terminated(), f"{seq.text!r} stopped before its constraint was complete"
                if "regex" in constraint:
                    assert re.fullmatch(constraint["regex"], seq.text), seq.text
                elif "choice" in constraint:
                    assert seq.text in constraint["choice"]
                elif "json" in constraint:
                    assert isinstance(json.loads(seq.text)["ok"], bool)
        # a small model may pad JSON or numbers past 48 tokens: every token was still checked against the grammar

    def test_structured_outputs_end_once_complete_even_with_ignore_eos(self, sampler: Sampler) -> None:
        """A complete constraint allows only an end token, which ends the completion: ``ignore_eos``
        cannot make a completion go on past its match."""
        self._declares(sampler, "structured_outputs")
        choices = ["yes", "no", "maybe so"]
        for ignore_eos in (False, True):
            params = SamplingParams(
                max_tokens=24,
                temperature=1.0,
                seed=5,
                num_samples=4,
                ignore_eos=ignore_eos,
                structured_outputs={"choice": choices},
            )
            for response in sampler.sample([_traj(0), _traj(1)], params):
                for seq in response.sequences:
                    assert seq.stop_reason == "stop" and seq.text in choices, (ignore_eos, seq.text, seq.stop_reason)
                    assert self._grammar_accepts(sampler, params, seq).is_terminated()

    def test_structured_outputs_that_do_not_compile_are_refused_before_any_work(self, sampler: Sampler) -> None:
        self._declares(sampler, "structured_outputs")
        for bad in ({"regex": "([a-z"}, {"json": {"type": 5}}, {"grammar": "root ::= undefined_rule"}):
            with pytest.raises(InvalidSamplingParams, match="structured_outputs"):
                sampler.sample([_traj(0), _traj(1)], SamplingParams(max_tokens=4, structured_outputs=bad))
        self.assert_still_works(sampler)

    def test_structured_outputs_that_admit_no_token_are_refused(self, sampler: Sampler) -> None:
        """A constraint that compiles but matches nothing (a rule that only refers to itself, an empty
        character class) is an ``InvalidSamplingParams`` naming it, not an engine's generic failure."""
        self._declares(sampler, "structured_outputs")
        for empty in ({"grammar": "root ::= root"}, {"regex": "[^\\s\\S]"}):
            with pytest.raises(InvalidSamplingParams, match="structured_outputs"):
                sampler.sample(_traj(0), SamplingParams(max_tokens=4, structured_outputs=empty))
        self.assert_still_works(sampler)

    def test_structured_outputs_too_long_for_max_tokens_end_by_length(self, sampler: Sampler) -> None:
        self._declares(sampler, "structured_outputs")
        params = _greedy(max_tokens=5, ignore_eos=False, structured_outputs={"regex": "(ab){40}"})
        seq = sampler.sample(_traj(0), params)[0].sequences[0]
        assert seq.stop_reason == "length" and len(seq.tokens) == 5
        assert ("ab" * 40).startswith(seq.text), seq.text


def _occurs(seq: list[int], tokens: list[int]) -> bool:
    n = len(seq)
    return any(tokens[i : i + n] == seq for i in range(len(tokens) - n + 1))


def _label(sampler: Sampler) -> str:
    return sampler.engine_name or type(sampler).__name__
