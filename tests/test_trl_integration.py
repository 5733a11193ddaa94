"""TRL's real ``GRPOTrainer`` training the tiny model with twinkle generating (``twinkle_core.integrations.trl``).

Each run is a few optimizer steps. What is asserted is what a TRL user relies
on: every completion TRL trains on carries the version of the trainer's latest
push (read from TRL's side, through a reward function's arguments), the
sampler's log-probs equal the trainer's to float-32 noise, the policy really
moved (so those checks could fail), and a run whose weights do not follow the
policy is stopped by the integration itself. One sampler per engine serves the
module; the Ray replicas get their own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from twinkle_core import create_sampler  # noqa: E402
from twinkle_core.errors import (  # noqa: E402
    ConfigError,
    InvalidSamplingParams,
    PolicyMismatchError,
    StalePolicyError,
    UnsupportedFeatureError,
)
from twinkle_core.integrations.trl import TwinkleRollout, trl_sampling_params  # noqa: E402
from twinkle_core.testing import build_tiny_model  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

#: Prompts for the tiny model, sampled at temperature 1.5 so a group's completions differ.
QUESTIONS = [
    "Count from 3 to 7.",
    "What is 2 plus 5?",
    "Tell me a story about a cat.",
    "List three colors.",
    "Count from 1 to 4.",
    "What is the capital of France?",
    "Write 9 in words.",
    "What is 6 plus 1?",
]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-3  # the engines' parity tolerance with transformers in float32


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model("llama")


@pytest.fixture(scope="module")
def torch_sampler(model_dir: Path) -> Iterator[Any]:
    with create_sampler("torch", model_id=str(model_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def vllm_sampler(model_dir: Path) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from twinkle_vllm.sampler import vLLMSampler

    args = {
        "enforce_eager": True,
        "kv_cache_memory_bytes": 1 << 30,
        "dtype": "float32",
        "max_num_seqs": 64,
        "enable_lora": True,
        "max_lora_rank": 8,
    }
    with vLLMSampler(model_dir, engine_args=args) as s:
        yield s


@pytest.fixture(params=["torch", "vllm"])
def sampler(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_sampler")


def even_share(completion_ids: list[list[int]]) -> list[float]:
    """The share of even token ids in each completion: any two different completions almost surely score
    differently, so each group has reward signal whichever tokens this CPU's tiny model samples."""
    return [sum(t % 2 == 0 for t in ids) / len(ids) if ids else 0.0 for ids in completion_ids]


def config(tmp_path: Path, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 16,
        "temperature": 1.5,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "seed": 0,
    }
    settings.update(overrides)
    return trl.GRPOConfig(**settings)


def trainer_for(
    model_dir: Path,
    rollout: TwinkleRollout,
    args: Any,
    *,
    lora: bool = False,
    prompts: list[Any] | None = None,
    seen: list[dict[str, Any]] | None = None,
) -> Any:
    """A ``GRPOTrainer`` on the tiny model; ``seen`` collects what each reward call is handed."""

    def reward(completions: list[Any], **kwargs: Any) -> list[float]:
        if seen is not None:
            seen.append({"weights_version": kwargs["weights_version"], "stop_reason": kwargs["stop_reason"]})
        return even_share(kwargs["completion_ids"])

    reward.__name__ = "even_share"
    if prompts is None:
        prompts = [[{"role": "user", "content": q}] for q in QUESTIONS * 4]
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0)
    return trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
        reward_funcs=reward,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
        rollout_func=rollout,
        peft_config=peft_config,
    )


def base_state(sampler: Any, model_dir: Path) -> None:
    """Put the shared sampler back on the tiny model's own weights, with no adapter (tests share it)."""
    for name in list(sampler.adapters):
        sampler.remove_adapter(name)
    start = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    sampler.update_weights(list(start.state_dict().items()))


def assert_followed(rollout: TwinkleRollout, seen: list[dict[str, Any]], steps: int) -> None:
    """Every completion TRL scored carries the version pushed for its step; each push made a new version."""
    assert [h["step"] for h in rollout.history] == list(range(steps))
    versions = [h["version"] for h in rollout.history]
    assert versions == sorted(set(versions)), versions  # one new version per step
    assert len(seen) == steps
    for record, call in zip(rollout.history, seen):
        assert call["weights_version"] == [record["version"]] * 8
        assert set(call["stop_reason"]) <= {"stop", "length"}
    for record in rollout.history:
        assert record["logp_diff_max"] < TOLERANCE, record


