"""The torch engine on other model families: its log-probs are the model's own, whatever the architecture.

The engine swaps parts of a ``transformers`` model for its own (a
preallocated KV cache, a decode mask it keeps itself, grouped-query attention
through SDPA or a native kernel, oneDNN linears) and the tiny models of the
other tests are Llama and Qwen2 only. Here random tiny models of other
families, built offline from their configs, each bring something those two
lack: sliding windows (all layers, or alternating with full ones), logit
soft-capping, attention sinks, query/key norms, biases, GPT-2's ``Conv1D`` and
learned positions, partial rotary embeddings, parallel residuals, mixtures of
experts, multipliers, full multi-head attention, latent attention (values of
another width than keys), head sizes of 32, 48 and 128.

For each, the engine samples (two samples per prompt, prompts longer than
the sliding windows, generations that cross them) and every sampled token's
log-prob and every prompt log-prob must equal a plain forward of the same
model over the same tokens. The expectation comes from the model itself, so
it holds whichever tokens a CPU happens to draw. Weights are drawn wide
(std 0.3) so that attention moves the logits: a row attending to the wrong
keys (a window ignored, a stale cache column) moves a log-prob by far more
than the tolerance, which covers float32 summation order only (oneDNN
against BLAS, the native kernel against SDPA: up to about 3e-4 here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch_helpers import make_lora

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.testing.tiny_random import save_random_model
from twinkle_torch import TorchSampler

_BASE: dict[str, Any] = dict(
    vocab_size=768, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, max_position_embeddings=512, pad_token_id=0,
)  # fmt: skip

#: name: (model_type, config overrides); a value of None removes the base key.
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-mha-head32": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32)),
    "llama-head48": ("llama", dict(hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=48)),
    "llama-head128": ("llama", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128)),
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", dict(sliding_window=12)),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    "gemma": ("gemma", {}),
    "gemma2": (
        "gemma2",
        dict(sliding_window=12, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=64),
    ),
    "gemma2-full": (  # soft-capped with no window: the engine's own decode masks reach the eager attention
        "gemma2",
        dict(layer_types=["full_attention"] * 3, attn_logit_softcapping=5.0, query_pre_attn_scalar=64),
    ),
    "vaultgemma": ("vaultgemma", dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gpt-oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=12)),
    "gemma3": ("gemma3_text", dict(sliding_window=12, sliding_window_pattern=2)),
    "phi3": ("phi3", dict(num_key_value_heads=2)),
    "phi": ("phi", dict(num_key_value_heads=2, partial_rotary_factor=0.5)),
    "olmo2": ("olmo2", {}),
    "gpt2": ("gpt2", dict(n_embd=128, n_head=2, n_layer=3, n_positions=512)),
    "gpt-neox": ("gpt_neox", dict(num_key_value_heads=None, rotary_pct=0.5)),
    "opt": ("opt", dict(ffn_dim=256, word_embed_proj_dim=128, num_key_value_heads=None)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "granite": (
        "granite",
        dict(attention_multiplier=0.1, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
    ),
    "starcoder2": ("starcoder2", dict(sliding_window=None)),
    "cohere": ("cohere", {}),
    "deepseek-v3": (  # multi-head latent attention: values narrower than query/key heads; routed experts
        "deepseek_v3",
        dict(
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=48,
            v_head_dim=32,
            head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=64,
            num_key_value_heads=2,
        ),
    ),
    "mimo-v2-flash": ("mimo_v2_flash", dict(sliding_window=12)),  # values wider than keys, windows
    # attention in code of their own (no attention interface): transformers' default attention
    "mpt": ("mpt", dict(d_model=128, n_heads=2, n_layers=3, expansion_ratio=2, max_seq_len=512)),
    "bloom": ("bloom", dict(n_layer=3, n_head=2)),
    "xglm": ("xglm", dict(d_model=128, num_layers=3, attention_heads=2, ffn_dim=256)),
    "doge": ("doge", {}),  # a decode mask per head
}

#: Families the engine must refuse at load, and what its error says.
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "mamba": ("mamba", dict(num_hidden_layers=2), "recurrent state"),
    "rwkv": ("rwkv", dict(num_hidden_layers=2, attention_hidden_size=128), "recurrent state"),
    "bert": ("bert", {}, "not a causal language model"),
    "trocr": ("trocr", dict(d_model=128, decoder_layers=2, decoder_attention_heads=2), "left padding"),
    "openai-gpt": ("openai-gpt", dict(n_embd=128, n_layer=2, n_head=2), "KV cache"),
}

#: These run again with ``attention_kernel="sdpa"`` (the engine's other decode attention).
SDPA_TOO = ("mistral-window", "gemma2", "gemma2-full", "gpt-oss", "llama-mha-head32", "gpt2")

_TOLERANCE = 1e-3

PARAMS = SamplingParams(
    temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0, num_samples=2, seed=3
)


def _random_model(name: str, out: Path) -> Path:
    """A random model of family ``name`` with the tiny Llama's tokenizer and chat template."""
    from transformers import AutoConfig

    model_type, overrides = ARCHS[name] if name in ARCHS else REFUSED[name][:2]
    kwargs = {**_BASE, **overrides}
    config = AutoConfig.for_model(
        model_type, **{k: v for k, v in kwargs.items() if v is not None or k == "sliding_window"}
    )
    save_random_model(config, out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: _random_model(name, root / name) for name in ARCHS}


def prompts() -> list[Trajectory]:
    # 9 to about 40 tokens: shorter and longer than the 12-token windows, padded against each other
    return [Trajectory(messages=[{"role": "user", "content": "hi " * k + "there"}]) for k in (1, 9, 4, 22)]


