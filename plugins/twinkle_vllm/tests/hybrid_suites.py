"""The shared suites on a hybrid model that vLLM's CPU build serves in bfloat16, and the tolerances they are held to.

A test module subclasses :class:`HybridContractSuite` and
:class:`HybridPolicySuite` and defines a module fixture ``hybrid_model`` (the
model's folder); ``conftest.py`` builds the module's one engine on it
(``hybrid_sampler``) and the fixtures below the suites read.

**Tolerances, measured, not picked.** vLLM's CPU Gated DeltaNet kernels run
bfloat16 only, and a bfloat16 computation rounds every matmul, norm and state
update to 8 significant bits in its own order: two computations of the same
log-probs differ by rounding alone, by an amount that is a property of the
model. ``transformers``' own forward of the same weights in bfloat16 against
float32 gives the rounding one bfloat16 computation carries; two computations
that each carry that much differ by at most twice it. A state carried to the
wrong row or a layer run in the wrong order moves log-probs by whole nats.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from twinkle_core.testing import TINY_CHAT_PROMPTS, SamplerContractTests
from twinkle_core.testing.policy import (
    PolicyContractTests,
    checkpoint_weights,
    merged_weights,
    score_gap,
    transformers_scores,
)

from .conftest import TEST_ENGINE_ARGS

__all__ = [
    "DTYPES",
    "ENGINE_ARGS",
    "HybridContractSuite",
    "HybridPolicySuite",
    "bfloat16_weights",
    "rounding_of_bfloat16",
    "rounding_over_the_top",
    "suite_engine_args",
]

#: A bfloat16 computation and the float32 one it rounds.
DTYPES = ("bfloat16", "float32")
#: The test engine's options without a dtype: the engine must find bfloat16 itself.
ENGINE_ARGS = {k: v for k, v in TEST_ENGINE_ARGS.items() if k != "dtype"}

#: A routed expert's tensor in a checkpoint's names: ``<layer>.mlp.experts.<e>.<projection>.weight``.
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")


def suite_engine_args(folder: Path, *, lora: bool = True) -> dict[str, Any]:
    """:data:`ENGINE_ARGS` plus what the shared suites use: log-probs over the whole vocabulary, and adapters."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    adapters = dict(enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=3) if lora else {}
    return dict(ENGINE_ARGS, max_logprobs=vocab, **adapters)


def bfloat16_weights(folder: Path) -> dict[str, Any]:
    """The checkpoint's tensors in the dtype the engine serves (it takes bfloat16 updates)."""
    import torch

    return {name: t.to(torch.bfloat16) for name, t in checkpoint_weights(folder).items()}


def _forwards(folder: Path) -> list[Any]:
    """``transformers``' model of ``folder`` in bfloat16 and in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(str(folder), dtype=d) for d in (torch.bfloat16, torch.float32)]


def rounding_of_bfloat16(folder: Path, sequences: list[tuple[list[int], list[int]]]) -> float:
    """The largest gap between ``transformers``' bfloat16 and float32 log-probs of these ``(prompt, tokens)``."""
    import torch

    gaps = []
    models = _forwards(folder)
    for prompt, tokens in sequences:
        ids = torch.tensor([prompt + tokens])
        logprobs = []
        for model in models:
            with torch.no_grad():
                full = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[len(prompt) - 1 : -1]
            logprobs.append(full.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1))
        gaps.append(float((logprobs[0] - logprobs[1]).abs().max()))
    return max(gaps)