# -- the recipe, in process, on each engine ---------------------------------------------------------


def test_full_finetune_samples_the_current_policy(sampler: Any, model_dir: Path, tmp_path: Path) -> None:
    base_state(sampler, model_dir)
    seen: list[dict[str, Any]] = []
    rollout = TwinkleRollout(sampler)
    trainer = trainer_for(model_dir, rollout, config(tmp_path), seen=seen)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert_followed(rollout, seen, steps=3)
    moved = max((v - before[k]).abs().max().item() for k, v in trainer.model.state_dict().items())
    assert moved > 1e-4  # the policy changed, so a sampler left on the old weights would have been caught
    assert rollout.serving == ""
    # TRL's own log carries the integration's figures
    logged = [row for row in trainer.state.log_history if "twinkle/sampling_logp_difference/max" in row]
    assert len(logged) == 3
    assert all(row["twinkle/sampling_logp_difference/max"] < TOLERANCE for row in logged)
    assert [row["twinkle/weights_version"] for row in logged] == [h["version"] for h in rollout.history]
    # the sampler now serves what the trainer ends with: greedy tokens and log-probs agree
    prompt = sampler.encode({"messages": [{"role": "user", "content": "Count from 3 to 7."}]})
    out = sampler.sample([prompt], {"temperature": 0, "max_tokens": 8, "logprobs": 0})[0].sequences[0]
    from twinkle_core.integrations.trl import _model_logprobs

    want = _model_logprobs(trainer.model, [(list(prompt.input_ids), list(out.tokens))], 0.0)[0]
    assert out.logprobs == pytest.approx(want, abs=TOLERANCE)


def test_lora_policy_is_pushed_as_an_adapter(sampler: Any, model_dir: Path, tmp_path: Path) -> None:
    base_state(sampler, model_dir)
    version_before = sampler.weights_version
    seen: list[dict[str, Any]] = []
    rollout = TwinkleRollout(sampler, adapter_name="grpo")
    trainer = trainer_for(model_dir, rollout, config(tmp_path, learning_rate=1e-2), lora=True, seen=seen)
    trainer.train()
    assert_followed(rollout, seen, steps=3)
    assert rollout.serving == "grpo" and "grpo" in sampler.adapters
    assert rollout.history[0]["version"] == version_before + 1
    # only the adapter was pushed: the base model still gives the base model's numbers
    prompt = sampler.encode({"messages": [{"role": "user", "content": "What is 2 plus 5?"}]})
    params = {"temperature": 0, "max_tokens": 8, "logprobs": 0}
    base = sampler.sample([prompt], params)[0].sequences[0]
    tuned = sampler.sample([prompt], params, adapter_name="grpo")[0].sequences[0]
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    from twinkle_core.integrations.trl import _model_logprobs

    assert base.logprobs == pytest.approx(
        _model_logprobs(plain, [(list(prompt.input_ids), list(base.tokens))], 0.0)[0], abs=TOLERANCE
    )
    assert tuned.logprobs == pytest.approx(
        _model_logprobs(trainer.model, [(list(prompt.input_ids), list(tuned.tokens))], 0.0)[0], abs=TOLERANCE
    )
    assert tuned.adapter_name == "grpo"


def test_a_policy_the_sampler_does_not_follow_is_caught(torch_sampler: Any, model_dir: Path, tmp_path: Path) -> None:
    """No pushes (the sampler keeps the start weights): the integration's own check stops the run."""
    base_state(torch_sampler, model_dir)
    rollout = TwinkleRollout(torch_sampler, sync_weights=False)
    trainer = trainer_for(model_dir, rollout, config(tmp_path, max_steps=4))
    with pytest.raises(PolicyMismatchError, match="not running the trainer's policy"):
        trainer.train()
    assert rollout.history[0]["logp_diff_max"] < TOLERANCE  # step 0: same weights, the check passes
    assert 1 <= len(rollout.history) < 4


