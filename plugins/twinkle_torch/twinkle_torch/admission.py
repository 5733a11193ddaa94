"""Admission to the running batch: which waiting rows join it, and their prefill.

Waiting rows join first come first served, rows of one adapter at a time,
while the batch fits the token budget (``rows x (longest (prompt +
max_tokens) + state)`` within ``max_batch_tokens``, where a hybrid model's
per-row linear-attention state counts as the KV tokens of its size,
:mod:`twinkle_torch.state`; an empty batch always takes one row):
:func:`admissible`.

The rows taken are prefilled together (:class:`Prefiller`), left-padded, one
prefill per prompt shared by its samples, in chunks of similar lengths whose
caches are gathered into one sized for the whole generation. The prefill
calls nothing back: it hands the decode loop a :class:`Prefilled`, the new
rows' batch (which the loop joins to the running one, :mod:`twinkle_torch.batch`)
and the rows that end and the runs that fail there, for the loop to report.
The loop passes that record in, so that what was found before an error
(a run failed by NaN prompt scores) stands when the prefill raises.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import torch

from twinkle_core.errors import NumericalError
from twinkle_torch.batch import Batch
from twinkle_torch.cache import gather_prefills, joinable, make_cache, select_rows
from twinkle_torch.gdn import gdn_kernels
from twinkle_torch.media import media_inputs
from twinkle_torch.mrope import RopeIndex
from twinkle_torch.routes import RouteRecorder
from twinkle_torch.rows import Job, PromptScores, Row

__all__ = ["Prefilled", "Prefiller", "admissible"]

#: Padded tokens one prefill forward takes (a longer prompt takes one forward of its own).
_PREFILL_CHUNK_TOKENS = 1024


def admissible(
    queue: list[Row],
    live: list[Row],
    adapter: str | None,
    *,
    state_tokens: int,
    max_batch_tokens: int,
    row_cap: int | None,
) -> list[Row]:
    """The waiting rows that may join the batch now: first come first served, same adapter, within budget.

    Args:
        queue: the waiting rows, in the order they came.
        live: the batch's unfinished rows.
        adapter: the batch's adapter (``None``: the batch is empty, the first row taken sets it).
        state_tokens: a row's recurrent state, in KV tokens of its memory.
        max_batch_tokens: the batch's budget.
        row_cap: after an out-of-memory error, the most rows a batch may hold.
    """
    rows = len(live)
    width = max((r.span for r in live), default=0) + state_tokens
    taken: list[Row] = []
    for row in queue:
        if adapter is None:
            adapter = row.job.control.adapter
        elif row.job.control.adapter != adapter:
            break  # it waits for the batch to drain; nothing behind it overtakes it
        cost_rows = 0 if row.score_only else 1
        new_width = max(width, row.span + state_tokens)
        if rows + cost_rows > 0 and (live or taken):
            if (rows + cost_rows) * new_width > max_batch_tokens:
                break
            if row_cap is not None and rows + cost_rows > row_cap:
                break
        taken.append(row)
        rows += cost_rows
        width = new_width
    return taken


@attrs.define(eq=False)
class Prefilled:
    """What one prefill gives the decode loop (filled as it goes: what it holds when the prefill raises stands).

    Attributes:
        batch: the rows that decode on, prefilled (their ``seen`` not built yet),
            or ``None`` when none does.
        ended: rows that end at their prefill (scoring rows, rows with no
            budget left): each finishes with ``"length"``.
        failed: runs that fail, each with its error (prompt scores that hold NaN).
        forwards: the prefill forwards run.
    """

    batch: Batch | None = None
    ended: list[Row] = attrs.Factory(list)
    failed: list[tuple[Job, BaseException]] = attrs.Factory(list)
    forwards: int = 0


@attrs.define(eq=False)
class _Plan:
    """How one admission's rows are prefilled: grouped by prompt, longest first, in chunks.

    Rows of one prompt with nothing generated share one prefill (a group,
    ``members[b]``); ``decoding[b]`` are the rows of it that decode on,
    ``counts[b]`` of them, placed from ``offsets[b]`` in the new batch.
    """

    members: list[list[Row]]
    lengths: list[int]
    scoring: list[bool]  # whether the group's prompt is scored (prompt log-probs)
    decoding: list[list[Row]]
    counts: list[int]
    order: list[int]  # the groups, longest prompt first
    chunks: list[list[int]]  # the groups of each prefill forward
    offsets: list[int]
    width: int
    total: int
    remaining: int  # the most tokens a decoding row may still generate
    ends: list[torch.Tensor]  # per group, the logits of its next token (filled by the prefill)
    deltas: list[int]  # per group, how far its positions run behind its length (multimodal rotary positions)

    @property
    def expand(self) -> bool:
        """Whether samples share their prompt's row (the new batch has more rows than prefills)."""
        return self.total != len(self.members)

    @classmethod
    def of(cls, rows: list[Row], gatherable: bool) -> _Plan:
        groups: dict[Any, list[Row]] = {}
        for row in rows:
            key = (id(row.job), row.prompt) if not row.tokens else id(row)
            groups.setdefault(key, []).append(row)
        members = list(groups.values())
        lengths = [len(g[0].ids) for g in members]
        scoring = [
            g[0].job.params.prompt_logprobs is not None and not g[0].tokens and g[0].prompt not in g[0].job.scores
            for g in members
        ]
        decoding = [[r for r in g if not r.score_only and r.limit > len(r.tokens)] for g in members]
        counts = [len(d) for d in decoding]
        # the batch's rows, longest prompt first: rows of similar length side by side keep the
        # attention's row blocks narrow (see twinkle_torch.attention.row_blocks)
        order = sorted(range(len(members)), key=lambda b: -lengths[b])
        chunks = _chunks([lengths[b] for b in order]) if gatherable else [list(range(len(members)))]
        chunks = [[order[i] for i in chunk] for chunk in chunks] if gatherable else chunks
        offsets = [0] * len(members)  # each prompt's first row in the batch
        at = 0
        for b in order:
            offsets[b], at = at, at + counts[b]
        return cls(
            members=members,
            lengths=lengths,
            scoring=scoring,
            decoding=decoding,
            counts=counts,
            order=order,
            chunks=chunks,
            offsets=offsets,
            width=max(lengths),
            total=sum(counts),
            remaining=max((r.limit - len(r.tokens) for d in decoding for r in d), default=0),
            ends=[torch.empty(0)] * len(members),
            deltas=[0] * len(members),
        )


