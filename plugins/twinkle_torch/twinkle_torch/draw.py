"""The draw: the next token of every live row of the batch, and the rows that end with it.

One :class:`~twinkle_torch.sampling.TokenSampler` per group of rows that
share sampling parameters draws for the whole group at once
(:mod:`twinkle_torch.sampling`); each row keeps its own stop tokens, stop
strings, grammar, log-probs and sampling mask, and a seeded row its own random
stream (:mod:`twinkle_torch.randomness`), so what a row generates does not
depend on what else is in the batch. The draw calls nothing back: it fills
a :class:`Drawn`, the rows that end here and the runs that fail, for the
decode loop to report (what it holds when the draw raises stands too).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import torch

from twinkle_core.errors import InvalidSamplingParams
from twinkle_torch.batch import Batch
from twinkle_torch.constraints import LogitConstraints
from twinkle_torch.randomness import RowRandomness
from twinkle_torch.rows import Job, Row
from twinkle_torch.sampling import StepResult, TokenSampler, Workspace

__all__ = ["Drawn", "Ending", "Samplers", "draw", "non_finite"]

Ending = tuple[Row, str, str | int | None]


class Samplers:
    """The token sampler of each group of runs with equal parameters, built on first use.

    Args:
        tokenizer: the tokenizer of bad words (setting another drops the samplers built with this one).
        vocab_size: the width of the logits (token constraints are checked against it).
        eos_token_ids: the end-of-sequence ids (``min_tokens`` holds them back).
        native: whether a sampler may use :mod:`twinkle_torch.native`'s kernels.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Sequence[int], native: bool) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.native = native
        self._samplers: dict[Hashable, TokenSampler] = {}

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._samplers = {}  # their bad words were tokenized by the old one

    def _min_tokens_ids(self, job: Job) -> list[int]:
        """What ``min_tokens`` holds back: the end-of-sequence ids (even with ``ignore_eos``) and the stop ids."""
        return sorted(set(self.eos_token_ids) | set(job.params.stop_token_ids))

    def of(self, job: Job) -> TokenSampler:
        """The sampler of ``job``'s parameters (bad constraints raise here)."""
        sampler = self._samplers.get(job.group)
        if sampler is None:
            if len(self._samplers) > 256:  # parameters of runs long gone
                self._samplers.clear()
            constraints = LogitConstraints.of(job.params, self._min_tokens_ids(job), self.tokenizer, self.vocab_size)
            params = job.params
            if params.top_k >= self.vocab_size:  # keeps every token: no top-k (and no sort), as vLLM reads it
                params = params.replace(top_k=-1)
            sampler = self._samplers[job.group] = TokenSampler(params, constraints, native=self.native)
        return sampler


@attrs.define(eq=False)
class Drawn:
    """What one draw gives the decode loop.

    Attributes:
        ended: the rows that end with the token just drawn: ``(row, stop_reason, stop)``.
        failed: runs that fail, each with its error (parameters that leave nothing to draw).
    """

    ended: list[Ending] = attrs.Factory(list)
    failed: list[tuple[Job, BaseException]] = attrs.Factory(list)


def non_finite(batch: Batch) -> list[Job]:
    """The runs whose live rows' logits hold NaN or +inf (or only -inf): nothing can be drawn from them.

    Weights that passed every check can still overflow in the forward; a
    row of NaN would draw token 0 greedily, or break the draw. One
    reduction over the logits (a few ms a step at 256 rows).
    """
    assert batch.logits is not None
    finite = torch.isfinite(batch.logits.amax(dim=-1)).tolist()
    bad = [row for row, ok in zip(batch.rows, finite) if not ok and not row.done]
    return list({id(r.job): r.job for r in bad}.values())