def rounding_over_the_top(folder: Path) -> float:
    """The largest gap between ``transformers``' bfloat16 and float32 log-probs over each position's top 8 tokens.

    The shared suites compare the engine's log-probs with each other (a sampled token's against the same
    token scored in another pass, the processed against the raw): in float32 those agree to 1e-4, in bfloat16
    each carries the rounding of one bfloat16 computation, and for the unlikely alternatives of the top 8
    that rounding is larger than for the chosen token (a logit of -12 rounds by more than one of -0.01).
    """
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    models = _forwards(folder)
    worst = 0.0
    for messages in TINY_CHAT_PROMPTS[:4]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            ids = models[1].generate(**ids, max_new_tokens=16, do_sample=False)
            low, full = (torch.log_softmax(m(ids).logits[0].float(), dim=-1) for m in models)
        top = full.topk(8, dim=-1).indices
        worst = max(worst, float((low.gather(-1, top) - full.gather(-1, top)).abs().max()))
    return worst


class HybridContractSuite(SamplerContractTests):
    """The shared contract on the module's engine, in bfloat16.

    Its log-prob comparisons are held to twice the rounding one bfloat16 computation carries over the top 8
    (two passes, each rounded), not float32's 1e-4 (``rounding_over_the_top``).
    """

    @pytest.fixture
    def sampler(self, hybrid_sampler: Any, top_rounding: float) -> Any:
        self.logprob_atol = self.reference_atol = 2 * top_rounding
        return hybrid_sampler


class HybridPolicySuite(PolicyContractTests):
    """Weight updates and adapters reach the module engine's samples (it takes bfloat16 tensors)."""

    adapter_options = ({"merge": True},)
    # the Qwen hybrids' norms scale by 1 + weight: doubling the bias-free head doubles the logits
    logit_scale_weight = "lm_head.weight"
    # the per-head decay parameters (A_log, dt_bias), nudged by 30%, move the tiny Qwen3.5's log-probs by 5e-4
    # to 5e-3 (see the torch engine's hybrid policy suite): still far above a repeated call's change (none)
    policy_min_change = 1e-4

    #: The suite's tests (by node name) that a module's engine cannot run, and why.
    not_held: Mapping[str, str] = {}

    @pytest.fixture(autouse=True)
    def _skip_not_held(self, request: pytest.FixtureRequest) -> None:
        reason = self.not_held.get(request.node.name)
        if reason:
            pytest.skip(reason)

    @pytest.fixture
    def sampler(self, hybrid_sampler: Any, hybrid_model: Path) -> Any:
        self.model_dir = hybrid_model
        return hybrid_sampler

    @pytest.fixture
    def base_weights(self, hybrid_weights: Mapping[str, Any]) -> Mapping[str, Any]:
        return hybrid_weights

    def unmerged_atol(
        self, sampler: Any, base_weights: Mapping[str, Any], adapter: tuple[dict[str, Any], dict[str, Any]]
    ) -> float:
        """Twice the rounding one bfloat16 computation of the adapted model carries over the scored tokens.

        Served unmerged (the base matmul, then the adapter's two, each rounded to bfloat16) and merged
        (``W + s * B @ A`` rounded once) are two bfloat16 computations of one model: they differ by
        rounding, 0.06-0.50 nats over the top 8 of the policy prompts on the tiny Qwen3.5
        (``bench/probe_vllm_lora.py``), far above float32's 2e-3. Measured, not picked: ``transformers``' own
        forward of the merged weights in bfloat16 against float32, over the base model's top 8 at every
        prompt position.
        """
        prompts = [list(f.input_ids) for f in self.policy_prompts(sampler)]
        like = self.scores(sampler)  # the base model's top tokens: the positions and tokens compared
        merged = merged_weights(base_weights, *adapter)
        low, full = (transformers_scores(self.model_dir, prompts, like, dtype=d, weights=merged) for d in DTYPES)
        return 2 * score_gap(low, full)

    def with_siblings(self, update: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
        """The suite's siblings, and a routed expert's: vLLM loads a layer's experts into one fused module."""
        out = super().with_siblings(update, current)
        layers = {m.group(1) for name in out if (m := _EXPERT.match(name))}
        for name, tensor in current.items():
            m = _EXPERT.match(name)
            if m and m.group(1) in layers and name not in out:
                out[name] = tensor
        return out