def _chunks(lengths: list[int]) -> list[list[int]]:
    """Consecutive runs of ``lengths`` (sorted longest first) of at most ``_PREFILL_CHUNK_TOKENS`` padded tokens.

    A run's width is its first prompt's length; a prompt longer than the budget runs alone.
    """
    chunks: list[list[int]] = []
    for i in range(len(lengths)):
        if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= _PREFILL_CHUNK_TOKENS:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def _prompt_scores(logits: torch.Tensor, ids: torch.Tensor, top: int) -> PromptScores:
    """Raw log-probs of each prompt token given the ones before it (prompt tokens are not sampled)."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    chosen = logprobs.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1).tolist()
    out = PromptScores(logprobs=[None, *chosen])
    if top:
        values, idx = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
        out.top_logprobs = [None, *[list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]]
    return out


class Prefiller:
    """Prefills the rows admitted to the batch, into a cache sized for their whole generation.

    Args:
        model: the ``transformers`` causal LM.
        device: where it lives.
        pad_token_id: the id left padding uses (any valid id: it is masked).
        logits_to_keep: whether the model's forward takes ``logits_to_keep``.
        routes: the model's route recorder (``return_routed_experts``); ``None``: never recorded.
        gdn_sites: where its Gated DeltaNet layers call ``transformers``' kernels
            (:func:`twinkle_torch.gdn.kernel_sites`), which twinkle's replace in the forward.
    """

    def __init__(
        self,
        model: Any,
        *,
        device: torch.device,
        pad_token_id: int,
        logits_to_keep: bool,
        routes: RouteRecorder | None,
        gdn_sites: list[tuple[str, str]],
    ) -> None:
        self.model = model
        self.gdn_sites = gdn_sites
        self.device = device
        self.pad_token_id = pad_token_id
        self.logits_to_keep = logits_to_keep
        self.routes = routes
        self.dtype = next(model.parameters()).dtype
        self.rope_index = RopeIndex.of(model)  # a model that places image tokens on a grid
        # whether this model's caches are all preallocated layers: chunked prefills can be gathered
        self.gatherable = joinable(make_cache(model.config, 1))

    def __call__(self, rows: list[Row], out: Prefilled) -> None:
        """Prefill ``rows`` (rows of one prompt with nothing generated share one prefill) into ``out``.

        Prompts are prefilled longest first, in chunks of about
        ``_PREFILL_CHUNK_TOKENS`` padded tokens: prompts of similar length pad
        little (one left-padded batch of prompts of 25 to 122 tokens computes
        2.5x the tokens it needs), and a chunk's activations bound the
        prefill's peak memory. The chunks' caches are gathered into the
        batch's cache, sized for the whole generation. A model whose cache has
        layers of other kinds (sliding windows...) takes one prefill of every prompt.
        """
        out.batch = self._prefill(_Plan.of(rows, self.gatherable), out)

    def _prefill(self, plan: _Plan, out: Prefilled) -> Batch | None:
        width, remaining = plan.width, plan.remaining
        if len(plan.chunks) > 1 and plan.total:
            # each chunk's cache is copied into the batch's as soon as it is prefilled, then dropped
            parts = (self._chunk(plan, chunk, out) for chunk in plan.chunks)
            cache = gather_prefills(
                self.model.config, (p for p in parts if p[1].numel()), plan.total, width, width + remaining
            )
        else:  # one chunk, or prompts scored and none decoded
            cache, taken_t, placed_t = self._chunk(plan, plan.chunks[0], out)
            for chunk in plan.chunks[1:]:
                self._chunk(plan, chunk, out)
            if plan.total and (plan.expand or plan.chunks[0] != plan.order):  # samples share a row, or rows move
                select_rows(cache, taken_t[torch.argsort(placed_t)], width + remaining)
        for g, d in zip(plan.members, plan.decoding):
            out.ended.extend(row for row in g if row not in d)  # scoring rows, and rows with no budget left
        if not plan.total:
            return None
        device = self.device
        source = torch.tensor([b for b in plan.order for _ in range(plan.counts[b])], dtype=torch.long, device=device)
        lengths_t = torch.tensor(plan.lengths, dtype=torch.long, device=device)
        new_rows = [r for b in plan.order for r in plan.decoding[b]]
        mask = torch.zeros(plan.total, width + remaining, dtype=torch.bool, device=device)
        mask[:, :width] = torch.arange(width, device=device).unsqueeze(0) >= (width - lengths_t[source]).unsqueeze(1)
        logits_out = torch.stack(plan.ends)[source]
        next_pos = (lengths_t + torch.tensor(plan.deltas, dtype=torch.long, device=device))[source]
        return Batch(new_rows, cache, width, mask, next_pos, logits_out, None)

    def _chunk(self, plan: _Plan, chunk: list[int], out: Prefilled) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Prefill one chunk: its cache, its rows each decoding row takes, and where they go in the batch."""
        device = self.device
        members, lengths, counts = plan.members, plan.lengths, plan.counts
        # a lone chunk's cache becomes the batch's: sized for the generation unless samples expand it
        capacity = plan.width + plan.remaining if chunk == plan.order and plan.total and not plan.expand else 0
        ids = [members[b][0].ids for b in chunk]
        media = [members[b][0].media for b in chunk]
        record = any(r.routes is not None for b in chunk for r in members[b])
        scoring = any(plan.scoring[b] for b in chunk)
        cache, logits, routes, deltas = self._forward(ids, media, capacity, scoring, record, out)
        chunk_width = max(lengths[b] for b in chunk)
        for i, b in enumerate(chunk):
            plan.deltas[b] = int(deltas[i])
        for i, b in enumerate(chunk):  # each prompt's routes, past its left padding, for each of its rows
            for row in members[b]:
                if routes is not None and row.routes is not None:
                    row.routes = [routes[i, chunk_width - lengths[b] :]]
        ends = logits[:, -1].clone()  # not views: a chunk's logits of every position must not stay alive
        for i, b in enumerate(chunk):
            plan.ends[b] = ends[i]
            if plan.scoring[b]:
                job = members[b][0].job
                scores = _prompt_scores(
                    logits[i, chunk_width - lengths[b] :],
                    torch.tensor(ids[i], dtype=torch.long, device=device),
                    job.params.prompt_logprobs or 0,
                )
                if any(v is not None and math.isnan(v) for v in scores.logprobs):
                    # NaN logits: a call that only scores never reaches the decode step's check
                    out.failed.append((job, NumericalError.in_logits(job.control.adapter)))
                job.scores[members[b][0].prompt] = scores
        taken = [i for i, b in enumerate(chunk) for _ in range(counts[b])]  # chunk rows, once per sample
        placed = [plan.offsets[b] + j for b in chunk for j in range(counts[b])]  # where they go in the batch
        return cache, torch.tensor(taken, dtype=torch.long, device=device), torch.tensor(placed, device=device)

    def _forward(
        self,
        ids: list[list[int]],
        media: list[dict[str, Any] | None],
        capacity: int,
        scoring: bool,
        record: bool,
        out: Prefilled,
    ) -> tuple[Any, torch.Tensor, np.ndarray | None, list[int]]:
        """One left-padded prefill forward of ``ids`` into a fresh cache of at least ``capacity`` columns.

        ``media``: per row, its prompt's processed media inputs, passed to the forward
        (:func:`twinkle_torch.media.media_inputs`); for a model with multimodal
        rotary positions, they place the rows' tokens (:mod:`twinkle_torch.mrope`).

        Returns the cache, the logits (of every position when ``scoring``,
        prompt log-probs, else where the model allows of the last only),
        when ``record`` the routed experts ``[rows, width, layers, top_k]``,
        and per row how far its positions run behind its length.
        """
        device = self.device
        lengths = [len(x) for x in ids]
        width = max(lengths)
        padded = [[self.pad_token_id] * (width - len(x)) + x for x in ids]
        input_ids = torch.tensor(padded, dtype=torch.long, device=device)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        prompt_mask = (torch.arange(width, device=device).unsqueeze(0) >= (width - lengths_t).unsqueeze(1)).long()
        positions = (prompt_mask.cumsum(-1) - 1).clamp_(min=0)
        cache = make_cache(self.model.config, max(capacity, width))
        kwargs: dict[str, Any] = {}
        deltas = [0] * len(ids)
        if any(media):
            kwargs.update(media_inputs(media, lengths, width, device=device, dtype=self.dtype))
            placed = self.rope_index(input_ids, prompt_mask, kwargs) if self.rope_index is not None else None
            if placed is not None:
                positions, deltas = placed[0], placed[1].tolist()
        if self.logits_to_keep and not scoring:
            kwargs["logits_to_keep"] = 1
        recorder = self.routes if record else None
        if recorder is not None:
            recorder.arm()
        with gdn_kernels(self.gdn_sites):
            logits = self.model(
                input_ids=input_ids, attention_mask=prompt_mask, position_ids=positions, past_key_values=cache,
                use_cache=True, **kwargs,
            ).logits  # fmt: skip
        out.forwards += 1
        return cache, logits, recorder.take(len(ids)) if recorder is not None else None, deltas
