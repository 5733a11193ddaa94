"""Replaying the sampler's truncation: log-probs over exactly the support a token was drawn from.

With top-k, top-p or min-p a token is drawn from a truncated, renormalised
distribution. A trainer that takes ``log_softmax`` over the whole vocabulary
scores the same token lower (the dropped mass is back in the normaliser), so
the importance ratio drifts from 1 even with identical weights. Given the
sampler's :class:`~twinkle_core.data_format.SamplingMask`, :func:`masked_logprobs`
applies the same processing as the sampler (logit bias, repetition penalty,
frequency and presence penalties, temperature) and normalises over the kept
ids only; the token constraints (``allowed_token_ids``, ``bad_words``,
``min_tokens``) are in the mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from twinkle_core.data_format import SamplingMask, SamplingParams
from twinkle_core.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

__all__ = ["masked_logprobs", "replay_logprobs"]


def _as_mask(mask: SamplingMask | dict[str, Any]) -> SamplingMask:
    if isinstance(mask, SamplingMask):
        return mask
    if isinstance(mask, dict):
        return SamplingMask.from_dict(mask)
    raise InvalidInputError(f"mask={mask!r:.60} is invalid: expected a SamplingMask or its dict.")


def _as_tokens(tokens: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    import torch

    return torch.as_tensor(tokens, dtype=torch.long, device=device).reshape(-1)


def masked_logprobs(
    logits: torch.Tensor,
    mask: SamplingMask | dict[str, Any],
    params: SamplingParams | dict[str, Any],
    *,
    tokens: Sequence[int] | torch.Tensor | None = None,
    prompt_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """Log-probs over the sampler's kept support at each position, ``-inf`` elsewhere.

    For position ``t`` with kept set ``K_t`` (the whole vocabulary when the
    mask's row is empty) and processed logits ``z_t``::

        z_t = (penalise(logits_t + bias, seen_t) - frequency * count_t - presence * [count_t > 0]) / temperature
        logp_t[v] = z_t[v] - logsumexp(z_t[K_t])  for v in K_t,  -inf otherwise

    (no division when greedy; ``count_t`` counts each token in the completion before ``t``)

    which is the sampler's ``logprobs_mode="processed"`` distribution. The
    result is differentiable in ``logits``, computed in float32 whatever their dtype.

    Args:
        logits: ``[T, V]`` the trainer's logits for the ``T`` generated positions
            (the logits that predict each completion token), any float dtype.
        mask: the sequence's ``SampledSequence.sampling_mask`` (``T`` rows).
        params: the ``SamplingParams`` the sequence was sampled with.
        tokens: the ``T`` sampled tokens; needed with a repetition, frequency
            or presence penalty (the whole completion: a continued sequence's
            earlier tokens included).
        prompt_ids: the prompt's ids; needed only with a repetition penalty
            (a token seen in the prompt or earlier in the completion is penalised).

    Returns:
        ``[T, V]`` float32 log-probs.

    Raises:
        InvalidInputError: shapes that do not fit the mask, a kept id outside the
            vocabulary, or a repetition penalty without ``tokens`` and ``prompt_ids``.
    """
    import torch

    mask = _as_mask(mask)
    params = SamplingParams.coerce(params)
    if logits.dim() != 2 or logits.shape[0] != len(mask):
        raise InvalidInputError(
            f"logits of shape {tuple(logits.shape)} do not fit the mask: expected [T, V] with T = {len(mask)}"
            " (one row per sampled token)."
        )
    positions, vocab = logits.shape
    device = logits.device
    z = logits.float()
    if params.logit_bias:
        bias = torch.zeros(vocab, dtype=torch.float32, device=device)
        bias[torch.tensor([t for t, _ in params.logit_bias], device=device)] = torch.tensor(
            [b for _, b in params.logit_bias], dtype=torch.float32, device=device
        )
        z = z + bias
    if (params.frequency_penalty or params.presence_penalty) and tokens is None:
        raise InvalidInputError(
            f"frequency_penalty={params.frequency_penalty} and presence_penalty={params.presence_penalty} need"
            " tokens= to replay which tokens the completion held."
        )
    if params.repetition_penalty != 1.0:
        if tokens is None or prompt_ids is None:
            raise InvalidInputError(
                f"repetition_penalty={params.repetition_penalty} needs tokens= and prompt_ids= to replay which"
                " tokens were penalised."
            )
        toks = _as_tokens(tokens, device)
        if toks.numel() != positions:
            raise InvalidInputError(f"tokens has {toks.numel()} entries: expected {positions}, one per position.")
        # position t has seen the prompt and the completion tokens before t
        seen = torch.zeros(positions, vocab, dtype=torch.int32, device=device)
        if positions > 1:
            seen[torch.arange(1, positions, device=device), toks[:-1]] = 1
        seen = seen.cumsum(dim=0) > 0
        seen[:, _as_tokens(list(prompt_ids), device)] = True
        z = torch.where(seen, torch.where(z > 0, z / params.repetition_penalty, z * params.repetition_penalty), z)
    if params.frequency_penalty or params.presence_penalty:
        toks = _as_tokens(tokens, device)  # type: ignore[arg-type]
        if toks.numel() != positions:
            raise InvalidInputError(f"tokens has {toks.numel()} entries: expected {positions}, one per position.")
        drawn = torch.zeros(positions, vocab, dtype=torch.float32, device=device)
        drawn[torch.arange(positions, device=device), toks] = 1.0
        before = drawn.cumsum(dim=0) - drawn  # per position, how often each token came before it
        z = z - params.frequency_penalty * before - params.presence_penalty * (before > 0).float()
    if not params.greedy and params.temperature != 1.0:
        z = z / params.temperature
    keep = _kept_support(mask, positions, vocab, device)
    return torch.log_softmax(z.masked_fill(~keep, -torch.inf), dim=-1)


def _kept_support(mask: SamplingMask, positions: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[T, V]`` booleans: the ids ``mask`` kept at each position (all of them where its row is empty)."""
    import torch

    counts = torch.tensor(
        [mask.offsets[i + 1] - mask.offsets[i] for i in range(positions)], dtype=torch.long, device=device
    )
    ids = torch.tensor(mask.token_ids, dtype=torch.long, device=device)
    if ids.numel() and int(ids.max()) >= vocab:
        raise InvalidInputError(
            f"the mask keeps token id {int(ids.max())}, outside the logits' vocabulary of {vocab}: is it the model"
            " that sampled?"
        )
    keep = torch.zeros(positions, vocab, dtype=torch.bool, device=device)
    keep[torch.repeat_interleave(torch.arange(positions, device=device), counts), ids] = True
    keep[counts == 0] = True  # an empty row is the whole vocabulary
    return keep


def replay_logprobs(
    logits: torch.Tensor,
    tokens: Sequence[int] | torch.Tensor,
    mask: SamplingMask | dict[str, Any],
    params: SamplingParams | dict[str, Any],
    *,
    prompt_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """The log-prob of each sampled token under the sampler's truncated distribution.

    ``masked_logprobs(...)`` gathered at ``tokens``: with the sampler's weights
    it equals the sampler's processed log-probs (to float32 rounding), so the
    importance ratio ``exp(trainer - sampler)`` is 1 up to numerics.

    Args:
        logits: ``[T, V]`` the trainer's logits for the generated positions.
        tokens: the ``T`` sampled tokens (``SampledSequence.tokens``).
        mask: ``SampledSequence.sampling_mask``.
        params: the ``SamplingParams`` of the request.
        prompt_ids: the prompt's ids (needed only with a repetition penalty).

    Returns:
        ``[T]`` float32 log-probs, differentiable in ``logits``.

    Raises:
        InvalidInputError: see :func:`masked_logprobs`; also a token outside its kept set.
    """
    toks = _as_tokens(tokens, logits.device)
    if toks.numel() != logits.shape[0]:
        raise InvalidInputError(f"tokens has {toks.numel()} entries: expected {logits.shape[0]}, one per logits row.")
    logp = masked_logprobs(logits, mask, params, tokens=toks, prompt_ids=prompt_ids)
    out = logp.gather(-1, toks.unsqueeze(-1)).squeeze(-1)
    bad = (out == -float("inf")).nonzero().flatten().tolist()
    if bad:
        raise InvalidInputError(
            f"token {int(toks[bad[0]])} at position {bad[0]} is outside the kept set of the mask: the mask does not"
            " belong to these tokens."
        )
    return out
