"""The decode loop: continuous batching over one KV cache, one forward per generated token.

Every ``sample()`` (every engine run) hands its rows (one per prompt and
sample) to the :class:`Decoder`, and one decode loop serves them all, in a
thread the decoder starts when work arrives and that ends when none is left.
Between two steps the loop:

1. **Stops** the rows of runs whose ``stopped()`` is set: each ends with
   ``"abort"`` and the tokens it has.
2. **Admits** waiting rows, first come first served, while the batch fits the
   token budget (``rows x (longest (prompt + max_tokens) + state)`` within
   ``max_batch_tokens``, where a hybrid model's per-row linear-attention state
   counts as the KV tokens of its size, :mod:`twinkle_torch.state`; an empty
   batch always takes one row; :mod:`twinkle_torch.admission`). Admitted rows
   are **prefilled** together, left-padded, one prefill per prompt shared by
   its samples, and their cache rows are **joined** to the running cache,
   right-aligned (the shorter side is padded on the left, and masked): a
   request arriving while others decode joins them at the next step
   (:mod:`twinkle_torch.batch`).
3. **Samples** one token per live row, vectorised over the rows that share
   sampling parameters (:mod:`twinkle_torch.draw`); each row keeps its
   own stop tokens, stop strings, repetition-penalty history, log-probs and
   sampling mask, and a seeded row its own random stream (keyed on its seed
   and position), so what a row generates does not depend on what else is in
   the batch.
4. **Reports** the rows that finished, through their run's callback, as they
   finish, and drops them from the batch (their cache rows pruned, and the
   leading columns no remaining row attends to trimmed) once enough have
   finished or when new rows join.
5. **Forwards** the live rows once.

The prefill and the draw call nothing back: each returns the rows that end
and the runs that fail, and this loop reports them (it alone finishes rows
and fails runs). The rows and runs themselves are :mod:`twinkle_torch.rows`;
what ties the loop's thread to the process is :mod:`twinkle_torch.process`.

PEFT activates one adapter for the whole model, so a batch holds rows of one
adapter: rows of another wait until the batch drains (the queue stays first
come first served, so neither side starves). The sampler's lock guarantees
no weight or adapter change happens while any run has rows here.

On CUDA an out-of-memory error in a prefill puts its rows back in the queue
and halves the rows a batch may hold; in a decode step, the newest half of the
batch goes back to the queue (those rows are prefilled again with what they
generated, and continue where they were). A single row that does not fit fails its run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from twinkle_core.data_format import SamplingMask, SamplingParams
from twinkle_core.errors import NumericalError, SamplerClosedError
from twinkle_torch.admission import Prefilled, Prefiller, admissible
from twinkle_torch.batch import Batch, seen_of
from twinkle_torch.cache import joinable, rewindable
from twinkle_torch.draw import Drawn, Ending, Samplers, draw, non_finite
from twinkle_torch.gdn import gdn_kernels, kernel_sites
from twinkle_torch.openmp import release_idle_workers
from twinkle_torch.process import (
    close_at_exit,
    empty_cuda_cache,
    give_back_freed_memory,
    is_cuda_oom,
    name_this_thread,
)
from twinkle_torch.randomness import derive_seed
from twinkle_torch.routes import RouteRecorder
from twinkle_torch.rows import Job, PromptScores, Row, RunControl, SequenceResult
from twinkle_torch.sampling import Workspace
from twinkle_torch.state import state_tokens_per_row
from twinkle_torch.stopping import StopStringMatcher

__all__ = ["Decoder", "DecoderStats"]

#: A batch drops its finished rows once at least this share of it has finished.
_PRUNE_FRACTION = 1 / 8
#: How long closing waits for the decode loop to end (it checks between steps, so about one step).
_JOIN_TIMEOUT_S = 120.0


@attrs.define
class DecoderStats:
    """Counters of the decode loop, for tests and benchmarks (they only grow).

    Attributes:
        prefills: prefill forwards.
        steps: decode forwards (one per generated token of the whole batch).
        peak_rows: the most live rows one decode forward has carried.
        joined_rows: rows admitted while other rows were decoding (continuous batching at work).
        out_of_memory: out-of-memory errors recovered from by shrinking the batch.
    """

    prefills: int = 0
    steps: int = 0
    peak_rows: int = 0
    joined_rows: int = 0
    out_of_memory: int = 0


class Decoder:
    """Runs the rows of every concurrent run through a causal LM, in one continuous batch.

    Args:
        model: a ``transformers`` causal LM (adapters are selected per batch by ``RunControl.activate``).
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
        max_batch_tokens: the KV-cache budget of the batch, in tokens:
            rows x the longest (prompt + max_tokens) among them, plus, for a
            hybrid model, each row's recurrent state in tokens of the same memory.
        vocab_size: the width of the logits (token constraints are checked against it).
        native_kernels: whether the sampler may use :mod:`twinkle_torch.native`'s
            kernels (the engine's choice; see its ``attention_kernel``).
        routes: the model's route recorder (``return_routed_experts``); ``None``: never recorded.
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
        max_batch_tokens: int = 65536,
        vocab_size: int | None = None,
        native_kernels: bool = False,
        routes: RouteRecorder | None = None,
    ) -> None:
        self.model = model
        self.routes = routes
        self.vocab_size = vocab_size if vocab_size is not None else int(model.config.vocab_size)
        self.device = device
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len
        self.logits_to_keep = logits_to_keep
        self.sdpa_masks = sdpa_masks
        # a hybrid model's per-row linear-attention state, charged to the budget as KV tokens of its size
        self.state_tokens = state_tokens_per_row(model.config, next(model.parameters()).dtype)
        #: where the model's Gated DeltaNet layers call ``transformers``' kernels, which twinkle's replace
        #: in its forwards (:mod:`twinkle_torch.gdn`)
        self.gdn_sites = kernel_sites(model)
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        self.stats = DecoderStats()
        self._prefill = Prefiller(
            model, device=device, pad_token_id=pad_token_id, logits_to_keep=logits_to_keep, routes=routes,
            gdn_sites=self.gdn_sites,
        )  # fmt: skip
        self._cond = threading.Condition()
        self._queue: list[Row] = []  # waiting rows, first come first served
        self._jobs: list[Job] = []  # runs with rows queued or in the batch
        self._looping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # Decode-loop state, touched by the loop's thread only.
        self._batch: Batch | None = None
        self._adapter: str | None = None
        self._row_cap: int | None = None  # after an out-of-memory error: the most rows a batch may hold
        self._samplers = Samplers(
            tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids, native=native_kernels
        )
        self._workspace = Workspace()  # the sampler's [rows, vocab] buffers, while a batch runs

    # -- public -------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The tokenizer of stop strings and bad words (set when the template changes)."""
        return self._samplers.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self._samplers.tokenizer = tokenizer

    @property
    def native_kernels(self) -> bool:
        """Whether the samplers built from now on may use :mod:`twinkle_torch.native`'s kernels."""
        return self._samplers.native

    @native_kernels.setter
    def native_kernels(self, native: bool) -> None:
        self._samplers.native = native

    def run(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        control: RunControl | None = None,
        media: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[PromptScores | None]:
        """Generate ``params.num_samples`` completions for every prompt (blocks until they are done).

        The rows join the decode loop with whatever else is running; each
        completion goes to ``control.on_finish`` as it ends (a scoring-only run,
        ``max_tokens=0``, has none: its samples are empty).

        Args:
            prompts: token ids.
            params: the sampling parameters.
            control: per-prompt budgets and seed positions, an early stop, a
                callback for each finished completion and the adapter (see :class:`RunControl`).
            media: per prompt, its processed media inputs (``InputFeature.multimodal``), read
                by its prefill (:mod:`twinkle_torch.media`); ``None``: text only.

        Returns:
            Per prompt, its prompt scores (``None`` unless ``params.prompt_logprobs`` is set).

        Raises:
            Whatever the model raised for this run's rows.
        """
        control = control if control is not None else RunControl.plain(len(prompts), params)
        job = Job(prompts, params, control, self.eos_token_ids, media)
        if params.max_tokens > 0:
            self._samplers.of(job)  # bad constraints (a bad word that cannot be tokenized) fail here, before any work
        n = params.num_samples
        generating = params.max_tokens > 0
        rows: list[Row] = []
        for p, ids in enumerate(prompts):
            if not generating:
                if params.prompt_logprobs is not None:
                    rows.append(Row(job, p, 0, 0, None, 0, score_only=True))
                continue
            limit = max(0, min(control.max_tokens[p], self.max_model_len - len(ids)))
            for s in range(n):
                index = control.sample_base[p] + s
                seed = None if params.seed is None else derive_seed(params.seed, index)
                row = Row(job, p, s, limit, seed, control.generated[p])
                if params.logprobs is not None:
                    row.logprobs = []
                    row.top = [] if params.logprobs else None
                if params.return_sampling_mask:
                    row.kept = []
                if params.return_routed_experts:
                    row.routes = []
                if params.stop:
                    row.matcher = StopStringMatcher(
                        self.tokenizer, params.stop, 1, skip_special_tokens=params.skip_special_tokens
                    )
                rows.append(row)
        if rows:
            job.pending = len(rows)
            if threading.current_thread() is not self._thread:
                release_idle_workers()  # this thread waits now: its idle OpenMP pool would slow the loop's
            with self._cond:
                if self._closed:
                    raise SamplerClosedError("The torch engine is closed: its decode loop takes no new runs.")
                self._queue.extend(rows)
                self._jobs.append(job)
                if not self._looping:
                    self._looping = True
                    close_at_exit(self)
                    self._thread = threading.Thread(target=self._loop, name="twinkle-torch-decode", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
            try:
                job.done.wait()
            except BaseException:  # the caller was interrupted (Ctrl-C): its rows must not outlive the call
                job.interrupted = True  # the loop ends them at its next step (_stop_requested)
                job.done.wait(_JOIN_TIMEOUT_S)  # so that nothing runs for this call once run() is left
                raise
            if job.error is not None:
                raise job.error
        return [job.scores.get(p) for p in range(len(prompts))]

    def close(self) -> None:
        """Refuse new runs, end the loop (runs in flight fail) and wait for its thread to finish.

        Waiting matters: the loop frees the batch (its KV cache) after its last
        run returns, and a process that exits while that thread is still inside
        a tensor's destructor aborts. Called from the loop's own thread (a
        finish callback), it does not wait.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT_S)

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        name_this_thread(b"twinkle-decode")
        with torch.inference_mode():
            while True:
                with self._cond:
                    if self._closed or (not self._queue and self._batch is None):
                        self._looping = False
                        self._batch = None
                        self._workspace.clear()
                        give_back_freed_memory()
                        self._row_cap = None  # an out-of-memory limit lasts while its work does
                        if self._closed:
                            error = SamplerClosedError("The torch engine was closed while this run was in flight.")
                            for job in list(self._jobs):
                                self._fail_locked(job, error)
                        return
                try:
                    self._step()
                except BaseException as exc:  # a failed step fails its runs, never the loop
                    self._fail_batch(exc)
                    self._fail_stranded(exc)

    def _step(self) -> None:
        self._stop_requested()
        self._admit()
        batch = self._batch
        if batch is None:
            return
        ended = self._sample(batch)
        ending = {id(row) for row, _, _ in ended}
        if all(row.done or id(row) in ending for row in batch.rows):
            # The batch ends here: its cache is freed before its last rows are reported, so a
            # caller whose run returns sees the memory back (not a moment later, from this thread).
            self._batch = None
            batch.cache = batch.logits = batch.inputs = batch.seen = None
            self._workspace.clear()
            give_back_freed_memory()
        for row, reason, stop in ended:
            self._finish(row, reason, stop)
        live = batch.live()
        if self._batch is None or not live:
            self._batch = None
            return
        dead = len(batch.rows) - len(live)
        if dead and dead >= max(1.0, len(batch.rows) * _PRUNE_FRACTION):
            batch.prune()
        self._forward(batch)

    # -- stopping and finishing ---------------------------------------------------------------
    def _stop_requested(self) -> None:
        """End every unfinished row of each run whose ``stopped()`` is set, with ``"abort"``."""
        with self._cond:
            jobs = [job for job in self._jobs if job.interrupted or job.control.stopped()]
            if not jobs:
                return
            stopping = set(map(id, jobs))
            queued = [r for r in self._queue if id(r.job) in stopping]
            self._queue = [r for r in self._queue if id(r.job) not in stopping]
        in_batch = [r for r in (self._batch.rows if self._batch else []) if id(r.job) in stopping and not r.done]
        for row in queued + in_batch:
            self._finish(row, "abort", None)

    def _finish(self, row: Row, reason: str, stop: str | int | None) -> None:
        """Hand a finished row to its run (as it ends) and complete the run after its last row."""
        row.done = True
        job = row.job
        if not row.score_only and job.error is None:
            result = SequenceResult(tokens=list(row.tokens), stop_reason=reason, stop=stop)
            result.logprobs = row.logprobs
            result.top_logprobs = row.top
            if row.kept is not None:
                result.sampling_mask = SamplingMask.from_rows(row.kept)
            if row.routes is not None and self.routes is not None:
                result.routed_experts = row.routed_experts(self.routes)
            if job.control.on_finish is not None:
                try:
                    job.control.on_finish(row.prompt, row.sample, result)
                except BaseException as exc:  # the caller's callback failed: its run fails
                    self._fail(job, exc)
                    return
        with self._cond:
            job.pending -= 1
            if job.pending == 0 and job in self._jobs:
                self._jobs.remove(job)
                job.done.set()

    def _fail(self, job: Job, error: BaseException) -> None:
        with self._cond:
            self._fail_locked(job, error)

    def _fail_locked(self, job: Job, error: BaseException) -> None:
        if job.error is None:
            job.error = error
        self._queue = [r for r in self._queue if r.job is not job]
        for row in self._batch.rows if self._batch else []:
            if row.job is job:
                row.done = True
        if job in self._jobs:
            self._jobs.remove(job)
        job.done.set()

    def _fail_batch(self, error: BaseException) -> None:
        """A step failed: the runs with rows in the batch fail with its error; the loop goes on."""
        batch, self._batch = self._batch, None
        for job in {id(r.job): r.job for r in (batch.rows if batch else []) if not r.done}.values():
            self._fail(job, error)

    def _fail_stranded(self, error: BaseException) -> None:
        """After a failed step: fail any run left with rows neither queued nor decoding (none should be)."""
        live = {id(r.job) for r in (self._batch.rows if self._batch else []) if not r.done}
        with self._cond:
            queued = {id(r.job) for r in self._queue}
            for job in list(self._jobs):
                if id(job) not in live and id(job) not in queued:
                    self._fail_locked(job, error)

    # -- admission ----------------------------------------------------------------------------
    def _take(self) -> list[Row]:
        """Waiting rows that may join the batch now (:func:`twinkle_torch.admission.admissible`), out of the queue."""
        batch = self._batch
        live = batch.live() if batch else []
        if live and not joinable(batch.cache):  # type: ignore[union-attr]
            return []  # a cache with sliding-window or other special layers cannot be joined
        with self._cond:
            taken = admissible(
                self._queue,
                live,
                self._adapter if live else None,
                state_tokens=self.state_tokens,
                max_batch_tokens=self.max_batch_tokens,
                row_cap=self._row_cap,
            )
            taken_ids = set(map(id, taken))
            self._queue = [r for r in self._queue if id(r) not in taken_ids]
        return taken

    def _admit(self) -> None:
        taken = self._take()
        if not taken:
            return
        live = self._batch.live() if self._batch else []
        if not live:
            self._batch = None
            # A new batch: select its adapter (the model's weights may have changed since the last one).
            taken[0].job.control.activate()
            self._adapter = taken[0].job.control.adapter
        try:
            prefilled = self._prefill_rows(taken)
            for row in prefilled.ended:
                self._finish(row, "length", None)
            admitted = prefilled.batch
            if admitted is not None and any(self._samplers.of(r.job).needs_seen for r in admitted.rows):
                assert admitted.logits is not None
                admitted.seen = seen_of(admitted.rows, int(admitted.logits.shape[-1]), self.device)
            if admitted is not None and self._batch is not None:
                self._batch.join(admitted)
                self.stats.joined_rows += len(admitted.rows)
            elif admitted is not None:
                self._batch = admitted
            if prefilled.forwards > 1:  # a large admission: its chunks' memory goes back
                give_back_freed_memory()
        except BaseException as exc:
            if is_cuda_oom(exc):
                self._requeue(taken, exc, batch_rows=len(live))
                return
            for job in {id(r.job): r.job for r in taken}.values():
                self._fail(job, exc)
            raise

    def _prefill_rows(self, rows: list[Row]) -> Prefilled:
        """Prefill ``rows`` (:class:`twinkle_torch.admission.Prefiller`) and fail the runs it found failing."""
        prefilled = Prefilled()
        try:
            self._prefill(rows, prefilled)
        finally:  # what it found before an error stands
            self.stats.prefills += prefilled.forwards
            for job, error in prefilled.failed:
                self._fail(job, error)
        return prefilled

    def _requeue(self, rows: list[Row], exc: BaseException, *, batch_rows: int) -> None:
        """Out of memory while admitting ``rows``: back to the front of the queue, with fewer rows per batch."""
        empty_cuda_cache()
        decoding = [r for r in rows if not r.done and not r.score_only]
        if batch_rows == 0 and len(decoding) <= 1:
            for job in {id(r.job): r.job for r in rows}.values():
                self._fail(job, exc)
            return
        self.stats.out_of_memory += 1
        self._row_cap = max(1, (batch_rows + len(decoding)) // 2)
        with self._cond:
            self._queue[:0] = [r for r in rows if not r.done]

    # -- one step -----------------------------------------------------------------------------
    def _sample(self, batch: Batch) -> list[Ending]:
        """Draw the next token of every live row (:func:`twinkle_torch.draw.draw`); returns the rows that end here."""
        for job in non_finite(batch):
            self._fail(job, NumericalError.in_logits(job.control.adapter))
        drawn = Drawn()
        try:
            draw(batch, self._samplers, self._workspace, drawn, pad_token_id=self.pad_token_id, device=self.device)
        finally:  # runs failed before an error stay failed
            for job, error in drawn.failed:
                self._fail(job, error)
        return drawn.ended

    def _forward(self, batch: Batch) -> None:
        """One decode forward of every row of the batch (finished rows not yet pruned ride along)."""
        tokens_in = batch.inputs
        assert tokens_in is not None
        length = batch.length
        cache = batch.cache
        if batch.mask.shape[1] <= length:  # the cache grows on its own; the mask grows with it
            grown = torch.zeros(batch.mask.shape[0], 2 * length + 1, dtype=torch.bool, device=self.device)
            grown[:, :length] = batch.mask[:, :length]
            batch.mask = grown
        batch.mask[:, length] = True
        mask_4d = self.sdpa_masks and joinable(cache)
        step_mask = batch.mask[:, None, None, : length + 1] if mask_4d else batch.mask[:, : length + 1].long()
        forward_kwargs: dict[str, Any] = {"logits_to_keep": 1} if self.logits_to_keep else {}
        live = sum(1 for r in batch.rows if not r.done)
        recorder = self.routes if any(r.routes is not None and not r.done for r in batch.rows) else None
        if recorder is not None:
            recorder.arm()
        try:
            with gdn_kernels(self.gdn_sites):
                out = self.model(
                    input_ids=tokens_in.unsqueeze(1),
                    attention_mask=step_mask,
                    position_ids=batch.next_pos.unsqueeze(1),
                    past_key_values=cache,
                    use_cache=True,
                    **forward_kwargs,
                )
        except BaseException as exc:
            if not is_cuda_oom(exc) or live <= 1:
                raise
            self._evict(batch, length, exc)
            return
        self.stats.steps += 1
        self.stats.peak_rows = max(self.stats.peak_rows, live)
        if recorder is not None:
            step = recorder.take(len(batch.rows))
            for i, row in enumerate(batch.rows):
                if row.routes is not None and not row.done:
                    row.routes.append(step[i])
        batch.logits, batch.inputs = out.logits[:, -1, :], None
        batch.length = length + 1
        batch.next_pos = batch.next_pos + 1

    def _evict(self, batch: Batch, length: int, exc: BaseException) -> None:
        """Out of memory in a decode step: the newest half of the rows goes back to the queue.

        They keep what they generated and are prefilled again with it; the
        others retry the step. Layers the failed forward already wrote are cut
        back; where a layer holds a recurrent state, which cannot be, every row
        goes back (and is prefilled again, a half at a time).
        """
        empty_cuda_cache()
        batch.cut_back(length)
        live = [i for i, r in enumerate(batch.rows) if not r.done]
        back = live[len(live) // 2 :] if rewindable(batch.cache) else live
        self.stats.out_of_memory += 1
        self._row_cap = max(1, len(live) - len(back), len(live) // 2)
        for i in back:
            batch.rows[i].done = True  # pruned below; the row itself lives on in the queue
        evicted = [batch.rows[i] for i in back]
        # the token each evicted row just drew is kept: its next prefill reads it
        batch.prune()
        for row in evicted:
            row.done = False
        with self._cond:
            self._queue[:0] = evicted
        if not batch.rows:
            self._batch = None
        else:
            self._forward(batch)
