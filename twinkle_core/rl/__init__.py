"""Trainer-side correctness helpers for RL: sampling-mask replay and importance corrections.

Everything here takes and returns ``torch`` tensors but imports torch only
when called, so ``import twinkle_core.rl`` stays as slim as the core.

* :func:`replay_logprobs` / :func:`masked_logprobs`: recompute log-probs over
  exactly the support the sampler drew from (``SamplingParams.return_sampling_mask``).
* :func:`truncated_is` / :func:`masked_is`: token- and sequence-level truncated
  (TIS) and masked (MIS) importance-sampling weights for sampler-trainer mismatch.
* :func:`k3_kl`: the k3 estimator of a KL divergence from sampled log-probs.
* :class:`RoutingReplay`: the trainer's MoE layers take the experts the sampler
  took (``SamplingParams.return_routed_experts``), rollout routing replay.

See ``docs/rl-correctness.md`` for which source of mismatch each removes.
"""

from twinkle_core.rl.correction import ISWeights, k3_kl, masked_is, masked_mean, truncated_is
from twinkle_core.rl.replay import masked_logprobs, replay_logprobs
from twinkle_core.rl.routing import ROUTER_RULES, RoutingReplay, find_routers

__all__ = [
    "ROUTER_RULES",
    "ISWeights",
    "RoutingReplay",
    "find_routers",
    "k3_kl",
    "masked_is",
    "masked_logprobs",
    "masked_mean",
    "replay_logprobs",
    "truncated_is",
]
