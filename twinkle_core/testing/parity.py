"""Greedy parity between two computations of one model that may round differently.

Two engines (or one engine at two tensor-parallel sizes, or with an adapter
merged and not) sum the same products in different orders. Where the model's
top two tokens are within rounding of each other, each side's argmax may be
a different one: on a random tiny model after its end-of-turn token, that
happens. Comparing greedy tokens for exact equality then passes or fails by
the CPU's kernels, not by the engine's correctness.

:func:`assert_greedy_parity` compares exactly up to the first token where the
two sides differ, and accepts that divergence only where it is a true tie:
both sides' chosen tokens have the same log-probability within ``atol`` (each
side's greedy token is its maximum, so equal maxima mean a tie). After it the
sequences are conditioned on different prefixes and are not compared. A
wrong engine moves log-probs by far more than ``atol``, and most tokens must
have been compared, so a run that diverges everywhere still fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["assert_greedy_parity", "hf_logprobs"]


def assert_greedy_parity(got: Sequence[Any], want: Sequence[Any], *, atol: float, min_compared: float = 0.75) -> None:
    """Assert two lists of greedy ``SampledSequence`` agree, up to a divergence at a near-tie.

    Args:
        got: sequences from the engine under test (``logprobs=0`` or more).
        want: the reference's sequences, same prompts in the same order.
        atol: tolerance on log-probs of the same tokens, and the width of a tie.
        min_compared: the least share of all tokens that must lie before a divergence.

    Raises:
        AssertionError: naming the prompt and position that differ.
    """
    assert len(got) == len(want), f"{len(got)} sequences against {len(want)}"
    compared = total = 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.logprobs is not None and b.logprobs is not None, "sample with logprobs=0 to compare"
        assert len(a.tokens) == len(b.tokens), f"prompt {i}: {len(a.tokens)} tokens against {len(b.tokens)}"
        k = next((j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
        for j in range(k):
            assert abs(a.logprobs[j] - b.logprobs[j]) <= atol, (
                f"prompt {i}, token {j}: log-probs {a.logprobs[j]:.6f} and {b.logprobs[j]:.6f} differ by more"
                f" than {atol}"
            )
        if k < len(a.tokens):
            assert abs(a.logprobs[k] - b.logprobs[k]) <= atol, (
                f"prompt {i}: greedy tokens differ at {k} ({a.tokens[k]} with log-prob {a.logprobs[k]:.6f},"
                f" {b.tokens[k]} with {b.logprobs[k]:.6f}): not a tie"
            )
        compared += k
        total += len(a.tokens)
    assert compared >= min_compared * total, (
        f"only {compared} of {total} tokens lie before a divergence: the two sides agree on too little"
    )


def hf_logprobs(model: Any, feature: Any, tokens: Sequence[int]) -> Any:
    """Log-softmax of an HF model's one forward over a prompt's feature plus ``tokens``, at each of ``tokens``.

    The feature's processed media (``InputFeature.multimodal``) go in as they
    are, cast to the model's dtype where floating; its per-token arrays
    (``mm_token_type_ids``) are extended over ``tokens`` as text (type 0).
    Returns a float32 ``[len(tokens), vocab]`` tensor (the whole distributions).
    """
    import numpy as np
    import torch

    dtype = next(model.parameters()).dtype
    media = {k: torch.from_numpy(np.asarray(v)) for k, v in (feature.multimodal or {}).items()}
    media = {k: v.to(dtype) if v.is_floating_point() else v for k, v in media.items()}
    if "mm_token_type_ids" in media:
        media["mm_token_type_ids"] = torch.nn.functional.pad(media["mm_token_type_ids"], (0, len(tokens)))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(feature.input_ids) + list(tokens)]), **media).logits[0].float()
    return logits.log_softmax(-1)[len(feature.input_ids) - 1 : -1]
