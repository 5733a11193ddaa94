"""A tiny, deterministic causal language model for tests, built offline.

:func:`build_tiny_model` trains a byte-level BPE tokenizer and a two-layer
transformer (Llama or Qwen2 architecture, or a Qwen3.5 hybrid of Gated
DeltaNet and attention layers) on a small built-in corpus of chat
conversations, and saves both as a plain Hugging Face folder that
``transformers`` (``AutoModelForCausalLM`` / ``AutoTokenizer``) and vLLM's CPU
build load. The result is cached under ``$TWINKLE_CACHE`` (default
``~/.cache/twinkle``) in ``tiny-models/<arch>-v<VERSION>``, so only the first
call in a cache pays the build (well under a minute on two CPU cores).

The model is trained until its next-token distributions are sharply peaked on
in-distribution chat prompts (see :data:`TINY_CHAT_PROMPTS`): greedy decoding
produces real text ("The capital of France is Paris.") and the gap between the
top-1 and top-2 logits along greedy continuations is large, so greedy
comparisons between engines are not fragile.

Nothing heavy is imported at module import time: ``torch``, ``tokenizers`` and
``transformers`` are imported inside the functions that need them.

The parts live beside this module: the template and corpus in
:mod:`~twinkle_core.testing.tiny_corpus`, the tokenizer in
:mod:`~twinkle_core.testing.tiny_tokenizer`, the model configs in
:mod:`~twinkle_core.testing.tiny_architectures` and the training loop in
:mod:`~twinkle_core.testing.tiny_training`; this module builds, caches and
perturbs the models and re-exports the public names.

Run ``python -m twinkle_core.testing.tiny_model`` to build both variants and
check that vLLM (CPU) loads them and decodes greedily like ``transformers``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from twinkle_core.hub import build_cached_folder, cache_root
from twinkle_core.testing.tiny_architectures import (
    ARCH_CLASSES,
    TINY_ARCHS,
    TINY_MAX_MODEL_LEN,
    check_arch,
    model_config,
)
from twinkle_core.testing.tiny_corpus import SEED, TINY_CHAT_PROMPTS, TINY_CHAT_TEMPLATE, TINY_WEATHER_TOOL, tiny_corpus
from twinkle_core.testing.tiny_moe import WARM_ARCHS, WARM_LEARNING_RATE, WARM_STEPS, warm_start
from twinkle_core.testing.tiny_tokenizer import TINY_SPECIAL_TOKENS, save_tiny_tokenizer, train_tiny_tokenizer
from twinkle_core.testing.tiny_training import LEARNING_RATE, TRAIN_STEPS, torch_threads, train

__all__ = [
    "TINY_ARCHS",
    "TINY_CHAT_PROMPTS",
    "TINY_CHAT_TEMPLATE",
    "TINY_MAX_MODEL_LEN",
    "TINY_MODEL_VERSION",
    "TINY_SPECIAL_TOKENS",
    "TINY_WEATHER_TOOL",
    "build_tiny_model",
    "perturbed_tiny_model",
    "tiny_corpus",
    "train_tiny_tokenizer",
    "write_tiny_model",
]

#: Bump whenever anything that changes the built files changes (corpus,
#: hyper-parameters, template, file layout, in this module or the ``tiny_*``
#: modules it builds from): the cache folder name includes it,
#: so a new version is rebuilt instead of reusing a stale folder.
TINY_MODEL_VERSION = 4

_MARKER = "twinkle_tiny_model.json"


def write_tiny_model(
    folder: str | os.PathLike[str], arch: str = "llama", *, train_steps: int | None = None
) -> dict[str, Any]:
    """Build a tiny model into ``folder`` without any caching.

    Most callers want :func:`build_tiny_model`, which caches the result. This
    function exists for tests that check determinism with fewer steps.

    Args:
        folder: the output folder (created; existing files are overwritten).
        arch: one of :data:`TINY_ARCHS`.
        train_steps: optimizer steps (0 leaves the initialisation); by default
            :data:`TRAIN_STEPS`, or :data:`~twinkle_core.testing.tiny_moe.WARM_STEPS`
            for the MoE hybrids, which start from the trained tiny Qwen3.5.

    Returns:
        Build metadata, also written to ``twinkle_tiny_model.json``: version,
        arch, steps, first and last loss, seconds taken, hashes.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    check_arch(arch)
    warm = arch in WARM_ARCHS
    base = build_tiny_model("qwen3_5") if warm else None  # before the clock: a cached folder, or its own build
    steps = train_steps if train_steps is not None else WARM_STEPS if warm else TRAIN_STEPS
    start = time.perf_counter()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)

    raw_tokenizer = train_tiny_tokenizer(arch)
    save_tiny_tokenizer(raw_tokenizer, arch, out)
    vocab_size = raw_tokenizer.get_vocab_size(with_added_tokens=True)
    token_lists = [enc.ids for enc in raw_tokenizer.encode_batch(tiny_corpus())]
    too_long = max(len(ids) for ids in token_lists)
    if too_long > TINY_MAX_MODEL_LEN:  # pragma: no cover - corpus invariant
        raise RuntimeError(f"corpus conversation of {too_long} tokens exceeds the context")

    config = model_config(arch, vocab_size)
    # One thread: float sums are identical whatever the machine's core count,
    # and on a busy machine it is ~10x faster than oversubscribed OpenMP threads
    # for a model this small. fork_rng leaves the caller's random state untouched.
    with torch_threads(1), torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        if base is not None:
            warm_start(model, arch, base)
        rate = WARM_LEARNING_RATE if warm else LEARNING_RATE
        losses = train(model, token_lists, steps, pad_id=0, learning_rate=rate) if steps > 0 else []
    model.config.architectures = [ARCH_CLASSES[arch]]
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(str(out))

    weights = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        weights.update(name.encode())
        weights.update(tensor.detach().contiguous().numpy().tobytes())
    meta = {
        "version": TINY_MODEL_VERSION,
        "arch": arch,
        "architecture": ARCH_CLASSES[arch],
        "vocab_size": vocab_size,
        "train_steps": steps,
        "warm_start": "qwen3_5" if warm else None,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "build_seconds": round(time.perf_counter() - start, 2),
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "weights_sha256": weights.hexdigest(),
    }
    (out / _MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    for path in out.iterdir():  # safetensors are written 0600; a shared cache wants 0644
        path.chmod(0o644)
    return meta


def build_tiny_model(arch: str = "llama", cache_dir: str | Path | None = None) -> Path:
    """Return the folder of a tiny causal LM, building and caching it on first use.

    The model is a two-layer ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``
    (hidden 128, 2 query heads and 1 KV head of size 64, float32, untied
    embeddings, context 512), or a four-layer hybrid ``Qwen3_5ForCausalLM``
    (three Gated DeltaNet layers, then one attention layer of those sizes),
    with a byte-level BPE tokenizer of 768 tokens, a ChatML chat template and a ``generation_config.json`` whose
    ``eos_token_id`` is ``<|im_end|>``. Building is deterministic and offline.

    The folder is ``<cache_dir>/tiny-models/<arch>-v<TINY_MODEL_VERSION>``. It
    is built in a temporary sibling folder and renamed into place, under a
    file lock, so processes racing to build it are safe and a half-written
    folder is never seen.

    Args:
        arch: one of :data:`TINY_ARCHS`.
        cache_dir: the cache root; defaults to :func:`twinkle_core.hub.cache_root`
            (``$TWINKLE_CACHE`` or ``~/.cache/twinkle``).

    Returns:
        The model folder, loadable with ``from_pretrained`` and by vLLM.

    Raises:
        ValueError: if ``arch`` is unknown.
    """
    check_arch(arch)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = root / "tiny-models" / f"{arch}-v{TINY_MODEL_VERSION}"

    def build(out: Path) -> None:
        write_tiny_model(out, arch)

    return build_cached_folder(final, _MARKER, build)


def perturbed_tiny_model(arch: str = "llama", seed: int = 1, scale: float = 0.05) -> Path:
    """The tiny model with every weight nudged: a second model for checking that tests do not lean on luck.

    A test whose expectation holds only because the tiny model's greedy
    decoding emitted (or did not emit) one particular token passes on the CPU
    it was written on and fails on a CPU whose kernels round a near-tie the
    other way. Running the same test on this model (each tensor plus
    ``scale x std(tensor)`` Gaussian noise from ``seed``: the same tokenizer
    and template, different near-ties everywhere) shows such a test on the
    developer's own machine. Cached next to the base model.

    Args:
        arch: one of :data:`TINY_ARCHS`.
        seed: the noise's seed; each seed is another model.
        scale: the noise relative to each tensor's standard deviation.

    Returns:
        The model folder, loadable like :func:`build_tiny_model`'s.
    """
    base = build_tiny_model(arch)
    final = base.parent / f"{base.name}-perturbed-{int(seed)}-{scale:g}"

    def build(out: Path) -> None:
        import shutil

        import torch
        from safetensors.torch import load_file, save_file

        for path in base.iterdir():
            if path.name not in ("model.safetensors", _MARKER):
                shutil.copy2(path, out / path.name)
        gen = torch.Generator().manual_seed(int(seed))
        weights = load_file(str(base / "model.safetensors"))
        nudged = {
            name: (t + scale * t.float().std() * torch.randn(t.shape, generator=gen)).to(t.dtype).contiguous()
            for name, t in sorted(weights.items())
        }
        save_file(nudged, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "model.safetensors").chmod(0o644)
        meta = json.loads((base / _MARKER).read_text(encoding="utf-8"))
        meta["perturbed"] = {"seed": int(seed), "scale": scale}
        (out / _MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")  # last: marks it complete

    return build_cached_folder(final, _MARKER, build)


# ---------------------------------------------------------------------------
# Manual check: python -m twinkle_core.testing.tiny_model
# ---------------------------------------------------------------------------


def _hf_greedy(
    folder: Path, prompts: list[list[dict[str, Any]]], max_new_tokens: int
) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """Greedy-decode chat prompts with ``transformers``.

    Args:
        folder: the model folder.
        prompts: chat conversations.
        max_new_tokens: the generation budget.

    Returns:
        ``(prompt_ids, completion_ids, margins)`` where ``margins`` are the
        top-1 minus top-2 logit gaps over every generated position.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    prompt_ids: list[list[int]] = []
    completions: list[list[int]] = []
    margins: list[float] = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        completions.append(out.sequences[0, len(ids) :].tolist())
        prompt_ids.append(ids)
        for scores in out.scores:
            top = torch.topk(scores[0], 2).values
            margins.append(float(top[0] - top[1]))
    return prompt_ids, completions, margins


def _main() -> None:  # pragma: no cover - manual check, needs vLLM
    """Build both variants, then compare HF and vLLM (CPU) greedy decoding."""
    import statistics

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for arch in TINY_ARCHS:
        start = time.perf_counter()
        folder = build_tiny_model(arch)
        print(f"[{arch}] folder {folder} ready in {time.perf_counter() - start:.1f}s")
        print(json.loads((folder / _MARKER).read_text()))
        prompt_ids, hf_out, margins = _hf_greedy(folder, TINY_CHAT_PROMPTS, 48)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        for ids in hf_out[:4]:
            print(f"[{arch}] HF greedy: {tokenizer.decode(ids)!r}")
        print(
            f"[{arch}] margins: min {min(margins):.3f} median {statistics.median(margins):.3f} "
            f"share>1: {sum(m > 1 for m in margins) / len(margins):.2f}"
        )
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        llm = LLM(
            model=str(folder),
            dtype="float32",
            max_model_len=TINY_MAX_MODEL_LEN,
            enforce_eager=True,
            kv_cache_memory_bytes=256 * 1024**2,
            seed=0,
        )
        print(f"[{arch}] vLLM engine start {time.perf_counter() - start:.1f}s")
        params = SamplingParams(temperature=0.0, max_tokens=48)
        results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params)
        same = [list(r.outputs[0].token_ids) == hf for r, hf in zip(results, hf_out, strict=True)]
        print(f"[{arch}] vLLM == HF greedy: {same}")
        del llm


if __name__ == "__main__":  # pragma: no cover
    _main()
