"""Fault and soak drivers shared by the engines' reliability tests.

They drive a real sampler the way a long RL job does (many rounds of
sampling, weight updates and adapter swaps from several threads) and check
every sequence against a reference computed on the same engine for its
``(weights, adapter)``, so a sequence labelled with an adapter or version that
did not produce it shows up as a token mismatch. Threads are paced with
events, never with sleeps. Torch is imported at call time only.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from twinkle_core.adapter_input import read_adapter
from twinkle_core.data_format import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import AdapterError, UnknownAdapterError, WeightUpdateError
from twinkle_core.sampler import Sampler

__all__ = [
    "SoakReport",
    "check_refused_changes",
    "failing_when_copied",
    "kill_and_wait",
    "read_adapter_folder",
    "run_soak",
    "soak_seconds",
]

Prompts = Sequence[InputFeature | Trajectory]


def soak_seconds(default: float = 15.0) -> float:
    """How long a soak runs: ``TWINKLE_SOAK_S`` (CI keeps the default short; set minutes by hand)."""
    raw = os.environ.get("TWINKLE_SOAK_S", "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = default
    return value if math.isfinite(value) and value > 0 else default


def kill_and_wait(actor: Any, timeout_s: float = 30.0) -> None:
    """Kill a Ray actor and wait until calls on it fail (``ray.kill`` returns before the actor is gone)."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"actor {actor} still answers {timeout_s:g} s after ray.kill")


