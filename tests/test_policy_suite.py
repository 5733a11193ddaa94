"""The policy suite itself: an engine that does not serve the policy it was given fails it.

Each fake is the real torch engine with one lie: an update that is validated
and then dropped (wholly, when partial, when full, or for one tensor name), an
adapter that loads and is never applied, a replaced adapter that keeps its old
weights, a merged adapter whose removal leaves the merge in, adapters mixed in
one batch, sequences labelled with a version that did not produce them. Each
must fail ``PolicyContractTests`` and the unbroken engine must pass it, all in
one fresh interpreter on the tiny model.
"""

from __future__ import annotations

import re

import pytest

pytest_plugins = ["pytester"]

#: Fakes of the torch engine, by name: each is a subclass body overriding one part.
FAKES: dict[str, str] = {
    "update_validated_then_dropped": """
    def update_weights(self, named_tensors, *, version):
        self._weights.check(named_tensors)
""",
    "partial_update_dropped": """
    def update_weights(self, named_tensors, *, version):
        if len(named_tensors) == len(BASE):
            super().update_weights(named_tensors, version=version)
""",
    "full_update_dropped": """
    def update_weights(self, named_tensors, *, version):
        if len(named_tensors) < len(BASE):
            super().update_weights(named_tensors, version=version)
""",
    "one_name_dropped": """
    def update_weights(self, named_tensors, *, version):
        kept = [(n, t) for n, t in named_tensors if n != 'model.layers.1.post_attention_layernorm.weight']
        super().update_weights(kept, version=version)
""",
    "adapter_never_applied": """
    def run(self, run):
        asked, run.adapter_name = run.adapter_name, ''
        relabel(run, lambda seq: attrs.evolve(seq, adapter_name=asked))
        return super().run(run)
""",
    "replaced_adapter_kept": """
    def load_adapter(self, adapter, *, version, **kwargs):
        if adapter.name in self._adapter_set.names:
            return 'kept'
        return super().load_adapter(adapter, version=version, **kwargs)
""",
    "merge_left_in_on_removal": """
    def remove_adapter(self, name):
        if self._merged.name == name:  # the merge state forgotten, the weights left merged
            from twinkle_core.merge import MergedLoRA
            self._merged._state = MergedLoRA()
        else:
            super().remove_adapter(name)
""",
    "adapters_mixed_in_a_batch": """
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run = self._decoder.run

        def mixed(prompts, params, *, control=None):
            if control is not None:
                control.adapter = ''  # every run joins any batch; the batch's first run picks the adapter
            return run(prompts, params, control=control)

        self._decoder.run = mixed
""",
    "stale_version_label": """
    def run(self, run):
        relabel(run, lambda seq: attrs.evolve(seq, weights_version=max(0, seq.weights_version - 1)))
        return super().run(run)
""",
}

#: A run whose reported sequences a fake relabels (what an engine that mislabels them does).
RELABEL = """
def relabel(run, change):
    finish = run.finish
    run.finish = lambda p, s, seq: finish(p, s, change(seq))
"""


def _module(model_dir: str) -> str:
    lines = [
        "import pytest",
        "from twinkle_core.testing.policy import PolicyContractTests, checkpoint_weights",
        "import attrs",
        "from twinkle_core import Sampler",
        "from twinkle_torch.engine import TorchEngine",
        "",
        f"MODEL = {model_dir!r}",
        "BASE = checkpoint_weights(MODEL)",
        "",
        "",
        "class Suite(PolicyContractTests):",
        "    engine = TorchEngine",
        "    adapter_options = ({'merge': True},)",
        "",
        "    @pytest.fixture(scope='class')",
        "    @classmethod",
        "    def sampler(cls):",
        "        with Sampler(cls.engine, MODEL, device='cpu') as s:",
        "            yield s",
        "",
        "    @pytest.fixture(scope='class')",
        "    @classmethod",
        "    def base_weights(cls):",
        "        return BASE",
        "",
        "",
        "class TestIntact(Suite):",
        "    pass",
        *RELABEL.splitlines(),
    ]
    for name, body in FAKES.items():
        lines += ["", "", f"class Fake_{name}(TorchEngine):", *body.strip("\n").splitlines()]
        lines += ["", "", f"class TestFake_{name}(Suite):", f"    engine = Fake_{name}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def model_dir() -> str:
    """The tiny model, found before ``pytester`` points HOME (and so the model cache) at a new folder."""
    pytest.importorskip("twinkle_torch")
    from twinkle_core.testing import build_tiny_model

    return str(build_tiny_model("llama"))


def test_every_fake_engine_fails_the_policy_suite(model_dir: str, pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_policy_fakes=_module(model_dir))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "--tb=line")
    outcomes: dict[str, dict[str, int]] = {}
    for line in result.outlines:
        match = re.match(r"(PASSED|FAILED|ERROR|SKIPPED)\S* test_policy_fakes\.py::(\w+)::", line)
        if match:
            per = outcomes.setdefault(match.group(2), {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0})
            per[match.group(1)] += 1
    tail = result.stdout.str()[-4000:]
    intact = outcomes.get("TestIntact", {})
    assert intact.get("PASSED", 0) == 7 and intact.get("FAILED", 0) == intact.get("ERROR", 0) == 0, tail
    survivors = [name for name in FAKES if not outcomes.get(f"TestFake_{name}", {}).get("FAILED", 0)]
    assert not survivors, f"fake engines passing the policy suite: {survivors}\n{outcomes}"
