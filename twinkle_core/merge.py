"""Serving a LoRA adapter merged into the base weights: ``W + scale * B @ A``.

An engine that serves an adapter through its LoRA kernels pays for them on
every token (on vLLM's CPU build a call took 1.33x the base model's, with
twinkle's replacement ops; 2.48x with vLLM's own). Merging the adapter into
the weights its layers wrap makes sampling run at base-model speed, at the
cost of one weight push per adapter version.

This module is the part every engine shares (``add_adapter_to_model(...,
merge=True)`` on the ``torch`` and ``vllm`` engines):

* :func:`lora_deltas` turns an adapter (read by
  ``twinkle_core.adapter_input.read_adapter``) into one ``scale * B @ A`` per
  target weight, named as in the model's Hugging Face ``state_dict``.
* :class:`MergedLoRA` keeps the *base* values of the weights a merge touches
  (only those), and plans each push: merge, re-merge of a new adapter
  version from the kept base values (a trainer pushes only the adapter),
  ``update_weights`` while merged (the kept base values take the pushed
  tensors, the engine gets them merged), and un-merge (the kept base values
  go back). A plan is committed only after the engine applied it, so a
  refused push changes nothing.

What is refused (``AdapterError``): tensors other than ``lora_A`` /
``lora_B`` weights (``modules_to_save``, LoRA biases, embedding LoRA) and
DoRA, whose merge is not ``W + scale * B @ A``.

Torch is imported only when a merge is planned (tensors cannot exist without it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from twinkle_core.adapter_input import peft_pattern_value
from twinkle_core.errors import AdapterError, IncompleteUpdateError, MergedAdapterError, WeightUpdateError
from twinkle_core.weights import find_non_finite, find_not_floating

__all__ = ["AdapterMerger", "MergePlan", "MergedLoRA", "check_merge_flag", "lora_deltas"]

_PREFIXES = ("base_model.model.", "base_model.")
_LORA_KINDS = ("lora_A", "lora_B")


def check_merge_flag(merge: Any) -> bool:
    """``merge`` as a bool; anything but ``True`` / ``False`` is an ``AdapterError``."""
    if not isinstance(merge, bool):
        raise AdapterError(f"merge={merge!r} is invalid: expected True (merge into the weights) or False.")
    return merge


def _module_of(name: str) -> tuple[str, str] | None:
    """``(module, "lora_A" | "lora_B")`` of a PEFT LoRA weight name, or ``None``.

    Both PEFT spellings: ``...q_proj.lora_A.weight`` (saved) and
    ``...q_proj.lora_A.<adapter>.weight`` (a live model's state_dict).
    """
    parts = name.split(".")
    if len(parts) < 3 or parts[-1] != "weight":
        return None
    if parts[-2] in _LORA_KINDS:
        module, kind = parts[:-2], parts[-2]
    elif len(parts) >= 4 and parts[-3] in _LORA_KINDS:
        module, kind = parts[:-3], parts[-3]
    else:
        return None
    path = ".".join(module)
    for prefix in _PREFIXES:
        if path.startswith(prefix):
            path = path[len(prefix) :]
            break
    return path, kind


def lora_deltas(name: str, config: Mapping[str, Any], tensors: list[tuple[str, Any]]) -> dict[str, Any]:
    """``scale * B @ A`` per target weight, by ``state_dict`` name (``<module>.weight``), in float32.

    ``scale`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA),
    with per-module ``alpha_pattern`` honoured and ``r`` read from ``A``'s shape
    (so ``rank_pattern`` needs no special case); ``fan_in_fan_out`` layers get
    the transposed product.

    Raises:
        AdapterError: a tensor that is not a LoRA ``A`` / ``B`` weight, an ``A``
            without its ``B`` (or the reverse), mismatched ranks or rank 0, a
            tensor that is not floating point, a product that is not finite,
            DoRA, or no LoRA tensors at all.
    """
    if config.get("use_dora"):
        raise AdapterError(
            f"Adapter {name!r} uses DoRA, whose merge is not W + scale * B @ A; load it with merge=False."
        )
    parts: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors:
        found = _module_of(key)
        if found is None:
            raise AdapterError(
                f"Adapter {name!r}: {key!r} is not a lora_A / lora_B weight; merge=True serves plain LoRA on linear"
                " layers (no modules_to_save, LoRA biases or embedding LoRA). Load it with merge=False."
            )
        module, kind = found
        parts.setdefault(module, {})[kind] = tensor
    if not parts:
        raise AdapterError(f"Adapter {name!r} has no lora_A / lora_B tensors.")
    alpha = float(config.get("lora_alpha", 8))
    alpha_pattern = dict(config.get("alpha_pattern") or {})
    rslora = bool(config.get("use_rslora", False))
    transpose = bool(config.get("fan_in_fan_out", False))
    out: dict[str, Any] = {}
    for module, pair in parts.items():
        if set(pair) != set(_LORA_KINDS):
            raise AdapterError(
                f"Adapter {name!r}: layer {module!r} has only {sorted(pair)[0]}; it needs lora_A and lora_B."
            )
        not_floating = find_not_floating([(f"{module}.{kind}", pair[kind]) for kind in _LORA_KINDS])
        if not_floating is not None:
            raise AdapterError(f"Adapter {name!r}: {not_floating}.")
        a, b = pair["lora_A"].detach().float(), pair["lora_B"].detach().float()
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or a.shape[0] == 0:
            raise AdapterError(
                f"Adapter {name!r}: layer {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)};"
                " expected (r, in) and (out, r) with r >= 1."
            )
        rank = a.shape[0]
        layer_alpha = float(peft_pattern_value(alpha_pattern, module, alpha))
        scale = layer_alpha / (math.sqrt(rank) if rslora else rank)
        delta = (b.to(a.device) @ a) * scale
        # Whatever check_finite says: a non-finite merged weight would spoil every token. The
        # scan is one reduction per layer, small beside the product.
        if find_non_finite([(module, delta)]) is not None:
            raise AdapterError(
                f"Adapter {name!r}: the merged update of layer {module!r} (scale * lora_B @ lora_A) holds NaN or"
                " infinity (non-finite adapter values, or a product beyond float32's range); nothing was merged."
            )
        out[f"{module}.weight"] = delta.T.contiguous() if transpose else delta
    return out


@attrs.frozen
class MergePlan:
    """What to push into the engine, and the merge state once it is applied.

    Attributes:
        tensors: ``(state_dict name, value)`` pairs to apply, as ``update_weights`` takes them.
        name: the merged adapter afterwards (``None``: none).
        base: the kept base values afterwards.
        deltas: the merged deltas afterwards.
    """

    tensors: list[tuple[str, Any]]
    name: str | None
    base: dict[str, Any]
    deltas: dict[str, Any]


class MergedLoRA:
    """The adapter merged into one engine's weights, and the base values it was merged into.

    The kept base values cover every weight the merge touches, plus what the
    engine asked to keep with them (vLLM: the other members of a fused layer,
    which must be pushed together). Every plan pushes all of them, so an
    engine's all-or-nothing update path applies each change whole.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self._base: dict[str, Any] = {}
        self._deltas: dict[str, Any] = {}

    def check_request(self, adapter_name: str) -> None:
        """Refuse to sample anything but the merged adapter while one is merged.

        Raises:
            MergedAdapterError: ``adapter_name`` is the base model or another adapter.
        """
        merged = self.name
        if merged is not None and adapter_name != merged:
            asked = "the base model" if not adapter_name else repr(adapter_name)
            raise MergedAdapterError(
                f"Adapter {merged!r} is merged into the weights, so {asked} cannot be sampled:"
                f" use adapter_name={merged!r}, or remove_adapter({merged!r}) first."
            )

    @property
    def kept_names(self) -> frozenset[str]:
        """The weights whose base values are kept (empty when nothing is merged)."""
        return frozenset(self._base)

    def _combine(self, base: dict[str, Any], deltas: dict[str, Any]) -> list[tuple[str, Any]]:
        out = []
        for key, value in base.items():
            delta = deltas.get(key)
            if delta is None:
                out.append((key, value))
            else:
                out.append((key, (value.float() + delta.to(value.device)).to(value.dtype)))
        return out

    def plan_merge(
        self, name: str, deltas: dict[str, Any], read_base: Callable[[list[str]], Mapping[str, Any]]
    ) -> MergePlan:
        """Merge ``deltas`` (from :func:`lora_deltas`) as adapter ``name``, replacing any merged adapter.

        ``read_base(names)`` returns the engine's current values of ``names``
        (which are base values: they are not merged), plus any other tensor
        that must travel with them. Weights the previous merge touched and this
        one does not are restored from their kept base values.

        Raises:
            AdapterError: a delta whose shape differs from its weight's.
        """
        missing = [key for key in deltas if key not in self._base]
        base = dict(self._base)
        if missing:
            base.update(read_base(missing))
        for key, delta in deltas.items():
            if tuple(base[key].shape) != tuple(delta.shape):
                raise AdapterError(
                    f"Adapter {name!r}: the update of {key!r} has shape {tuple(delta.shape)}, but the weight is"
                    f" {tuple(base[key].shape)}; nothing was merged."
                )
        return MergePlan(self._combine(base, deltas), name, base, dict(deltas))

    def plan_unmerge(self) -> MergePlan:
        """Put every kept base value back; afterwards nothing is merged."""
        return MergePlan(list(self._base.items()), None, {}, {})

    def plan_update(self, named_tensors: list[tuple[str, Any]]) -> MergePlan:
        """An ``update_weights`` while merged: pushed base tensors are kept, and sent merged.

        ``named_tensors`` must be validated already (names and shapes fit the
        model). Tensors the merge does not touch go through as they are.
        """
        base = dict(self._base)
        out: list[tuple[str, Any]] = []
        for key, value in named_tensors:
            if key in base:
                kept = base[key]
                base[key] = value.detach().to(device=kept.device, dtype=kept.dtype, copy=True)
                delta = self._deltas.get(key)
                merged = base[key] if delta is None else (base[key].float() + delta.to(kept.device)).to(kept.dtype)
                out.append((key, merged))
            else:
                out.append((key, value))
        return MergePlan(out, self.name, base, dict(self._deltas))

    def undo(self, plan: MergePlan) -> list[tuple[str, Any]]:
        """The values the engine held before a merge or unmerge ``plan`` (not committed) began to be applied.

        An engine whose copy of ``plan.tensors`` fails part-way (an interrupt,
        a failing device copy) applies these to stand where it stood: merged
        weights come back from the kept base values and deltas (computed as the
        merge computed them, so to the same bits), weights the plan merges
        first from the base values it read.
        """
        out = []
        for key, _ in plan.tensors:
            if key in self._base:
                out.extend(self._combine({key: self._base[key]}, self._deltas))
            else:
                out.append((key, plan.base[key]))
        return out

    @staticmethod
    def undo_failed(plan: MergePlan, error: BaseException, undo_error: BaseException) -> str:
        """What to say when applying ``plan`` failed part-way and putting back :meth:`undo`'s values failed too.

        The engine may then hold a mix of merged and unmerged values: it names
        the plan's tensors as in doubt, and sampling is refused until they are
        pushed again.
        """
        names = [name for name, _ in plan.tensors]
        return (
            f"A merge failed part-way ({type(error).__name__}: {error}) and could not be undone"
            f" ({type(undo_error).__name__}: {undo_error}): the engine may hold a mix of merged and unmerged"
            f" values of {len(names)} tensors ({names[:3]}...). Sampling is refused until they are"
            " pushed again with update_weights(...)."
        )

    def commit(self, plan: MergePlan) -> None:
        """Record ``plan`` as applied by the engine."""
        self.name, self._base, self._deltas = plan.name, plan.base, plan.deltas


def _as_is(adapter: Any) -> tuple[Mapping[str, Any], list[tuple[str, Any]]]:
    return adapter.config, adapter.tensors


def _same(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return pairs


def _always() -> bool:
    return True


@attrs.frozen
class _Hooks:
    """What an engine gives :class:`AdapterMerger`: its own weight and adapter operations.

    Arguments of ``AdapterMerger(...)``:
        engine: the engine's name, for messages.
        read_base: the engine's current values of some weights, and of any
            weight that must travel with them (vLLM: the rest of a fused layer).
        check: validate ``(name, tensor)`` pairs against the model (a
            ``WeightUpdateError`` changes nothing); returns what ``apply`` takes.
        apply: apply what ``check`` returned, as one update.
        loaded: the adapters loaded unmerged (through the engine's LoRA path).
        load_unmerged: load an adapter unmerged; returns its source.
        remove_unmerged: unload an adapter loaded unmerged (it may not be).
        prepare: the adapter's LoRA config and tensors, refused where the
            engine cannot take them (default: as read).
        spell: weight names as the engine spells them (default: as they are).
        can_undo: whether a failed push can be undone now (vLLM: not while its
            engine is dead; the restart replays the weights instead).
        on_lost: told which weights a failed push left unknown, and why.
    """

    engine: str
    read_base: Callable[[list[str]], Mapping[str, Any]]
    check: Callable[[list[tuple[str, Any]]], Any]
    apply: Callable[[Any], None]
    loaded: Callable[[], list[str]]
    load_unmerged: Callable[[Any], str]
    remove_unmerged: Callable[[str], None]
    prepare: Callable[[Any], tuple[Mapping[str, Any], list[tuple[str, Any]]]] = _as_is
    spell: Callable[[list[tuple[str, Any]]], list[tuple[str, Any]]] = _same
    can_undo: Callable[[], bool] = _always
    on_lost: Callable[[list[str], str], None] | None = None


class AdapterMerger:
    """``add_adapter_to_model(..., merge=True)`` for any engine: the one state machine of merged adapters.

    An engine holds one, built with its own operations (see ``_Hooks`` for
    each keyword), and routes its
    adapter and weight changes through it: :meth:`load_adapter`,
    :meth:`remove_adapter`, :meth:`update_weights`, and :meth:`running` for
    each run (a merged adapter runs on the plain weights under its own name).
    Every push is applied whole or undone; a push that fails part-way and
    whose undo fails too raises ``IncompleteUpdateError`` naming the weights,
    and the sampler refuses to sample until they are pushed again.
    """

    def __init__(
        self,
        *,
        engine: str,
        read_base: Callable[[list[str]], Mapping[str, Any]],
        check: Callable[[list[tuple[str, Any]]], Any],
        apply: Callable[[Any], None],
        loaded: Callable[[], list[str]],
        load_unmerged: Callable[[Any], str],
        remove_unmerged: Callable[[str], None],
        prepare: Callable[[Any], tuple[Mapping[str, Any], list[tuple[str, Any]]]] = _as_is,
        spell: Callable[[list[tuple[str, Any]]], list[tuple[str, Any]]] = _same,
        can_undo: Callable[[], bool] = _always,
        on_lost: Callable[[list[str], str], None] | None = None,
    ) -> None:
        self._hooks = _Hooks(
            engine, read_base, check, apply, loaded, load_unmerged, remove_unmerged, prepare, spell, can_undo, on_lost
        )
        self._state = MergedLoRA()
        #: bumped by every merge: caches keyed on it never mix two merges' weights
        self.merge_id = 0

    @property
    def name(self) -> str | None:
        """The merged adapter, or ``None``."""
        return self._state.name

    @property
    def kept_names(self) -> frozenset[str]:
        """The weights whose base values are kept (empty when nothing is merged)."""
        return self._state.kept_names

    def running(self, adapter_name: str) -> str:
        """The adapter a run of ``adapter_name`` uses on the engine: ``""`` (the plain weights) for the merged one.

        Raises:
            MergedAdapterError: an adapter is merged and ``adapter_name`` is another one, or the base model.
        """
        self._state.check_request(adapter_name)
        return "" if adapter_name == self._state.name else adapter_name

    def load_adapter(self, adapter: Any, options: Mapping[str, Any]) -> str:
        """Load (or replace) ``adapter`` as ``add_adapter_to_model`` asks (``options``: ``merge=`` only); its source.

        Raises:
            AdapterError: an option other than ``merge``, an adapter that does
                not fit, or a merge while other adapters are loaded (or the reverse).
        """
        options = dict(options)
        merge = options.pop("merge", False)
        if options:
            raise AdapterError(
                f"add_adapter_to_model got unexpected options {sorted(options)} for the {self._hooks.engine} engine"
                " (it accepts merge=)."
            )
        name, merged = adapter.name, self._state.name
        if check_merge_flag(merge):
            return self._merge(adapter)
        if merged is not None and merged != name:
            raise AdapterError(
                f"Cannot load adapter {name!r}: adapter {merged!r} is merged into the weights it would run on."
                f" remove_adapter({merged!r}) first."
            )
        source = self._hooks.load_unmerged(adapter)
        if merged == name:  # merged before, served unmerged now: the weights go back to base
            self._push(self._state.plan_unmerge())
        return source

    def _merge(self, adapter: Any) -> str:
        name = adapter.name
        others = sorted(n for n in self._hooks.loaded() if n != name)
        merged = self._state.name
        if others or merged not in (None, name):
            raise AdapterError(
                f"Cannot merge adapter {name!r}: adapter(s) {others or [merged]} are loaded, and a merged adapter"
                " changes the weights they run on. Remove them first (one merged adapter at a time)."
            )
        config, tensors = self._hooks.prepare(adapter)
        deltas = dict(self._hooks.spell(list(lora_deltas(name, config, tensors).items())))
        plan = self._state.plan_merge(name, deltas, self._hooks.read_base)
        try:
            self._push(plan)
        except WeightUpdateError as exc:
            raise AdapterError(f"Cannot merge adapter {name!r}: {exc}") from exc
        self.merge_id += 1
        if name in self._hooks.loaded():  # loaded unmerged before: that copy is stale now
            self._hooks.remove_unmerged(name)
        return str(adapter.source)

    def remove_adapter(self, name: str) -> None:
        """Unload ``name``: a merged adapter's weights go back to base."""
        if self._state.name == name:
            self._push(self._state.plan_unmerge())
        else:
            self._hooks.remove_unmerged(name)

    def update_weights(self, named_tensors: list[tuple[str, Any]], apply: Callable[[Any], None]) -> None:
        """New base weights (``apply`` takes the checked pairs); while merged, pushed base values are kept."""
        named_tensors = self._hooks.spell(named_tensors)
        checked = self._hooks.check(named_tensors)
        if self._state.name is None:
            apply(checked)
            return
        plan = self._state.plan_update(named_tensors)
        apply(self._hooks.check(plan.tensors))
        self._state.commit(plan)

    def _push(self, plan: MergePlan) -> None:
        """Apply a merge or unmerge whole, or stand where the engine stood.

        A push that fails part-way (an interrupt, a failing copy) is undone:
        the values from before it are pushed again. If that fails too, the
        weights may be a mix of merged and unmerged values: an
        ``IncompleteUpdateError`` names them.
        """
        checked = self._hooks.check(plan.tensors)
        try:
            self._hooks.apply(checked)
        except BaseException as exc:
            if self._hooks.can_undo():
                names = [name for name, _ in plan.tensors]
                try:
                    self._hooks.apply(self._hooks.check(self._state.undo(plan)))
                except BaseException as undo_exc:
                    message = self._state.undo_failed(plan, exc, undo_exc)
                    if self._hooks.on_lost is not None:
                        self._hooks.on_lost(names, message)
                    raise IncompleteUpdateError(message, tensors=names) from undo_exc
            raise
        self._state.commit(plan)
