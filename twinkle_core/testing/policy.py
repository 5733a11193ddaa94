"""``PolicyContractTests``: the sampler really serves the policy it was given, as pytest tests.

An RL run trusts two things the sampling contract cannot see: that after
``update_weights`` the engine samples from the new weights, and that a LoRA
adapter changes outputs to what that adapter gives (only for the calls that
ask for it). An engine that validates an update and then keeps the old
weights, or loads an adapter and never applies it, still samples fluent text
and passes :class:`~twinkle_core.testing.SamplerContractTests`. This suite
catches it, from the engine's own outputs:

* **A prediction.** Scaling the final norm's weight by ``c`` multiplies every
  logit by ``c`` (for a model whose LM head has no bias and whose logits are
  not soft-capped: Llama, Qwen2, Mistral and most others). So after an update
  that does only that, each raw log-prob difference between two tokens must be
  ``c`` times what it was before: a number the engine cannot meet without
  running the new weights. It is checked for a full and a partial update, and
  the original outputs must come back when the base weights are pushed again.
* **Every tensor counts.** Each tensor of a perturbed copy of the weights is
  pushed alone, one after the other: each push must change the scores (an
  engine dropping any one name fails), and the end state must score what one
  full update of the same copy scores.
* **Adapters against merged weights.** The suite writes random LoRA adapters
  in memory; what an adapter must give is what the base model gives after an
  ``update_weights`` of ``W + (alpha / r) * B @ A``, computed here (checked
  by the prediction above). Loading, replacing and removing an adapter, two
  adapters and the base model in calls submitted together, and (where the
  engine takes it) ``merge=True`` are checked against it.
* **Labels.** Every sequence's ``weights_version`` and ``adapter_name`` must
  name what produced it.

An engine that refuses weight updates or adapters with
``UnsupportedFeatureError`` passes those tests if the refusal changes nothing
(they are then skipped with that reason).

Subclass it in an engine's test module with two fixtures::

    class TestMyEnginePolicy(PolicyContractTests):
        @pytest.fixture(scope="class")
        @classmethod
        def sampler(cls):
            with MySampler(model_dir) as s:
                yield s

        @pytest.fixture(scope="class")
        @classmethod
        def base_weights(cls):
            return checkpoint_weights(model_dir)  # the weights the sampler was built from

The tests push the base weights when they start and end, and remove their
adapters (their names start with ``policy-``), so the sampler can be shared
with other tests of the module (an ``adapter_options`` merge needs no other
adapter loaded). They need ``prompt_logprobs`` up to ``policy_top_logprobs``
and an engine that can hold two adapters at once.
Torch is imported when a test runs.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from twinkle_core.data_format import InputFeature, SampleResponse, SamplingParams, Trajectory
from twinkle_core.errors import UnknownAdapterError, UnsupportedFeatureError
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract import CONTRACT_PROMPTS

__all__ = ["PolicyContractTests", "checkpoint_weights", "random_lora"]

#: Per scored prompt, per position, the top log-probs by token id.
Scores = list[list[dict[int, float]]]


def checkpoint_weights(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor of a Hugging Face checkpoint folder (``*.safetensors``), by ``state_dict`` name."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    out: dict[str, Any] = {}
    for file in files:
        out.update(load_file(str(file)))
    return out


def random_lora(
    base_weights: Mapping[str, Any],
    targets: tuple[str, ...],
    *,
    seed: int,
    rank: int = 4,
    scale: float = 0.05,
    zero: tuple[str, ...] = (),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A LoRA adapter with random ``A`` and ``B`` for the 2-D weights whose module name is in ``targets``.

    The modules named in ``zero`` (among ``targets``) get zero ``A`` and ``B``: adapted, and unchanged.

    Returns:
        ``(config dict, {PEFT tensor name: tensor})``, as ``add_adapter_to_model(name, config, weights=...)`` takes.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for name, weight in base_weights.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in targets or weight.dim() != 2:
            continue
        out_features, in_features = weight.shape
        a = torch.randn(rank, in_features, generator=gen) / math.sqrt(in_features)
        b = torch.randn(out_features, rank, generator=gen) * scale
        if module.rpartition(".")[2] in zero:
            a, b = torch.zeros_like(a), torch.zeros_like(b)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(weight.dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(weight.dtype)
    if not tensors:
        raise ValueError(f"no 2-D weight of a module named {targets} in the base weights")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
    }
    return config, tensors


def merged_weights(
    base_weights: Mapping[str, Any], config: Mapping[str, Any], tensors: Mapping[str, Any]
) -> dict[str, Any]:
    """The base weights an adapter touches, with ``(alpha / r) * B @ A`` added (computed in float32)."""
    scale = config["lora_alpha"] / config["r"]
    out: dict[str, Any] = {}
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        base = base_weights[target]
        out[target] = (base.float() + scale * (b.float() @ a.float())).to(base.dtype)
    return out


def transformers_scores(
    model_dir: str | os.PathLike[str],
    prompts: list[list[int]],
    like: Scores,
    *,
    dtype: str = "float32",
    weights: Mapping[str, Any] | None = None,
    adapter: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> Scores:
    """``transformers``' log-probs of the tokens ``like`` holds, at the same positions of ``prompts``.

    The model of ``model_dir`` in ``dtype``, with ``weights`` (some of its tensors) over the checkpoint's and
    ``adapter`` (``random_lora``'s pair) applied by ``peft``, unmerged: a trainer's view of the same policy.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval()
    if weights:
        state = model.state_dict()
        for name, tensor in weights.items():
            state[name].copy_(tensor.to(torch_dtype))
    if adapter is not None:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        config, tensors = adapter
        model = get_peft_model(model, LoraConfig(**{k: v for k, v in config.items() if k != "peft_type"}))
        set_peft_model_state_dict(model, {k: v.to(torch_dtype) for k, v in tensors.items()})
    out: Scores = []
    for ids, rows in zip(prompts, like, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        out.append([{t: float(logp[j, t]) for t in row} for j, row in enumerate(rows)])
    return out


def _gaps(before: Scores, after: Scores) -> Iterator[float]:
    """Per position, the largest difference of a token's log-prob (infinite if the top sets differ much)."""
    for rows_a, rows_b in zip(before, after, strict=True):
        for a, b in zip(rows_a, rows_b, strict=True):
            common = a.keys() & b.keys()
            if len(common) < len(a) - 2:
                yield math.inf
                continue
            yield max(abs(a[t] - b[t]) for t in common)


def score_gap(before: Scores, after: Scores) -> float:
    """The largest log-prob difference between two scorings of the same prompts."""
    return max(_gaps(before, after), default=0.0)


class PolicyContractTests:
    """Weights and adapters reach the samples. Subclasses provide ``sampler`` and ``base_weights``."""

    #: The weight that scales the last hidden state elementwise before a bias-free LM head
    #: (``None``: the model has no such weight, and the prediction tests are skipped).
    logit_scale_weight: str | None = "model.norm.weight"
    #: The factor the prediction tests scale it by.
    logit_scale: float = 2.0
    #: Module names the suite's adapters put LoRA on.
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj", "gate_proj", "down_proj")
    #: ``add_adapter_to_model`` options tried by the adapter test, beside none (e.g. ``{"merge": True}``).
    adapter_options: tuple[dict[str, Any], ...] = ()
    #: Module names an engine loads into one layer, which an update must carry together (vLLM fuses
    #: ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``): an update of one of them gets its
    #: siblings of the same parent added, at their current values. A group may also name parameters of
    #: one module that a layer loads together (``("A_log", "dt_bias")`` of a Gated DeltaNet layer).
    fused_weights: tuple[tuple[str, ...], ...] = ()
    #: Top log-probs per position the scorings read.
    policy_top_logprobs: int = 8
    #: Tolerance of two log-probs that must agree (the same weights reached two ways).
    policy_atol: float = 2e-3
    #: A change of weights must move some log-prob by at least this much.
    policy_min_change: float = 2e-2

    @pytest.fixture
    def sampler(self) -> Sampler:  # pragma: no cover - always overridden
        raise NotImplementedError("Subclasses of PolicyContractTests must provide a 'sampler' fixture.")

    @pytest.fixture
    def base_weights(self) -> Mapping[str, Any]:  # pragma: no cover - always overridden
        raise NotImplementedError("Subclasses of PolicyContractTests must provide a 'base_weights' fixture.")

    # -- helpers ---------------------------------------------------------------------------
    def policy_prompts(self, sampler: Sampler) -> list[InputFeature]:
        return [sampler.encode(Trajectory(messages=m)) for m in CONTRACT_PROMPTS]

    def scores(self, sampler: Sampler, adapter_name: str = "") -> Scores:
        """The raw top log-probs at every position of the prompts, scored with ``adapter_name``."""
        params = SamplingParams(max_tokens=0, prompt_logprobs=self.policy_top_logprobs, logprobs_mode="raw")
        out = sampler.sample(self.policy_prompts(sampler), params, adapter_name=adapter_name)
        result: Scores = []
        for resp in out:
            assert resp.prompt_top_logprobs is not None, "prompt_logprobs were asked and not returned"
            result.append([dict(entry) for entry in resp.prompt_top_logprobs[1:] if entry is not None])
        return result

    def samples(self, sampler: Sampler, adapter_name: str = "") -> list[SampleResponse]:
        """Greedy continuations of the prompts, checked to carry the sampler's version and ``adapter_name``."""
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
        out = sampler.sample(self.policy_prompts(sampler), params, adapter_name=adapter_name)
        self.assert_labels(out, sampler.weights_version, adapter_name)
        return out

    @staticmethod
    def assert_labels(out: list[SampleResponse], version: int, adapter_name: str) -> None:
        for i, resp in enumerate(out):
            for seq in resp.sequences:
                assert seq.weights_version == version, (
                    f"input {i}: a sequence sampled at weights_version {version} says {seq.weights_version}"
                )
                assert seq.adapter_name == adapter_name, (
                    f"input {i}: a sequence sampled with adapter {adapter_name!r} says {seq.adapter_name!r}"
                )

    def assert_same(self, before: Scores, after: Scores, what: str, atol: float | None = None) -> None:
        atol = self.policy_atol if atol is None else atol
        gap = score_gap(before, after)
        assert gap <= atol, f"{what}: log-probs differ by up to {gap:.5f} (tolerance {atol:.5g})"

    def assert_changed(self, before: Scores, after: Scores, what: str, beyond: float = 0.0) -> None:
        """``after`` moved some log-prob by ``policy_min_change``, and by more than ``beyond`` (a tolerance that
        must not hide the change)."""
        gap = score_gap(before, after)
        assert gap >= self.policy_min_change, f"{what}: log-probs moved by at most {gap:.6f}: it had no effect"
        assert gap > beyond, f"{what}: log-probs moved by at most {gap:.5f}, within the tolerance {beyond:.5g}"

    def assert_scaled(self, before: Scores, after: Scores, factor: float, what: str) -> None:
        """Every log-prob difference to the top token in ``after`` is ``factor`` times that in ``before``."""
        worst, where = 0.0, ""
        for p, (rows_a, rows_b) in enumerate(zip(before, after, strict=True)):
            for j, (a, b) in enumerate(zip(rows_a, rows_b, strict=True)):
                top = max(a, key=a.__getitem__)
                assert top in b, f"{what}: prompt {p}, position {j}: the top token {top} left the top log-probs"
                for token in a.keys() & b.keys():
                    err = abs((b[token] - b[top]) - factor * (a[token] - a[top]))
                    if err > worst:
                        worst, where = err, f"prompt {p}, position {j}, token {token}"
        assert worst <= self.policy_atol * max(1.0, factor), (
            f"{what}: log-prob differences are not {factor}x those before (off by {worst:.5f} at {where}):"
            " the engine does not sample from the weights it was given"
        )

    def refused(self, sampler: Sampler, change: Any) -> bool:
        """Try ``change()``; if the engine refuses it as unsupported, check nothing changed and say so."""
        version = sampler.weights_version
        try:
            change()
        except UnsupportedFeatureError:
            assert sampler.weights_version == version, "a refused change moved weights_version"
            return True
        return False

    def with_siblings(self, update: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
        """``update`` plus, for each weight in a ``fused_weights`` group, the group's others from ``current``."""
        out = dict(update)
        for name in update:
            parent, _, rest = name.rpartition(".")
            if not parent:
                continue
            grand, _, module = parent.rpartition(".")
            for group in self.fused_weights:
                if module in group:  # modules fused into one layer (q_proj, k_proj, v_proj)
                    others = [f"{grand}.{sibling}.{rest}" if grand else f"{sibling}.{rest}" for sibling in group]
                elif rest in group:  # parameters of one module loaded together (a layer's A_log and dt_bias)
                    others = [f"{parent}.{sibling}" for sibling in group]
                else:
                    continue
                for other in others:
                    if other in current and other not in out:
                        out[other] = current[other]
        return out

    def _scale_weight(self, base_weights: Mapping[str, Any]) -> tuple[str, Any]:
        name = self.logit_scale_weight
        if name is None:
            pytest.skip("logit_scale_weight is None: the model has no weight that scales every logit")
        assert name in base_weights, f"logit_scale_weight {name!r} is not among the base weights"
        return name, base_weights[name]

    @pytest.fixture
    def restore_base(self, sampler: Sampler, base_weights: Mapping[str, Any]) -> Iterator[None]:
        """Before and after the test: the base weights (other tests may have pushed others), no ``policy-`` adapter."""

        def reset() -> None:
            for name in [n for n in sampler.adapters if n.startswith("policy-")]:
                sampler.remove_adapter(name)
            try:
                sampler.update_weights(dict(base_weights))
            except UnsupportedFeatureError:
                pass

        reset()
        yield
        reset()

    # -- weights ---------------------------------------------------------------------------
    @pytest.mark.parametrize("kind", ["full", "partial"])
    def test_update_serves_the_new_weights(
        self, sampler: Sampler, base_weights: Mapping[str, Any], restore_base: None, kind: str
    ) -> None:
        name, weight = self._scale_weight(base_weights)
        scaled = {name: weight * self.logit_scale}
        update = {**base_weights, **scaled} if kind == "full" else scaled
        before, before_tokens = self.scores(sampler), [r.sequences[0].tokens for r in self.samples(sampler)]
        if self.refused(sampler, lambda: sampler.update_weights(update)):
            assert self.scores(sampler) == before
            pytest.skip("the engine does not update weights (UnsupportedFeatureError)")
        self.assert_scaled(before, self.scores(sampler), self.logit_scale, f"after a {kind} update")
        self.samples(sampler)  # labelled with the new version
        sampler.update_weights(dict(base_weights) if kind == "full" else {name: weight})
        self.assert_same(before, self.scores(sampler), "after pushing the base weights back")
        assert [r.sequences[0].tokens for r in self.samples(sampler)] == before_tokens, (
            "greedy outputs differ after pushing the base weights back"
        )

    def test_every_tensor_of_an_update_is_applied(
        self, sampler: Sampler, base_weights: Mapping[str, Any], restore_base: None
    ) -> None:
        import torch

        gen = torch.Generator().manual_seed(7)
        perturbed = {
            name: (t.float() * (1 + 0.3 * torch.randn(t.shape, generator=gen))).to(t.dtype)
            if t.is_floating_point()
            else t
            for name, t in base_weights.items()
        }
        previous = self.scores(sampler)
        current = dict(base_weights)
        for i, (name, tensor) in enumerate(perturbed.items()):
            update = self.with_siblings({name: tensor}, current)
            if i:
                sampler.update_weights(update)
            elif self.refused(sampler, lambda: sampler.update_weights(update)):  # noqa: B023 - called at once
                pytest.skip("the engine does not update weights (UnsupportedFeatureError)")
            current[name] = tensor
            now = self.scores(sampler)
            if base_weights[name].is_floating_point():
                self.assert_changed(previous, now, f"pushing {name!r} alone")
            previous = now
        sampler.update_weights(dict(base_weights))
        sampler.update_weights(perturbed)
        self.assert_same(previous, self.scores(sampler), "one full update against the same tensors pushed one by one")

    # -- adapters --------------------------------------------------------------------------
    def _adapter(self, base_weights: Mapping[str, Any], seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return random_lora(base_weights, self.lora_targets, seed=seed)

    def adapter_reference(
        self, sampler: Sampler, base_weights: Mapping[str, Any], adapter: tuple[dict[str, Any], dict[str, Any]]
    ) -> Scores:
        """What an adapter must give: the base model's scores with the adapter merged in by ``update_weights``."""
        sampler.update_weights(self.with_siblings(merged_weights(base_weights, *adapter), base_weights))
        try:
            return self.scores(sampler)
        finally:
            sampler.update_weights(dict(base_weights))

    def unmerged_atol(
        self, sampler: Sampler, base_weights: Mapping[str, Any], adapter: tuple[dict[str, Any], dict[str, Any]]
    ) -> float:
        """How far an adapter served unmerged may score from the same adapter merged (``adapter_reference``).

        ``policy_atol`` (float32: the two orders of sums agree to it); an engine in a low precision
        derives its own from the rounding one computation of the adapted model carries there.
        """
        return self.policy_atol

    def _load(self, sampler: Sampler, name: str, adapter: tuple[dict[str, Any], dict[str, Any]], **options: Any) -> int:
        config, tensors = adapter
        return sampler.add_adapter_to_model(name, config, weights=tensors, **options)

    @pytest.mark.parametrize("option", ["plain", "with-options"])
    def test_an_adapter_gives_what_it_should_and_removing_it_restores_the_base(
        self, sampler: Sampler, base_weights: Mapping[str, Any], restore_base: None, option: str
    ) -> None:
        options: dict[str, Any] = {}
        if option == "with-options":
            if not self.adapter_options:
                pytest.skip("adapter_options is empty: the engine takes no adapter options")
            options = self.adapter_options[0]
        adapter = self._adapter(base_weights, seed=11)
        base = self.scores(sampler)
        if self.refused(sampler, lambda: self._load(sampler, "policy-probe", adapter, **options)):
            assert "policy-probe" not in sampler.adapters
            pytest.skip("the engine has no LoRA support (UnsupportedFeatureError)")
        sampler.remove_adapter("policy-probe")
        want = self.adapter_reference(sampler, base_weights, adapter)
        atol = None if options.get("merge") else self.unmerged_atol(sampler, base_weights, adapter)
        self.assert_changed(base, want, "the test adapter merged into the weights", beyond=atol or 0.0)
        version = self._load(sampler, "policy-x", adapter, **options)
        assert sampler.weights_version == version and "policy-x" in sampler.adapters
        self.assert_same(want, self.scores(sampler, "policy-x"), f"adapter 'policy-x' ({option})", atol)
        self.samples(sampler, "policy-x")
        if not options:
            self.assert_same(base, self.scores(sampler), "the base model while an adapter is loaded")
        sampler.remove_adapter("policy-x")
        with pytest.raises(UnknownAdapterError):
            sampler.sample(self.policy_prompts(sampler)[:1], SamplingParams(max_tokens=1), adapter_name="policy-x")
        self.assert_same(base, self.scores(sampler), "the base model after the adapter was removed")

    def test_replacing_an_adapter_serves_the_new_one(
        self, sampler: Sampler, base_weights: Mapping[str, Any], restore_base: None
    ) -> None:
        first, second = self._adapter(base_weights, seed=21), self._adapter(base_weights, seed=22)
        if self.refused(sampler, lambda: self._load(sampler, "policy-x", first)):
            pytest.skip("the engine has no LoRA support (UnsupportedFeatureError)")
        want_second = self.adapter_reference(sampler, base_weights, second)
        old = self.scores(sampler, "policy-x")
        atol = self.unmerged_atol(sampler, base_weights, second)
        self.assert_changed(old, want_second, "the two test adapters", beyond=atol)
        version = self._load(sampler, "policy-x", second)
        self.assert_same(
            want_second, self.scores(sampler, "policy-x"), "adapter 'policy-x' after it was replaced", atol
        )
        out = self.samples(sampler, "policy-x")
        assert all(s.weights_version == version for r in out for s in r.sequences)
        sampler.remove_adapter("policy-x")
        self._load(sampler, "policy-x", first)  # removed, then loaded again: the first one, not a cached second
        self.assert_same(old, self.scores(sampler, "policy-x"), "adapter 'policy-x' loaded again after removal")

    def test_adapters_in_calls_submitted_together_do_not_mix(
        self, sampler: Sampler, base_weights: Mapping[str, Any], restore_base: None
    ) -> None:
        adapters = {"policy-x": self._adapter(base_weights, seed=31), "policy-y": self._adapter(base_weights, seed=32)}
        if self.refused(sampler, lambda: self._load(sampler, "policy-x", adapters["policy-x"])):
            pytest.skip("the engine has no LoRA support (UnsupportedFeatureError)")
        self._load(sampler, "policy-y", adapters["policy-y"])
        names = ["", "policy-x", "policy-y"]
        solo = {name: self.scores(sampler, name) for name in names}
        self.assert_changed(solo["policy-x"], solo["policy-y"], "two different adapters")
        self.assert_changed(solo[""], solo["policy-x"], "an adapter against the base model")
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        prompts = self.policy_prompts(sampler)
        solo_tokens = {name: sampler.sample(prompts, params, adapter_name=name) for name in names}
        version = sampler.weights_version
        order = names * 3
        with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
            handles = list(pool.map(lambda name: sampler.submit(prompts, params, adapter_name=name), order))
        for name, handle in zip(order, handles):
            got = handle.result()
            self.assert_labels(got, version, name)
            assert [r.sequences[0].tokens for r in got] == [r.sequences[0].tokens for r in solo_tokens[name]], (
                f"calls with adapter {name!r} submitted beside the others sampled what it does not sample alone"
            )
        with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
            together = list(pool.map(lambda name: self.scores(sampler, name), order))
        for name, scores in zip(order, together):
            self.assert_same(solo[name], scores, f"adapter {name!r} scored beside the others")
