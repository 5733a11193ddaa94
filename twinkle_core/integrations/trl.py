"""TRL's ``GRPOTrainer`` with twinkle generating: ``GRPOTrainer(..., rollout_func=TwinkleRollout(sampler))``.

:class:`TwinkleRollout` is the whole integration. It is TRL's ``rollout_func``
(TRL calls it with the prompts of a generation batch and the trainer) and a
``TrainerCallback`` (it adds its own figures to TRL's logs). Each call:

1. **Keeps the sampler on the policy.** When the trainer's ``global_step`` has
   moved since the last push (and on the first call), it pushes the trainer's
   model: a PEFT model's active adapter with ``add_adapter_to_model`` (the
   adapter's tensors only, never the whole model), any other model's
   ``state_dict`` with ``update_weights`` (floating tensors in the dtype the
   sampler holds its weights in, which an engine such as vLLM requires). That is TRL's own rule for vLLM
   (``sync_weights`` when ``global_step`` changes), so ``steps_per_generation``,
   ``num_iterations`` and gradient accumulation need nothing more. When
   training ends it pushes once more, so the sampler holds the final policy.
2. **Samples with TRL's settings**, mapped once by :func:`trl_sampling_params`
   (a setting twinkle cannot honour is an error naming it). TRL hands each
   prompt repeated ``num_generations`` times in a row; each run of equal
   prompts becomes one input with that many samples, and the completions come
   back in TRL's order. Conversational prompts go through the sampler's
   template (with ``chat_template_kwargs``), plain ones through its tokenizer
   as TRL tokenizes them.
3. **Checks what it got.** Every sample must carry the version and adapter the
   last push returned (else :class:`~twinkle_core.errors.StalePolicyError`);
   every ``verify_every`` calls, ``verify_samples`` completions are scored by
   the trainer's model and compared with the sampler's log-probs (else
   :class:`~twinkle_core.errors.PolicyMismatchError`). The first check catches
   a push that never happened; the second a sampler that was told the new
   weights and does not run them.

Returned to TRL: ``prompt_ids`` (the tokens the sampler conditioned on),
``completion_ids``, ``logprobs`` (``logprobs_mode="processed"``: the
distribution each token was drawn from, what TRL's importance-sampling code
expects of vLLM) and, for reward functions, ``weights_version`` and
``stop_reason`` per completion.

This module imports torch, transformers and (when a PEFT model is pushed) peft;
``import twinkle_core`` does not import it. See ``docs/trl.md``.
"""

from __future__ import annotations

import json
import math
import random
import time
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import TrainerCallback

from twinkle_core.data_format import InputFeature, SampledSequence, SamplingParams, Trajectory
from twinkle_core.data_format.media import PER_TOKEN_INPUTS
from twinkle_core.errors import (
    ConfigError,
    InvalidSamplingParams,
    PolicyMismatchError,
    StalePolicyError,
    UnsupportedFeatureError,
    did_you_mean,
)

__all__ = ["GENERATION_KWARGS", "TwinkleRollout", "trl_sampling_params"]

#: ``generation_kwargs`` keys twinkle honours (vLLM's ``SamplingParams`` names and Hugging Face
#: ``GenerationConfig``'s), and the ``SamplingParams`` field each sets. ``do_sample=False`` means greedy.
GENERATION_KWARGS: Mapping[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_tokens",
    "max_new_tokens": "max_tokens",
    "seed": "seed",
    "stop": "stop",
    "stop_strings": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "do_sample": "temperature",
    "return_routed_experts": "return_routed_experts",
}

# Set by the integration itself: the number of samples comes from num_generations, log-probs are always returned.
_OWNED = ("n", "num_samples", "num_return_sequences", "logprobs", "logprobs_mode", "prompt_logprobs")


def _top_k(value: Any) -> Any:
    return -1 if value in (0, None) else value  # TRL's (and vLLM's, HF's) "disabled" is 0; twinkle's is -1


def _checked(source: str, field: str, value: Any) -> Any:
    """``value`` for ``SamplingParams.field``, or an error that names the TRL setting it came from."""
    try:
        SamplingParams(**{field: value})
    except InvalidSamplingParams as exc:
        raise InvalidSamplingParams(f"{source}={value!r} cannot be honoured: {exc}") from None
    return value


