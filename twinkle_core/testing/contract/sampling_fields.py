"""Each sampling field, in numbers: processed log-probs match the reference, the field changes the samples,
an undeclared field is refused, token ids stay within the vocabulary.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from twinkle_core.data_format import InputFeature, SamplingParams, bad_word_token_ids
from twinkle_core.data_format.structured import compile_structured
from twinkle_core.errors import InvalidSamplingParams, UnsupportedFeatureError
from twinkle_core.inputs import CORE_FIELDS
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase, undeclared_fields
from twinkle_core.testing.contract.prompts import greedy_params, some_words, spread_ids, traj
from twinkle_core.testing.reference import (
    NEG_INF,
    Completion,
    ambiguous_tokens,
    fit_logit_offsets,
    processed_logprobs,
    reference_error,
)

__all__ = ["SamplingFieldTests"]


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


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
    "logit_bias": lambda s: dict.fromkeys(spread_ids(s.vocab_size or 256, 12, 1), 6.0),
    "allowed_token_ids": lambda s: spread_ids(s.vocab_size or 256, 40, 2),
}

#: The fields of each reference case: every field alone, then combinations (a temperature
#: above 2 and a penalty below 1 too, which some engines emulate).
_REFERENCE_CASES: dict[str, dict[str, Any]] = {
    **{name: {name: value} for name, value in _FIELD_VALUES.items()},
    "min_tokens": {"min_tokens": 3, "temperature": 1.5},
    "bad_words": {"bad_words": lambda s: some_words(s, 12), "temperature": 1.5},
    "greedy-repetition_penalty": {"temperature": 0.0, "repetition_penalty": 1.8},
    "greedy-constraints": {
        "temperature": 0.0,
        "repetition_penalty": 1.4,
        "presence_penalty": 0.7,
        "frequency_penalty": 0.4,
        "logit_bias": lambda s: dict.fromkeys(spread_ids(s.vocab_size or 256, 20, 4), -3.0),
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
        "logit_bias": lambda s: dict.fromkeys(spread_ids(s.vocab_size or 256, 10, 5), 4.0),
        "allowed_token_ids": lambda s: spread_ids(s.vocab_size or 256, 60, 6),
        "bad_words": lambda s: [s.template.decode([t]).strip() for t in spread_ids(s.vocab_size or 256, 60, 6)[:3]],
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


class SamplingFieldTests(ContractBase):
    """Every sampling field does what it says, checked against :mod:`twinkle_core.testing.reference`."""

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
            pytest.skip(f"the engine does not declare {undeclared_fields(sampler, params)} (and refuses them)")
        problems = self.reference_mismatches(sampler, params, [traj(1), traj(3)])
        assert not problems, f"{len(problems)} mismatches with the reference, e.g.:\n" + "\n".join(problems[:6])

    @pytest.mark.parametrize("field", list(_FIELD_VALUES))
    def test_each_sampling_field_changes_the_samples(self, sampler: Sampler, field: str) -> None:
        base = SamplingParams(max_tokens=8, ignore_eos=True, seed=21, logprobs=0)
        changed = base.replace(**_resolve({field: _FIELD_VALUES[field]}, sampler))
        if self.refused_if_undeclared(sampler, changed):
            pytest.skip(f"the engine does not declare {field} (and refuses it)")
        inputs = [traj(i) for i in range(4)]
        before = [s for r in sampler.sample(inputs, base) for s in r.sequences]
        after = [s for r in sampler.sample(inputs, changed) for s in r.sequences]
        differs = False
        for a, b in zip(before, after):
            assert a.logprobs is not None and b.logprobs is not None
            if a.tokens != b.tokens or any(abs(x - y) > self.field_change_atol for x, y in zip(a.logprobs, b.logprobs)):
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
                sampler.sample(traj(0), SamplingParams(**{name: _non_default(name)}))
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
                sampler.sample(traj(0), params)
            assert name in str(info.value) and str(vocab) in str(info.value)
            assert isinstance(info.value, ValueError)
        self.assert_still_works(sampler)
        # the whole vocabulary is not beyond it
        seq = sampler.sample(traj(0), greedy_params(max_tokens=1, logprobs=vocab))[0].sequences[0]
        assert seq.top_logprobs is not None and len(seq.top_logprobs[0]) == vocab
