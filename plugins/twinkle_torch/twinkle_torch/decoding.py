"""The decode loop: batched prefill, a KV cache, and one forward per generated token.

:func:`plan_batches` groups the work of one ``sample()`` call into batches
bounded by a token budget. :class:`Decoder` runs them:

1. **Prefill** each prompt of the batch once, left-padded, with position ids
   counted from each prompt's first real token.
2. **Expand** the cache: each prompt's rows are repeated for its samples, so
   ``num_samples`` completions share one prefill.
3. **Decode**: one forward per step for all live rows, sampling vectorised
   over the batch (:mod:`twinkle_torch.sampling`). Finished rows are dropped
   from the batch (their cache rows pruned) once enough of them have
   finished, so they stop costing compute without a copy of the cache every
   time a single row ends.

On CUDA an out-of-memory error splits the batch in two and retries each half.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from twinkle_core.data_format import SamplingMask, SamplingParams
from twinkle_torch.cache import PreallocatedLayer, make_cache, select_rows
from twinkle_torch.sampling import RowRandomness, TokenSampler, derive_seed
from twinkle_torch.stopping import StopStringMatcher

__all__ = [
    "Decoder",
    "PromptScores",
    "RunControl",
    "SequenceResult",
    "WorkUnit",
    "plan_batches",
    "run_with_split",
    "split_batch",
]

#: A batch drops its finished rows once at least this share of it has finished.
_PRUNE_FRACTION = 1 / 8

OutOfMemoryError: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

TopList = list[list[tuple[int, float]]]


@attrs.frozen
class WorkUnit:
    """Samples ``first_sample .. first_sample + count - 1`` of prompt ``prompt_index``."""

    prompt_index: int
    first_sample: int
    count: int


@attrs.define
class SequenceResult:
    """One finished completion, before it becomes a ``SampledSequence``."""

    tokens: list[int]
    stop_reason: str
    stop: str | int | None = None
    text: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: TopList | None = None
    sampling_mask: SamplingMask | None = None


@attrs.define
class RunControl:
    """What a run may vary per prompt, and how it is stopped and streamed.

    Attributes:
        max_tokens: per prompt, the most tokens to generate.
        sample_base: per prompt, the sample index of its first completion (seeds use it).
        generated: per prompt, tokens generated before this run (seeded draws are keyed on the position).
        stopped: called between steps; ``True`` ends every unfinished row with ``"abort"``.
        on_finish: called with ``(prompt_index, sample_index, result)`` as each completion ends.
    """

    max_tokens: list[int]
    sample_base: list[int]
    generated: list[int]
    stopped: Callable[[], bool] = lambda: False
    on_finish: Callable[[int, int, SequenceResult], None] | None = None

    @classmethod
    def plain(cls, prompts: int, params: SamplingParams) -> RunControl:
        """Every prompt with ``params.max_tokens``, fresh sequences, no early stop."""
        return cls([params.max_tokens] * prompts, [0] * prompts, [0] * prompts)


@attrs.define
class PromptScores:
    """Prompt log-probs of one prompt (the first entry ``None``)."""

    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


def plan_batches(
    prompt_lengths: Sequence[int], num_samples: int, max_new_tokens: int, max_batch_tokens: int
) -> list[list[WorkUnit]]:
    """Group prompts (and their samples) into batches that fit the token budget.

    A batch's cost is its rows times its longest prompt plus ``max_new_tokens``:
    the size of its KV cache, in tokens. Prompts are taken longest first (so a
    batch that does not fit fails early) and a prompt whose samples alone
    exceed the budget is split into several units. Every batch holds at least
    one row, so a budget smaller than one sequence still makes progress.

    Returns:
        The batches; each unit appears in exactly one of them.
    """
    budget = max(1, int(max_batch_tokens))
    order = sorted(range(len(prompt_lengths)), key=lambda i: -prompt_lengths[i])
    batches: list[list[WorkUnit]] = []
    current: list[WorkUnit] = []
    rows = 0
    width = 0
    for i in order:
        span = prompt_lengths[i] + max_new_tokens
        first = 0
        while first < num_samples:
            new_width = max(width, span)
            room = budget // new_width - rows if current else max(1, budget // span)
            if room <= 0:
                batches.append(current)
                current, rows, width = [], 0, 0
                continue
            count = min(room, num_samples - first)
            current.append(WorkUnit(i, first, count))
            rows += count
            width = new_width
            first += count
    if current:
        batches.append(current)
    return batches


def split_batch(units: list[WorkUnit]) -> tuple[list[WorkUnit], list[WorkUnit]] | None:
    """Split a batch into two halves of about equal rows, or ``None`` if it is a single row."""
    rows = sum(u.count for u in units)
    if rows <= 1:
        return None
    if len(units) == 1:
        u = units[0]
        half = u.count // 2
        return [WorkUnit(u.prompt_index, u.first_sample, half)], [
            WorkUnit(u.prompt_index, u.first_sample + half, u.count - half)
        ]
    acc = 0
    for cut, u in enumerate(units):
        acc += u.count
        if acc * 2 >= rows:
            cut = max(1, min(cut + 1, len(units) - 1))
            return units[:cut], units[cut:]
    return units[:1], units[1:]  # pragma: no cover - the loop always returns


def run_with_split(
    units: list[WorkUnit],
    run: Callable[[list[WorkUnit]], dict[Any, Any]],
    *,
    is_oom: Callable[[BaseException], bool],
    on_oom: Callable[[], None] = lambda: None,
) -> dict[Any, Any]:
    """Run a batch; if it runs out of memory, split it in two and run each half (recursively).

    Raises:
        The out-of-memory error itself when a single row does not fit.
    """
    try:
        return run(units)
    except BaseException as exc:
        halves = split_batch(units) if is_oom(exc) else None
        if halves is None:
            raise
    on_oom()
    out = run_with_split(halves[0], run, is_oom=is_oom, on_oom=on_oom)
    out.update(run_with_split(halves[1], run, is_oom=is_oom, on_oom=on_oom))
    return out


def _is_cuda_oom(exc: BaseException) -> bool:
    return isinstance(exc, OutOfMemoryError)


def _empty_cuda_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Decoder:
    """Runs batches of prompts through a causal LM with a KV cache.

    Args:
        model: a ``transformers`` causal LM (adapters, if any, already selected).
        tokenizer: its tokenizer (for stop strings).
        device: where the model lives.
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
        pad_token_id: the id left padding uses (any valid id: it is masked).
        max_model_len: the context window; a row stops with ``"length"`` at it.
        logits_to_keep: whether the model's forward takes ``logits_to_keep``
            (then the prefill computes logits for the last position only).
        sdpa_masks: whether the model's attention takes SDPA boolean masks
            (``sdpa`` and ``twinkle_sdpa``); then decode steps pass their 4D
            mask directly instead of having ``transformers`` build one each step.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: torch.device,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        max_model_len: int,
        logits_to_keep: bool,
        sdpa_masks: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len
        self.logits_to_keep = logits_to_keep
        self.sdpa_masks = sdpa_masks

    # -- public -------------------------------------------------------------------------------
    def run(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        max_batch_tokens: int,
        control: RunControl | None = None,
    ) -> tuple[list[list[SequenceResult]], list[PromptScores | None]]:
        """Generate ``params.num_samples`` completions for every prompt.

        Args:
            prompts: token ids.
            params: the sampling parameters.
            max_batch_tokens: the KV-cache budget of one batch.
            control: per-prompt budgets and seed positions, an early stop and
                a callback for each finished completion (see :class:`RunControl`).

        Returns:
            Per prompt, its completions in sample order, and its prompt scores
            (``None`` unless ``params.prompt_logprobs`` is set).
        """
        control = control if control is not None else RunControl.plain(len(prompts), params)
        n = params.num_samples
        lengths = [len(p) for p in prompts]
        max_new = (
            max(
                (min(budget, self.max_model_len - length) for budget, length in zip(control.max_tokens, lengths)),
                default=0,
            )
            if params.max_tokens
            else 0
        )
        if max_new == 0 and params.prompt_logprobs is None:
            batches: list[list[WorkUnit]] = []  # nothing to generate, nothing to score
        else:
            batches = plan_batches(lengths, 1 if max_new == 0 else n, max_new, max_batch_tokens)
        results: dict[Any, Any] = {}
        for units in batches:
            results.update(
                run_with_split(
                    units,
                    lambda u: self._run_batch(u, prompts, params, control),
                    is_oom=_is_cuda_oom,
                    on_oom=_empty_cuda_cache,
                )
            )
        sequences: list[list[SequenceResult]] = []
        scores: list[PromptScores | None] = []
        for i in range(len(prompts)):
            scores.append(results.get(("prompt", i)))
            if max_new == 0:  # scoring only: each sample is an empty completion
                empty: dict[str, Any] = {
                    "logprobs": [] if params.logprobs is not None else None,
                    "top_logprobs": [] if params.logprobs else None,
                }
                if params.return_sampling_mask:
                    empty["sampling_mask"] = SamplingMask(offsets=[0], token_ids=[])
                sequences.append([SequenceResult(tokens=[], stop_reason="length", text="", **empty) for _ in range(n)])
            else:
                sequences.append([results[(i, s)] for s in range(n)])
        return sequences, scores

    # -- one batch ----------------------------------------------------------------------------
    def _forward(self, **kwargs: Any) -> torch.Tensor:
        out = self.model(use_cache=True, **kwargs)
        logits: torch.Tensor = out.logits
        return logits

    def _run_batch(
        self, units: list[WorkUnit], prompts: list[list[int]], params: SamplingParams, control: RunControl
    ) -> dict[Any, Any]:
        device = self.device
        lengths = [len(prompts[u.prompt_index]) for u in units]
        width = max(lengths)
        batch = len(units)
        padded = [[self.pad_token_id] * (width - len(prompts[u.prompt_index])) + prompts[u.prompt_index] for u in units]
        input_ids = torch.tensor(padded, dtype=torch.long, device=device)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        # 1 on real tokens: the last `length` columns of each row
        columns = torch.arange(width, device=device)
        prompt_mask = (columns.unsqueeze(0) >= (width - lengths_t).unsqueeze(1)).long()
        positions = (prompt_mask.cumsum(-1) - 1).clamp_(min=0)

        budgets = [control.max_tokens[u.prompt_index] for u in units]
        max_new = max(min(b, self.max_model_len - n) for b, n in zip(budgets, lengths)) if params.max_tokens else 0
        counts = [u.count for u in units]
        rows = sum(counts)
        expand = max_new > 0 and rows != batch
        cache = make_cache(self.model.config, width if expand else width + max(max_new, 1))

        want_prompt = params.prompt_logprobs is not None
        kwargs: dict[str, Any] = {}
        if self.logits_to_keep and not want_prompt:
            kwargs["logits_to_keep"] = 1
        logits = self._forward(
            input_ids=input_ids, attention_mask=prompt_mask, position_ids=positions, past_key_values=cache, **kwargs
        )
        results: dict[Any, Any] = {}
        if want_prompt:
            for b, u in enumerate(units):
                if u.first_sample == 0:
                    results[("prompt", u.prompt_index)] = self._prompt_scores(
                        logits[b, width - lengths[b] :], input_ids[b, width - lengths[b] :], params.prompt_logprobs or 0
                    )
        if max_new == 0:
            return results
        last = logits[:, -1, :]
        del logits

        # one row per sample from here on
        source = torch.repeat_interleave(torch.arange(batch, device=device), torch.tensor(counts, device=device))
        if expand:
            select_rows(cache, source, width + max_new)
            last = last[source]
        row_prompt = [u.prompt_index for u in units for _ in range(u.count)]
        row_sample = [u.first_sample + j for u in units for j in range(u.count)]
        row_length = [lengths[b] for b, u in enumerate(units) for _ in range(u.count)]
        limits = [
            min(control.max_tokens[u.prompt_index], self.max_model_len - lengths[b])
            for b, u in enumerate(units)
            for _ in range(u.count)
        ]
        return results | self._decode(
            cache,
            last,
            prompt_mask[source],
            input_ids[source],
            row_prompt,
            row_sample,
            row_length,
            limits,
            max_new,
            params,
            control,
        )

    def _prompt_scores(self, logits: torch.Tensor, ids: torch.Tensor, top: int) -> PromptScores:
        """Raw log-probs of each prompt token given the ones before it (prompt tokens are not sampled)."""
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        chosen = logprobs.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1).tolist()
        out = PromptScores(logprobs=[None, *chosen])
        if top:
            values, idx = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
            out.top_logprobs = [None, *[list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]]
        return out

    def _decode(
        self,
        cache: Any,
        logits: torch.Tensor,
        prompt_mask: torch.Tensor,
        prompt_ids: torch.Tensor,
        row_prompt: list[int],
        row_sample: list[int],
        row_length: list[int],
        limits: list[int],
        max_new: int,
        params: SamplingParams,
        control: RunControl,
    ) -> dict[Any, Any]:
        device = self.device
        rows = len(row_prompt)
        width = prompt_mask.shape[1]
        sampler = TokenSampler(params)
        randomness = None
        if sampler.needs_uniforms:
            samples = [control.sample_base[p] + s for p, s in zip(row_prompt, row_sample)]
            seeds = [None if params.seed is None else derive_seed(params.seed, s) for s in samples]
            randomness = RowRandomness(seeds, [control.generated[p] for p in row_prompt])
        seen = None
        if sampler.needs_seen:
            counts = torch.zeros(rows, logits.shape[-1], dtype=torch.int32, device=device)
            counts.scatter_add_(1, prompt_ids, prompt_mask.int())
            seen = counts > 0
            del counts
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.eos_token_ids)
        stop_ids_t = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device) if stop_ids else None
        matcher = StopStringMatcher(self.tokenizer, params.stop, rows) if params.stop else None

        # every row generates in lockstep, so the mask's generated columns are all ones
        mask = torch.ones(rows, width + max_new, dtype=torch.bool, device=device)
        mask[:, :width] = prompt_mask.bool()
        # A plain-attention model under (twinkle_)sdpa takes the decode step's mask as it is:
        # the query may see every unpadded cached position. Others get the 2D mask.
        mask_4d = self.sdpa_masks and all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
        if not mask_4d:
            mask = mask.long()
        next_pos = torch.tensor(row_length, dtype=torch.long, device=device)
        live = torch.arange(rows, device=device)  # original row of each current row
        live_list = list(range(rows))
        limit_list = list(limits)
        alive = [True] * rows  # per current row: still generating (finished rows linger until pruned)
        pruned = False

        out_tokens = torch.zeros(rows, max_new, dtype=torch.long, device=device)
        out_lp = torch.zeros(rows, max_new, device=device) if params.logprobs is not None else None
        top_n = params.logprobs or 0
        out_top_ids = torch.zeros(rows, max_new, top_n, dtype=torch.long, device=device) if top_n else None
        out_top_lp = torch.zeros(rows, max_new, top_n, device=device) if top_n else None
        forward_kwargs: dict[str, Any] = {"logits_to_keep": 1} if self.logits_to_keep else {}
        # per original row, the kept ids of each step ([]: the whole vocabulary)
        kept_rows: list[list[list[int]]] | None = [[] for _ in range(rows)] if params.return_sampling_mask else None

        finished: dict[int, tuple[int, str, str | int | None]] = {}  # original row -> (length, reason, stop)
        stop_text_end: dict[int, int] = {}
        step = 0

        def report(rows_done: list[int]) -> None:
            """Hand finished rows to the control's callback as they end (their tokens come to the host)."""
            if control.on_finish is None or not rows_done:
                return
            for row in rows_done:
                control.on_finish(
                    row_prompt[row],
                    row_sample[row],
                    self._row_result(
                        row,
                        finished[row],
                        out_tokens,
                        out_lp,
                        out_top_ids,
                        out_top_lp,
                        matcher,
                        stop_text_end,
                        kept_rows,
                    ),
                )

        while True:
            if control.stopped():
                # stop early: every unfinished row ends here with what it has
                rows_stopped = [live_list[j] for j, a in enumerate(alive) if a]
                for row in rows_stopped:
                    finished[row] = (step, "abort", None)
                report(rows_stopped)
                break
            if randomness is not None:
                result = sampler(logits, seen, randomness.uniforms(device), randomness.redraw)
            else:
                result = sampler(logits, seen)
            tokens = result.tokens
            where: Any = live if pruned else slice(None)
            out_tokens[where, step] = tokens
            if out_lp is not None and result.logprobs is not None:
                out_lp[where, step] = result.logprobs
            if (
                out_top_ids is not None
                and out_top_lp is not None
                and result.top_ids is not None
                and result.top_logprobs is not None
            ):
                out_top_ids[where, step] = result.top_ids
                out_top_lp[where, step] = result.top_logprobs
            if kept_rows is not None:
                for j, row in enumerate(live_list):
                    kept_rows[row].append(result.kept[j] if result.kept is not None else [])
            if seen is not None:
                seen.scatter_(1, tokens.unsqueeze(1), True)

            # Which rows end here. Only stop tokens and stop strings need the tokens on the host.
            ended = [j for j, a in enumerate(alive) if a and limit_list[j] == step + 1]
            for j in ended:
                finished[live_list[j]] = (step + 1, "length", None)
            token_list: list[int] | None = None
            if stop_ids_t is not None:
                hits = torch.isin(tokens, stop_ids_t).nonzero().flatten().tolist()
                if hits or matcher is not None:
                    token_list = tokens.tolist()
                for j in hits:
                    if alive[j]:
                        assert token_list is not None
                        finished[live_list[j]] = (step + 1, "stop", token_list[j])
                        ended.append(j)
            if matcher is not None:
                if token_list is None:
                    token_list = tokens.tolist()
                for j, row in enumerate(live_list):
                    if not alive[j]:
                        continue
                    hit = matcher.push(row, token_list[j])
                    if hit is None:
                        continue
                    previous = finished.get(row)
                    if previous is None or previous[1] == "length":
                        # a stop string completed by the last allowed token still counts as a stop
                        finished[row] = (step + 1, "stop", hit[0])
                        stop_text_end[row] = hit[1]
                        ended.append(j)
            for j in ended:
                alive[j] = False
            report(sorted({live_list[j] for j in ended}))
            n_alive = sum(alive)
            if n_alive == 0:
                break
            step += 1
            tokens_in = tokens
            n_dead = len(alive) - n_alive
            if n_dead and n_dead >= max(1.0, len(alive) * _PRUNE_FRACTION):
                keep_list = [j for j, a in enumerate(alive) if a]
                keep = torch.tensor(keep_list, dtype=torch.long, device=device)
                select_rows(cache, keep)
                mask, next_pos, live, tokens_in = mask[keep], next_pos[keep], live[keep], tokens[keep]
                if seen is not None:
                    seen = seen[keep]
                if randomness is not None:
                    randomness.select(keep_list)
                live_list = [live_list[j] for j in keep_list]
                limit_list = [limit_list[j] for j in keep_list]
                alive = [True] * len(keep_list)
                pruned = True
            step_mask = mask[:, None, None, : width + step] if mask_4d else mask[:, : width + step]
            logits = self._forward(
                input_ids=tokens_in.unsqueeze(1),
                attention_mask=step_mask,
                position_ids=(next_pos + (step - 1)).unsqueeze(1),
                past_key_values=cache,
                **forward_kwargs,
            )[:, -1, :]

        del cache
        results: dict[Any, Any] = {}
        for row in range(rows):
            results[(row_prompt[row], row_sample[row])] = self._row_result(
                row, finished[row], out_tokens, out_lp, out_top_ids, out_top_lp, matcher, stop_text_end, kept_rows
            )
        return results

    @staticmethod
    def _row_result(
        row: int,
        end: tuple[int, str, str | int | None],
        out_tokens: torch.Tensor,
        out_lp: torch.Tensor | None,
        out_top_ids: torch.Tensor | None,
        out_top_lp: torch.Tensor | None,
        matcher: StopStringMatcher | None,
        stop_text_end: dict[int, int],
        kept_rows: list[list[list[int]]] | None = None,
    ) -> SequenceResult:
        """One row's completion, from the step buffers (indexed by the row's original place)."""
        length, reason, stop = end
        toks = out_tokens[row, :length].tolist()
        seq = SequenceResult(tokens=toks, stop_reason=reason, stop=stop)
        if out_lp is not None:
            seq.logprobs = out_lp[row, :length].tolist()
        if kept_rows is not None:
            seq.sampling_mask = SamplingMask.from_rows(kept_rows[row][:length])
        if out_top_ids is not None and out_top_lp is not None:
            seq.top_logprobs = [
                list(zip(ids, lps))
                for ids, lps in zip(out_top_ids[row, :length].tolist(), out_top_lp[row, :length].tolist())
            ]
        if row in stop_text_end:
            assert matcher is not None and isinstance(stop, str)
            seq.text = matcher.final_text(toks, stop, stop_text_end[row], row)
        return seq
