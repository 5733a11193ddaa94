"""Training a tiny model: deterministic batches, AdamW with warm-up and cosine decay, one torch thread."""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from typing import Any

from twinkle_core.testing.tiny_corpus import SEED

__all__ = ["BATCH_SIZE", "LEARNING_RATE", "TRAIN_STEPS", "batches", "torch_threads", "train"]

#: Optimizer steps of a full build, sequences per step, peak learning rate.
TRAIN_STEPS = 800
BATCH_SIZE = 16
LEARNING_RATE = 4e-3


def batches(token_lists: list[list[int]], steps: int, batch_size: int) -> Iterator[list[list[int]]]:
    """Yield ``steps`` batches in a fixed order (reshuffled each epoch from a fixed seed).

    Args:
        token_lists: the tokenized corpus.
        steps: how many batches to yield.
        batch_size: sequences per batch.

    Yields:
        Lists of ``batch_size`` token lists.
    """
    rng = random.Random(SEED + 1)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            epoch = list(range(len(token_lists)))
            rng.shuffle(epoch)
            order += epoch
        yield [token_lists[i] for i in order[:batch_size]]
        del order[:batch_size]


def train(
    model: Any, token_lists: list[list[int]], steps: int, pad_id: int, learning_rate: float = LEARNING_RATE
) -> list[float]:
    """Train ``model`` in place on the tokenized corpus, deterministically.

    Args:
        model: a freshly initialised causal LM (float32, CPU).
        token_lists: the tokenized corpus.
        steps: optimizer steps.
        pad_id: the padding token id.
        learning_rate: the peak learning rate.

    Returns:
        The loss of every step.
    """
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses = []
    for batch in batches(token_lists, steps, BATCH_SIZE):
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
        labels = input_ids.masked_fill(attention == 0, -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())
    model.eval()
    return losses


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count.

    Args:
        count: the thread count to use inside the block.

    Yields:
        Nothing.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
