"""Routed experts (``return_routed_experts``) on the torch engine, and their replay in a trainer's forward.

The expectations come from the same model's own plain forward: the experts
its routers pick for the prompt and completion, and its log-probs of the
completion with and without :class:`twinkle_core.rl.RoutingReplay`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_torch_architectures import eager

from twinkle_core.data_format import InputFeature, SampledSequence, SampleResponse, SamplingParams, Trajectory
from twinkle_core.errors import InvalidInputError, UnsupportedFeatureError
from twinkle_core.rl import RoutingReplay, find_routers
from twinkle_core.testing.tiny_random import save_random_model
from twinkle_torch import TorchSampler

_TINY: dict[str, Any] = dict(
    vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, max_position_embeddings=512, pad_token_id=0, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
)  # fmt: skip
#: DeepSeek-V3's attention (MLA) and its shared expert.
_DEEPSEEK: dict[str, Any] = dict(
    num_key_value_heads=2, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, kv_lora_rank=32,
    q_lora_rank=None, first_k_dense_replace=0, n_shared_experts=1, n_group=1, topk_group=1,
)  # fmt: skip

PARAMS = SamplingParams(
    temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=0, num_samples=2, seed=7, return_routed_experts=True
)
#: float32 noise between the engine's batched, padded forward and a plain one
_NOISE = 1e-4


def _prompts() -> list[Trajectory]:
    return [Trajectory(messages=[{"role": "user", "content": "hi " * k + "there"}]) for k in (1, 9)]


def _model(model_type: str, root: Path) -> Path:
    from transformers import AutoConfig

    out = root / model_type
    kwargs = {**_TINY, **_DEEPSEEK} if model_type == "deepseek_v3" else _TINY
    if model_type == "deepseek_v3":
        del kwargs["head_dim"]  # its heads are the MLA sizes
    save_random_model(AutoConfig.for_model(model_type, **kwargs), out)
    return out


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, TorchSampler, list[SampleResponse]]]:
    path = _model("qwen3_moe", tmp_path_factory.mktemp("moe"))
    with TorchSampler(path, device="cpu") as sampler:
        yield path, sampler, sampler.sample(_prompts(), PARAMS)


def _own_routes(model: Any, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The experts the model's routers pick in a plain forward of ``ids``, and each pick's margin.

    The margin of a position and layer is the smallest gap between consecutive
    sorted router logits among the top k + 1: below float noise, two experts tie.
    """
    picks: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []

    def keep(module: Any, args: Any, output: Any) -> None:
        picks.append(output[2])
        top = output[0].float().reshape(output[2].shape[0], -1).topk(output[2].shape[-1] + 1, dim=-1).values
        margins.append((top[:, :-1] - top[:, 1:]).min(dim=-1).values)

    handles = [router.register_forward_hook(keep) for _, router in find_routers(model)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(picks, dim=1).numpy(), torch.stack(margins, dim=1).min(dim=1).values.numpy()


def assert_routes_are_own(results: list[SampleResponse], model: Any) -> int:
    """Each sequence's routes are ``model``'s own for its prompt and completion; returns how many were compared."""
    layers = len(find_routers(model))
    compared = 0
    for result in results:
        prompt = result.prompt_token_ids
        for seq in result.sequences:
            routes = seq.routed_experts
            assert isinstance(routes, np.ndarray) and routes.dtype == np.uint8
            # every token the engine forwarded: the prompt and each generated token but the last
            assert routes.shape[:2] == (len(prompt) + len(seq.tokens) - 1, layers)
            own, margin = _own_routes(model, prompt + seq.tokens[:-1])
            clear = margin > _NOISE  # positions where no two experts tie within float noise
            assert clear.mean() > 0.5
            np.testing.assert_array_equal(routes[clear], own[clear])
            compared += int(clear.sum())
    return compared


def _trainer_logprobs(model: Any, prompt: list[int], seq: SampledSequence, replay: Any = None) -> np.ndarray:
    """The trainer's log-probs of ``seq``'s tokens (temperature 1: the sampler's processed log-probs)."""
    ids = torch.tensor([prompt + seq.tokens])
    with torch.no_grad():
        if replay is not None:
            with RoutingReplay(model, replay):
                logits = model(ids).logits[0]
        else:
            logits = model(ids).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs[len(prompt) - 1 : -1].gather(-1, torch.tensor(seq.tokens).unsqueeze(-1)).squeeze(-1)
    return picked.numpy()  # type: ignore[no-any-return]


def test_routes_are_the_models_own_for_prompt_and_completion(
    qwen3_moe: tuple[Path, TorchSampler, list[SampleResponse]],
) -> None:
    path, _, results = qwen3_moe
    # two prompts of different lengths (padded), two samples sharing one prefill each
    assert assert_routes_are_own(results, eager(path)) > 0
    assert all(s.routed_experts.shape[2] == 2 for r in results for s in r.sequences)


def test_routes_round_trip_through_dicts(qwen3_moe: tuple[Path, TorchSampler, list[SampleResponse]]) -> None:
    seq = qwen3_moe[2][0].sequences[0]
    again = SampledSequence.from_dict(seq.to_dict())
    assert isinstance(seq.to_dict()["routed_experts"], str)  # JSON-safe: base64 .npy, as vLLM's server sends them
    np.testing.assert_array_equal(again.routed_experts, seq.routed_experts)
    assert again == seq


def test_routes_through_the_server(qwen3_moe: tuple[Path, TorchSampler, list[SampleResponse]]) -> None:
    """``return_routed_experts`` on completions and chat: each choice's ``routed_experts``, as vLLM encodes them."""
    import httpx

    from twinkle_core.data_format.routes import decode_routes
    from twinkle_core.server import start_server

    _, sampler, _ = qwen3_moe
    body: dict[str, Any] = {"model": "moe", "max_tokens": 4, "seed": 1, "return_routed_experts": True}
    with start_server(sampler, model_name="moe") as srv:
        done = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": [[5, 6, 7, 8]]}, timeout=60).json()
        messages = [{"role": "user", "content": "hi there"}]
        chat = httpx.post(srv.url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=60).json()
        plain = httpx.post(
            srv.url + "/v1/completions", json={**body, "prompt": [[5, 6]], "return_routed_experts": False}, timeout=60
        )
    choice = done["choices"][0]
    direct = sampler.sample(InputFeature(input_ids=[5, 6, 7, 8]), {**PARAMS.to_dict(), "max_tokens": 4, "seed": 1,
                            "num_samples": 1, "ignore_eos": False})[0].sequences[0]  # fmt: skip
    assert choice["token_ids"] == direct.tokens
    np.testing.assert_array_equal(decode_routes(choice["routed_experts"]), direct.routed_experts)
    routes = decode_routes(chat["choices"][0]["routed_experts"])
    assert routes.shape[1:] == (2, 2) and routes.shape[0] >= len(chat["choices"][0]["token_ids"])
    assert "routed_experts" not in plain.json()["choices"][0]


def test_no_routes_unless_asked(qwen3_moe: tuple[Path, TorchSampler, list[SampleResponse]]) -> None:
    _, sampler, results = qwen3_moe
    plain = sampler.sample(_prompts()[:1], PARAMS.replace(return_routed_experts=False))[0].sequences
    assert all(s.routed_experts is None for s in plain)
    assert [s.tokens for s in plain] == [s.tokens for s in results[0].sequences]  # recording changes nothing drawn


def _reroute(model: Any, model_type: str) -> None:
    """A weight update that changes the routing: the load-balancing bias (DeepSeek-V3) or the router weights."""
    torch.manual_seed(11)
    with torch.no_grad():
        for _, router in find_routers(model):
            if model_type == "deepseek_v3":
                # aux-loss-free balancing moves this bias between steps: it picks experts, never weighs them
                router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 1.0, 1.0]))
            else:
                router.weight.add_(0.01 * torch.randn_like(router.weight))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_replay_gives_the_trainer_the_samplers_logprobs(model_type: str, tmp_path: Path) -> None:
    path = _model(model_type, tmp_path)
    with TorchSampler(path, device="cpu") as sampler:
        results = sampler.sample(_prompts(), PARAMS)
    model = eager(path)
    same = [
        float(np.abs(_trainer_logprobs(model, r.prompt_token_ids, s, s.routed_experts) - s.logprobs).max())
        for r in results
        for s in r.sequences
    ]
    assert max(same) < _NOISE  # the same weights, replayed: the sampler's own log-probs
    _reroute(model, model_type)
    replayed, free = [], []
    for r in results:
        for s in r.sequences:
            replayed.extend(np.abs(_trainer_logprobs(model, r.prompt_token_ids, s, s.routed_experts) - s.logprobs))
            free.extend(np.abs(_trainer_logprobs(model, r.prompt_token_ids, s) - s.logprobs))
    print(
        f"{model_type}: same weights {max(same):.2e}; rerouted: replay max {max(replayed):.2e} mean"
        f" {np.mean(replayed):.2e}, free max {max(free):.2e} mean {np.mean(free):.2e}"
    )
    assert max(free) > 0.05  # the trainer's router now picks other experts: visibly other log-probs
    if model_type == "deepseek_v3":  # the update moved only the choice: replay restores the sampler's log-probs
        assert max(replayed) < _NOISE
    else:  # the moved router still weighs the replayed experts (as R3 does): closer on average, not equal
        assert np.mean(replayed) < np.mean(free)