def trl_sampling_params(args: Any, *, context_window: int | None = None) -> SamplingParams:
    """The ``SamplingParams`` a ``GRPOConfig`` asks for (``num_samples`` is set per call).

    ``top_k=0`` and ``min_p=None`` (TRL's "off") become twinkle's ``-1`` and
    ``0``; ``max_completion_length=None`` leaves generation bounded by the
    context window only (``max_tokens=context_window``, the sampler's
    ``max_model_len``; a sequence ends where the window does). ``generation_kwargs``
    override the named settings, as in TRL; an unknown key, or one the
    integration sets itself, is an error.

    Raises:
        InvalidSamplingParams: a value out of range, naming the TRL setting.
        UnsupportedFeatureError: a ``generation_kwargs`` key or a setting twinkle does not honour.
    """
    fields: dict[str, Any] = {
        "temperature": _checked("GRPOConfig.temperature", "temperature", args.temperature),
        "top_p": _checked("GRPOConfig.top_p", "top_p", args.top_p),
        "top_k": _checked("GRPOConfig.top_k", "top_k", _top_k(args.top_k)),
        "min_p": _checked("GRPOConfig.min_p", "min_p", 0.0 if args.min_p is None else args.min_p),
        "repetition_penalty": _checked("GRPOConfig.repetition_penalty", "repetition_penalty", args.repetition_penalty),
    }
    if args.max_completion_length is not None:
        fields["max_tokens"] = _checked("GRPOConfig.max_completion_length", "max_tokens", args.max_completion_length)
    elif context_window is not None:
        fields["max_tokens"] = context_window
    else:
        raise ConfigError(
            "GRPOConfig.max_completion_length=None needs the sampler's context window:"
            " pass context_window=sampler.max_model_len (TwinkleRollout does)."
        )
    if getattr(args, "vllm_structured_outputs_regex", None) is not None:
        raise UnsupportedFeatureError(
            f"GRPOConfig.vllm_structured_outputs_regex={args.vllm_structured_outputs_regex!r}: twinkle does not"
            " constrain generation yet; leave it None."
        )
    gen = args.generation_kwargs or {}
    if isinstance(gen, str):
        gen = json.loads(gen)
    for key, value in gen.items():
        if key in _OWNED:
            raise UnsupportedFeatureError(
                f"generation_kwargs[{key!r}]={value!r}: TwinkleRollout sets it (samples per prompt from"
                " num_generations, log-probs always in 'processed' mode); remove it."
            )
        if key not in GENERATION_KWARGS:
            hint = did_you_mean(key, GENERATION_KWARGS)
            raise UnsupportedFeatureError(
                f"generation_kwargs[{key!r}]={value!r} is not honoured by twinkle.{hint}"
                f" Accepted keys: {', '.join(sorted(GENERATION_KWARGS))}."
            )
        if value is None:  # Hugging Face's "unset"
            continue
        field = GENERATION_KWARGS[key]
        if key == "do_sample":
            if not isinstance(value, bool):
                raise InvalidSamplingParams(f"generation_kwargs['do_sample']={value!r} is invalid: expected a bool.")
            if not value:
                fields["temperature"] = 0.0
            continue
        if key == "top_k":
            value = _top_k(value)
        if key == "stop_strings" and isinstance(value, str):
            value = [value]
        fields[field] = _checked(f"generation_kwargs[{key!r}]", field, value)
    return SamplingParams(**fields, logprobs=0)


def _is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) and "role" in prompt[0]


def _runs(prompts: Sequence[Any]) -> list[tuple[int, int]]:
    """``(first index, length)`` of each run of equal consecutive prompts."""
    runs: list[tuple[int, int]] = []
    for i, prompt in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == prompt:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _plain(params: SamplingParams) -> bool:
    """Whether processed log-probs are ``log_softmax(logits / T)``, the trainer's own formula."""
    return (
        not params.greedy
        and params.top_k == -1
        and params.top_p == 1.0
        and params.min_p == 0.0
        and params.repetition_penalty == 1.0
    )


