"""The ``twinkle`` alias: the core's own objects under the reference docs' names, and just as cheap to import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import twinkle
import twinkle.data_format
import twinkle.sampler
import twinkle.template
import twinkle_core
import twinkle_core.data_format
import twinkle_core.sampler
import twinkle_core.template

PAIRS = [
    (twinkle, twinkle_core),
    (twinkle.sampler, twinkle_core.sampler),
    (twinkle.data_format, twinkle_core.data_format),
    (twinkle.template, twinkle_core.template),
]
HEAVY = ["torch", "transformers", "vllm", "ray", "numpy", "peft"]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_alias_identifies_itself_with_the_core_version():
    assert twinkle.__twinkle_core__ == twinkle_core.__version__
    assert "__twinkle_core__" in twinkle.__all__


@pytest.mark.parametrize(("alias", "core"), PAIRS, ids=lambda m: m.__name__)
def test_every_public_name_is_the_cores_own_object(alias, core):
    assert set(core.__all__) <= set(alias.__all__)
    for name in core.__all__:
        assert getattr(alias, name) is getattr(core, name), name
    # a star import (what `from twinkle.data_format import *` gives a user) yields the same objects
    namespace: dict[str, object] = {}
    exec(f"from {alias.__name__} import *", namespace)
    assert all(namespace[name] is getattr(core, name) for name in core.__all__)


def test_reference_imports_resolve_to_core_objects():
    from twinkle import DeviceGroup, DeviceMesh
    from twinkle.data_format import SamplingParams, Trajectory
    from twinkle.sampler import TorchSampler, vLLMSampler
    from twinkle.template import Template

    assert DeviceGroup is twinkle_core.DeviceGroup and DeviceMesh is twinkle_core.DeviceMesh
    assert SamplingParams is twinkle_core.SamplingParams and Trajectory is twinkle_core.Trajectory
    assert Template is twinkle_core.Template
    assert twinkle.initialize is twinkle_core.initialize and twinkle.shutdown is twinkle_core.shutdown
    # engines come from the registry, the same classes the core's lazy names give
    assert vLLMSampler is twinkle_core.sampler.vLLMSampler is twinkle_core.get_sampler_class("vllm")
    assert TorchSampler is twinkle_core.sampler.TorchSampler is twinkle_core.get_sampler_class("torch")
    assert issubclass(vLLMSampler, twinkle.sampler.Sampler)


def test_public_names_outside_all_are_forwarded_too():
    # not in __all__, but public: a user reading the core's docs may reach for it
    assert twinkle.data_format.training_feature is twinkle_core.data_format.training_feature
    assert "Trajectory" in dir(twinkle.data_format) and "__twinkle_core__" in dir(twinkle)


def test_unknown_names_say_which_twinkle_this_is():
    with pytest.raises(AttributeError, match=r"twinkle-core alias.*'twinkle_core.sampler'") as info:
        twinkle.sampler.NoSuchSampler  # noqa: B018
    assert "NoSuchSampler" in str(info.value)
    with pytest.raises(ImportError, match="get_logger"):
        exec("from twinkle import get_logger", {})
    with pytest.raises(AttributeError):  # private names of the core are not part of the alias
        twinkle._core_private_name  # noqa: B018


def test_import_twinkle_pulls_in_no_heavy_library_and_no_engine():
    mods = _modules_after("import twinkle, twinkle.sampler, twinkle.data_format, twinkle.template")
    assert not [m for m in HEAVY if m in mods]
    assert not [m for m in mods if m.startswith(("twinkle_torch", "twinkle_vllm", "twinkle_echo"))]
    out = subprocess.run(
        [sys.executable, "-c", "import twinkle_core.plugins.registry as r; import twinkle; print(r._scan.done)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out.strip() == "False"


def test_reference_engine_import_loads_only_that_engine():
    mods = _modules_after("from twinkle.sampler import TorchSampler")
    assert "twinkle_torch.sampler" in mods
    assert "vllm" not in mods and "twinkle_vllm.sampler" not in mods
