"""Structured outputs: every completion follows its regex, choice, grammar or JSON schema."""

from __future__ import annotations

from typing import Any

import pytest

from twinkle_core.data_format import SamplingParams
from twinkle_core.data_format.structured import compile_structured
from twinkle_core.errors import InvalidSamplingParams
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase
from twinkle_core.testing.contract.prompts import greedy_params, traj

__all__ = ["StructuredOutputTests"]


class StructuredOutputTests(ContractBase):
    """Constrained completions follow their grammar, end when complete, and bad ones are refused."""

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
        for response in sampler.sample([traj(0), traj(2)], params):
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
            for response in sampler.sample([traj(0), traj(1)], params):
                for seq in response.sequences:
                    assert seq.stop_reason == "stop" and seq.text in choices, (ignore_eos, seq.text, seq.stop_reason)
                    assert self._grammar_accepts(sampler, params, seq).is_terminated()

    def test_structured_outputs_that_do_not_compile_are_refused_before_any_work(self, sampler: Sampler) -> None:
        self._declares(sampler, "structured_outputs")
        for bad in ({"regex": "([a-z"}, {"json": {"type": 5}}, {"grammar": "root ::= undefined_rule"}):
            with pytest.raises(InvalidSamplingParams, match="structured_outputs"):
                sampler.sample([traj(0), traj(1)], SamplingParams(max_tokens=4, structured_outputs=bad))
        self.assert_still_works(sampler)

    def test_structured_outputs_that_admit_no_token_are_refused(self, sampler: Sampler) -> None:
        """A constraint that compiles but matches nothing (a rule that only refers to itself, an empty
        character class) is an ``InvalidSamplingParams`` naming it, not an engine's generic failure."""
        self._declares(sampler, "structured_outputs")
        for empty in ({"grammar": "root ::= root"}, {"regex": "[^\\s\\S]"}):
            with pytest.raises(InvalidSamplingParams, match="structured_outputs"):
                sampler.sample(traj(0), SamplingParams(max_tokens=4, structured_outputs=empty))
        self.assert_still_works(sampler)

    def test_structured_outputs_too_long_for_max_tokens_end_by_length(self, sampler: Sampler) -> None:
        self._declares(sampler, "structured_outputs")
        params = greedy_params(max_tokens=5, ignore_eos=False, structured_outputs={"regex": "(ab){40}"})
        seq = sampler.sample(traj(0), params)[0].sequences[0]
        assert seq.stop_reason == "length" and len(seq.tokens) == 5
        assert ("ab" * 40).startswith(seq.text), seq.text
