"""``TorchEngine``: the ``torch`` engine, on PyTorch + ``transformers``.

Users build it through ``TorchSampler(...)`` (:mod:`twinkle_torch.sampler`),
``create_sampler("torch", ...)`` or ``Sampler(TorchEngine, ...)``: the core's
``Sampler`` holds it and calls it through the ``twinkle_core.engine`` contract.

It loads any ``AutoModelForCausalLM`` and samples with its own batched decode
loop (:mod:`twinkle_torch.decoding`) rather than ``model.generate``: a KV
cache written in place, one prefill per prompt shared by its samples,
vectorised sampling, finished rows dropped from the batch, batches bounded by
a token budget. LoRA adapters go in through PEFT (:mod:`twinkle_torch.adapters`),
weight updates by ``state_dict`` name (:mod:`twinkle_torch.weights`).

The engine declares ``concurrent=True``: concurrent calls (threads
calling ``sample()``, or ``submit()``) all hand their rows to one decode loop,
which batches them continuously: a call arriving while others decode joins
them at the next step (:class:`~twinkle_torch.decoding.Decoder`). PEFT runs
one adapter at a time, so rows of different adapters never share a batch: a
call with another adapter waits until the running batch drains. The sampler
keeps adapter and weight changes apart from every run (its readers-writer
lock), so every sequence's ``weights_version`` is the version its tokens came from.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from twinkle_core.engine import (
    AdapterInput,
    AdapterMerger,
    DeviceMesh,
    Engine,
    EngineContext,
    EngineInfo,
    EngineRun,
)
from twinkle_core.errors import (
    ConfigError,
    UnsupportedFeatureError,
)
from twinkle_core.hub import resolve_model_id
from twinkle_torch.adapters import AdapterSet
from twinkle_torch.attention import ATTN_IMPLEMENTATION, NATIVE_ATTN_IMPLEMENTATION
from twinkle_torch.decoding import Decoder
from twinkle_torch.linear import use_onednn
from twinkle_torch.loading import (
    attention_for,
    brief,
    check_decodes,
    check_linear_kernel,
    check_options,
    eos_ids,
    image_text_class,
    load_model,
    resolve_device,
    resolve_dtype,
)
from twinkle_torch.openmp import release_idle_workers, releasing
from twinkle_torch.routes import RouteRecorder
from twinkle_torch.rows import RunControl, SequenceResult
from twinkle_torch.weights import WeightTable

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "SUPPORTED_PARAMS", "TorchEngine"]

#: Default KV-cache budget of one batch, in tokens (rows x (prompt + max_tokens)).
DEFAULT_MAX_BATCH_TOKENS = 65536

#: The ``SamplingParams`` fields the engine honours, by name (a field added later is refused until listed).
SUPPORTED_PARAMS = frozenset(
    {
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
        "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logprobs_mode", "num_samples",
        "return_sampling_mask", "return_routed_experts", "presence_penalty", "frequency_penalty", "min_tokens",
        "logit_bias", "allowed_token_ids", "bad_words", "include_stop_str_in_output", "skip_special_tokens",
        "spaces_between_special_tokens", "structured_outputs",
    }
)  # fmt: skip


def _options() -> list[str]:
    """The options ``TorchEngine`` takes by name (the rest go to ``from_pretrained``)."""
    return [
        n for n in inspect.signature(TorchEngine.__init__).parameters if n not in ("self", "context", "model_kwargs")
    ]


class TorchEngine(Engine):
    """Samples from a ``transformers`` causal LM with a batched KV-cache decode loop.

    Args:
        context: the sampler's (``Sampler(TorchEngine, ...)`` passes it).
        model_id: a local folder, ``hf://org/name``, ``ms://org/name`` (or a
            bare ``org/name``) or ``builtin://<name>``, resolved by
            ``twinkle_core.hub.resolve_model_id``.
        device_mesh: ``None`` or a mesh of ``dp_size=1, tp_size=1``. Several
            replicas (``dp_size > 1``) need ``remote_group=``; tensor
            parallelism is not supported by this engine.
        dtype: ``"auto"`` (the checkpoint's dtype; float32 on CPU when the
            checkpoint is half precision), a name such as ``"float32"`` /
            ``"bfloat16"``, or a ``torch.dtype``.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; default CUDA when available.
        template: the chat template (a registered name, a ``Template`` class or
            instance); default: the tokenizer's own.
        max_batch_tokens: the KV-cache budget of one batch, in tokens: a batch
            holds rows whose ``(longest prompt + max_tokens) * rows`` fits.
            Bigger is faster until memory runs out; on CUDA an out-of-memory
            error splits the batch and retries.
        max_model_len: the context window (prompt + completion), at most the
            model's positions; default: the model's positions.
        trust_remote_code: passed to ``from_pretrained``.
        linear_kernel: ``"auto"`` (oneDNN's matmul for the linear layers of a
            CPU model, see :mod:`twinkle_torch.linear`; PyTorch's elsewhere),
            ``"onednn"`` (the same, and an error where the build lacks it or
            the device is not the CPU),
            ``"onednn-packed"`` (the same kernel on copies of the weights in
            its blocked layout: faster, while the linear weights take twice
            their memory; a copy is remade at the first step after its weight
            changed) or ``"torch"`` (``F.linear`` everywhere).
        attention_kernel: ``"auto"`` (on CPU, decode steps through the
            attention kernel of :mod:`twinkle_torch.native`, built on first use
            with the machine's C++ compiler; PyTorch's SDPA where it cannot be
            built, with a warning, and on other devices), ``"native"`` (the
            same, and an error where it cannot be built) or ``"sdpa"``
            (PyTorch's ``scaled_dot_product_attention`` throughout). The
            same library, where this loads it, also gives the sampler the
            normaliser of processed log-probs under top-p without a sort
            (:func:`twinkle_torch.native.nucleus`); with ``"sdpa"`` the
            engine builds and runs no native code.
        **model_kwargs: more ``AutoModelForCausalLM.from_pretrained`` arguments
            (e.g. ``attn_implementation="eager"``); ``revision=`` goes to the model-id resolver.

    Seeds: with ``SamplingParams.seed``, sample ``i`` of each prompt draws from
    its own generator, seeded with :func:`twinkle_torch.randomness.derive_seed`
    ``(seed, i)`` (sample 0 uses ``seed`` itself), so a seeded request gives
    the same tokens whatever else is in the batch.
    """

    def __init__(
        self,
        context: EngineContext,
        model_id: str | os.PathLike[str],
        device_mesh: DeviceMesh | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        template: Any = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        linear_kernel: str = "auto",
        attention_kernel: str = "auto",
        **model_kwargs: Any,
    ) -> None:
        super().__init__(context)
        check_options(
            device_mesh=device_mesh,
            linear_kernel=linear_kernel,
            attention_kernel=attention_kernel,
            max_batch_tokens=max_batch_tokens,
            trust_remote_code=trust_remote_code,
            max_model_len=max_model_len,
        )
        from transformers import AutoConfig

        path = resolve_model_id(model_id, revision=model_kwargs.pop("revision", None))
        self.model_path = path
        self.device = resolve_device(device)
        check_linear_kernel(linear_kernel, self.device)
        attention = attention_for(attention_kernel, self.device, model_kwargs)
        try:
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except Exception as exc:  # no config, an unknown model type, values of the wrong type (transformers' own)
            raise ConfigError(f"{str(path)!r} holds no model transformers can read: {brief(exc)}") from exc
        self.dtype = resolve_dtype(dtype, config, self.device)
        own = [
            n
            for n in inspect.signature(TorchEngine.__init__).parameters
            if n not in ("self", "context", "model_kwargs")
        ]
        model = load_model(path, config, self.dtype, trust_remote_code, model_kwargs, attention, own)
        self._model: torch.nn.Module = model.to(self.device).eval()
        if self.device.type == "cpu" and linear_kernel != "torch":
            use_onednn(self._model, packed=linear_kernel == "onednn-packed")
        check_decodes(self._model, self.device)
        context.init_template(template, path)
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        positions = int(
            getattr(text_config, "max_position_embeddings", None)
            or getattr(self.tokenizer, "model_max_length", None)
            or 2048
        )
        if max_model_len is not None and max_model_len > positions:
            raise ConfigError(
                f"max_model_len={max_model_len} is invalid: expected at most the model's {positions} positions."
            )
        vocab_size = int(self._model.get_input_embeddings().num_embeddings)
        self.info = EngineInfo(
            name="torch",
            max_model_len=positions if max_model_len is None else max_model_len,
            vocab_size=vocab_size,
            supported_params=SUPPORTED_PARAMS,
            concurrent=True,
            weights_dtype=self.dtype,
            media=frozenset({"image"}) if image_text_class(config, path) is not None else frozenset(),
        )
        self._weights = WeightTable(self._model)
        self._adapter_set = AdapterSet(self._model, self.device)
        # add_adapter_to_model(..., merge=True): the merged adapter and the base values it replaced.
        self._merged = AdapterMerger(
            engine="torch",
            read_base=self._weights.read,
            check=self._weights.check,
            apply=self._weights.apply,
            loaded=lambda: self._adapter_set.names,
            load_unmerged=self._adapter_set.load,
            remove_unmerged=self._adapter_set.remove,
            spell=self._weights.spelled,
        )
        self._decoder = self._build_decoder(max_batch_tokens, attention)
        release_idle_workers()  # loading ran parallel work on this thread: its idle pool would slow the loop

    def _build_decoder(self, max_batch_tokens: int, attention: str | None) -> Decoder:
        """The decode loop over the loaded model (its pad id: the tokenizer's, else the first EOS id)."""
        vocab_size = self.info.vocab_size
        pad = getattr(self.tokenizer, "pad_token_id", None)
        eos = eos_ids(self._model, self.tokenizer)
        if pad is None or not 0 <= pad < vocab_size:
            pad = eos[0] if eos else 0
        return Decoder(
            self._model,
            self.tokenizer,
            device=self.device,
            eos_token_ids=eos,
            pad_token_id=pad,
            max_model_len=self.info.max_model_len,
            logits_to_keep="logits_to_keep" in inspect.signature(type(self._model).forward).parameters,
            sdpa_masks=getattr(self._model.config, "_attn_implementation", None)
            in (
                "sdpa",
                ATTN_IMPLEMENTATION,
                NATIVE_ATTN_IMPLEMENTATION,
            ),
            max_batch_tokens=max_batch_tokens,
            vocab_size=self.info.vocab_size,
            native_kernels=attention == NATIVE_ATTN_IMPLEMENTATION,
            routes=RouteRecorder(self._model),
        )

    @property
    def max_batch_tokens(self) -> int:
        """The KV-cache budget of the running batch, in tokens (settable; applies from the next admission)."""
        return self._decoder.max_batch_tokens

    @max_batch_tokens.setter
    def max_batch_tokens(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"max_batch_tokens={value!r} is invalid: expected an integer >= 1.")
        self._decoder.max_batch_tokens = value

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of the sampler's template."""
        return self.context.tokenizer

    @property
    def model(self) -> torch.nn.Module:
        """The ``transformers`` model (with any LoRA layers injected)."""
        return self._model

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a sequence unless ``ignore_eos``: the generation config's and the tokenizer's."""
        return self._decoder.eos_token_ids

    # -- the engine contract ---------------------------------------------------------------------
    def template_changed(self) -> None:
        decoder = getattr(self, "_decoder", None)
        if decoder is not None:
            decoder.tokenizer = self.tokenizer

    def run(self, run: EngineRun) -> None:
        # The sampler holds its lock shared (no adapter or weight change meanwhile); runs in several
        # threads share the decoder's one continuous batch.
        params = run.params
        if params.return_routed_experts and not (self._decoder.routes and self._decoder.routes.layers):
            raise UnsupportedFeatureError(
                f"SamplingParams.return_routed_experts=True: {type(self._model).__name__} has no mixture-of-experts"
                " router the torch engine records (families: twinkle_core.rl.ROUTER_RULES)."
            )

        def report(prompt_index: int, sample_index: int, result: SequenceResult) -> None:
            run.report(
                prompt_index,
                sample_index,
                result.tokens,
                stop_reason=result.stop_reason,
                stop=result.stop,
                logprobs=result.logprobs,
                top_logprobs=result.top_logprobs,
                sampling_mask=result.sampling_mask,
                routed_experts=result.routed_experts,
            )

        # A merged adapter runs on the plain modules: its sequences still carry its name.
        active = self._merged.running(run.adapter_name)
        control = RunControl(
            max_tokens=list(run.max_tokens),
            sample_base=list(run.sample_base),
            generated=list(run.generated),
            stopped=run.stopped,
            on_finish=report,
            activate=lambda: self._adapter_set.activate(active),
            adapter=active,
        )
        media = [p.multimodal for p in run.prompts]
        scores = self._decoder.run(
            [list(p.input_ids) for p in run.prompts], params, control=control, media=media if any(media) else None
        )
        for p, score in enumerate(scores):
            if params.max_tokens == 0:  # scoring only: each sample is an empty completion
                run.report_empty(p, "length")
            if score is not None:
                run.report_scores(p, score.logprobs, score.top_logprobs)

    @releasing
    def load_adapter(self, adapter: AdapterInput, *, version: int, **options: Any) -> str:
        """Load (or replace) ``adapter``; with ``merge=True``, merge it into the weights.

        A merged adapter must be the only one loaded (the base weights it
        changes are shared by every other adapter); see ``twinkle_core.merge``.

        Raises:
            AdapterError: unknown options, an adapter that does not fit, or a
                merge while other adapters are loaded (or the reverse).
        """
        return self._merged.load_adapter(adapter, options)

    @releasing
    def remove_adapter(self, name: str) -> None:
        self._merged.remove_adapter(name)

    @releasing
    def update_weights(self, named_tensors: list[tuple[str, Any]], *, version: int) -> None:
        # While merged, pushed base values of merged weights are kept and applied merged.
        self._merged.update_weights(named_tensors, self._weights.apply)

    def close(self) -> None:
        with self.context.exclusive():
            self._decoder.close()
            self._decoder.model = None
            self._adapter_set.model = None  # type: ignore[assignment]
            self._weights.model = None  # type: ignore[assignment]
            self._model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