def test_replay_refuses_routes_of_another_model(qwen3_moe: tuple[Path, TorchSampler, list[SampleResponse]]) -> None:
    path, _, results = qwen3_moe
    model = eager(path)
    routes = results[0].sequences[0].routed_experts
    with pytest.raises(InvalidInputError, match=r"expected \[tokens, 2, 2\]"):
        RoutingReplay(model, routes[:, :1])  # one MoE layer: recorded for another model
    with pytest.raises(InvalidInputError, match="expert 9"):
        RoutingReplay(model, np.full_like(routes, 9))
    # a forward shorter than the routes
    with pytest.raises(InvalidInputError, match="does not fit"), RoutingReplay(model, routes), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


def test_dense_model_refuses_routes(tiny_llama: Path) -> None:
    with TorchSampler(tiny_llama, device="cpu") as sampler:
        with pytest.raises(UnsupportedFeatureError, match="return_routed_experts"):
            sampler.sample(_prompts()[:1], PARAMS)
        assert sampler.sample(_prompts()[:1], PARAMS.replace(return_routed_experts=False))[0].sequences
    with pytest.raises(UnsupportedFeatureError, match="RoutingReplay"):
        RoutingReplay(eager(tiny_llama), np.zeros((3, 2, 2), dtype=np.uint8))