def test_mixed_precision_trainer_and_settings_through_the_scoring_check(
    torch_sampler: Any, model_dir: Path, tmp_path: Path
) -> None:
    """bf16 autocast (TRL's default), top-k / top-p / repetition penalty, and two generations per step."""
    base_state(torch_sampler, model_dir)
    seen: list[dict[str, Any]] = []
    rollout = TwinkleRollout(torch_sampler)
    args = config(
        tmp_path,
        bf16=True,
        top_k=20,
        top_p=0.95,
        repetition_penalty=1.1,
        steps_per_generation=2,
        per_device_train_batch_size=4,
        max_steps=4,
    )
    assert rollout.history == []
    trainer = trainer_for(model_dir, rollout, args, seen=seen)
    trainer.train()
    # one generation feeds two optimizer steps: pushes at steps 0 and 2, and nothing is stale
    assert [h["step"] for h in rollout.history] == [0, 2]
    assert all(h["logp_diff_max"] < TOLERANCE for h in rollout.history)
    assert [call["weights_version"] for call in seen] == [[h["version"]] * 8 for h in rollout.history]


def test_uneven_and_plain_prompts(torch_sampler: Any, model_dir: Path, tmp_path: Path) -> None:
    """Runs of equal prompts of any length come back in TRL's order; plain strings are tokenized as TRL does."""
    base_state(torch_sampler, model_dir)
    rollout = TwinkleRollout(torch_sampler, verify_every=0)
    trainer = trainer_for(model_dir, rollout, config(tmp_path), prompts=["Numbers: 1 2 3"] * 8)
    prompts = ["Numbers: 1 2 3"] * 2 + ["The quick brown fox"] * 3 + ["Hello"]
    out = rollout(prompts, trainer)
    assert len(out["completion_ids"]) == len(out["logprobs"]) == len(prompts)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert out["prompt_ids"] == tokenizer(text=prompts)["input_ids"]  # TRL's own tokenization of plain prompts
    for ids, lps in zip(out["completion_ids"], out["logprobs"]):
        assert len(ids) == len(lps) > 0
    chat = [[{"role": "user", "content": "Hi"}]] * 2
    out = rollout(chat, trainer)
    assert out["prompt_ids"] == [list(torch_sampler.encode({"messages": chat[0]}).input_ids)] * 2
    with pytest.raises(UnsupportedFeatureError, match="plain strings"):
        rollout([{"text": "not a prompt"}], trainer)