def eager(path: Path) -> Any:
    """The reference: the model loaded plainly, with ``transformers``' own eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def _worstgap(path: Path, attention_kernel: str) -> tuple[float, int]:
    """The largest |engine - forward| over every sampled and prompt log-prob, and how many were compared."""
    with TorchSampler(path, device="cpu", attention_kernel=attention_kernel) as sampler:
        results = sampler.sample(prompts(), PARAMS)
        results += sampler.sample(prompts()[-1:], PARAMS)  # alone: no padding, so possibly no mask at all
    return gap(results, eager(path))


def gap(results: list[Any], model: Any) -> tuple[float, int]:
    worst, compared = 0.0, 0
    for result in results:
        prompt = result.prompt_token_ids
        assert result.prompt_logprobs is None or len(result.prompt_logprobs) == len(prompt)
        assert len(result.sequences) == PARAMS.num_samples
        for seq in result.sequences:
            assert seq.tokens and seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
            ids = torch.tensor([prompt + seq.tokens])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            want = [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(seq.tokens)]
            want_prompt = [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
            gaps = [abs(a - b) for a, b in zip(want, seq.logprobs)]
            if result.prompt_logprobs is not None:
                got_prompt = result.prompt_logprobs[1:]
                assert all(v is not None for v in got_prompt)
                gaps += [abs(a - b) for a, b in zip(want_prompt, got_prompt)]  # type: ignore[operator]
            worst, compared = max(worst, *gaps), compared + len(gaps)
    return worst, compared


@pytest.mark.parametrize("name", list(ARCHS))
def test_sampled_and_prompt_logprobs_are_the_models_own(models: dict[str, Path], name: str) -> None:
    worst, compared = _worstgap(models[name], "auto")
    assert compared > 200
    assert worst < _TOLERANCE, f"{name}: a log-prob is {worst:.2e} away from the model's own forward"


@pytest.mark.parametrize("name", SDPA_TOO)
def test_the_same_through_sdpa_attention(models: dict[str, Path], name: str) -> None:
    worst, _ = _worstgap(models[name], "sdpa")
    assert worst < _TOLERANCE, f"{name}: a log-prob is {worst:.2e} away from the model's own forward"


@pytest.mark.parametrize(
    ("name", "deferred"), [("qwen3", False), ("mistral-window", False), ("gemma2", True), ("gemma2-full", True)]
)
def test_only_what_needs_it_leaves_the_engines_attention(
    models: dict[str, Path], name: str, deferred: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soft-cap (or sinks...) sends attention to the model's eager code; a plain model stays on the engine's."""
    from twinkle_torch import attention

    calls: list[str] = []
    real = attention._model_eager

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_model_eager", counted)
    with TorchSampler(models[name], device="cpu") as sampler:
        sampler.sample(prompts()[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert bool(calls) is deferred, calls


#: Where each family keeps the projections a LoRA adapter targets (GPT-2's are ``Conv1D``, Phi-3's fused).
LORA_TARGETS = {
    "gpt2": ["c_attn", "c_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj"],
    "mixtral": ["q_proj", "v_proj", "o_proj"],
    "gpt-oss": ["q_proj", "v_proj", "o_proj"],
}


@pytest.mark.parametrize("name", list(LORA_TARGETS))
def test_adapters_merges_and_weight_updates_on_other_families(
    models: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """LoRA served on the fly, the same merged, the base again, then new weights: each is the model it says."""
    from peft import PeftModel

    path = models[name]
    adapter = make_lora(path, tmp_path / "lora", seed=1, targets=LORA_TARGETS[name])
    base = eager(path)
    with_adapter = PeftModel.from_pretrained(eager(path), str(adapter)).eval()
    gen = torch.Generator().manual_seed(7)
    new_weights = {
        k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in base.state_dict().items() if v.is_floating_point()
    }
    updated = eager(path)
    updated.load_state_dict(new_weights, strict=False)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=0, num_samples=2, seed=5)
    gaps = {}
    with TorchSampler(path, device="cpu") as sampler:
        sampler.add_adapter_to_model("a", str(adapter))
        gaps["adapter"] = gap(sampler.sample(prompts(), params, adapter_name="a"), with_adapter)[0]
        gaps["base beside it"] = gap(sampler.sample(prompts(), params), base)[0]
        sampler.remove_adapter("a")
        sampler.add_adapter_to_model("m", str(adapter), merge=True)
        gaps["merged"] = gap(sampler.sample(prompts(), params, adapter_name="m"), with_adapter)[0]
        sampler.remove_adapter("m")
        gaps["base, unmerged"] = gap(sampler.sample(prompts(), params), base)[0]
        sampler.update_weights(new_weights)
        gaps["updated"] = gap(sampler.sample(prompts(), params), updated)[0]
    assert max(gaps.values()) < _TOLERANCE, gaps
    # and the three models differ, so each comparison could fail
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    with torch.no_grad():
        logits = [m(ids).logits for m in (base, with_adapter, updated)]
    assert (logits[0] - logits[1]).abs().max() > 0.1 and (logits[0] - logits[2]).abs().max() > 0.1


@pytest.mark.parametrize("name", list(REFUSED))
def test_models_it_would_sample_wrongly_are_refused_at_load(name: str, tmp_path: Path) -> None:
    """A recurrent state, an encoder, positions that ignore padding, no cache: a clear error, not wrong samples."""
    from twinkle_core.errors import ConfigError

    path = _random_model(name, tmp_path / name)
    with pytest.raises(ConfigError, match=REFUSED[name][2]):
        TorchSampler(path, device="cpu")
