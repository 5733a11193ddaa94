"""Importance-sampling corrections and the k3 KL estimator, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle_core.errors import InvalidInputError, TwinkleError
from twinkle_core.rl import k3_kl, masked_is, masked_mean, truncated_is


def _logs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


def _close(got: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(expected, dtype=got.dtype))


# Two sequences of three slots; the second has two tokens (its last slot is padding).
# Token ratios pi_train / pi_sampler: row 0 -> 3, 0.5, 1; row 1 -> 1.5, 0.25, (pad).
TRAIN = _logs([[0.6, 0.1, 0.4], [0.3, 0.05, 1.0]])
SAMPLER = _logs([[0.2, 0.2, 0.4], [0.2, 0.2, 1e-9]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_token_tis_clips_each_token_ratio_at_the_cap() -> None:
    out = truncated_is(TRAIN, SAMPLER, MASK, cap=2.0)
    _close(out.weights, [[2.0, 0.5, 1.0], [1.5, 0.25, 0.0]])
    _close(out.ratio, [[3.0, 0.5, 1.0], [1.5, 0.25, 0.0]])
    assert out.share == pytest.approx(1 / 5)  # one of five real tokens was clipped


def test_sequence_tis_clips_the_product_of_ratios() -> None:
    # row 0: 3 * 0.5 * 1 = 1.5 (under the cap); row 1: 1.5 * 0.25 = 0.375
    out = truncated_is(TRAIN, SAMPLER, MASK, cap=2.0, level="sequence")
    _close(out.weights, [[1.5, 1.5, 1.5], [0.375, 0.375, 0.0]])
    assert out.share == 0.0
    tight = truncated_is(TRAIN, SAMPLER, MASK, cap=1.0, level="sequence")
    _close(tight.weights, [[1.0, 1.0, 1.0], [0.375, 0.375, 0.0]])
    assert tight.share == pytest.approx(3 / 5)  # all three tokens of row 0


def test_token_mis_drops_tokens_outside_the_band() -> None:
    out = masked_is(TRAIN, SAMPLER, MASK, low=0.5, high=2.0)
    # 3 > 2 and 0.25 < 0.5 are dropped; 0.5 sits on the boundary and is kept
    _close(out.weights, [[0.0, 0.5, 1.0], [1.5, 0.0, 0.0]])
    assert out.share == pytest.approx(2 / 5)


def test_sequence_mis_drops_whole_sequences() -> None:
    out = masked_is(TRAIN, SAMPLER, MASK, low=0.5, high=2.0, level="sequence")
    _close(out.weights, [[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]])
    assert out.share == pytest.approx(2 / 5)


def test_weights_carry_no_gradient() -> None:
    train = TRAIN.clone().requires_grad_(True)
    assert not truncated_is(train, SAMPLER, MASK).weights.requires_grad
    assert not masked_is(train, SAMPLER, MASK).weights.requires_grad


def test_k3_matches_the_formula_and_is_zero_where_masked() -> None:
    p = torch.tensor([math.log(0.5), math.log(0.2), math.log(0.9)], dtype=torch.float64)
    q = torch.tensor([math.log(0.25), math.log(0.4), math.log(0.1)], dtype=torch.float64)
    # r = q / p: 0.5 -> 0.5 - ln 0.5 - 1; 2 -> 2 - ln 2 - 1
    expected = [0.5 - math.log(0.5) - 1, 2 - math.log(2) - 1, 0.0]
    got = k3_kl(p, q, torch.tensor([True, True, False]))
    assert got.tolist() == pytest.approx(expected)
    assert (k3_kl(p, q) >= 0).all()
    assert k3_kl(p, p).abs().max() == 0.0
    # differentiable: the KL penalty goes into the loss
    lp = p.clone().requires_grad_(True)
    k3_kl(lp, q).sum().backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0


def test_k3_averages_to_the_exact_kl_over_many_samples() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    draws = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    estimate = k3_kl(p.log()[draws], q.log()[draws]).mean()
    exact = (p * (p / q).log()).sum()
    assert float(estimate) == pytest.approx(float(exact), rel=0.02)


def test_masked_mean() -> None:
    values = torch.tensor([[1.0, 2.0, 100.0]])
    assert float(masked_mean(values, torch.tensor([[True, True, False]]))) == 1.5
    assert float(masked_mean(values, torch.zeros(1, 3, dtype=torch.bool))) == 0.0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: truncated_is(TRAIN, SAMPLER, MASK, cap=0), "cap=0"),
        (lambda: truncated_is(TRAIN, SAMPLER, MASK, level="batch"), "level='batch'"),  # type: ignore[arg-type]
        (lambda: masked_is(TRAIN, SAMPLER, MASK, low=2.0, high=0.5), "low=2.0, high=0.5"),
        (lambda: masked_is(TRAIN, SAMPLER[:, :2], MASK), r"logp_sampler \(2, 2\)"),
        (lambda: k3_kl(TRAIN, SAMPLER[0]), "expected the same shape"),
    ],
)
def test_bad_arguments_raise_typed_errors(call: object, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match) as info:
        call()  # type: ignore[operator]
    assert isinstance(info.value, TwinkleError) and isinstance(info.value, ValueError)
