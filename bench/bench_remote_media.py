"""Bytes a Ray replica's share of an image call crosses with, both ways: the prompts sent, the sequences back.

    python bench/bench_remote_media.py                  # 3 prompts x 4 samples, 448 x 448 images
    python bench/bench_remote_media.py --side 64 --samples 8

It runs a replica's host (``twinkle_core.remote._host.ReplicaHost``) in this
process around a TorchSampler of the tiny Llava, and counts what Ray would
pickle: the share's arguments (each prompt's ``InputFeature``, its processed
arrays and decoded images), and every item the share streams back. "before"
counts each sequence with its prompt's media on its training feature, as
replicas sent them until each sequence shed them (``twinkle_core.remote._media``).
"""

from __future__ import annotations

import argparse
import pickle
from typing import Any

from PIL import Image

from twinkle_core import SamplingParams, Trajectory
from twinkle_core.placement import ReplicaContext
from twinkle_core.remote._host import ReplicaHost
from twinkle_core.remote._media import restore_prompt_media
from twinkle_core.testing.tiny_vlm import build_tiny_vlm
from twinkle_torch.sampler import TorchSampler


def _size(value: Any) -> int:
    return len(pickle.dumps(value, protocol=5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=448, help="image width and height in pixels")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    context = ReplicaContext(index=0, num_replicas=1, group="bench", device_type="cpu", tp_size=1, bundle_indices=(0,))
    host = ReplicaHost(TorchSampler, (str(build_tiny_vlm()),), {"dtype": "float32"}, context)
    items = []
    for seed in range(args.prompts):
        pixels = bytes((seed * 53 + i * 11) % 256 for i in range(args.side * args.side * 3))
        content = [{"type": "image", "image": Image.frombytes("RGB", (args.side, args.side), pixels)}]
        chat = Trajectory(messages=[{"role": "user", "content": [*content, {"type": "text", "text": "What is it?"}]}])
        items.append(host.get("template").encode(chat))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, num_samples=args.samples, logprobs=0)
    share = ("bench", items, list(range(len(items))), params, "", "raise", None)
    before = after = 0
    for value in host.stream_shard(*share):
        if isinstance(value, list):  # the share's closing responses, the same either way
            before, after = before + _size(value), after + _size(value)
            continue
        k, s, sequence, shed = value
        after += _size(value)
        before += _size((k, s, restore_prompt_media(sequence, items[k]) if shed else sequence))
    host.close()
    arrays = sum(v.nbytes for v in items[0].multimodal.values())
    print(
        f"{args.prompts} prompts x {args.samples} samples, one {args.side}x{args.side} image each"
        f" (processed arrays {arrays} B, one prompt pickled {_size(items[0])} B):"
        f" sent {_size(share)} B; back {before} B before, {after} B after"
    )


if __name__ == "__main__":
    main()
