"""Splitting one ``sample()`` call across replicas so they finish together."""

from __future__ import annotations

import heapq
import json

from twinkle_core.data_format import InputFeature, SamplingParams, Trajectory

__all__ = ["estimate_prompt_tokens", "item_cost", "split_by_cost", "trajectory_chars"]


def trajectory_chars(item: Trajectory) -> int:
    """Characters of a conversation's text (messages and tools): the base of its token estimate."""
    n = 0
    for m in item.messages:
        content = m.content if isinstance(m.content, str) else json.dumps(m.content)
        n += len(content) + len(m.role) + 8  # role header and turn markers
        if m.tool_calls:
            n += len(json.dumps(m.tool_calls))
        if m.reasoning_content:
            n += len(m.reasoning_content)
    for t in item.tools:
        n += len(json.dumps(t.to_dict()))
    return n


def estimate_prompt_tokens(item: InputFeature | Trajectory, chars_per_token: float) -> float:
    """Prompt length in tokens: exact for token ids, estimated from text for a conversation."""
    if isinstance(item, InputFeature):
        return float(len(item.input_ids))
    return trajectory_chars(item) / chars_per_token


def item_cost(prompt_tokens: float, params: SamplingParams) -> float:
    """Work of one input: every sample attends over its prompt and decodes up to ``max_tokens``."""
    return params.num_samples * (prompt_tokens + params.max_tokens)


def split_by_cost(costs: list[float], bins: int) -> list[list[int]]:
    """Greedy longest-first bin packing of input indices into ``bins`` shards.

    Each input goes whole to the least loaded shard, the costliest first (ties
    to the lower shard). Indices inside a shard keep their input order; a
    shard may be empty when there are fewer inputs than bins.
    """
    if bins < 1:
        raise ValueError(f"bins={bins} must be >= 1")
    shards: list[list[int]] = [[] for _ in range(bins)]
    heap = [(0.0, b) for b in range(bins)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, b = heapq.heappop(heap)
        shards[b].append(i)
        heapq.heappush(heap, (load + costs[i], b))
    return [sorted(s) for s in shards]