def test_routes_of_a_sequence_kept_across_a_weight_update(
    qwen3_moe: tuple[Path, TorchSampler, list[SampleResponse]],
) -> None:
    """``in_flight="keep"``: each row of the routes comes from the weights that produced the next token."""
    import time

    path, sampler, _ = qwen3_moe
    original = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    before = eager(path)
    rerouted = {k: v.clone() for k, v in original.items()}
    for name, _ in find_routers(before):
        rerouted[f"{name}.weight"] = rerouted[f"{name}.weight"] + 0.3 * torch.randn_like(rerouted[f"{name}.weight"])
    after = eager(path)
    after.load_state_dict(rerouted)
    stats = sampler.engine._decoder.stats  # type: ignore[attr-defined]
    start = stats.steps
    handle = sampler.submit(_prompts()[0], PARAMS.replace(max_tokens=40, num_samples=1))
    deadline = time.monotonic() + 60
    while stats.steps < start + 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        sampler.update_weights(rerouted, in_flight="keep")
        result = handle.result(timeout=120)[0]
    finally:
        sampler.update_weights(original)
    seq, prompt = result.sequences[0], result.prompt_token_ids
    assert seq.version_spans is not None and len(seq.version_spans) == 2
    switch = seq.version_spans[1][0]  # the first token the new weights produced
    routes = seq.routed_experts
    assert routes is not None and routes.shape[0] == len(prompt) + len(seq.tokens) - 1
    ids = prompt + seq.tokens[:-1]
    cut = len(prompt) + switch - 1  # row i produced token i + 1: rows before the cut are the old weights'
    for model, rows in ((before, slice(0, cut)), (after, slice(cut, None))):
        own, margin = _own_routes(model, ids)
        clear = margin[rows] > _NOISE
        np.testing.assert_array_equal(routes[rows][clear], own[rows][clear])
    assert not np.array_equal(_own_routes(before, ids)[0][cut:], routes[cut:])  # the update did reroute