def test_an_images_column_reaches_the_sampler_and_the_trainers_check(tmp_path: Path) -> None:
    """TRL's VLM recipe (conversational ``prompt`` plus an ``images`` column) on the tiny Llava: each completion
    TRL trains on is the sampler's own greedy output for that row's image, and the trainer's forward on the
    image agrees with the sampler's log-probs."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from twinkle_core.data_format import Trajectory
    from twinkle_core.testing.tiny_vlm import build_tiny_vlm

    vlm = str(build_tiny_vlm())
    images = [
        Image.frombytes("RGB", (40, 32), bytes((seed * 53 + i * 11) % 256 for i in range(40 * 32 * 3)))
        for seed in range(4)
    ]
    question = "What is it?"
    args = config(
        tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=1, generation_kwargs={"do_sample": False}
    )
    seen: list[dict[str, Any]] = []

    def reward(completions: list[Any], **kwargs: Any) -> list[float]:
        seen.append({"completion_ids": kwargs["completion_ids"], "images": kwargs["images"]})
        return even_share(kwargs["completion_ids"])

    with create_sampler("torch", model_id=vlm) as sampler:
        params = trl_sampling_params(args, context_window=sampler.max_model_len)

        chats = [[{"type": "image", "image": im}, {"type": "text", "text": question}] for im in images]
        responses = sampler.sample([Trajectory(messages=[{"role": "user", "content": c}]) for c in chats], params)
        expected = [r.sequences[0].tokens for r in responses]
        assert len({tuple(t) for t in expected}) > 1  # the model's output depends on the image
        rollout = TwinkleRollout(sampler)
        trainer = trl.GRPOTrainer(
            model=AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32),
            reward_funcs=reward,
            args=args,
            train_dataset=datasets.Dataset.from_dict(
                {"prompt": [[{"role": "user", "content": question}]] * 4, "images": [[im] for im in images]}
            ),
            processing_class=AutoProcessor.from_pretrained(vlm),
            rollout_func=rollout,
        )
        trainer.train()
    (call,) = seen
    assert len(call["completion_ids"]) == 4
    by_pixels = {im.tobytes(): k for k, im in enumerate(images)}
    for ids, row_images in zip(call["completion_ids"], call["images"]):
        assert ids == expected[by_pixels[row_images[0].tobytes()]]
    # greedy: the check scored the completions with the sampler and the trainer's forward, both on the images
    assert rollout.history[0]["logp_diff_max"] < TOLERANCE


def test_a_policy_loaded_from_a_checkpoints_nested_layout_is_followed(tmp_path: Path) -> None:
    """The trainer's policy is ``AutoModelForCausalLM`` of Qwen3.5's checkpoint layout (the language model
    nested as ``model.language_model.*`` beside a tower and an MTP block): its ``state_dict`` holds
    ``model.layers.*``, which the push hands the sampler of that folder as they are (:mod:`twinkle_core.names`).
    After a step the sampler serves the trained weights, which moved the completion's log-probs."""
    from twinkle_core.integrations.trl import _model_logprobs
    from twinkle_core.testing.tiny_layouts import build_tiny_checkpoint_layout

    layout = build_tiny_checkpoint_layout()
    seen: list[dict[str, Any]] = []
    with create_sampler("torch", model_id=str(layout)) as sampler:
        rollout = TwinkleRollout(sampler)
        trainer = trainer_for(layout, rollout, config(tmp_path, max_steps=1, learning_rate=1e-2), seen=seen)
        names = list(trainer.model.state_dict())
        assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names and "lm_head.weight" in names
        assert not any(n.startswith(("model.language_model.", "mtp.", "model.visual.")) for n in names)
        trainer.train()
        assert_followed(rollout, seen, steps=1)
        assert sampler.weights_version == rollout.version > rollout.history[0]["version"]  # the push after the step
        prompt = sampler.encode({"messages": [{"role": "user", "content": "Count from 3 to 7."}]})
        out = sampler.sample([prompt], {"temperature": 0, "max_tokens": 8, "logprobs": 0})[0].sequences[0]
    row = [(list(prompt.input_ids), list(out.tokens))]
    trained = _model_logprobs(trainer.model, row, 0.0)[0]
    start = _model_logprobs(AutoModelForCausalLM.from_pretrained(str(layout), dtype=torch.float32), row, 0.0)[0]
    assert out.logprobs == pytest.approx(trained, abs=TOLERANCE)
    assert max(abs(a - b) for a, b in zip(trained, start)) > 10 * TOLERANCE  # a sampler left behind would fail


# -- settings ------------------------------------------------------------------------------------------


def test_settings_map_faithfully(tmp_path: Path) -> None:
    params = trl_sampling_params(config(tmp_path, temperature=0.7, top_p=0.9, max_completion_length=12))
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, -1, 0.0)
    assert (params.max_tokens, params.logprobs, params.logprobs_mode) == (12, 0, "processed")
    params = trl_sampling_params(config(tmp_path, top_k=5, min_p=0.05, repetition_penalty=1.2))
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.05, 1.2)
    gen = {"max_new_tokens": 7, "top_k": 0, "stop_strings": "\n", "seed": None, "do_sample": False}
    params = trl_sampling_params(config(tmp_path, top_k=3, generation_kwargs=gen))
    assert (params.max_tokens, params.top_k, params.stop, params.temperature) == (7, -1, ("\n",), 0.0)
    assert trl_sampling_params(config(tmp_path, generation_kwargs={"seed": 5})).seed == 5
    unbounded = config(tmp_path, max_completion_length=None)
    assert trl_sampling_params(unbounded, context_window=128).max_tokens == 128
    with pytest.raises(ConfigError, match="context_window"):
        trl_sampling_params(unbounded)
    with pytest.raises(UnsupportedFeatureError, match=r"generation_kwargs\['num_beams'\]"):
        trl_sampling_params(config(tmp_path, generation_kwargs={"num_beams": 4}))
    with pytest.raises(UnsupportedFeatureError, match="Did you mean 'top_p'"):
        trl_sampling_params(config(tmp_path, generation_kwargs={"top_pp": 0.5}))
    with pytest.raises(UnsupportedFeatureError, match="num_generations"):
        trl_sampling_params(config(tmp_path, generation_kwargs={"n": 2}))
    with pytest.raises(InvalidSamplingParams, match=r"GRPOConfig.temperature=20000.0"):
        trl_sampling_params(config(tmp_path, temperature=20000.0))
    with pytest.raises(InvalidSamplingParams, match=r"generation_kwargs\['min_p'\]=2"):
        trl_sampling_params(config(tmp_path, generation_kwargs={"min_p": 2}))
    with pytest.raises(UnsupportedFeatureError, match="vllm_structured_outputs_regex"):
        trl_sampling_params(config(tmp_path, vllm_structured_outputs_regex="[0-9]+"))


