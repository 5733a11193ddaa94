"""The base every part of the conformance suite builds on: tolerances, the ``sampler`` fixture, helpers."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from twinkle_core.data_format import SamplingParams
from twinkle_core.errors import UnsupportedFeatureError
from twinkle_core.inputs import CORE_FIELDS
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.prompts import greedy_params, traj

__all__ = ["ContractBase", "engine_label", "undeclared_fields"]


def undeclared_fields(sampler: Sampler, params: SamplingParams) -> list[str]:
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


def engine_label(sampler: Sampler) -> str:
    """The engine's name, for skip messages."""
    return sampler.engine_name or type(sampler).__name__


class ContractBase:
    """What every part of the suite shares: the tolerances, the ``sampler`` fixture and the helpers."""

    #: Tolerance when one engine's log-probs are compared with each other.
    logprob_atol: float = 1e-4
    #: Tolerance when processed log-probs are compared with the reference computed from
    #: the engine's raw ones (raw log-probs come from a separate scoring pass).
    reference_atol: float = 1e-3
    #: How far a sampling field must move a log-prob to count as a change, between two calls on the same
    #: inputs that differ only by that field (the forwards are the same; only the field acts).
    field_change_atol: float = 1e-3
    #: Top-k alternatives asked for in the reference checks.
    reference_top_logprobs: int = 8
    #: Tokens generated per sequence in the reference checks.
    reference_max_tokens: int = 4

    @pytest.fixture
    def sampler(self) -> Sampler:  # pragma: no cover - always overridden
        raise NotImplementedError("Subclasses of SamplerContractTests must provide a 'sampler' fixture.")

    # -- helpers ---------------------------------------------------------------------------
    def greedy_tokens(self, sampler: Sampler, inputs: Any, **kw: Any) -> list[list[int]]:
        return [r.sequences[0].tokens for r in sampler.sample(inputs, greedy_params(**kw))]

    def assert_still_works(self, sampler: Sampler) -> None:
        out = sampler.sample(traj(0), greedy_params(max_tokens=4))
        assert len(out) == 1 and len(out[0].sequences[0].tokens) == 4

    def refused_if_undeclared(self, sampler: Sampler, params: SamplingParams) -> bool:
        """Check that ``params`` is refused if it sets a field the engine does not declare.

        Returns:
            Whether it was (the caller then has nothing more to check).
        """
        undeclared = undeclared_fields(sampler, params)
        if not undeclared:
            return False
        with pytest.raises(UnsupportedFeatureError, match=undeclared[0]):
            sampler.sample(traj(0), params)
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

    def _declares(self, sampler: Sampler, *fields: str) -> None:
        missing = [f for f in fields if f not in sampler.supported_params and f not in CORE_FIELDS]
        if missing:
            pytest.skip(f"the {engine_label(sampler)} engine does not declare {missing}")