def test_routes_of_rows_that_join_a_running_batch(qwen3_moe: tuple[Path, TorchSampler, list[SampleResponse]]) -> None:
    """Continuous batching: a call arriving mid-decode joins the batch; every row's routes stay its own."""
    import time

    path, sampler, _ = qwen3_moe
    stats = sampler.engine._decoder.stats  # type: ignore[attr-defined]
    steps, joined = stats.steps, stats.joined_rows
    running = sampler.submit(_prompts()[1], PARAMS.replace(max_tokens=30, num_samples=1))
    deadline = time.monotonic() + 60
    while stats.steps < steps + 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    arriving = sampler.sample(_prompts()[0], PARAMS)
    results = [running.result(timeout=120)[0], arriving[0]]
    assert stats.joined_rows > joined
    assert assert_routes_are_own(results, eager(path)) > 0


def test_routes_under_an_adapter_are_the_adapted_models(
    qwen3_moe: tuple[Path, TorchSampler, list[SampleResponse]], tmp_path: Path
) -> None:
    """A LoRA on the attention changes what reaches the routers: the routes are the adapted model's."""
    from peft import PeftModel
    from torch_helpers import make_lora

    path, sampler, _ = qwen3_moe
    adapter = make_lora(path, tmp_path / "lora", seed=1, targets=["q_proj", "v_proj"])
    sampler.add_adapter_to_model("routes-lora", str(adapter))
    try:
        adapted = sampler.sample(_prompts()[:1], PARAMS, adapter_name="routes-lora")
    finally:
        sampler.remove_adapter("routes-lora")
    model = PeftModel.from_pretrained(eager(path), str(adapter)).eval()
    assert assert_routes_are_own(adapted, model) > 0
    base = eager(path)
    seq = adapted[0].sequences[0]
    ids = adapted[0].prompt_token_ids + seq.tokens[:-1]
    assert not np.array_equal(_own_routes(base, ids)[0], seq.routed_experts)  # the base model routes otherwise


def test_routes_of_an_aborted_then_resumed_sequence(qwen3_moe: tuple[Path, TorchSampler, list[SampleResponse]]) -> None:
    """The aborted part's routes, then the continuation's: whole and in order, as one uninterrupted forward's."""
    import time

    path, sampler, _ = qwen3_moe
    stats = sampler.engine._decoder.stats  # type: ignore[attr-defined]
    steps = stats.steps
    handle = sampler.submit(_prompts()[0], PARAMS.replace(max_tokens=30, num_samples=1))
    deadline = time.monotonic() + 60
    while stats.steps < steps + 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    handle.abort()
    partial = handle.result(timeout=60)[0]
    first = partial.sequences[0]
    assert first.stop_reason == "abort" and first.routed_experts is not None
    resumed = handle.resume().result(timeout=120)[0]
    seq = resumed.sequences[0]
    assert seq.tokens[: len(first.tokens)] == first.tokens and len(seq.tokens) > len(first.tokens)
    ahead = len(partial.prompt_token_ids) + len(first.tokens) - 1
    np.testing.assert_array_equal(seq.routed_experts[:ahead], first.routed_experts)
    assert assert_routes_are_own([resumed], eager(path)) > 0
