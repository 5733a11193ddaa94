"""Turning one decode step's logits into tokens and log-probs, for a whole batch at once.

Everything here is vectorised over the rows of the batch: one call per decode
step, whatever the batch size, with no per-row Python work except drawing one
uniform number per seeded row (see :class:`twinkle_torch.randomness.RowRandomness`).

The processing order: the token constraints and the logit bias (see
:mod:`twinkle_torch.constraints`), the repetition penalty, the frequency and
presence penalties, then (as Hugging Face ``generate`` does) temperature,
top-k, top-p (renormalised over the top-k survivors), min-p.
Nothing sorts the vocabulary (``torch.sort`` over a 50k vocabulary is slower
on CPU than a small model's forward): see :class:`TokenSampler` for how
truncation is done instead.

Sampling uses the inverse CDF: a uniform number ``u`` picks the first token
whose cumulative probability exceeds ``u``. A row's result depends only on its
own logits and its own numbers, which is what makes seeded rows reproducible
whatever else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

from twinkle_core.data_format import SamplingParams
from twinkle_core.data_format.structured import no_token_left
from twinkle_core.errors import InvalidSamplingParams
from twinkle_torch import native
from twinkle_torch.constraints import LogitConstraints

__all__ = ["FRESH_PAGES_BYTES", "StepResult", "TokenSampler", "Workspace"]

#: Candidates examined first when top-p or min-p is on (widened x4 as needed).
_FIRST_CANDIDATES = 64
#: Rejection rounds before a row's kept set is searched for directly.
_MAX_REDRAWS = 8


#: Blocks at least this big come from fresh pages at every allocation (glibc's largest mmap
#: threshold on 64-bit Linux); its heap already reuses smaller ones.
FRESH_PAGES_BYTES = 32 << 20


class Workspace:
    """Buffers the sampler's passes over ``[rows, vocab]`` write into, kept from one decode step to the next.

    A fresh ``[256, 49152]`` float32 tensor (50 MB) comes from new pages every
    time (glibc maps blocks over 32 MB afresh and unmaps them when freed), and
    faulting them in costs more than the pass that fills them: on 2 cores a
    softmax into a fresh tensor took 33 ms, into a reused one 8.6 ms. The same
    kernels write into these buffers (their ``out=`` forms), so the results
    are the same bits. One buffer per name, grown to the largest request;
    :meth:`clear` drops them (the decoder does when its batch ends). Only CPU
    blocks of ``min_bytes`` or more are kept: smaller ones the allocator
    reuses already (keeping them would only hold memory the forward could
    have reused), and CUDA's caching allocator keeps its own. One decode
    loop's: not for two threads at once.
    """

    def __init__(self, min_bytes: int = FRESH_PAGES_BYTES) -> None:
        self.min_bytes = min_bytes
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor shaped as ``like`` (its dtype, or ``dtype``) to write into; its contents are garbage."""
        dtype = like.dtype if dtype is None else dtype
        if like.device.type != "cpu" or like.numel() * dtype.itemsize < self.min_bytes:
            return torch.empty(like.shape, dtype=dtype, device=like.device)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < like.numel() or buffer.dtype != dtype or buffer.device != like.device:
            self._buffers.pop(name, None)  # the old one goes before the new one comes
            buffer = self._buffers[name] = torch.empty(like.numel(), dtype=dtype, device=like.device)
        return buffer[: like.numel()].view(like.shape)

    def clear(self) -> None:
        self._buffers.clear()