def _media_kwargs(media: Mapping[str, Any], length: int, device: Any, dtype: torch.dtype) -> dict[str, Any]:
    """A prompt's processed media inputs as the forward over ``length`` tokens (prompt and completion) reads them."""
    out = {}
    for key, value in media.items():
        tensor = torch.tensor(value)  # a copy: the arrays may be read-only (from Ray's object store)
        if key in PER_TOKEN_INPUTS:  # [1, prompt length]: zeros under the completion
            tensor = torch.nn.functional.pad(tensor, (0, length - tensor.shape[-1]))
        out[key] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    return out


def _sent(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A copy of a trainer's tensor to push: a floating one in ``dtype``, the one the sampler holds weights in.

    An engine may take only its own dtype (vLLM does: Qwen3.5's CPU path runs
    bfloat16 while TRL trains in float32); the trainer's values are what it
    serves either way, rounded as the engine would hold them.
    """
    if dtype is not None and tensor.is_floating_point():
        return tensor.detach().to(dtype=dtype, copy=True)
    return tensor.detach().clone()


def _model_logprobs(
    model: Any,
    rows: Sequence[tuple[list[int], list[int]]],
    temperature: float,
    media: Sequence[Mapping[str, Any] | None] | None = None,
) -> list[list[float]]:
    """The model's log-prob of each completion token given what precedes it (no grad, dropout off).

    ``media``: per row, its prompt's processed media inputs (``InputFeature.multimodal``) or ``None``; a
    row with media is scored in a forward of its own, with them.
    """
    parameter = next(model.parameters())
    device = parameter.device
    media = list(media) if media is not None else [None] * len(rows)
    text = [i for i, m in enumerate(media) if not m]
    groups = ([text] if text else []) + [[i] for i, m in enumerate(media) if m]
    out: list[list[float]] = [[] for _ in rows]
    was_training = model.training
    model.eval()
    try:
        for group in groups:
            picked = [rows[i] for i in group]
            width = max(len(p) + len(c) for p, c in picked)
            ids = torch.zeros(len(picked), width, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for j, (p, c) in enumerate(picked):
                ids[j, : len(p) + len(c)] = torch.tensor(p + c)
                attn[j, : len(p) + len(c)] = 1
            first = media[group[0]]
            extra = _media_kwargs(first, width, device, parameter.dtype) if first else {}
            with torch.no_grad():
                # the class's forward, not the instance's: under mixed precision accelerate wraps the instance's in
                # autocast, and the check is about the weights the sampler serves, compared in their own precision
                forward = type(model).forward
                logits = forward(model, input_ids=ids.to(device), attention_mask=attn.to(device), **extra).logits
            for j, (p, c) in enumerate(picked):
                scores = logits[j, len(p) - 1 : len(p) + len(c) - 1].float()
                if temperature > 0:
                    scores = scores / temperature
                chosen = torch.tensor(c, device=scores.device).unsqueeze(-1)
                out[group[j]] = torch.log_softmax(scores, dim=-1).gather(-1, chosen).squeeze(-1).tolist()
    finally:
        model.train(was_training)
    return out


class TwinkleRollout(TrainerCallback):  # type: ignore[misc]
    """TRL's ``rollout_func`` backed by a twinkle sampler, keeping it on the trainer's policy.

    Args:
        sampler: any twinkle sampler (in process, a Ray ``remote_group`` one, ...) over the
            trainer's base model.
        adapter_name: the name a PEFT policy is served under.
        merge: serve a PEFT policy merged into the base weights (``add_adapter_to_model(...,
            merge=...)``, for engines that offer it); ``None`` leaves the engine's default.
        sync_weights: push the policy when the trainer's step moves (default). ``False`` samples
            whatever the sampler holds: the log-prob check is then what notices a moving policy.
        verify_every: score ``verify_samples`` completions with the trainer's model every this many
            calls (1: every call; 0: never).
        verify_samples: how many completions a check scores, spread over the batch.
        tolerance: the largest sampler/trainer log-prob difference a check accepts. The check
            runs the trainer's weights in their own precision (not under accelerate's autocast):
            float32 weights agree with twinkle's float32 engines to about 1e-5; bfloat16 weights,
            or a sampler in another precision than the trainer, need more.
        on_mismatch: ``"raise"`` (default) or ``"warn"`` when a check exceeds ``tolerance``.

    Attributes:
        history: one dict per call: ``step``, ``version``, ``completions``, ``push_s``,
            ``generate_s`` and, when checked, ``logp_diff_mean`` / ``logp_diff_max``.
    """

    def __init__(
        self,
        sampler: Any,
        *,
        adapter_name: str = "policy",
        merge: bool | None = None,
        sync_weights: bool = True,
        verify_every: int = 1,
        verify_samples: int = 2,
        tolerance: float = 1e-3,
        on_mismatch: str = "raise",
    ) -> None:
        if not isinstance(adapter_name, str) or not adapter_name:
            raise ConfigError(f"adapter_name={adapter_name!r} is invalid: expected a non-empty string.")
        if not isinstance(sync_weights, bool):
            raise ConfigError(f"sync_weights={sync_weights!r} is invalid: expected True or False.")
        if merge is not None and not isinstance(merge, bool):
            raise ConfigError(f"merge={merge!r} is invalid: expected True, False or None.")
        for name, value in (("verify_every", verify_every), ("verify_samples", verify_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} is invalid: expected an integer >= 0.")
        if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not tolerance > 0:
            raise ConfigError(f"tolerance={tolerance!r} is invalid: expected a number > 0.")
        if on_mismatch not in ("raise", "warn"):
            raise ConfigError(f"on_mismatch={on_mismatch!r} is invalid: expected 'raise' or 'warn'.")
        self.sampler = sampler
        self.adapter_name = adapter_name
        self.merge = merge
        self.sync_weights = sync_weights
        self.verify_every = verify_every
        self.verify_samples = verify_samples
        self.tolerance = float(tolerance)
        self.on_mismatch = on_mismatch
        self.history: list[dict[str, Any]] = []
        self.version: int | None = None  # what the last push returned
        self.serving = ""  # the adapter the policy is served under ("" = base weights)
        self._pushed_step: int | None = None
        self._trainer: Any = None
        self._params: SamplingParams | None = None
        self._template: Any = None
        self._rng = random.Random(0)
        self._calls = 0
        self._pending: dict[str, list[float]] = defaultdict(list)

    # -- TRL's rollout_func ------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        if self._trainer is not trainer:
            self._bind(trainer)
        assert self._params is not None
        step = trainer.state.global_step
        push_s = 0.0
        if self.sync_weights and step != self._pushed_step:
            t = time.perf_counter()
            self._push(trainer)
            push_s = time.perf_counter() - t
            self._pushed_step = step
        t = time.perf_counter()
        seqs, prompt_ids = self._generate(prompts)
        generate_s = time.perf_counter() - t
        self._check_versions(seqs, step)
        record: dict[str, Any] = {
            "step": step,
            "version": self.sampler.weights_version if self.version is None else self.version,
            "completions": len(seqs),
            "push_s": push_s,
            "generate_s": generate_s,
        }
        self._calls += 1
        if self.verify_every and self.verify_samples and (self._calls - 1) % self.verify_every == 0:
            record.update(self._verify(trainer, seqs, prompt_ids, step))
        self.history.append(record)
        for key in ("push_s", "generate_s"):
            self._pending[f"twinkle/{key}"].append(record[key])
        self._pending["twinkle/weights_version"].append(record["version"])
        self._pending["twinkle/policy_lag_steps"].append(step - (self._pushed_step or 0))
        out: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "completion_ids": [list(s.tokens) for s in seqs],
            "logprobs": [list(s.logprobs or ()) for s in seqs],
            "weights_version": [s.weights_version for s in seqs],
            "stop_reason": [s.stop_reason for s in seqs],
        }
        if any(s.routed_experts is not None for s in seqs):
            # generation_kwargs={"return_routed_experts": True}: per completion, for a loss of the user's own that
            # replays them (twinkle_core.rl.RoutingReplay); TRL's loss does not
            out["routed_experts"] = [s.routed_experts for s in seqs]
        return out

    def _bind(self, trainer: Any) -> None:
        """Read the trainer's settings once: what to sample with, and what twinkle cannot do."""
        args = trainer.args
        if getattr(args, "use_vllm", False):
            raise ConfigError(
                "GRPOConfig.use_vllm=True makes TRL start (and sync weights into) its own vLLM as well;"
                " with TwinkleRollout twinkle generates: set use_vllm=False."
            )
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            raise UnsupportedFeatureError(
                "GRPOTrainer(tools=... / environment_factory=...) runs TRL's own tool loop, which generates"
                " with TRL's generator, not the rollout_func; use twinkle's agent loop (docs/agents.md) instead."
            )
        self._params = trl_sampling_params(args, context_window=self.sampler.max_model_len)
        options = getattr(trainer, "chat_template_kwargs", None) or {}
        template = self.sampler.template
        self._template = template.with_options(**options) if options else template
        self._rng = random.Random(args.seed)
        self._trainer = trainer
        self._pushed_step = None  # a new trainer starts from its own weights: push them on this call
        self.version = None
        # first in line, so TRL's printer and the reporters (wandb, trackio, ...) see the figures it adds
        handler = trainer.callback_handler
        if self not in handler.callbacks:
            handler.callbacks.insert(0, self)

    def _push(self, trainer: Any) -> None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        if getattr(model, "peft_config", None) and hasattr(model, "active_adapter"):
            from peft import get_peft_model_state_dict

            name = model.active_adapter
            weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
            options = {} if self.merge is None else {"merge": self.merge}
            self.version = self.sampler.add_adapter_to_model(
                self.adapter_name, model.peft_config[name], weights=weights, **options
            )
            self.serving = self.adapter_name
        else:
            into = self.sampler.engine.info.weights_dtype
            dtype = getattr(torch, into) if into else None
            self.version = self.sampler.update_weights([(k, _sent(v, dtype)) for k, v in model.state_dict().items()])
            self.serving = ""

    def _feature(self, prompt: Any) -> InputFeature:
        if _is_conversational(prompt):
            feature: InputFeature = self._template.encode(Trajectory(messages=prompt), add_generation_prompt=True)
            return feature
        if isinstance(prompt, str):
            return InputFeature(input_ids=list(self.sampler.tokenizer(prompt)["input_ids"]))
        raise UnsupportedFeatureError(
            f"a prompt of type {type(prompt).__name__} ({str(prompt)[:60]!r}): TwinkleRollout takes TRL's"
            " conversational prompts (a list of {'role', 'content'} messages) or plain strings."
        )

    def _seed(self) -> int:
        """A seed drawn from ``GRPOConfig.seed`` per call (a run is reproducible), or the one
        ``generation_kwargs`` fixed."""
        assert self._params is not None
        return self._params.seed if self._params.seed is not None else self._rng.randrange(2**31)

    def _generate(self, prompts: list[Any]) -> tuple[list[SampledSequence], list[list[int]]]:
        """One completion per prompt, in order: each run of equal prompts is one input with that many samples."""
        assert self._params is not None
        runs = _runs(prompts)
        features = [self._feature(prompts[start]) for start, _ in runs]
        # runs of one length share one call (num_samples is per call); the calls run side by side
        by_length: dict[int, list[int]] = defaultdict(list)
        for r, (_, length) in enumerate(runs):
            by_length[length].append(r)
        handles = {
            length: self.sampler.submit(
                [features[r] for r in members],
                self._params.replace(num_samples=length, seed=self._seed()),
                adapter_name=self.serving,
            )
            for length, members in by_length.items()
        }
        seqs: list[SampledSequence] = [None] * len(prompts)  # type: ignore[list-item]
        prompt_ids: list[list[int]] = [[]] * len(prompts)
        for length, members in by_length.items():
            for r, response in zip(members, handles[length].result()):
                start = runs[r][0]
                for k, seq in enumerate(response.sequences):
                    seqs[start + k] = seq
                    prompt_ids[start + k] = list(response.prompt_token_ids)
        return seqs, prompt_ids

    # -- checks ------------------------------------------------------------------------------
    def _check_versions(self, seqs: list[SampledSequence], step: int) -> None:
        if not self.sync_weights:
            return
        for seq in seqs:
            if seq.weights_version != self.version or seq.adapter_name != self.serving:
                raise StalePolicyError(
                    f"step {step}: a sample carries weights_version {seq.weights_version} (adapter"
                    f" {seq.adapter_name!r}) but the last push made version {self.version} (adapter"
                    f" {self.serving!r}): the sampler is not running the current policy."
                )

    def _verify(
        self, trainer: Any, seqs: list[SampledSequence], prompt_ids: list[list[int]], step: int
    ) -> dict[str, float]:
        """Score a few completions with the trainer's model; compare with the sampler's own numbers."""
        assert self._params is not None
        t = time.perf_counter()
        count = min(self.verify_samples, len(seqs))
        picks = sorted({round(i * (len(seqs) - 1) / max(count - 1, 1)) for i in range(count)})
        picks = [i for i in picks if seqs[i].tokens]
        if not picks:
            return {}
        rows = [(prompt_ids[i], list(seqs[i].tokens)) for i in picks]
        # a prompt's images: the trainer's forward reads them as the sampler did (the training feature's arrays)
        features = [seqs[i].training_feature for i in picks]
        media = [None if f is None else f.multimodal for f in features]
        plain = _plain(self._params)
        if plain:  # the sampling log-probs are the trainer's formula: compare them directly
            sampler_lp = [list(seqs[i].logprobs or ()) for i in picks]
            temperature = self._params.temperature
        else:  # truncation or a penalty: compare the plain log-softmax, scored by the sampler
            scored = self.sampler.sample(
                [
                    InputFeature(input_ids=p + c, multimodal=m, images=f.images if m and f else [])
                    for (p, c), m, f in zip(rows, media, features)
                ],
                SamplingParams(max_tokens=0, prompt_logprobs=0),
                adapter_name=self.serving,
            )
            sampler_lp = [list(r.prompt_logprobs or ())[len(p) :] for r, (p, _) in zip(scored, rows)]
            temperature = 1.0
        for (_, c), row in zip(rows, sampler_lp):
            if len(row) != len(c) or any(x is None for x in row):
                raise PolicyMismatchError(
                    f"step {step}: the sampler returned {len(row)} log-probs for a completion of {len(c)} tokens"
                    " (or a missing one): it does not report what it sampled."
                )
        model = trainer.accelerator.unwrap_model(trainer.model)
        trainer_lp = _model_logprobs(model, rows, temperature, media)
        log_ratios = [a - float(b) for t_row, s_row in zip(trainer_lp, sampler_lp) for a, b in zip(t_row, s_row)]
        diffs = [abs(x) if math.isfinite(x) else math.inf for x in log_ratios]  # NaN must fail, not pass
        ratios = [math.exp(min(x, 80.0)) for x in log_ratios]  # capped: a wild mismatch must not overflow
        figures = {
            "logp_diff_mean": sum(diffs) / len(diffs),
            "logp_diff_max": max(diffs),
            "verify_s": time.perf_counter() - t,
        }
        self._pending["twinkle/sampling_logp_difference/mean"].append(figures["logp_diff_mean"])
        self._pending["twinkle/sampling_logp_difference/max"].append(figures["logp_diff_max"])
        if plain:  # the ratio TRL's importance-sampling correction would apply, on the checked tokens
            self._pending["twinkle/importance_sampling_ratio/min"].append(min(ratios))
            self._pending["twinkle/importance_sampling_ratio/mean"].append(sum(ratios) / len(ratios))
            self._pending["twinkle/importance_sampling_ratio/max"].append(max(ratios))
        if figures["logp_diff_max"] > self.tolerance:
            message = (
                f"step {step}: the sampler's log-probs differ from the trainer's by up to"
                f" {figures['logp_diff_max']:.3g} (mean {figures['logp_diff_mean']:.3g}) on {len(diffs)} tokens of"
                f" {len(rows)} completions, over the tolerance {self.tolerance:g}: the sampler is not running the"
                " trainer's policy (weights not pushed, or not applied)."
            )
            if self.on_mismatch == "raise":
                raise PolicyMismatchError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return figures

    # -- TrainerCallback ---------------------------------------------------------------------
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Push the final policy, so the sampler serves what training ended with (for evaluation, saving)."""
        if self.sync_weights and self._trainer is not None and state.global_step != self._pushed_step:
            self._push(self._trainer)
            self._pushed_step = state.global_step

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Add the figures gathered since the last log (means; ``/max`` keys their maximum, ``/min`` minimum)."""
        if logs is None or not self._pending:
            return
        figures = {}
        for key, values in self._pending.items():
            if key.endswith("/max"):
                figures[key] = max(values)
            elif key.endswith("/min"):
                figures[key] = min(values)
            else:
                figures[key] = sum(values) / len(values)
        self._pending.clear()
        logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)
