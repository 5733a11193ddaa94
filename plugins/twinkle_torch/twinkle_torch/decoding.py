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
   batch always takes one row). Admitted rows
   are **prefilled** together, left-padded, one prefill per prompt shared by
   its samples, and their cache rows are **joined** to the running cache,
   right-aligned (the shorter side is padded on the left, and masked): a
   request arriving while others decode joins them at the next step.
3. **Samples** one token per live row, vectorised over the rows that share
   sampling parameters (:mod:`twinkle_torch.sampling`); each row keeps its
   own stop tokens, stop strings, repetition-penalty history, log-probs and
   sampling mask, and a seeded row its own random stream (keyed on its seed
   and position), so what a row generates does not depend on what else is in
   the batch.
4. **Reports** the rows that finished, through their run's callback, as they
   finish, and drops them from the batch (their cache rows pruned, and the
   leading columns no remaining row attends to trimmed) once enough have
   finished or when new rows join.
5. **Forwards** the live rows once.

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

import atexit
import math
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from twinkle_core.data_format import SamplingMask, SamplingParams
from twinkle_core.errors import InvalidSamplingParams, NumericalError, SamplerClosedError
from twinkle_torch.cache import (
    PreallocatedLayer,
    gather_prefills,
    join_caches,
    joinable,
    make_cache,
    rewindable,
    select_rows,
)
from twinkle_torch.constraints import LogitConstraints
from twinkle_torch.openmp import release_idle_workers
from twinkle_torch.randomness import RowRandomness, derive_seed
from twinkle_torch.routes import RouteRecorder
from twinkle_torch.sampling import TokenSampler, Workspace
from twinkle_torch.state import state_tokens_per_row
from twinkle_torch.stopping import StopStringMatcher

__all__ = ["Decoder", "DecoderStats", "PromptScores", "RunControl", "SequenceResult"]

#: Padded tokens one prefill forward takes (a longer prompt takes one forward of its own).
_PREFILL_CHUNK_TOKENS = 1024
#: A batch drops its finished rows once at least this share of it has finished.
_PRUNE_FRACTION = 1 / 8
#: How long closing waits for the decode loop to end (it checks between steps, so about one step).
_JOIN_TIMEOUT_S = 120.0

#: Decoders alive in this process: stopped at exit, before the interpreter stops daemon threads.
_LIVE: weakref.WeakSet[Decoder] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    # The loop thread is a daemon: at interpreter exit it would be stopped wherever it is, and
    # when that is inside a tensor's destructor (the loop frees the batch's KV cache after its
    # last run is reported, with the GIL released), the unwind through C++ aborts the whole
    # process ("terminate called without an active exception", exit 134). Atexit handlers run
    # before daemon threads are stopped, so every loop is ended and joined here.
    for decoder in list(_LIVE):
        decoder.close()


def _load_libc() -> Any:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


