"""Validation of ``update_weights`` input against the model's checkpoint.

The names a trainer sends are its Hugging Face ``state_dict`` names, which are
the checkpoint's names (or their nested twins, and a mixture-of-experts
layer's experts fused as ``transformers`` holds them: :mod:`twinkle_core.names`):
the spec (names, shapes, dtypes) is read from the safetensors headers of the
model folder, without loading any tensor. Nothing is sent to the engine until
every tensor passed these checks.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from twinkle_core.engine import AdapterInput, TensorSpec, check_update
from twinkle_core.errors import AdapterError, UnsupportedFeatureError, WeightUpdateError
from twinkle_core.names import known_name, known_names, split_experts, unserved_part

__all__ = ["WeightSpec"]

_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_EXPERT = re.compile(r"\.experts\.\d+(\.|$)")


def _read_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(length))
        return header


class WeightSpec:
    """Names, shapes and dtypes a weight update may carry.

    Args:
        shapes: checkpoint name -> shape.
        dtypes: checkpoint name -> dtype name (``"bfloat16"``...).
        engine_dtype: the dtype the engine runs in; floating-point tensors must have it.
        packed_modules_mapping: vLLM's fused modules (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``).
        tied_embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight``.
        packed_slices: a fused module's count of output slices, where it is not its count of modules
            (Qwen3.5's ``in_proj_qkvz``: 4 slices from ``in_proj_qkv`` and ``in_proj_z``).
    """

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        dtypes: dict[str, str],
        engine_dtype: str,
        packed_modules_mapping: dict[str, list[str]],
        tied_embeddings: bool,
        files: dict[str, Path] | None = None,
        packed_slices: dict[str, int] | None = None,
    ) -> None:
        self.shapes = shapes
        self.files = files or {}
        self.dtypes = dtypes
        self.spec = {name: TensorSpec(shape, dtypes[name]) for name, shape in shapes.items()}
        self.engine_dtype = engine_dtype
        self.tied = tied_embeddings and "lm_head.weight" not in shapes
        self._fused = {part: fused for fused, parts in packed_modules_mapping.items() for part in parts}
        self._packed = {fused: list(parts) for fused, parts in packed_modules_mapping.items()}
        self._slices = dict(packed_slices or {})
        # Tensors that vLLM loads into one layer must arrive together: a layer
        # is rebuilt from what is sent, so half a fused layer would be garbage.
        self.groups: dict[str, list[str]] = {}
        for name in shapes:
            self.groups.setdefault(self._layer_key(name), []).append(name)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        engine_dtype: str,
        packed_modules_mapping: dict[str, list[str]],
        unloaded: frozenset[str] = frozenset(),
        packed_slices: dict[str, int] | None = None,
    ) -> WeightSpec:
        """Read the spec from ``model_dir/*.safetensors``.

        ``unloaded`` names the kinds of checkpoint part (:data:`twinkle_core.names.UNSERVED_PARTS`)
        the engine did not load: their tensors are left out, so an update naming
        one is refused, saying why, instead of reaching a loader that skips it.

        Raises:
            UnsupportedFeatureError: the folder has no safetensors checkpoint.
        """
        files = sorted(p for p in Path(model_dir).glob("*.safetensors") if not p.name.startswith("adapter_"))
        if not files:
            raise UnsupportedFeatureError(
                f"update_weights needs a safetensors checkpoint to validate against; {model_dir} has none."
            )
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, str] = {}
        where: dict[str, Path] = {}
        for file in files:
            for name, info in _read_header(file).items():
                if name == "__metadata__" or unserved_part(name, unloaded):
                    continue
                where[name] = file
                shapes[name] = tuple(info["shape"])
                dtypes[name] = _ST_DTYPES.get(info["dtype"], info["dtype"].lower())
        tied = False
        config = Path(model_dir) / "config.json"
        if config.is_file():
            data = json.loads(config.read_text())
            tied = bool(data.get("tie_word_embeddings", data.get("text_config", {}).get("tie_word_embeddings", False)))
        return cls(shapes, dtypes, engine_dtype, packed_modules_mapping, tied, where, packed_slices)

    def _layer_key(self, name: str) -> str:
        module = name.rsplit(".", 1)[0]
        expert = _EXPERT.search(module)
        if expert:
            # vLLM keeps all experts of a layer in one fused module.
            return module[: expert.start()] + ".experts"
        head, _, last = module.rpartition(".")
        fused = self._fused.get(last)
        return f"{head}.{fused}" if fused else module

    def group_of(self, name: str) -> list[str]:
        """Every checkpoint tensor an update of ``name`` must include (its fused layer), ``name`` among them."""
        return list(self.groups.get(self._layer_key(name), [name]))

    def read_checkpoint(self, names: list[str], dtype: Any) -> dict[str, Any]:
        """The checkpoint's values of ``names``, as CPU tensors of ``dtype`` (read with safetensors).

        Raises:
            AdapterError: a name that is not in the checkpoint.
        """
        from safetensors import safe_open

        unknown = [n for n in names if n not in self.files]
        if unknown:
            raise AdapterError(f"merge=True: the adapter changes {unknown[0]!r}, which is not a weight of this model.")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        out: dict[str, Any] = {}
        for file, members in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in members:
                    out[name] = f.get_tensor(name).to(dtype)
        return out

    def validate(self, items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Check every tensor; return what to send (tied ``lm_head`` folded into the embedding).

        The shared checks of :func:`twinkle_core.weights.check_update`
        (floating-point tensors must be in the engine's dtype), then vLLM's own
        rule: tensors loaded into one fused layer arrive together.

        Raises:
            WeightUpdateError: an unknown or repeated name, a non-tensor, a wrong
                shape or dtype, or a fused layer sent in part. Nothing is sent then.
        """
        # a trainer's names (model.*) or a checkpoint's nested ones (model.language_model.*): the checkpoint's;
        # a trainer's fused MoE experts (transformers 5's 3-D tensors): the checkpoint's per-expert tensors
        items = known_names(split_experts(items, self.spec), self.spec)
        names = [name for name, _ in items]
        if self.tied and "lm_head.weight" in names:
            # One tensor in the trainer; vLLM keeps only the embedding.
            embed = known_name("model.embed_tokens.weight", self.spec)
            if embed in names:
                items = [(n, t) for n, t in items if n != "lm_head.weight"]
            else:
                items = [(embed if n == "lm_head.weight" else n, t) for n, t in items]
        checked = check_update(items, self.spec, float_dtype=self.engine_dtype)
        for name in checked:
            members = self.groups[self._layer_key(name)]
            missing = [m for m in members if m not in checked]
            if missing:
                fused = (
                    " (a layer's experts: all its expert tensors, fused or one by one)" if _EXPERT.search(name) else ""
                )
                raise WeightUpdateError(
                    f"update_weights: {name!r} is loaded into one engine layer together with {missing[:4]}"
                    f"{' and more' if len(missing) > 4 else ''}; send all of them in the same update{fused}."
                    " Nothing was updated."
                )
        return list(checked.items())

    def check_lora(self, lora: AdapterInput, *, unmerged: bool = True) -> None:
        """Check LoRA tensors against the model: each ``lora_A`` is ``(r, in)``, each ``lora_B`` ``(out, r)``.

        ``unmerged``: the adapter is to be served by vLLM's LoRA layers (not merged into
        the weights), which cannot serve every subset of a fused layer's modules.

        Names are PEFT's (``base_model.model.<module>.lora_A.weight``); ``r`` is
        the config's, or the module's entry in ``rank_pattern``. vLLM itself
        loads a mis-shaped or half adapter without a word.

        Raises:
            AdapterError: an unknown module, a wrong shape, or an ``A`` without its ``B``.
            UnsupportedFeatureError: (``unmerged``) LoRA vLLM's loader cannot place (see ``_check_packed_lora``).
        """
        adapter = lora.name
        seen: dict[str, set[str]] = {}
        for name, tensor in lora.tensors:
            parts = name.split(".")
            if len(parts) < 3 or parts[-2] not in ("lora_A", "lora_B"):
                continue  # e.g. modules_to_save: vLLM decides
            module = ".".join(parts[:-2])
            for prefix in ("base_model.model.", "base_model."):
                if module.startswith(prefix):
                    module = module[len(prefix) :]
                    break
            base = self.spec.get(known_name(f"{module}.weight", self.spec))
            if base is None or len(base.shape) != 2:
                raise AdapterError(
                    f"Adapter {adapter!r}: {name!r} targets {module!r}, which is not a linear layer of this model."
                )
            out_features, in_features = base.shape
            layer_rank = lora.rank_of(module)
            want = (layer_rank, in_features) if parts[-2] == "lora_A" else (out_features, layer_rank)
            if tuple(tensor.shape) != tuple(want):
                raise AdapterError(
                    f"Adapter {adapter!r}: {name!r} has shape {tuple(tensor.shape)}, expected {want}"
                    f" (r={layer_rank}, layer {module!r} is {out_features}x{in_features})."
                )
            seen.setdefault(module, set()).add(parts[-2])
        half = sorted(m for m, kinds in seen.items() if len(kinds) != 2)
        if half:
            raise AdapterError(
                f"Adapter {adapter!r}: layer {half[0]!r} has only {sorted(seen[half[0]])[0]}; each adapted layer"
                " needs both lora_A and lora_B."
            )
        if not seen:
            raise AdapterError(f"Adapter {adapter!r} has no lora_A / lora_B tensors.")
        if unmerged:
            self._check_packed_lora(adapter, set(seen))

    def _check_packed_lora(self, adapter: str, modules: set[str]) -> None:
        """Refuse LoRA on a later member of a fused layer of more slices than members, its first left out.

        vLLM 0.32's LoRA loader (``MergedColumnParallelLinearWithLoRA.expand_packed_lora``)
        gives a member without LoRA all the slices left, so a later member's
        adapter finds none: Qwen3.5's ``in_proj_z`` adapted without
        ``in_proj_qkv`` loads, then ends the engine at the first request that
        uses it ("Cannot determine how to split lora_b ...").

        Raises:
            UnsupportedFeatureError: naming the module and what to do.
        """
        for module in sorted(modules):
            head, _, leaf = module.rpartition(".")
            fused = self._fused.get(leaf)
            if fused is None or fused not in self._slices:
                continue
            members = self._packed[fused]
            left_out = [m for m in members[: members.index(leaf)] if f"{head}.{m}" not in modules]
            if left_out:
                raise UnsupportedFeatureError(
                    f"Adapter {adapter!r}: LoRA on {module!r} without {left_out[0]!r} of the same layer cannot be"
                    f" served unmerged by vLLM: it fuses {members} into one layer ({fused!r}, {self._slices[fused]}"
                    f" output slices) and its LoRA loader (vLLM 0.32) places a later member's adapter only after an"
                    f" earlier member's; the engine would die at the first request using it. Add {left_out[0]!r}"
                    " to the adapter (a zero lora_B leaves it unchanged), load it with merge=True, or use the"
                    " torch engine."
                )
