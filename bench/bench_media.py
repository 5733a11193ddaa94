"""A multimodal rollout on every engine, side by side: prompts with several 448 x 448 images.

    python bench/bench_media.py                          # 16 prompts x 2 images x 32 tokens, the tiny Llava
    python bench/bench_media.py --prompts 8 --images 4 --no-vllm

Every runner samples the same chat prompts, each holding ``--images``
photographs-sized images (448 x 448 random RGB, PNG ``data:`` URLs, as a
client sends them), one completion each, ``ignore_eos``, temperature 1:

* ``twinkle-torch``: the torch engine (``create_sampler("torch", ...)``);
* ``twinkle-vllm``: the vLLM engine (vLLM's processor expands the images);
* ``hf-generate``: the model's own processor and ``generate``, one padded batch.

The table gives tokens/s and images/s (images decoded, processed and read
by the vision tower per second) beside each runner's peak memory; each
runner runs in its own process (``bench/harness.py``). The model is the
tiny Llava of the tests (``twinkle_core.testing.tiny_vlm``): its processor
resizes every image to 28 x 28, and its tower and language model are tiny,
so the figures measure what a sampler adds around a model (decoding the
images, the processor, moving the arrays, batching), not a real tower's
compute; on a real VLM the tower's share grows with the image size.
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BENCH_PROMPTS, Runner, Workload, compare


def _data_url(seed: int, size: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_prompts(prompts: int, images: int, size: int = 448) -> list[list[dict[str, Any]]]:
    """``prompts`` chat prompts, each with ``images`` image blocks before its question."""
    out = []
    for i in range(prompts):
        question = BENCH_PROMPTS[i % len(BENCH_PROMPTS)][-1]["content"]
        blocks: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": _data_url(i * images + k, size)}} for k in range(images)
        ]
        out.append([{"role": "user", "content": [*blocks, {"type": "text", "text": question}]}])
    return out


def hf_vlm_runner(workload: Workload) -> Callable[[Workload], int]:
    """The model's own processor and ``generate``: every prompt in one left-padded batch."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(workload.model_id)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(workload.model_id, dtype=getattr(torch, workload.dtype)).eval()

    def as_hf(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        convert = {"image_url": lambda b: {"type": "image", "url": b["image_url"]["url"]}}
        return [{**m, "content": [convert.get(b["type"], lambda b: b)(b) for b in m["content"]]} for m in messages]

    def run(w: Workload) -> int:
        inputs = processor.apply_chat_template(
            [as_hf(m) for m in w.prompts],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding=True,
        )
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                do_sample=True,
                temperature=w.temperature,
                top_p=w.top_p,
                top_k=0,
                max_new_tokens=w.max_tokens,
                min_new_tokens=w.max_tokens,
                num_return_sequences=w.num_samples,
            )
        return int(out[:, inputs["input_ids"].shape[1] :].numel())

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--images", type=int, default=2, help="images per prompt")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-vllm", action="store_true", help="skip the twinkle-vllm runner")
    args = parser.parse_args(argv)
    from twinkle_core.testing.tiny_vlm import build_tiny_vlm

    model = str(build_tiny_vlm())
    runners = [
        Runner("hf-generate", "bench_media:hf_vlm_runner", {}),
        Runner("twinkle-torch", "harness:sampler_runner", {"engine": "torch"}),
    ]
    if not args.no_vllm:
        engine_args = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "limit_mm_per_prompt": {"image": 8}}
        runners.append(Runner("twinkle-vllm", "harness:sampler_runner", {"engine": "vllm", "engine_args": engine_args}))
    workload = Workload(
        name=f"{args.prompts} prompts x {args.images} images",
        model_id=model,
        prompts=image_prompts(args.prompts, args.images),
        num_samples=1,
        max_tokens=args.tokens,
        dtype="float32",
    )
    results = compare(runners, [workload], baseline="hf-generate", repeats=args.repeats)
    images = args.prompts * args.images
    print("\n| runner | images/s | tokens/s | peak memory (MiB) |\n|---|---:|---:|---:|")
    for r in results:
        if r.error is None:
            print(f"| {r.runner} | {images / r.best_s:.1f} | {r.tokens_per_s:.1f} | {r.peak_rss_mib:.0f} |")
        else:
            print(f"| {r.runner} | failed: {r.error[:120]} | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