def test_a_sampler_serving_someone_elses_weights_is_caught(torch_sampler: Any, model_dir: Path, tmp_path: Path) -> None:
    """Two trainers share one sampler: the second's push makes the first's next samples stale."""
    base_state(torch_sampler, model_dir)
    first, second = TwinkleRollout(torch_sampler), TwinkleRollout(torch_sampler)
    trainer_a = trainer_for(model_dir, first, config(tmp_path))
    trainer_b = trainer_for(model_dir, second, config(tmp_path))
    prompts = ["Numbers: 1 2 3"] * 4
    out = first(prompts, trainer_a)
    assert out["weights_version"] == [first.version] * 4
    second(prompts, trainer_b)  # pushes its own weights into the shared sampler
    with pytest.raises(StalePolicyError, match=f"weights_version {second.version} .* last push made version"):
        first(prompts, trainer_a)  # same step: no push of its own, and the sampler now runs trainer b's weights


def test_a_trainer_in_another_precision_is_pushed_in_the_samplers(
    vllm_sampler: Any, model_dir: Path, tmp_path: Path
) -> None:
    """vLLM takes weights in its own dtype only (Qwen3.5's CPU path runs bfloat16 while TRL trains in float32):
    the push casts them, so a bfloat16 policy updates the float32 engine, which then serves its weights."""
    from twinkle_core.integrations.trl import _model_logprobs

    base_state(vllm_sampler, model_dir)
    rollout = TwinkleRollout(vllm_sampler, verify_every=0)
    trainer = trainer_for(model_dir, rollout, config(tmp_path))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    trainer.model.to(torch.bfloat16)
    out = rollout(["Numbers: 1 2 3"] * 4, trainer)
    assert out["weights_version"] == [vllm_sampler.weights_version] * 4
    prompt = vllm_sampler.encode({"messages": [{"role": "user", "content": "Count from 3 to 7."}]})
    got = vllm_sampler.sample([prompt], {"temperature": 0, "max_tokens": 8, "logprobs": 0})[0].sequences[0]
    row = [(list(prompt.input_ids), list(got.tokens))]
    policy = _model_logprobs(trainer.model.float(), row, 0.0)[0]  # the bfloat16 values, in float32 as served
    start = _model_logprobs(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), row, 0.0)[0]
    assert got.logprobs == pytest.approx(policy, abs=TOLERANCE)
    assert max(abs(a - b) for a, b in zip(policy, start)) > 10 * TOLERANCE


def test_what_twinkle_cannot_do_is_refused(torch_sampler: Any, model_dir: Path, tmp_path: Path) -> None:
    rollout = TwinkleRollout(torch_sampler)
    trainer = trainer_for(model_dir, rollout, config(tmp_path))
    trainer.args.use_vllm = True  # as if GRPOConfig(use_vllm=True): TRL would start its own vLLM too
    with pytest.raises(ConfigError, match="use_vllm"):
        rollout(["Hello"], trainer)
    for bad in (
        {"tolerance": 0},
        {"on_mismatch": "ignore"},
        {"verify_every": -1},
        {"adapter_name": ""},
        {"sync_weights": "yes"},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            TwinkleRollout(torch_sampler, **bad)


# -- on Ray -------------------------------------------------------------------------------------------


def test_remote_group_sampler(model_dir: Path, tmp_path: Path) -> None:
    """The same recipe with the sampler as two Ray replicas (dp=2, CPU)."""
    pytest.importorskip("ray")
    import twinkle_core as tw

    tw.initialize("ray", groups=[tw.DeviceGroup(name="rollout", ranks=2, device_type="cpu")], num_cpus=2)
    try:
        with create_sampler(
            "torch", model_id=str(model_dir), remote_group="rollout", device_mesh=tw.DeviceMesh.from_sizes(dp_size=2)
        ) as remote:
            seen: list[dict[str, Any]] = []
            rollout = TwinkleRollout(remote)
            trainer = trainer_for(model_dir, rollout, config(tmp_path), seen=seen)
            trainer.train()
            assert_followed(rollout, seen, steps=3)
    finally:
        tw.shutdown()
