"""Importance-sampling corrections for sampler-trainer mismatch, and the k3 KL estimator.

Notation, per token ``t`` of sequence ``i`` (``m`` marks completion tokens)::

    log rho_it = logp_train_it - logp_sampler_it          (token ratio)
    log rho_i  = sum_t m_it * log rho_it                  (sequence ratio)

* **Truncated IS (TIS)**: weight ``w = min(rho, cap)``; token level uses
  ``rho_it``, sequence level ``rho_i`` for every token of the sequence.
  Unbiased where ``rho <= cap``, bounded variance everywhere.
* **Masked IS (MIS)**: weight ``w = rho`` if ``low <= rho <= high`` else ``0``:
  tokens (or whole sequences) whose ratio is out of range are dropped from the
  loss instead of being clipped.
* **k3 KL**: ``k3 = exp(logq - logp) - (logq - logp) - 1``, an unbiased,
  always non-negative estimate of ``KL(p || q)`` from samples of ``p``.

The weights are constants for the gradient (computed without grad): multiply
the per-token policy-gradient loss by them. ``logp_train`` is the trainer's
(detached) log-prob of each sampled token, ``logp_sampler`` the sampler's
(``SampledSequence.logprobs``, ``logprobs_mode="processed"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs

from twinkle_core.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

__all__ = ["ISWeights", "Level", "k3_kl", "masked_is", "masked_mean", "truncated_is"]

Level = Literal["token", "sequence"]


@attrs.frozen
class ISWeights:
    """Importance weights and how many tokens the correction touched.

    Attributes:
        weights: ``[B, T]`` the per-token weights (0 outside ``mask`` and where MIS dropped a token).
        ratio: ``[B, T]`` the raw ratio each weight came from (token or sequence level).
        share: the share of masked-in tokens whose weight was clipped (TIS) or dropped (MIS), in [0, 1].
    """

    weights: torch.Tensor
    ratio: torch.Tensor
    share: float


def _check_level(level: str) -> None:
    if level not in ("token", "sequence"):
        raise InvalidInputError(f"level={level!r} is invalid: expected 'token' or 'sequence'.")


def _log_ratio(
    logp_train: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log rho, mask)`` at the level asked, broadcast to ``[B, T]``, without grad."""
    _check_level(level)
    if logp_train.shape != logp_sampler.shape or logp_train.shape != mask.shape:
        raise InvalidInputError(
            f"shapes differ: logp_train {tuple(logp_train.shape)}, logp_sampler {tuple(logp_sampler.shape)},"
            f" mask {tuple(mask.shape)}; expected all three [B, T]."
        )
    m = mask.bool()
    # outside the mask the log-probs are padding (maybe -inf): zero them before any arithmetic
    log_rho = (logp_train.detach().float() - logp_sampler.detach().float()).masked_fill(~m, 0.0)
    if level == "sequence":
        log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)
    return log_rho, m


def _share(hit: torch.Tensor, m: torch.Tensor) -> float:
    total = int(m.sum())
    return float((hit & m).sum()) / total if total else 0.0


def truncated_is(
    logp_train: torch.Tensor,
    logp_sampler: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    level: Level = "token",
) -> ISWeights:
    """Truncated importance sampling: ``w = min(rho, cap)``.

    Args:
        logp_train: ``[B, T]`` the trainer's log-prob of each sampled token.
        logp_sampler: ``[B, T]`` the sampler's log-prob of the same tokens.
        mask: ``[B, T]`` true on completion tokens.
        cap: the truncation ``C > 0`` (commonly 2 for token level).
        level: ``"token"`` (``rho_it``) or ``"sequence"`` (``rho_i`` for every token).

    Returns:
        The weights, ratios and the share of tokens whose ratio exceeded ``cap``.

    Raises:
        InvalidInputError: ``cap <= 0``, an unknown ``level`` or mismatched shapes.
    """
    import torch

    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise InvalidInputError(f"cap={cap!r} is invalid: expected a number > 0.")
    with torch.no_grad():
        log_rho, m = _log_ratio(logp_train, logp_sampler, mask, level)
        rho = torch.exp(log_rho)
        weights = torch.clamp(rho, max=cap).masked_fill(~m, 0.0)
        return ISWeights(weights=weights, ratio=rho.masked_fill(~m, 0.0), share=_share(rho > cap, m))


def masked_is(
    logp_train: torch.Tensor,
    logp_sampler: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
    level: Level = "token",
) -> ISWeights:
    """Masked importance sampling: ``w = rho`` inside ``[low, high]``, ``0`` outside.

    Args:
        logp_train: ``[B, T]`` the trainer's log-prob of each sampled token.
        logp_sampler: ``[B, T]`` the sampler's log-prob of the same tokens.
        mask: ``[B, T]`` true on completion tokens.
        low: the smallest ratio kept, ``>= 0``.
        high: the largest ratio kept, ``> low``.
        level: ``"token"`` drops single tokens; ``"sequence"`` drops whole sequences.

    Returns:
        The weights, ratios and the share of tokens dropped.

    Raises:
        InvalidInputError: thresholds out of order, an unknown ``level`` or mismatched shapes.
    """
    import torch

    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (low, high))
    if not numbers or not 0 <= low < high:
        raise InvalidInputError(f"low={low!r}, high={high!r} are invalid: expected numbers with 0 <= low < high.")
    with torch.no_grad():
        log_rho, m = _log_ratio(logp_train, logp_sampler, mask, level)
        rho = torch.exp(log_rho)
        dropped = (rho < low) | (rho > high)
        weights = rho.masked_fill(dropped | ~m, 0.0)
        return ISWeights(weights=weights, ratio=rho.masked_fill(~m, 0.0), share=_share(dropped, m))


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(p || ref)`` from tokens sampled from ``p``.

    ``k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1``: unbiased, never
    negative, and lower-variance than ``logp - logp_ref``. Differentiable (used
    as a KL penalty in the loss).

    Args:
        logp: ``[...]`` the log-prob of each sampled token under ``p`` (the policy).
        logp_ref: the same tokens under the reference.
        mask: true where a token counts; elsewhere the result is 0.

    Returns:
        The per-token estimates, shaped like ``logp``.

    Raises:
        InvalidInputError: mismatched shapes.
    """
    if logp.shape != logp_ref.shape or (mask is not None and mask.shape != logp.shape):
        raise InvalidInputError(
            f"shapes differ: logp {tuple(logp.shape)}, logp_ref {tuple(logp_ref.shape)}"
            f"{'' if mask is None else f', mask {tuple(mask.shape)}'}; expected the same shape."
        )
    d = logp_ref - logp
    if mask is not None:
        d = d.masked_fill(~mask.bool(), 0.0)  # exp(0) - 0 - 1 = 0 where masked
    return d.exp() - d - 1


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` where ``mask`` is true (0 when nothing is)."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1)
