"""twinkle_core.adapter_input: the one reader of LoRA adapter input (folders, configs with tensors)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from twinkle_core.adapter_input import MEMORY_SOURCE, AdapterInput, read_adapter  # noqa: E402
from twinkle_core.errors import AdapterError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


@pytest.fixture(scope="module")
def peft_model() -> Any:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["proj"], init_lora_weights=False)
    return peft.get_peft_model(_Net(), config)


@pytest.fixture(scope="module")
def folder(peft_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(str(out))
    return out


def _saved(peft_model: Any) -> dict[str, Any]:
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(peft_model))


def test_a_folder_reads_as_peft_saved_it(folder: Path, peft_model: Any) -> None:
    adapter = read_adapter("a", folder)
    assert isinstance(adapter, AdapterInput) and adapter.name == "a" and adapter.folder == folder
    assert adapter.source == str(folder) and adapter.peft_config is None
    assert adapter.config == json.loads((folder / "adapter_config.json").read_text())
    want = _saved(peft_model)
    got = adapter.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_config_with_tensors_keeps_the_config_object_and_renames_in_model_names(peft_model: Any) -> None:
    config = peft_model.peft_config["default"]
    in_model = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert all(".default." in k for k in in_model)  # the spelling a live model's state_dict uses
    adapter = read_adapter("b", config, in_model)
    assert adapter.folder is None and adapter.source == MEMORY_SOURCE and adapter.peft_config is config
    assert adapter.config["r"] == 2 and sorted(adapter.config["target_modules"]) == ["proj"]
    json.dumps(adapter.config)  # JSON-safe: a set of target modules became a list
    want = _saved(peft_model)
    assert sorted(adapter.state_dict()) == sorted(want)
    assert not any(t.requires_grad for _, t in adapter.tensors)
    # pairs work as a dict does
    assert [k for k, _ in read_adapter("b", dict(config.to_dict()), list(want.items())).tensors] == list(want)


@pytest.mark.parametrize(
    ("config_or_dir", "weights", "match"),
    [
        ("FOLDER", {"x": 1}, "not a folder and weights"),
        ({"r": 2}, None, "config without weights"),
        (3, {"x": 1}, r"config_or_dir=3 is invalid: expected a PEFT adapter folder"),
        ({"r": 2}, {}, "weights is empty"),
        ({"r": 2}, 5, r"weights=5 is invalid"),
        ({"r": 2}, [("x",)], "weights must be a dict or \\(name, tensor\\) pairs"),
        ({"r": 2}, {"x.lora_A.weight": [1.0]}, "'x.lora_A.weight' is a list, expected a torch.Tensor"),
        ({"r": 2}, {"x.lora_A.weight": "INT"}, "has dtype torch.int64; expected a floating-point tensor"),
        ({"r": 2}, {"x.lora_B.weight": "NAN"}, "'x.lora_B.weight' holds 1 non-finite value"),
        # a scale PEFT would take, and the model turn into NaN; a rank that is not one
        ({"r": 2, "lora_alpha": math.nan}, {"x.lora_A.weight": "OK"}, r"lora_alpha=nan is invalid: expected a finite"),
        ({"r": 2, "lora_alpha": -math.inf}, {"x.lora_A.weight": "OK"}, r"lora_alpha=-inf is invalid"),
        ({"r": 2, "lora_alpha": "4"}, {"x.lora_A.weight": "OK"}, r"lora_alpha='4' is invalid"),
        ({"r": "4"}, {"x.lora_A.weight": "OK"}, r"r='4' is invalid: expected a positive integer"),
        ({"r": 0}, {"x.lora_A.weight": "OK"}, r"r=0 is invalid"),
        ({"r": 2, "rank_pattern": {"proj": 2.5}}, {"x.lora_A.weight": "OK"}, r"rank_pattern\['proj'\]=2.5 is invalid"),
        ({"r": 2, "alpha_pattern": {"proj": math.inf}}, {"x.lora_A.weight": "OK"}, r"alpha_pattern\['proj'\]=inf"),
        ({"r": 2, "alpha_pattern": [1]}, {"x.lora_A.weight": "OK"}, r"alpha_pattern=\[1\] is invalid"),
    ],
)
def test_bad_input_is_an_adapter_error_naming_it(folder: Path, config_or_dir: Any, weights: Any, match: str) -> None:
    if config_or_dir == "FOLDER":
        config_or_dir = folder
    if isinstance(weights, dict) and weights:
        [(key, value)] = weights.items()
        if value == "INT":
            weights = {key: torch.zeros(2, 2, dtype=torch.int64)}
        elif value == "NAN":
            weights = {key: torch.tensor([0.0, math.nan])}
        elif value == "OK":
            weights = {key: torch.zeros(2, 4)}
    with pytest.raises(AdapterError, match=match):
        read_adapter("bad", config_or_dir, weights)


def test_check_finite_false_lets_non_finite_values_through() -> None:
    adapter = read_adapter("n", {"r": 1}, {"x.lora_B.weight": torch.tensor([math.inf])}, check_finite=False)
    assert math.isinf(float(adapter.tensors[0][1]))


def test_broken_folders_are_refused_with_what_is_missing(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="does not exist"):
        read_adapter("f", tmp_path / "nowhere")
    weights_file = folder / "adapter_model.safetensors"  # a common slip: the weights file, not its folder
    with pytest.raises(AdapterError, match="is a file, not a folder"):
        read_adapter("f", weights_file)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterError, match=r"has no adapter_config\.json"):
        read_adapter("f", empty)
    (empty / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    with pytest.raises(AdapterError, match=r"has no adapter_model\.safetensors"):
        read_adapter("f", empty)
    (empty / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="is unreadable"):
        read_adapter("f", empty)
    (empty / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
    (empty / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match="holds no JSON object"):
        read_adapter("f", empty)


def test_no_shipped_module_but_the_reader_parses_adapter_input() -> None:
    """One reader: engines load what the core read, never the caller's folder or weights again."""
    shipped = [
        *(ROOT / "twinkle_core").rglob("*.py"),
        *(ROOT / "plugins").glob("*/twinkle_*/**/*.py"),
        *(ROOT / "examples").glob("*/twinkle_*/**/*.py"),
    ]
    reading = re.compile(r"load_peft_weights|PeftConfig\.from_pretrained|[\"']adapter_model\.(safetensors|bin)[\"']")
    readers = sorted(
        str(p.relative_to(ROOT)) for p in shipped if "testing" not in p.parts and reading.search(p.read_text())
    )
    assert readers == ["twinkle_core/adapter_input.py"]
