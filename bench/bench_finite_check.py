"""What ``check_finite`` costs: the non-finite scan of an update against a copy of the same bytes.

``update_weights`` and ``add_adapter_to_model`` refuse NaN and infinite values
by default (``check_finite=True``). This measures that scan on a state dict
of SmolLM2-135M's shapes (float32, built here: no download), next to a plain
``copy_`` of the same tensors, in one run::

    python bench/bench_finite_check.py            # SmolLM2-135M shapes, 5 repeats
"""

from __future__ import annotations

import argparse
import time

import torch

from twinkle_core.weights import find_non_finite


def smollm2_like(layers: int = 30, hidden: int = 576, inter: int = 1536, vocab: int = 49152) -> dict[str, torch.Tensor]:
    """Random float32 tensors with SmolLM2-135M's names' shapes (kv heads 3 x 64)."""
    gen = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (hidden, hidden),
            "self_attn.k_proj.weight": (192, hidden),
            "self_attn.v_proj.weight": (192, hidden),
            "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
        }
        for name, shape in shapes.items():
            state[p + name] = torch.randn(*shape, generator=gen)
    state["model.norm.weight"] = torch.ones(hidden)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    state = smollm2_like()
    items = list(state.items())
    targets = [torch.empty_like(t) for t in state.values()]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    scan, copy = [], []
    for _ in range(args.repeats):  # alternate the arms so drift hits both
        start = time.perf_counter()
        assert find_non_finite(items) is None
        scan.append(time.perf_counter() - start)
        start = time.perf_counter()
        for dst, src in zip(targets, state.values()):
            dst.copy_(src)
        copy.append(time.perf_counter() - start)
    s, c = min(scan), min(copy)
    print(f"state dict: {len(items)} tensors, {nbytes / 1e9:.3f} GB float32, torch threads {torch.get_num_threads()}")
    print(f"{'arm':<24}{'best s':>10}{'GB/s':>10}")
    print(f"{'non-finite scan':<24}{s:>10.3f}{nbytes / s / 1e9:>10.2f}")
    print(f"{'copy_ of the same bytes':<24}{c:>10.3f}{nbytes / c / 1e9:>10.2f}")
    print(f"scan / copy: {s / c:.2f}x")


if __name__ == "__main__":
    main()