def _out(ws: Workspace | None, name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Where a pass over ``like``'s shape writes: ``ws``'s buffer ``name``, or a fresh tensor without one."""
    if ws is None:
        return torch.empty(like.shape, dtype=like.dtype if dtype is None else dtype, device=like.device)
    return ws.take(name, like, dtype)


def _softmax(scores: torch.Tensor, ws: Workspace | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.aten._softmax.out(scores, -1, False, out=_out(ws, "probs", scores))
    return out


def _cumsum(probs: torch.Tensor, ws: Workspace | None) -> torch.Tensor:
    return torch.cumsum(probs, dim=-1, out=_out(ws, "cdf", probs))


@attrs.frozen
class StepResult:
    """What one decode step produced, per row.

    Attributes:
        tokens: ``[rows]`` the chosen token ids.
        logprobs: ``[rows]`` their log-probs in the requested mode, or ``None``.
        top_ids: ``[rows, k]`` the top-k alternatives, most likely first, or ``None``.
        top_logprobs: ``[rows, k]`` their log-probs, or ``None``.
        kept: with ``return_sampling_mask``, per row the token ids the sampler
            kept (the support the token was drawn from); ``None`` when nothing
            was truncated (greedy, or no top-k / top-p / min-p): the whole vocabulary.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    kept: list[list[int]] | None = None


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The CTRL / Hugging Face rule: seen tokens' positive logits / penalty, negative ones * penalty."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


Redraw = Callable[[list[int]], torch.Tensor]


def _global_redraw(rows: list[int]) -> torch.Tensor:
    return torch.rand(len(rows))


class TokenSampler:
    """Picks the next token of every row from its logits, under one ``SamplingParams``.

    Top-p and min-p without top-k sample by rejection: draw from the whole
    (tempered) distribution, keep the draw if the token survives truncation,
    else draw again for that row. A kept draw is distributed exactly as the
    renormalised truncated distribution, and each test is one pass over the
    vocabulary, where finding the truncation boundary would need a sort (slow
    on CPU) or a wide ``topk``. Top-k takes the candidate path: ``topk`` over a
    candidate set wide enough to hold every kept token, the kept prefix found
    there. Processed log-probs under top-p need the boundary too, for their
    normaliser: with ``native``, :func:`twinkle_torch.native.nucleus` finds it
    without a sort; otherwise a ``topk`` that starts narrow and widens for the
    rows whose nucleus is not closed yet. How a token is drawn never depends on
    the log-prob options, so asking for log-probs does not change the samples.

    All paths keep the tokens whose probability mass ranked above them is
    below ``top_p``; they differ only in how they break exact ties in
    probability. The draw by rejection and the native nucleus keep a tie
    whole; the ``topk`` paths cut it where the mass reaches ``top_p``.

    Args:
        params: the request's sampling parameters.
        constraints: its token constraints, bias and completion penalties
            (``LogitConstraints.of(params, ...)``), if it sets any.
        native: find the normaliser of processed log-probs under top-p with
            :func:`twinkle_torch.native.nucleus` (CPU, float32; no sort, and
            exact ties kept together as the draw keeps them) where it applies.
    """

    def __init__(
        self, params: SamplingParams, constraints: LogitConstraints | None = None, *, native: bool = False
    ) -> None:
        self.params = params
        self.native = native
        self.constraints = constraints
        self.greedy = params.greedy
        self.want_logprobs = params.logprobs is not None
        self.top_n = params.logprobs or 0
        self.raw_mode = params.logprobs_mode == "raw"
        self.penalty = params.repetition_penalty if params.repetition_penalty != 1.0 else None
        self.top_k = params.top_k if params.top_k > 0 else None
        self.top_p = params.top_p if params.top_p < 1.0 else None
        self.min_p = params.min_p if params.min_p > 0.0 else None
        self.log_min_p = math.log(params.min_p) if params.min_p > 0.0 else None
        self.truncates = self.top_k is not None or self.top_p is not None or self.log_min_p is not None
        self.by_rejection = self.truncates and self.top_k is None
        self.want_mask = params.return_sampling_mask
        self._width = _FIRST_CANDIDATES  # candidate width that sufficed last step

    @property
    def needs_outputs(self) -> bool:
        """Whether the caller must pass each row's completion so far (for the constraints)."""
        return self.constraints is not None

    @property
    def needs_seen(self) -> bool:
        """Whether the caller must keep the ``seen`` token mask (for the repetition penalty)."""
        return self.penalty is not None

    @property
    def needs_uniforms(self) -> bool:
        """Whether :meth:`__call__` needs one uniform number per row."""
        return not self.greedy

    def __call__(
        self,
        logits: torch.Tensor,
        seen: torch.Tensor | None = None,
        uniforms: torch.Tensor | None = None,
        redraw: Redraw = _global_redraw,
        outputs: list[list[int]] | None = None,
        matchers: list[Any] | None = None,
        workspace: Workspace | None = None,
    ) -> StepResult:
        """Choose one token per row.

        Args:
            logits: ``[rows, vocab]`` the model's raw next-token logits.
            seen: ``[rows, vocab]`` bool, tokens already in each row (prompt and
                completion); needed with a repetition penalty.
            uniforms: ``[rows]`` numbers in ``[0, 1)``; needed unless greedy.
            redraw: more uniform numbers for the given rows (rejection sampling
                asks for them; seeded rows must draw from their own generators).
            outputs: per row, its completion so far; needed with constraints.
            matchers: per row, its grammar matcher; needed with ``structured_outputs``.
            workspace: buffers to write the passes over the vocabulary into (see
                :class:`Workspace`); none: fresh tensors. No result refers to them.

        Raises:
            InvalidSamplingParams: the constraints leave a row no token to draw.
        """
        raw = logits.float()
        processed = raw
        constraints = self.constraints
        if constraints is not None:
            assert outputs is not None
            processed = constraints.before_penalty(processed, outputs, matchers)
        if self.penalty is not None:
            assert seen is not None
            processed = apply_repetition_penalty(processed, seen, self.penalty)
        if constraints is not None:
            processed = constraints.after_penalty(processed, outputs)  # type: ignore[arg-type]
            if constraints.masks:
                self._check_support(processed)
        if self.greedy:
            tokens = processed.argmax(dim=-1)
            result = (
                StepResult(tokens)
                if not self.want_logprobs
                else self._finish_full(tokens, raw if self.raw_mode else processed, workspace)
            )
            if self.want_mask and constraints is not None and constraints.masks:
                result = attrs.evolve(result, kept=self._finite(processed))  # greedy draws from what is left
            return result
        assert uniforms is not None
        if self.params.temperature != 1.0:
            t = self.params.temperature
            processed = torch.div(processed, t, out=_out(workspace, "scaled", processed))
        if not self.truncates:
            result = self._sample_full(processed, raw, uniforms, workspace)
            if self.want_mask and constraints is not None and constraints.masks:
                result = attrs.evolve(result, kept=self._finite(processed))
            return result
        if self.by_rejection:
            result = self._sample_by_rejection(processed, raw, uniforms, redraw, workspace)
        else:
            result = self._sample_candidates(processed, raw, uniforms)
        if self.want_mask:
            result = attrs.evolve(result, kept=self._kept(processed, result.tokens))
        return result

    def _check_support(self, processed: torch.Tensor) -> None:
        empty = (~torch.isfinite(processed).any(dim=-1)).nonzero().flatten().tolist()
        if empty:
            p = self.params
            if p.structured_outputs is not None:  # a grammar that admits nothing here (or nothing the rest allow)
                raise no_token_left(p.structured_outputs)
            raise InvalidSamplingParams(
                "The token constraints leave no token to draw: every token is removed by allowed_token_ids="
                f"{list(p.allowed_token_ids) if p.allowed_token_ids is not None else None!r}, bad_words="
                f"{list(p.bad_words)!r} and min_tokens={p.min_tokens} (which holds back the end-of-sequence and"
                " stop ids) together. Allow a token none of the others removes.",
                field="allowed_token_ids",
            )

    # -- the sampling mask --------------------------------------------------------------------------
    @staticmethod
    def _finite(scores: torch.Tensor) -> list[list[int]]:
        """Per row, the ids whose score is finite (the tokens the constraints left)."""
        rows: list[list[int]] = [[] for _ in range(scores.shape[0])]
        for r, t in torch.isfinite(scores).nonzero().tolist():
            rows[r].append(t)
        return rows

    def _kept(self, scaled: torch.Tensor, tokens: torch.Tensor) -> list[list[int]]:
        """Per row, the ids the truncation kept: the same sets the processed log-probs normalise over.

        Computed apart from the draw (so asking for the mask never changes the
        samples), with the rule the log-prob path uses: min-p alone compares
        probabilities against ``min_p`` times the peak; anything with top-k or
        top-p takes the kept prefix of the sorted candidates.
        """
        if self.by_rejection and self.top_p is None:
            assert self.min_p is not None
            probs = torch.softmax(scaled, dim=-1)
            keep = probs >= self.min_p * probs.amax(dim=-1, keepdim=True)
            rows: list[list[int]] = [[] for _ in range(scaled.shape[0])]
            for r, t in keep.nonzero().tolist():
                rows[r].append(t)
        else:
            _, ids, _, _, last = self._candidates(scaled)
            counts = (last.squeeze(-1) + 1).tolist()
            width = max(counts) if counts else 0
            rows = [row[:c] for row, c in zip(ids[:, :width].tolist(), counts)]
        if self.constraints is not None and self.constraints.masks:  # a top-k candidate may be a removed token
            finite = torch.isfinite(scaled)
            rows = [[t for t in row if finite[r, t]] for r, row in enumerate(rows)]
        # Exact ties in probability are broken differently by the rejection draw and the sorted
        # candidates; the drawn token is in its support by definition.
        for row, t in zip(rows, tokens.tolist()):
            if t not in row:
                row.append(t)
        return rows

    def _finish_full(self, tokens: torch.Tensor, scores: torch.Tensor, ws: Workspace | None = None) -> StepResult:
        """Log-probs of ``tokens`` (and the top-n) under the log-softmax of ``scores``."""
        logprobs = torch.ops.aten._log_softmax.out(scores, -1, False, out=_out(ws, "logprobs", scores))
        chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if not self.top_n:
            return StepResult(tokens, chosen)
        top_lp, top_ids = logprobs.topk(min(self.top_n, logprobs.shape[-1]), dim=-1)
        return StepResult(tokens, chosen, top_ids, top_lp)

    @staticmethod
    def _inverse_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """The first token of each row whose cumulative probability exceeds ``u`` times the total.

        The target stays strictly below the total, so the token found always has
        a probability above zero (its cumulative probability rises past the target).
        """
        total = cdf[:, -1:]
        below_total = torch.nextafter(total, torch.zeros_like(total))
        target = torch.minimum(uniforms.to(cdf.device).unsqueeze(-1) * total, below_total)
        return torch.searchsorted(cdf, target, right=True).squeeze(-1)

    # -- the untruncated distribution -------------------------------------------------------
    def _sample_full(
        self, scaled: torch.Tensor, raw: torch.Tensor, uniforms: torch.Tensor, ws: Workspace | None = None
    ) -> StepResult:
        probs = _softmax(scaled, ws)
        tokens = self._inverse_cdf(_cumsum(probs, ws), uniforms)
        if not self.want_logprobs:
            return StepResult(tokens)
        return self._finish_full(tokens, raw if self.raw_mode else scaled, ws)

    # -- top-p / min-p by rejection ---------------------------------------------------------------
    def _survives(
        self, probs: torch.Tensor, peak: torch.Tensor | None, tokens: torch.Tensor, ws: Workspace | None = None
    ) -> torch.Tensor:
        """Whether each row's token survives top-p and min-p (``peak``: each row's largest probability)."""
        p = probs.gather(-1, tokens.unsqueeze(-1))
        ok = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        if self.min_p is not None:
            assert peak is not None
            ok &= (p >= self.min_p * peak).squeeze(-1)
        if self.top_p is not None:
            # A token holding more than 1 - top_p of the mass is inside the nucleus whatever the
            # rest; only the others need the pass over the vocabulary.
            unsure = (p.squeeze(-1) <= 1.0 - self.top_p).nonzero().flatten()
            if unsure.numel() * 2 > len(tokens):
                higher = torch.gt(probs, p, out=_out(ws, "higher", probs, torch.bool))
                above = torch.where(higher, probs, probs.new_zeros(()), out=_out(ws, "above", probs))
                ok &= above.sum(dim=-1) < self.top_p  # mass ranked above
            elif unsure.numel():
                rows = probs[unsure]
                ok[unsure] &= torch.where(rows > p[unsure], rows, 0.0).sum(dim=-1) < self.top_p
        return ok

    def _sample_by_rejection(
        self, scaled: torch.Tensor, raw: torch.Tensor, uniforms: torch.Tensor, redraw: Redraw, ws: Workspace | None
    ) -> StepResult:
        probs = _softmax(scaled, ws)
        cdf = _cumsum(probs, ws)
        peak = probs.amax(dim=-1, keepdim=True) if self.min_p is not None else None
        tokens = self._inverse_cdf(cdf, uniforms)
        pending = (~self._survives(probs, peak, tokens, ws)).nonzero().flatten().tolist()
        for _ in range(_MAX_REDRAWS):
            if not pending:
                break
            idx = torch.tensor(pending, device=scaled.device)
            again = self._inverse_cdf(cdf[idx], redraw(pending))
            ok = self._survives(probs[idx], None if peak is None else peak[idx], again).tolist()
            tokens[idx] = again
            pending = [row for row, kept in zip(pending, ok) if not kept]
        if pending:  # a tiny kept mass: find it exactly instead
            idx = torch.tensor(pending, device=scaled.device)
            tokens[idx] = self._sample_candidates(scaled[idx], raw[idx], redraw(pending)).tokens
        if not self.want_logprobs:
            return StepResult(tokens)
        if self.raw_mode:
            return self._finish_full(tokens, raw, ws)
        # Processed log-probs need the kept mass. Under min-p alone that is one pass; under
        # top-p it takes the boundary, found over the largest probabilities (only the
        # normaliser comes from there: the token was drawn above, so asking for log-probs
        # never changes what is sampled).
        if self.top_p is None:
            assert self.min_p is not None and peak is not None
            threshold = self.min_p * peak
            log_kept = torch.log(torch.where(probs >= threshold, probs, 0.0).sum(dim=-1, keepdim=True))
            chosen = (torch.log(probs.gather(-1, tokens.unsqueeze(-1))) - log_kept).squeeze(-1)
            if not self.top_n:
                return StepResult(tokens, chosen)
            values, ids = probs.topk(min(self.top_n, probs.shape[-1]), dim=-1)
            top_lp = torch.where(values >= threshold, torch.log(values) - log_kept, -math.inf)
            return StepResult(tokens, chosen, ids, top_lp)
        return self._nucleus_logprobs(probs, tokens)

    def _nucleus_logprobs(self, probs: torch.Tensor, tokens: torch.Tensor) -> StepResult:
        """Processed log-probs under top-p (and min-p with it), from the probabilities the draw used."""
        assert self.top_p is not None
        n = min(self.top_n, probs.shape[-1])
        top_ids: torch.Tensor | None
        top_lp: torch.Tensor | None
        found = native.nucleus(probs, self.top_p, self.min_p) if self.native else None
        if found is None:
            log_mass, top_ids, top_lp = self._nucleus_topk(probs, n)
        else:
            mass, threshold = found
            log_mass = torch.log(mass)
            top_ids = top_lp = None
            if n:  # a topk of width 0 still costs a pass
                values, top_ids = probs.topk(n, dim=-1)
                top_lp = torch.where(values >= threshold, torch.log(values) - log_mass, -math.inf)
        chosen = (torch.log(probs.gather(-1, tokens.unsqueeze(-1))) - log_mass).squeeze(-1)
        if not n:
            return StepResult(tokens, chosen)
        return StepResult(tokens, chosen, top_ids, top_lp)

    def _nucleus_topk(self, probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's log nucleus mass and its top-``n`` ids and processed log-probs, found by ``topk``.

        The kept set is a prefix of each row's probabilities sorted down;
        ``topk`` finds it, starting ``_FIRST_CANDIDATES`` wide and widening x4
        only for the rows whose prefix is not closed yet (a nucleus of thousands
        of tokens in one row no longer widens every row's search).
        """
        assert self.top_p is not None
        rows, vocab = probs.shape
        log_mass = probs.new_empty(rows, 1)
        top_ids = torch.zeros(rows, n, dtype=torch.long, device=probs.device)
        top_lp = probs.new_empty(rows, n)
        todo = torch.arange(rows, device=probs.device)
        sub = probs
        k = min(vocab, max(_FIRST_CANDIDATES, n))
        while True:
            values, ids = sub.topk(k, dim=-1)
            cum = values.cumsum(dim=-1)
            keep = (cum - values) < self.top_p
            if self.min_p is not None:
                keep &= values >= self.min_p * values[:, :1]
            kept = keep.sum(dim=-1, keepdim=True).clamp_(min=1)
            closed = (kept < k).squeeze(-1) if k < vocab else torch.ones_like(kept, dtype=torch.bool).squeeze(-1)
            if closed.any():
                at = todo[closed]
                mass = torch.log(cum.gather(-1, kept - 1)[closed])
                log_mass[at] = mass
                if n:
                    top = torch.log(values[closed, :n]) - mass
                    beyond = torch.arange(n, device=probs.device).unsqueeze(0) >= kept[closed]
                    top_ids[at] = ids[closed, :n]
                    top_lp[at] = top.masked_fill(beyond, -math.inf)
            if bool(closed.all()):
                break
            todo = todo[~closed]
            sub = probs[todo]
            k = vocab if 4 * k > vocab // 2 else 4 * k
        return log_mass, top_ids, top_lp

    def _candidate_logprobs(
        self,
        tokens: torch.Tensor,
        token_values: torch.Tensor,
        values: torch.Tensor,
        ids: torch.Tensor,
        cum: torch.Tensor,
        ref_lse: torch.Tensor,
        last: torch.Tensor,
    ) -> StepResult:
        """Processed log-probs from the sorted candidates (see :meth:`_candidates`)."""
        log_norm = ref_lse + torch.log(cum.gather(-1, last))
        chosen = (token_values - log_norm).squeeze(-1)
        if not self.top_n:
            return StepResult(tokens, chosen)
        n = min(self.top_n, values.shape[-1])
        top = values[:, :n] - log_norm
        positions = torch.arange(n, device=values.device).unsqueeze(0)
        return StepResult(tokens, chosen, ids[:, :n], top.masked_fill(positions > last, -math.inf))

    # -- top-k (and top-p / min-p with it) over sorted candidates ----------------------------------
    def _candidates(
        self, scaled: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sorted top candidates of each row, and the prefix of them that survives truncation.

        Returns ``(values, ids, cum, ref_lse, last)``: the ``[rows, K]`` sorted
        scaled logits and their token ids, the cumulative probabilities of the
        candidates (normalised over the vocabulary, or over the top-k survivors
        when top-k is on), that normaliser, and ``[rows, 1]`` the index of each
        row's last kept candidate. Every kept token of the vocabulary is among
        the K candidates.
        """
        vocab = scaled.shape[-1]
        want = max(self.top_n, self.top_k or 0)
        k = min(vocab, max(self.top_k or self._width, want))
        full_lse = None if self.top_k is not None else torch.logsumexp(scaled, dim=-1, keepdim=True)
        while True:
            values, ids = scaled.topk(k, dim=-1)
            if full_lse is None:  # noqa: SIM108  top-p and min-p renormalise over the top-k survivors
                ref_lse = torch.logsumexp(values[:, : self.top_k], dim=-1, keepdim=True)
            else:
                ref_lse = full_lse
            probs = torch.exp(values - ref_lse)
            cum = probs.cumsum(dim=-1)
            # each rule keeps a prefix; count the kept candidates of each row
            keep = None
            if self.top_p is not None:
                keep = (cum - probs) < self.top_p
            if self.log_min_p is not None:
                rule = (values - values[:, :1]) >= self.log_min_p
                keep = rule if keep is None else keep & rule
            if keep is None:
                kept = torch.full((values.shape[0], 1), min(k, self.top_k or k), device=values.device)
            else:
                if self.top_k is not None and self.top_k < k:
                    keep[:, self.top_k :] = False
                kept = keep.sum(dim=-1, keepdim=True).clamp_(min=1)
            most = int(kept.max()) if kept.numel() else 1
            if k == vocab or (self.top_k is not None and self.top_k <= k) or most < k:
                if self.top_k is None:  # start the next step where this one ended
                    self._width = max(_FIRST_CANDIDATES, 1 << (2 * most - 1).bit_length())
                return values, ids, cum, ref_lse, kept - 1
            k = vocab if 4 * k > vocab // 2 else 4 * k

    def _sample_candidates(self, scaled: torch.Tensor, raw: torch.Tensor, uniforms: torch.Tensor) -> StepResult:
        values, ids, cum, ref_lse, last = self._candidates(scaled)
        # the kept candidates are a prefix, so their cumulative probabilities are `cum` up to `last`
        kept_mass = cum.gather(-1, last)
        target = uniforms.to(cum.device).unsqueeze(-1) * kept_mass
        pick = torch.minimum(torch.searchsorted(cum, target, right=True), last)
        tokens = ids.gather(-1, pick).squeeze(-1)
        if not self.want_logprobs:
            return StepResult(tokens)
        if self.raw_mode:
            return self._finish_full(tokens, raw)
        return self._candidate_logprobs(tokens, values.gather(-1, pick), values, ids, cum, ref_lse, last)