def draw(
    batch: Batch, samplers: Samplers, workspace: Workspace, out: Drawn, *, pad_token_id: int, device: torch.device
) -> None:
    """Draw the next token of every live row and record it on the row; the batch's logits become its inputs.

    The rows that end and the runs that fail go to ``out``.
    """
    assert batch.logits is not None
    groups: dict[Hashable, list[int]] = {}
    for i, row in enumerate(batch.rows):
        if not row.done:
            groups.setdefault(row.job.group, []).append(i)
    tokens_in = torch.full((len(batch.rows),), pad_token_id, dtype=torch.long, device=device)
    for members in groups.values():
        rows = [batch.rows[i] for i in members]
        job = rows[0].job
        sampler = samplers.of(job)
        idx = torch.tensor(members, dtype=torch.long, device=device)
        # a run of consecutive rows (one run's batch: the usual case) is a view, not a copy:
        # [256, 49152] float32 logits gathered into a fresh tensor cost 22 ms a step here
        # (mostly page faults), a tenth of the sampler's own time
        contiguous = members[-1] - members[0] == len(members) - 1
        logits = batch.logits[members[0] : members[-1] + 1] if contiguous else batch.logits[idx]
        seen = batch.seen[idx] if sampler.needs_seen and batch.seen is not None else None
        outputs = [r.output for r in rows] if sampler.needs_outputs else None
        matchers = None
        try:
            constraints = sampler.constraints
            if constraints is not None and constraints.structured is not None:
                for r, done in zip(rows, outputs or []):
                    if r.grammar is None:
                        r.grammar = constraints.new_matcher(done[: len(done) - len(r.tokens)])
                matchers = [r.grammar for r in rows]
            if sampler.needs_uniforms:
                randomness = RowRandomness([r.seed for r in rows], [r.position0 + len(r.tokens) for r in rows])
                uniforms = randomness.uniforms(device)
                result = sampler(logits, seen, uniforms, randomness.redraw, outputs, matchers, workspace)
            else:
                result = sampler(logits, seen, outputs=outputs, matchers=matchers, workspace=workspace)
        except InvalidSamplingParams as exc:  # these parameters leave nothing to draw: their runs fail alone
            # every run with rows here: a row left without its token this step cannot go on
            out.failed.extend((failed, exc) for failed in {id(r.job): r.job for r in rows}.values())
            continue
        tokens_in[idx] = result.tokens
        _record(rows, job, result, out.ended)
    if batch.seen is not None:
        batch.seen.scatter_(1, tokens_in.unsqueeze(1), True)
    batch.logits, batch.inputs = None, tokens_in


def _record(rows: list[Row], job: Job, result: StepResult, ended: list[Ending]) -> None:
    """Append each row's token (and its log-probs and kept set); the rows it ends go to ``ended``."""
    token_list = result.tokens.tolist()
    lp_list = result.logprobs.tolist() if result.logprobs is not None else None
    top_ids = result.top_ids.tolist() if result.top_ids is not None else None
    top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    for j, row in enumerate(rows):
        token = token_list[j]
        row.tokens.append(token)
        if row.logprobs is not None and lp_list is not None:
            row.logprobs.append(lp_list[j])
        if row.top is not None and top_ids is not None and top_lp is not None:
            row.top.append(list(zip(top_ids[j], top_lp[j])))
        if row.kept is not None:
            row.kept.append(result.kept[j] if result.kept is not None else [])
        end: tuple[str, str | int | None] | None = None
        if len(row.tokens) >= row.limit:
            end = ("length", None)
        if token in job.stop_ids:
            end = ("stop", token)
        if row.grammar is not None:
            row.grammar.accept_token(token)
            if row.grammar.is_terminated():  # complete, and it took a stop token: nothing may follow
                end = ("stop", token)
        if row.matcher is not None:
            hit = row.matcher.push(0, token)
            if hit is not None and row.position0 + len(row.tokens) <= job.params.min_tokens:
                hit = None  # stop strings count from min_tokens on (vLLM's rule)
            # a stop string completed by the last allowed token still counts as a stop
            if hit is not None and (end is None or end[0] == "length"):
                end = ("stop", hit[0])
        if end is not None:
            ended.append((row, *end))
