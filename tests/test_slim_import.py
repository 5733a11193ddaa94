"""``import twinkle_core`` stays slim: no heavy libraries, no plugin scan."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "transformers", "vllm", "ray", "numpy", "modelscope", "huggingface_hub", "peft"]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_import_pulls_in_no_heavy_library_and_scans_no_plugin():
    mods = _modules_after("import twinkle_core, twinkle_core.sampler, twinkle_core.data_format, twinkle_core.hub")
    assert not [m for m in HEAVY if m in mods]
    assert not [m for m in mods if m.startswith(("twinkle_torch", "twinkle_vllm", "twinkle_echo"))]
    code = "import twinkle_core; from twinkle_core.plugins import plugins_scanned; print(plugins_scanned())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_seed_style_engine_import_loads_only_that_engine():
    mods = _modules_after("from twinkle_core.sampler import TorchSampler")
    assert "twinkle_torch.sampler" in mods
    # other plugins' entry-point modules are loaded (they only register strings), their engines are not
    assert "vllm" not in mods and "twinkle_vllm.sampler" not in mods
    mods = _modules_after("from twinkle_core.data_format import SamplingParams")
    assert "torch" not in mods
