"""The requests of one sampling run on vLLM's loop: one per prompt, reported as vLLM ends them.

The engine checks a run and maps its errors; :class:`RunRequests` turns it
into vLLM requests on the engine's loop thread: one per prompt, keyed in the
prefix cache by weights version and adapter (:func:`cache_salt`), re-scored
where ``logprobs_mode='raw'`` asks for it, continued under a grammar, and all
aborted together when the run stops or one of them fails.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from vllm import SamplingParams as VllmSamplingParams
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from twinkle_core.data_format import SamplingParams
from twinkle_core.engine import AdapterMerger, EngineRun
from twinkle_core.errors import UnsupportedFeatureError
from twinkle_vllm._convert import Plan, report_completion, scoring_params
from twinkle_vllm._logits import GRAMMAR_ARG
from twinkle_vllm._media import PromptMedia
from twinkle_vllm._process import EngineProcess

__all__ = ["RunRequests", "cache_salt"]


def cache_salt(version: int, lora: LoRARequest | None, merge_id: int = 0) -> str:
    """vLLM's per-request prefix-cache salt: the weights version and the adapter load.

    Requests share cached KV only when their salts are equal, so a prompt is
    prefilled once per version and adapter and never reused across a weight
    update. The adapter part is vLLM's id of the load, fresh on every
    (re)load, so a replaced adapter never meets its predecessor's KV. A
    merged adapter (``merge_id``, fresh on every merge) has its own part:
    removing it restores the base weights without a new version, and the
    base model must not meet KV computed by the merged weights.
    """
    if merge_id:
        return f"twinkle-w{version}-m{merge_id}"
    return f"twinkle-w{version}-a{lora.lora_int_id if lora is not None else 0}"


class RunRequests:
    """The vLLM requests of sampling runs, as coroutines on the engine's loop.

    Args:
        process: the engine's vLLM processes (its ``AsyncLLM`` and facts, read on every call: a restart replaces them).
        merged: the engine's merged adapter (its ``merge_id`` keys the prefix cache).
        eos_token_ids: the ids vLLM ends a sequence on (a grammar's continuation stops there).
        grammar_processor: whether twinkle's grammar logits processor is installed (continuations need it).
    """

    def __init__(
        self,
        process: EngineProcess,
        merged: AdapterMerger,
        eos_token_ids: Callable[[], tuple[int, ...]],
        *,
        grammar_processor: bool,
    ) -> None:
        self._process = process
        self._merged = merged
        self._eos_token_ids = eos_token_ids
        self._grammar_processor = grammar_processor
        self._media = PromptMedia(process)

    async def run_all(self, run: EngineRun, plan: Plan, lora: LoRARequest | None, version: int) -> list[Any]:
        """Every prompt of ``run`` as one request; a stop of the run aborts them all.

        Every prompt is rendered for vLLM first (its images expanded by vLLM and checked against the
        template's ids, see :mod:`twinkle_vllm._media`), so a refused prompt refuses the run before any request.
        """
        request_ids = [uuid.uuid4().hex for _ in run.prompts]
        salt = cache_salt(version, lora, self._merged.merge_id if self._merged.name is not None else 0)
        rendered = [
            await self._media.prompt(prompt, list(prompt.input_ids), p, run.generated[p], salt)
            for p, prompt in enumerate(run.prompts)
        ]
        tasks = [
            asyncio.ensure_future(self._run_one(run, p, request_ids[p], plan, lora, salt, rendered[p]))
            for p in range(len(run.prompts))
        ]
        loop = asyncio.get_running_loop()

        def stop() -> None:  # from the thread that aborted: abort the requests on the loop
            asyncio.run_coroutine_threadsafe(self._abort_requests(request_ids), loop)

        run.stop_event.add_callback(stop)
        try:
            results: list[Any] = await asyncio.gather(*tasks)
            return results
        except BaseException:
            # One failed (or we were cancelled): abort the others, do not leak requests.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            run.stop_event.remove_callback(stop)

    async def _abort_requests(self, request_ids: list[str]) -> None:
        if self._process.engine is not None:
            await self._process.engine.abort(request_ids)

    async def request(
        self,
        prompt: Any,
        kwargs: dict[str, Any],
        lora: LoRARequest | None,
        request_id: str | None = None,
        on_output: Any = None,
    ) -> Any:
        """One vLLM request; ``on_output`` sees every cumulative output (to report finished completions).

        ``prompt`` is vLLM's input (:meth:`PromptMedia.prompt`), its ``cache_salt`` keying the prefix cache on
        the weights version and adapter (see ``cache_salt``).
        """
        engine = self._process.engine
        assert engine is not None
        kind = RequestOutputKind.CUMULATIVE if on_output is not None else RequestOutputKind.FINAL_ONLY
        if isinstance(kwargs.get("structured_outputs"), dict):
            kwargs = {**kwargs, "structured_outputs": StructuredOutputsParams(**kwargs["structured_outputs"])}
        params = VllmSamplingParams(**kwargs, output_kind=kind)
        final = None
        latest: dict[int, Any] = {}  # with n > 1 a cumulative output may carry only the completions that moved
        prompt_logprobs = None
        async for out in engine.generate(prompt, params, request_id or uuid.uuid4().hex, lora_request=lora):
            final = out
            for completion in out.outputs:
                latest[completion.index] = completion
            if out.prompt_logprobs is not None and prompt_logprobs is None:
                prompt_logprobs = out.prompt_logprobs
            if on_output is not None:
                await on_output(out)
        if final is not None and on_output is not None:
            final.outputs = [latest[i] for i in sorted(latest)]
            if final.prompt_logprobs is None:
                final.prompt_logprobs = prompt_logprobs
        return final

    async def _run_one(
        self, run: EngineRun, p: int, request_id: str, plan: Plan, lora: LoRARequest | None, salt: str, prompt: Any
    ) -> tuple[Any, list[Any] | None]:
        ids = list(run.prompts[p].input_ids)
        kwargs = plan.for_prompt(len(ids), self._process.facts.max_model_len)
        if kwargs is None:
            return None, None
        if not plan.scoring and run.max_tokens[p] < kwargs["max_tokens"]:
            kwargs = {**kwargs, "max_tokens": run.max_tokens[p]}
        if plan.params.structured_outputs is not None and run.generated[p]:
            kwargs = self._continued_grammar(kwargs, ids[len(ids) - run.generated[p] :], plan.params)
        if plan.params.min_tokens:
            # a continuation's prompt ends with what it generated before: min_tokens counts those too
            left = max(0, plan.params.min_tokens - run.generated[p])
            kwargs = {**kwargs, "min_tokens": min(left, kwargs["max_tokens"])}
        k = plan.params.logprobs or 0
        rescored: dict[int, Any] = {}
        reported: set[int] = set()

        async def report(out: Any) -> None:
            for completion in out.outputs:
                if completion.finish_reason is None or completion.index in reported:
                    continue
                reported.add(completion.index)
                raw = None
                if plan.rescore_raw and not plan.scoring:
                    raw = await self.request(await rescored_prompt(completion), scoring_params(k), lora)
                    rescored[completion.index] = raw
                report_completion(run, p, ids, completion, raw, plan)

        async def rescored_prompt(completion: Any) -> Any:  # the prompt and a completion, as one prompt
            full = ids + list(completion.token_ids)
            return await self._media.prompt(run.prompts[p], full, p, run.generated[p], salt)

        final = await self.request(prompt, kwargs, lora, request_id, on_output=report)
        if not plan.rescore_raw:
            return final, None
        missing = [o for o in final.outputs if o.index not in rescored]
        for o, raw in zip(
            missing,
            await asyncio.gather(*[self.request(await rescored_prompt(o), scoring_params(k), lora) for o in missing]),
        ):
            rescored[o.index] = raw
        return final, [rescored[o.index] for o in final.outputs]

    def _continued_grammar(self, kwargs: dict[str, Any], done: list[int], params: SamplingParams) -> dict[str, Any]:
        """A continuation's request under its constraint: twinkle's processor, fed ``done`` first.

        vLLM would start the grammar over at the continuation's first token
        (``_logits.GrammarProcessor`` says why and how this differs).
        """
        assert params.structured_outputs is not None
        if not self._grammar_processor:
            raise UnsupportedFeatureError(
                "SamplingParams.structured_outputs cannot be continued (resume(), or in_flight='keep') on this"
                " engine: it needs twinkle's logits processor, which speculative decoding turns off."
            )
        stops = sorted(set(self._eos_token_ids()) | set(params.stop_token_ids))
        grammar = {
            "spec": params.structured_outputs.to_dict(),
            "done": done,
            "stops": stops,
            "vocab": self._process.facts.vocab_size,
        }
        extra = {**(kwargs.get("extra_args") or {}), GRAMMAR_ARG: grammar}
        return {**kwargs, "structured_outputs": None, "extra_args": extra}