def read_adapter_folder(folder: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A PEFT adapter folder as ``(config dict, {name: tensor})``, for in-memory loads."""
    adapter = read_adapter("", folder)
    return adapter.config, adapter.state_dict()


@functools.cache
def _fails_when_copied() -> type:
    import torch

    class FailsWhenCopied(torch.Tensor):
        error: BaseException

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], FailsWhenCopied):
                raise type(args[1]).error
            return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]

    return FailsWhenCopied


def failing_when_copied(tensor: Any, error: BaseException) -> Any:
    """A copy of ``tensor`` that raises ``error`` when copied into another tensor (an engine's weights).

    An update holding it fails part-way, as one does when a trainer's shard
    cannot be gathered or Ctrl-C lands mid-copy.
    """
    cls = type("FailsWhenCopied", (_fails_when_copied(),), {"error": error})
    return tensor.detach().clone().as_subclass(cls)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(sampler: Sampler, prompts: Prompts, adapter: str, max_tokens: int) -> list[list[int]]:
    return [r.sequences[0].tokens for r in sampler.sample(list(prompts), _greedy(max_tokens), adapter_name=adapter)]


def check_refused_changes(
    sampler: Sampler,
    prompts: Prompts,
    weights: Mapping[str, Any],
    adapter_folder: str | os.PathLike[str],
    *,
    max_tokens: int = 8,
) -> None:
    """Refused weight and adapter changes leave every output exactly as it was.

    Tries NaN and infinite weights, weights finite only in a wider dtype than
    the engine's, NaN and overflowing adapter tensors, a mis-shaped adapter,
    an adapter with only half of its matrices and one of integer tensors; each must raise its typed
    error, leave the version and the adapter table unchanged, and leave greedy
    outputs (base model and a loaded adapter) identical. Then a good update of
    ``weights`` must still apply.

    Raises:
        AssertionError: any of that does not hold.
    """
    import torch

    config, tensors = read_adapter_folder(adapter_folder)
    sampler.add_adapter_to_model("kept", adapter_folder)
    version = sampler.weights_version
    before = {name: _tokens(sampler, prompts, name, max_tokens) for name in ("", "kept")}
    name, tensor = next((k, v) for k, v in weights.items() if v.is_floating_point() and v.dim() == 2)
    for bad in (math.nan, math.inf, -math.inf):
        poisoned = tensor.clone()
        poisoned.view(-1)[len(poisoned.view(-1)) // 2] = bad
        try:
            sampler.update_weights({name: poisoned})
        except WeightUpdateError as exc:
            assert name in str(exc) and "non-finite" in str(exc), str(exc)
        else:
            raise AssertionError(f"an update holding {bad} in {name!r} was accepted")
    try:  # finite as sent (float64), infinite once the engine casts it to its own dtype
        sampler.update_weights({name: tensor.double() * 1e300})
    except WeightUpdateError as exc:
        assert name in str(exc) and "range" in str(exc), str(exc)
    else:
        raise AssertionError(f"an update of {name!r} beyond the engine's dtype's range was accepted")
    lora_a = next(k for k in tensors if "lora_A" in k)
    lora_b = next(k for k in tensors if "lora_B" in k)
    broken: dict[str, dict[str, Any]] = {
        "nan": {**tensors, lora_b: torch.full_like(tensors[lora_b], math.nan)},
        "shape": {**tensors, lora_a: torch.zeros(tensors[lora_a].shape[0] + 1, tensors[lora_a].shape[1])},
        "half": {k: v for k, v in tensors.items() if k != lora_b},
        "integer": {k: v.round().to(torch.int32) for k, v in tensors.items()},
        "overflowing": {**tensors, lora_b: tensors[lora_b].double() + 1e300},
    }
    for label, bad_weights in broken.items():
        for target in ("kept", f"new-{label}"):  # replacing a loaded adapter, and adding a new one
            try:
                sampler.add_adapter_to_model(target, config, weights=bad_weights)
            except AdapterError:
                pass
            else:
                raise AssertionError(f"a {label} adapter was accepted as {target!r}")
    assert sampler.weights_version == version, "a refused change moved the version"
    assert set(sampler.adapters) >= {"kept"} and not any(n.startswith("new-") for n in sampler.adapters)
    after = {name: _tokens(sampler, prompts, name, max_tokens) for name in ("", "kept")}
    assert after == before, "outputs changed after refused updates"
    new_version = sampler.update_weights(dict(weights))
    assert new_version == version + 1
    sampler.remove_adapter("kept")


@attrs.define
class SoakReport:
    """What a soak did: sequences checked, updates, adapter swaps, refusals of a removed adapter."""

    sequences: int = 0
    updates: int = 0
    swaps: int = 0
    unknown_adapter: int = 0
    seconds: float = 0.0


def _soak_references(
    sampler: Sampler, prompts: Prompts, weight_states: Sequence[Mapping[str, Any]], names: list[str], max_tokens: int
) -> dict[tuple[int, str], list[list[int]]]:
    """The greedy tokens of every ``(weight state, adapter)``; each state must change some of them."""
    reference: dict[tuple[int, str], list[list[int]]] = {}
    for i, state in enumerate(weight_states):
        sampler.update_weights(dict(state))
        for name in names:
            reference[(i, name)] = _tokens(sampler, prompts, name, max_tokens)
    for i in range(len(weight_states)):
        assert any(reference[(i, n)] != reference[((i + 1) % len(weight_states), n)] for n in names), (
            "the weight states must change the greedy outputs"
        )
    return reference


class _Soak:
    """What the soak's threads share (the sequences seen, the updates applied, the pacing events), and their loops."""

    def __init__(
        self,
        sampler: Sampler,
        prompts: Prompts,
        weight_states: Sequence[Mapping[str, Any]],
        adapters: Mapping[str, str | os.PathLike[str]],
        names: list[str],
        swapped: str,
        max_tokens: int,
    ) -> None:
        self.sampler, self.prompts, self.weight_states = sampler, prompts, weight_states
        self.adapters, self.names, self.swapped, self.max_tokens = adapters, names, swapped, max_tokens
        self.applied: list[tuple[int, int]] = [(sampler.weights_version, len(weight_states) - 1)]  # (version, state)
        self.applied_lock = threading.Lock()
        self.seen: list[tuple[str, int, list[list[int]]]] = []
        self.report = SoakReport()
        self.stop = threading.Event()
        # set by samplers after each call: each writer waits for one, so writers never starve the samplers
        self.sampled, self.sampled_for_swap = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []

    def guarded(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the main thread
                self.errors.append(exc)
                self.stop.set()

        return run

    def sample_loop(self, offset: int) -> None:
        k = offset
        while not self.stop.is_set():
            name = self.names[k % len(self.names)]
            k += 1
            try:
                out = self.sampler.sample(list(self.prompts), _greedy(self.max_tokens), adapter_name=name)
            except UnknownAdapterError:
                if name != self.swapped:
                    raise
                with self.applied_lock:
                    self.report.unknown_adapter += 1
                continue
            versions = {r.sequences[0].weights_version for r in out}
            labels = {r.sequences[0].adapter_name for r in out}
            assert len(versions) == 1 and labels == {name}, (versions, labels, name)
            with self.applied_lock:
                self.seen.append((name, versions.pop(), [r.sequences[0].tokens for r in out]))
            self.sampled.set()
            self.sampled_for_swap.set()

    def update_loop(self) -> None:
        i = 0
        while not self.stop.is_set():
            self.sampled.wait()
            self.sampled.clear()
            if self.stop.is_set():
                return
            version = self.sampler.update_weights(dict(self.weight_states[i % len(self.weight_states)]))
            with self.applied_lock:
                self.applied.append((version, i % len(self.weight_states)))
                self.report.updates += 1
            i += 1

    def swap_loop(self) -> None:
        while not self.stop.is_set():
            self.sampled_for_swap.wait()
            self.sampled_for_swap.clear()
            if self.stop.is_set():
                return
            self.sampler.remove_adapter(self.swapped)
            self.sampler.add_adapter_to_model(self.swapped, self.adapters[self.swapped])
            with self.applied_lock:
                self.report.swaps += 1

    def run(self, seconds: float, sample_threads: int) -> None:
        """Run the loops for ``seconds``; re-raise the first error of any thread."""
        threads = [
            threading.Thread(target=self.guarded(functools.partial(self.sample_loop, o)), daemon=True)
            for o in range(sample_threads)
        ]
        threads += [
            threading.Thread(target=self.guarded(self.update_loop), daemon=True),
            threading.Thread(target=self.guarded(self.swap_loop), daemon=True),
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        self.stop.wait(seconds)
        self.stop.set()
        self.sampled.set()
        self.sampled_for_swap.set()
        for t in threads:
            t.join(300)
        self.report.seconds = time.monotonic() - started
        if self.errors:
            raise self.errors[0]
        assert not any(t.is_alive() for t in threads), "a soak thread did not finish"


def run_soak(
    sampler: Sampler,
    prompts: Prompts,
    weight_states: Sequence[Mapping[str, Any]],
    adapters: Mapping[str, str | os.PathLike[str]],
    *,
    seconds: float,
    sample_threads: int = 3,
    max_tokens: int = 6,
    swapped: str | None = None,
) -> SoakReport:
    """Sample, update weights and swap an adapter from several threads; check every sequence.

    Args:
        sampler: a real engine with LoRA enabled.
        prompts: the inputs every sampling call sends.
        weight_states: at least two weight updates whose greedy outputs differ;
            the updater applies them in turn.
        adapters: adapter name -> PEFT folder; all are loaded, and ``swapped``
            (default: the last) is removed and re-added over and over.
        seconds: how long the threads run.
        sample_threads: threads calling ``sample()``, cycling through the
            base model and the adapters.

    Returns:
        The report; ``AssertionError`` is raised on the first sequence whose
        tokens are not those of the weights and adapter it is labelled with.
    """
    if len(weight_states) < 2:
        raise ValueError("run_soak needs at least two weight states")
    names = ["", *adapters]
    swapped = swapped if swapped is not None else list(adapters)[-1]
    for name, folder in adapters.items():
        sampler.add_adapter_to_model(name, folder)
    reference = _soak_references(sampler, prompts, weight_states, names, max_tokens)
    soak = _Soak(sampler, prompts, weight_states, adapters, names, swapped, max_tokens)
    soak.run(seconds, sample_threads)
    applied = sorted(soak.applied)
    for name, version, tokens in soak.seen:
        state_index = max((a for a in applied if a[0] <= version), key=lambda a: a[0])[1]
        assert tokens == reference[(state_index, name)], (
            f"a sequence labelled adapter={name!r}, weights_version={version} does not match the outputs of"
            f" weight state {state_index} with that adapter"
        )
    soak.report.sequences = sum(len(t) for _, _, t in soak.seen)
    return soak.report