def _give_back_freed_memory() -> None:
    """Return the heap memory a batch freed to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    The loop's thread has a malloc arena of its own; what a prefill's chunks
    and a finished batch's cache free stays resident there (a process that had
    run 256 rows kept 1.2 GB of it), so the next, smaller batch would start
    from the last one's high-water mark.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _name_this_thread(name: bytes) -> None:
    """Give the calling thread a kernel name (Linux), which ``top -H`` shows and its OpenMP workers inherit."""
    if _LIBC is not None and hasattr(_LIBC, "prctl"):
        _LIBC.prctl(15, name, 0, 0, 0)  # PR_SET_NAME; at most 15 bytes


OutOfMemoryError: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

TopList = list[list[tuple[int, float]]]


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
    routed_experts: np.ndarray | None = None


@attrs.define
class RunControl:
    """What a run may vary per prompt, and how it is stopped and streamed.

    Attributes:
        max_tokens: per prompt, the most tokens to generate.
        sample_base: per prompt, the sample index of its first completion (seeds use it).
        generated: per prompt, tokens generated before this run (seeded draws are keyed on the position).
        stopped: called between steps; ``True`` ends every unfinished row with ``"abort"``.
        on_finish: called with ``(prompt_index, sample_index, result)`` as each completion ends
            (from the decode loop's thread).
        activate: called (from the decode loop's thread) before the first forward of a batch
            that starts with this run's rows: selects the run's adapter.
        adapter: the adapter the run samples; rows of different adapters never share a batch.
    """

    max_tokens: list[int]
    sample_base: list[int]
    generated: list[int]
    stopped: Callable[[], bool] = lambda: False
    on_finish: Callable[[int, int, SequenceResult], None] | None = None
    activate: Callable[[], None] = lambda: None
    adapter: str = ""

    @classmethod
    def plain(cls, prompts: int, params: SamplingParams) -> RunControl:
        """Every prompt with ``params.max_tokens``, fresh sequences, no early stop."""
        return cls([params.max_tokens] * prompts, [0] * prompts, [0] * prompts)


@attrs.define
class PromptScores:
    """Prompt log-probs of one prompt (the first entry ``None``)."""

    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


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


class _Job:
    """One run's rows, results and completion."""

    def __init__(
        self, prompts: list[list[int]], params: SamplingParams, control: RunControl, eos_token_ids: Sequence[int]
    ) -> None:
        self.prompts = prompts
        self.params = params
        self.control = control
        self.results: dict[tuple[int, int], SequenceResult] = {}
        self.scores: dict[int, PromptScores] = {}
        self.pending = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.interrupted = False  # the caller stopped waiting (Ctrl-C): end the rows as an abort would
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(eos_token_ids)
        self.stop_ids = stop_ids
        try:
            hash(params)
            self.group: Hashable = params  # runs with equal parameters sample as one group
        except TypeError:
            self.group = id(self)


@attrs.define(eq=False)
class _Row:
    """One completion being generated: where it belongs, what it has, when it ends."""

    job: _Job
    prompt: int
    sample: int
    limit: int  # the most tokens it may hold in all (the ones it had when queued included)
    seed: int | None
    position0: int  # completion position of its first token in this run (seeded draws are keyed on it)
    score_only: bool = False  # a prompt-scoring row: prefilled, never decoded
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[float] | None = None
    top: TopList | None = None
    kept: list[list[int]] | None = None
    routes: list[np.ndarray] | None = None  # with return_routed_experts: [positions, layers, top_k] per forward
    matcher: StopStringMatcher | None = None
    grammar: Any = None  # with structured_outputs: its xgrammar matcher
    done: bool = False

    @property
    def ids(self) -> list[int]:
        """What a prefill of this row reads: its prompt and what it generated before."""
        return self.job.prompts[self.prompt] + self.tokens

    @property
    def output(self) -> list[int]:
        """Its whole completion so far: what an earlier run generated (the prompt's tail) and its tokens."""
        prompt = self.job.prompts[self.prompt]
        return prompt[len(prompt) - self.position0 :] + self.tokens if self.position0 else self.tokens

    @property
    def span(self) -> int:
        """The most cache columns it can need: prompt plus budget."""
        return len(self.job.prompts[self.prompt]) + self.limit


class _Batch:
    """The running batch: rows, their KV cache, mask, positions and the logits of their next token."""

    def __init__(
        self,
        rows: list[_Row],
        cache: Any,
        length: int,
        mask: torch.Tensor,
        next_pos: torch.Tensor,
        logits: torch.Tensor,
        seen: torch.Tensor | None,
    ) -> None:
        self.rows = rows
        self.cache = cache
        self.length = length  # cache columns filled
        self.mask = mask  # [rows, capacity]: the first `length` columns are meaningful
        self.next_pos = next_pos  # per row, the position id of its next input token
        # Between a forward and the next draw: the logits of each row's next token. Between the
        # draw and the next forward: `inputs`, the tokens drawn.
        self.logits: torch.Tensor | None = logits
        self.inputs: torch.Tensor | None = None
        self.seen = seen

    def live(self) -> list[_Row]:
        return [r for r in self.rows if not r.done]


def _is_cuda_oom(exc: BaseException) -> bool:
    return isinstance(exc, OutOfMemoryError)


def _empty_cuda_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
        self.native_kernels = native_kernels
        self.vocab_size = vocab_size if vocab_size is not None else int(model.config.vocab_size)
        self._tokenizer = tokenizer
        self.device = device
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len
        self.logits_to_keep = logits_to_keep
        self.sdpa_masks = sdpa_masks
        # whether this model's caches are all preallocated layers: chunked prefills can be gathered
        self._gatherable = joinable(make_cache(model.config, 1))
        # a hybrid model's per-row linear-attention state, charged to the budget as KV tokens of its size
        self.state_tokens = state_tokens_per_row(model.config, next(model.parameters()).dtype)
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        self.stats = DecoderStats()
        self._cond = threading.Condition()
        self._queue: list[_Row] = []  # waiting rows, first come first served
        self._jobs: list[_Job] = []  # runs with rows queued or in the batch
        self._looping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # Decode-loop state, touched by the loop's thread only.
        self._batch: _Batch | None = None
        self._adapter: str | None = None
        self._row_cap: int | None = None  # after an out-of-memory error: the most rows a batch may hold
        self._samplers: dict[Hashable, TokenSampler] = {}
        self._workspace = Workspace()  # the sampler's [rows, vocab] buffers, while a batch runs

    # -- public -------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The tokenizer of stop strings and bad words (set when the template changes)."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._samplers = {}  # their bad words were tokenized by the old one

    def run(
        self, prompts: list[list[int]], params: SamplingParams, *, control: RunControl | None = None
    ) -> tuple[list[list[SequenceResult]], list[PromptScores | None]]:
        """Generate ``params.num_samples`` completions for every prompt (blocks until they are done).

        The rows join the decode loop with whatever else is running.

        Args:
            prompts: token ids.
            params: the sampling parameters.
            control: per-prompt budgets and seed positions, an early stop, a
                callback for each finished completion and the adapter (see :class:`RunControl`).

        Returns:
            Per prompt, its completions in sample order, and its prompt scores
            (``None`` unless ``params.prompt_logprobs`` is set).

        Raises:
            Whatever the model raised for this run's rows.
        """
        control = control if control is not None else RunControl.plain(len(prompts), params)
        job = _Job(prompts, params, control, self.eos_token_ids)
        if params.max_tokens > 0:
            self._sampler(job)  # bad constraints (a bad word that cannot be tokenized) fail here, before any work
        n = params.num_samples
        generating = params.max_tokens > 0
        rows: list[_Row] = []
        for p, ids in enumerate(prompts):
            if not generating:
                if params.prompt_logprobs is not None:
                    rows.append(_Row(job, p, 0, 0, None, 0, score_only=True))
                continue
            limit = max(0, min(control.max_tokens[p], self.max_model_len - len(ids)))
            for s in range(n):
                index = control.sample_base[p] + s
                seed = None if params.seed is None else derive_seed(params.seed, index)
                row = _Row(job, p, s, limit, seed, control.generated[p])
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
                    _LIVE.add(self)
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
        sequences: list[list[SequenceResult]] = []
        for p in range(len(prompts)):
            if generating:
                sequences.append([job.results[(p, s)] for s in range(n)])
            else:  # scoring only: each sample is an empty completion
                empty: dict[str, Any] = {
                    "logprobs": [] if params.logprobs is not None else None,
                    "top_logprobs": [] if params.logprobs else None,
                }
                if params.return_sampling_mask:
                    empty["sampling_mask"] = SamplingMask(offsets=[0], token_ids=[])
                sequences.append([SequenceResult(tokens=[], stop_reason="length", text="", **empty) for _ in range(n)])
        return sequences, [job.scores.get(p) for p in range(len(prompts))]

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
        _name_this_thread(b"twinkle-decode")
        with torch.inference_mode():
            while True:
                with self._cond:
                    if self._closed or (not self._queue and self._batch is None):
                        self._looping = False
                        self._batch = None
                        self._workspace.clear()
                        _give_back_freed_memory()
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
            _give_back_freed_memory()
        for row, reason, stop in ended:
            self._finish(row, reason, stop)
        live = batch.live()
        if self._batch is None or not live:
            self._batch = None
            return
        dead = len(batch.rows) - len(live)
        if dead and dead >= max(1.0, len(batch.rows) * _PRUNE_FRACTION):
            self._prune(batch)
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

    def _finish(self, row: _Row, reason: str, stop: str | int | None) -> None:
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
                result.routed_experts = self._routes_of(row)
            job.results[(row.prompt, row.sample)] = result
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

    def _fail(self, job: _Job, error: BaseException) -> None:
        with self._cond:
            self._fail_locked(job, error)

    def _fail_locked(self, job: _Job, error: BaseException) -> None:
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
    def _take(self) -> list[_Row]:
        """Waiting rows that may join the batch now: first come first served, same adapter, within budget."""
        batch = self._batch
        live = batch.live() if batch else []
        if live and not joinable(batch.cache):  # type: ignore[union-attr]
            return []  # a cache with sliding-window or other special layers cannot be joined
        adapter = self._adapter if live else None
        rows = len(live)
        width = max((r.span for r in live), default=0) + self.state_tokens
        taken: list[_Row] = []
        with self._cond:
            for row in self._queue:
                if adapter is None:
                    adapter = row.job.control.adapter
                elif row.job.control.adapter != adapter:
                    break  # it waits for the batch to drain; nothing behind it overtakes it
                cost_rows = 0 if row.score_only else 1
                new_width = max(width, row.span + self.state_tokens)
                if rows + cost_rows > 0 and (live or taken):
                    if (rows + cost_rows) * new_width > self.max_batch_tokens:
                        break
                    if self._row_cap is not None and rows + cost_rows > self._row_cap:
                        break
                taken.append(row)
                rows += cost_rows
                width = new_width
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
        admitted: _Batch | None = None
        prefills = self.stats.prefills
        try:
            admitted = self._prefill(taken)
            if admitted is not None and self._batch is not None:
                self._join(self._batch, admitted)
                self.stats.joined_rows += len(admitted.rows)
            elif admitted is not None:
                self._batch = admitted
            if self.stats.prefills - prefills > 1:  # a large admission: its chunks' memory goes back
                _give_back_freed_memory()
        except BaseException as exc:
            if _is_cuda_oom(exc):
                self._requeue(taken, exc, batch_rows=len(live))
                return
            for job in {id(r.job): r.job for r in taken}.values():
                self._fail(job, exc)
            raise

    def _requeue(self, rows: list[_Row], exc: BaseException, *, batch_rows: int) -> None:
        """Out of memory while admitting ``rows``: back to the front of the queue, with fewer rows per batch."""
        _empty_cuda_cache()
        decoding = [r for r in rows if not r.done and not r.score_only]
        if batch_rows == 0 and len(decoding) <= 1:
            for job in {id(r.job): r.job for r in rows}.values():
                self._fail(job, exc)
            return
        self.stats.out_of_memory += 1
        self._row_cap = max(1, (batch_rows + len(decoding)) // 2)
        with self._cond:
            self._queue[:0] = [r for r in rows if not r.done]

    def _prefill(self, rows: list[_Row]) -> _Batch | None:
        """Prefill ``rows`` (rows of one prompt with nothing generated share one prefill).

        Prompts are prefilled longest first, in chunks of about
        ``_PREFILL_CHUNK_TOKENS`` padded tokens: prompts of similar length pad
        little (one left-padded batch of prompts of 25 to 122 tokens computes
        2.5x the tokens it needs), and a chunk's activations bound the
        prefill's peak memory. The chunks' caches are gathered into the
        batch's cache, sized for the whole generation. A model whose cache has
        layers of other kinds (sliding windows...) takes one prefill of every prompt.
        """
        device = self.device
        groups: dict[Any, list[_Row]] = {}
        for row in rows:
            key = (id(row.job), row.prompt) if not row.tokens else id(row)
            groups.setdefault(key, []).append(row)
        members = list(groups.values())
        lengths = [len(g[0].ids) for g in members]
        width = max(lengths)
        scoring = [
            g[0].job.params.prompt_logprobs is not None and not g[0].tokens and g[0].prompt not in g[0].job.scores
            for g in members
        ]
        decoding = [[r for r in g if not r.score_only and r.limit > len(r.tokens)] for g in members]
        counts = [len(d) for d in decoding]
        total = sum(counts)
        remaining = max((r.limit - len(r.tokens) for d in decoding for r in d), default=0)
        # the batch's rows, longest prompt first: rows of similar length side by side keep the
        # attention's row blocks narrow (see twinkle_torch.attention.row_blocks)
        order = sorted(range(len(members)), key=lambda b: -lengths[b])
        gatherable = self._gatherable
        chunks = self._prefill_chunks([lengths[b] for b in order]) if gatherable else [list(range(len(members)))]
        chunks = [[order[i] for i in chunk] for chunk in chunks] if gatherable else chunks
        expand = total != len(members)
        last: list[torch.Tensor] = [torch.empty(0)] * len(members)
        offsets = [0] * len(members)  # each prompt's first row in the batch
        at = 0
        for b in order:
            offsets[b], at = at, at + counts[b]

        def prefilled(chunk: list[int]) -> tuple[Any, torch.Tensor, torch.Tensor]:
            """Prefill one chunk: its cache, its rows each decoding row takes, and where they go in the batch."""
            # a lone chunk's cache becomes the batch's: sized for the generation unless samples expand it
            capacity = width + remaining if chunk == order and total and not expand else 0
            ids = [members[b][0].ids for b in chunk]
            record = any(r.routes is not None for b in chunk for r in members[b])
            cache, logits, routes = self._prefill_forward(ids, capacity, any(scoring[b] for b in chunk), record)
            chunk_width = max(lengths[b] for b in chunk)
            for i, b in enumerate(chunk):  # each prompt's routes, past its left padding, for each of its rows
                for row in members[b]:
                    if routes is not None and row.routes is not None:
                        row.routes = [routes[i, chunk_width - lengths[b] :]]
            ends = logits[:, -1].clone()  # not views: a chunk's logits of every position must not stay alive
            for i, b in enumerate(chunk):
                last[b] = ends[i]
                if scoring[b]:
                    job = members[b][0].job
                    scores = self._prompt_scores(
                        logits[i, chunk_width - lengths[b] :],
                        torch.tensor(ids[i], dtype=torch.long, device=device),
                        job.params.prompt_logprobs or 0,
                    )
                    if any(v is not None and math.isnan(v) for v in scores.logprobs):
                        # NaN logits: a call that only scores never reaches the decode step's check
                        self._fail(job, NumericalError.in_logits(job.control.adapter))
                    job.scores[members[b][0].prompt] = scores
            taken = [i for i, b in enumerate(chunk) for _ in range(counts[b])]  # chunk rows, once per sample
            placed = [offsets[b] + j for b in chunk for j in range(counts[b])]  # where they go in the batch
            return cache, torch.tensor(taken, dtype=torch.long, device=device), torch.tensor(placed, device=device)

        if len(chunks) > 1 and total:
            # each chunk's cache is copied into the batch's as soon as it is prefilled, then dropped
            parts = (prefilled(chunk) for chunk in chunks)
            cache = gather_prefills(
                self.model.config, (p for p in parts if p[1].numel()), total, width, width + remaining
            )
        else:  # one chunk, or prompts scored and none decoded
            cache, taken_t, placed_t = prefilled(chunks[0])
            for chunk in chunks[1:]:
                prefilled(chunk)
            if total and (expand or chunks[0] != order):  # samples share their prompt's row, or rows move
                select_rows(cache, taken_t[torch.argsort(placed_t)], width + remaining)
        for g, d in zip(members, decoding):
            for row in g:
                if row not in d:  # scoring rows, and rows with no budget left
                    self._finish(row, "length", None)
        if not total:
            return None
        source = torch.tensor([b for b in order for _ in range(counts[b])], dtype=torch.long, device=device)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        new_rows = [r for b in order for r in decoding[b]]
        mask = torch.zeros(total, width + remaining, dtype=torch.bool, device=device)
        mask[:, :width] = torch.arange(width, device=device).unsqueeze(0) >= (width - lengths_t[source]).unsqueeze(1)
        logits_out = torch.stack(last)[source]
        seen = None
        if any(self._sampler(r.job).needs_seen for r in new_rows):
            seen = self._seen_of(new_rows, int(logits_out.shape[-1]))
        return _Batch(new_rows, cache, width, mask, lengths_t[source], logits_out, seen)

    @staticmethod
    def _prefill_chunks(lengths: list[int]) -> list[list[int]]:
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

    def _prefill_forward(
        self, ids: list[list[int]], capacity: int, scoring: bool, record: bool = False
    ) -> tuple[Any, torch.Tensor, np.ndarray | None]:
        """One left-padded prefill forward of ``ids`` into a fresh cache of at least ``capacity`` columns.

        Returns the cache, the logits (of every position when ``scoring``,
        prompt log-probs, else where the model allows of the last only) and,
        when ``record``, the routed experts ``[rows, width, layers, top_k]``.
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
        if self.logits_to_keep and not scoring:
            kwargs["logits_to_keep"] = 1
        recorder = self.routes if record else None
        if recorder is not None:
            recorder.arm()
        logits = self.model(
            input_ids=input_ids, attention_mask=prompt_mask, position_ids=positions, past_key_values=cache,
            use_cache=True, **kwargs,
        ).logits  # fmt: skip
        self.stats.prefills += 1
        return cache, logits, recorder.take(len(ids)) if recorder is not None else None

    def _routes_of(self, row: _Row) -> np.ndarray:
        """A finished row's routes: one per token it forwarded, all but its last token (which no forward read)."""
        assert self.routes is not None and row.routes is not None
        wanted = len(row.ids) - 1
        if not row.routes:
            return np.zeros((0, self.routes.layers, self.routes.top_k), dtype=self.routes.dtype)
        routes: np.ndarray = np.concatenate(row.routes)[:wanted]
        return routes

    def _prompt_scores(self, logits: torch.Tensor, ids: torch.Tensor, top: int) -> PromptScores:
        """Raw log-probs of each prompt token given the ones before it (prompt tokens are not sampled)."""
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        chosen = logprobs.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1).tolist()
        out = PromptScores(logprobs=[None, *chosen])
        if top:
            values, idx = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
            out.top_logprobs = [None, *[list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]]
        return out

    def _seen_of(self, rows: list[_Row], vocab: int) -> torch.Tensor:
        """Per row, the tokens it has seen (prompt and completion), for the repetition penalty."""
        seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=self.device)
        for i, row in enumerate(rows):
            seen[i, torch.tensor(row.ids, dtype=torch.long, device=self.device)] = True
        return seen

    def _join(self, batch: _Batch, new: _Batch) -> None:
        """Merge ``new`` (just prefilled) into the running ``batch``: rows appended, caches right-aligned."""
        self._prune(batch)
        assert batch.logits is not None and new.logits is not None
        old_len, new_len = batch.length, new.length
        length = max(old_len, new_len)
        rows = batch.rows + new.rows
        capacity = length + max(r.limit - len(r.tokens) for r in rows)
        join_caches(batch.cache, new.cache, capacity)
        mask = torch.zeros(len(rows), capacity, dtype=torch.bool, device=self.device)
        mask[: len(batch.rows), length - old_len : length] = batch.mask[:, :old_len].bool()
        mask[len(batch.rows) :, length - new_len : length] = new.mask[:, :new_len].bool()
        vocab = int(batch.logits.shape[-1])
        seen = batch.seen
        if seen is not None or new.seen is not None:
            top = seen if seen is not None else self._seen_of(batch.rows, vocab)
            bottom = new.seen if new.seen is not None else self._seen_of(new.rows, vocab)
            seen = torch.cat([top, bottom])
        batch.rows = rows
        batch.length = length
        batch.mask = mask
        batch.next_pos = torch.cat([batch.next_pos, new.next_pos])
        batch.logits = torch.cat([batch.logits, new.logits])
        batch.seen = seen

    def _prune(self, batch: _Batch) -> None:
        """Drop finished rows, and the leading columns none of the others attends to."""
        keep_list = [i for i, r in enumerate(batch.rows) if not r.done]
        if len(keep_list) == len(batch.rows):
            return
        keep = torch.tensor(keep_list, dtype=torch.long, device=self.device)
        length = batch.length
        mask = batch.mask[keep]
        start = 0
        if keep_list and joinable(batch.cache):
            used = mask[:, :length].any(dim=0).nonzero()
            start = int(used[0]) if used.numel() else 0
        select_rows(batch.cache, keep, start=start)
        batch.length -= start
        if start:
            trimmed = torch.zeros_like(mask)
            trimmed[:, : mask.shape[1] - start] = mask[:, start:]
            mask = trimmed
        batch.mask = mask
        batch.rows = [batch.rows[i] for i in keep_list]
        batch.next_pos = batch.next_pos[keep]
        if batch.logits is not None:
            batch.logits = batch.logits[keep]
        if batch.inputs is not None:
            batch.inputs = batch.inputs[keep]
        if batch.seen is not None:
            batch.seen = batch.seen[keep]

    # -- one step -----------------------------------------------------------------------------
    def _min_tokens_ids(self, job: _Job) -> list[int]:
        """What ``min_tokens`` holds back: the end-of-sequence ids (even with ``ignore_eos``) and the stop ids."""
        return sorted(set(self.eos_token_ids) | set(job.params.stop_token_ids))

    def _sampler(self, job: _Job) -> TokenSampler:
        sampler = self._samplers.get(job.group)
        if sampler is None:
            if len(self._samplers) > 256:  # parameters of runs long gone
                self._samplers.clear()
            constraints = LogitConstraints.of(job.params, self._min_tokens_ids(job), self.tokenizer, self.vocab_size)
            params = job.params
            if params.top_k >= self.vocab_size:  # keeps every token: no top-k (and no sort), as vLLM reads it
                params = params.replace(top_k=-1)
            sampler = self._samplers[job.group] = TokenSampler(params, constraints, native=self.native_kernels)
        return sampler

    def _sample(self, batch: _Batch) -> list[tuple[_Row, str, str | int | None]]:
        """Draw the next token of every live row and record it; returns the rows that end here (to finish)."""
        device = self.device
        assert batch.logits is not None
        self._fail_non_finite(batch)
        groups: dict[Hashable, list[int]] = {}
        for i, row in enumerate(batch.rows):
            if not row.done:
                groups.setdefault(row.job.group, []).append(i)
        tokens_in = torch.full((len(batch.rows),), self.pad_token_id, dtype=torch.long, device=device)
        ended: list[tuple[_Row, str, str | int | None]] = []
        for members in groups.values():
            rows = [batch.rows[i] for i in members]
            job = rows[0].job
            sampler = self._sampler(job)
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
                    result = sampler(logits, seen, uniforms, randomness.redraw, outputs, matchers, self._workspace)
                else:
                    result = sampler(logits, seen, outputs=outputs, matchers=matchers, workspace=self._workspace)
            except InvalidSamplingParams as exc:  # these parameters leave nothing to draw: their runs fail alone
                # every run with rows here: a row left without its token this step cannot go on
                for failed in {id(r.job): r.job for r in rows}.values():
                    self._fail(failed, exc)
                continue
            tokens_in[idx] = result.tokens
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
        if batch.seen is not None:
            batch.seen.scatter_(1, tokens_in.unsqueeze(1), True)
        batch.logits, batch.inputs = None, tokens_in
        return ended

    def _fail_non_finite(self, batch: _Batch) -> None:
        """Fail the runs whose rows' logits hold NaN or +inf (or only -inf): nothing can be drawn from them.

        Weights that passed every check can still overflow in the forward; a
        row of NaN would draw token 0 greedily, or break the draw. One
        reduction over the logits (a few ms a step at 256 rows).
        """
        assert batch.logits is not None
        finite = torch.isfinite(batch.logits.amax(dim=-1)).tolist()
        bad = [row for row, ok in zip(batch.rows, finite) if not ok and not row.done]
        for job in {id(r.job): r.job for r in bad}.values():
            self._fail(job, NumericalError.in_logits(job.control.adapter))

    def _forward(self, batch: _Batch) -> None:
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
            out = self.model(
                input_ids=tokens_in.unsqueeze(1),
                attention_mask=step_mask,
                position_ids=batch.next_pos.unsqueeze(1),
                past_key_values=cache,
                use_cache=True,
                **forward_kwargs,
            )
        except BaseException as exc:
            if not _is_cuda_oom(exc) or live <= 1:
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

    def _evict(self, batch: _Batch, length: int, exc: BaseException) -> None:
        """Out of memory in a decode step: the newest half of the rows goes back to the queue.

        They keep what they generated and are prefilled again with it; the
        others retry the step. Layers the failed forward already wrote are cut
        back; where a layer holds a recurrent state, which cannot be, every row
        goes back (and is prefilled again, a half at a time).
        """
        _empty_cuda_cache()
        for layer in batch.cache.layers:
            if isinstance(layer, PreallocatedLayer) and layer.length > length:
                layer.crop(length - layer.length)
        live = [i for i, r in enumerate(batch.rows) if not r.done]
        back = live[len(live) // 2 :] if rewindable(batch.cache) else live
        self.stats.out_of_memory += 1
        self._row_cap = max(1, len(live) - len(back), len(live) // 2)
        for i in back:
            batch.rows[i].done = True  # pruned below; the row itself lives on in the queue
        evicted = [batch.rows[i] for i in back]
        # the token each evicted row just drew is kept: its next prefill reads it
        self._prune(batch)
        for row in evicted:
            row.done = False
        with self._cond:
            self._queue[:0] = evicted
        if not batch.rows:
            self._batch = None
        else:
            self._forward(batch)
