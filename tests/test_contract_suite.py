"""The conformance suite itself: an engine that silently ignores any sampling field fails it.

Broken engines are real engines with one change: their ``generate`` (or ``_generate``) gets
the request's ``SamplingParams`` with one field reset to its default, which is
what an engine that drops a field does. The suite runs against them in a
nested pytest session (``pytester``); each must fail, and the unbroken engine
must pass the same selection.

Every field is tried on the echo example (pure Python, fast); the fields the
reference covers (but top-k, as cheap to break as the others) are also tried
on a broken copy of the torch engine on the tiny model, in fresh interpreters.
The vocabulary-limit test is left out of these runs: it checks a rule of the
base class, which no engine can break by dropping a field.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from twinkle_core.data_format import SamplingParams

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
ECHO_DIR = ROOT / "examples" / "twinkle_echo"

#: Every ``SamplingParams`` field: an engine ignoring any of them must fail the suite.
FIELDS = [f.name for f in attrs.fields(SamplingParams)]
#: Fields the numeric reference covers, tried on the torch engine too.
TORCH_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "structured_outputs",
]


def _suite_module(engine_import: str, engine_class: str, build: str, fields: list[str], intact: bool = True) -> str:
    """Source of a test module: one ``SamplerContractTests`` class per broken field, and the intact engine."""
    lines = [
        "import pytest",
        "from twinkle_core.data_format import SamplingParams",
        "from twinkle_core.testing import SamplerContractTests",
        engine_import,
        "",
        "DEFAULTS = SamplingParams()",
        "",
        "",
        "def broken(field):",
        f"    class Broken({engine_class}):",
        "        def generate(self, prompts, params, adapter_name):",
        "            # what an engine that drops `field` does: it samples as if the default were set",
        "            params = params.replace(**{field: getattr(DEFAULTS, field)})",
        "            return super().generate(prompts, params, adapter_name)",
        "",
        "        def run(self, run):",
        "            # the same for an engine that implements run (twinkle_core.engine.Engine)",
        "            run.params = run.params.replace(**{field: getattr(DEFAULTS, field)})",
        "            if field == 'max_tokens':",
        "                run.max_tokens = [DEFAULTS.max_tokens] * len(run.prompts)",
        "            return super().run(run)",
        "",
        "    return Broken",
    ]
    if intact:
        lines += [
            "",
            "",
            "class TestIntact(SamplerContractTests):",
            "    @pytest.fixture(scope='class')",
            "    @classmethod",
            f"    def sampler(cls, {'tiny_llama' if 'tiny_llama' in build else ''}):",
            f"        with {build.format(cls=engine_class)} as s:",
            "            yield s",
        ]
    for field in fields:
        lines += [
            "",
            "",
            f"class TestIgnores_{field}(SamplerContractTests):",
            "    @pytest.fixture(scope='class')",
            "    @classmethod",
            f"    def sampler(cls, {'tiny_llama' if 'tiny_llama' in build else ''}):",
            f"        with {build.format(cls=f'broken({field!r})')} as s:",
            "            yield s",
        ]
    return "\n".join(lines) + "\n"


def _outcomes_by_class(result: pytest.RunResult) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for report in result.reprec.getreports("pytest_runtest_logreport"):  # type: ignore[attr-defined]
        if report.when != "call" and report.outcome != "failed":
            continue
        cls = report.nodeid.split("::")[1]
        per = counts.setdefault(cls, {"passed": 0, "failed": 0, "skipped": 0})
        per[report.outcome] += 1
    return counts


def _check(counts: dict[str, dict[str, int]], fields: list[str]) -> None:
    intact = counts["TestIntact"]
    assert intact["failed"] == 0 and intact["passed"] > 0, f"the intact engine failed the suite: {intact}"
    survivors = [field for field in fields if counts.get(f"TestIgnores_{field}", {}).get("failed", 0) == 0]
    assert not survivors, f"engines ignoring {survivors} pass the suite: {counts}"


def test_the_suite_catches_an_echo_engine_ignoring_any_field(pytester: pytest.Pytester) -> None:
    pytester.syspathinsert(ECHO_DIR)
    imports = "from twinkle_core import Sampler\nfrom twinkle_echo.engine import EchoEngine"
    engine = (imports, "EchoEngine", "Sampler({cls})")
    pytester.makepyfile(test_intact_echo=_suite_module(*engine, []))
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "not vocabulary", "test_intact_echo.py")
    _check(_outcomes_by_class(result), [])
    # one session per broken engine, stopping at its first failure: the suite is long
    counts: dict[str, dict[str, int]] = {"TestIntact": {"passed": 1, "failed": 0}}
    # a field the engine does not declare is refused by the base before the engine sees it: nothing to ignore
    from twinkle_echo.engine import SUPPORTED_PARAMS

    fields = [field for field in FIELDS if field in SUPPORTED_PARAMS]
    assert len(fields) >= 14
    for field in fields:
        pytester.makepyfile(**{f"test_ignores_{field}": _suite_module(*engine, [field], intact=False)})
        result = pytester.runpytest("-p", "no:cacheprovider", "-x", "-k", "not vocabulary", f"test_ignores_{field}.py")
        counts.update(_outcomes_by_class(result))
    _check(counts, fields)


@pytest.fixture(scope="module")
def tiny_llama_dir() -> str:
    """The tiny model, found before ``pytester`` points HOME (and so the model cache) at a new folder.

    Built inside the nested session, it would be trained again there (minutes).
    """
    pytest.importorskip("twinkle_torch")
    from twinkle_core.testing import build_tiny_model

    return str(build_tiny_model("llama"))


def test_the_suite_catches_a_torch_engine_ignoring_a_sampling_field(
    tiny_llama_dir: str, pytester: pytest.Pytester
) -> None:
    pytester.makeconftest(
        "import pytest\n"
        "from pathlib import Path\n\n"
        "@pytest.fixture(scope='session')\n"
        "def tiny_llama():\n"
        f"    return Path({tiny_llama_dir!r})\n"
    )
    imports = "from twinkle_core import Sampler\nfrom twinkle_torch.engine import TorchEngine"
    engine = (imports, "TorchEngine", "Sampler({cls}, tiny_llama, device='cpu')")
    # The numeric checks only (the rest of the suite is the echo test's business), of each
    # broken engine only those of its own field, all in one fresh interpreter.
    source = _suite_module(*engine, TORCH_FIELDS)
    for i, field in enumerate(TORCH_FIELDS):  # class names without the field, for -k
        source = source.replace(f"TestIgnores_{field}", f"TestBroken{i}")
    pytester.makepyfile(test_broken_torch=source)
    selection = [f"(TestIntact and ({' or '.join(TORCH_FIELDS)}))"]
    selection += [f"(TestBroken{i} and {field})" for i, field in enumerate(TORCH_FIELDS)]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "-k", " or ".join(selection))
    counts: dict[str, dict[str, int]] = {}
    for line in result.outlines:
        match = re.match(r"(PASSED|FAILED|ERROR) test_broken_torch\.py::(\w+)::", line)
        if match:
            per = counts.setdefault(match.group(2), {"passed": 0, "failed": 0})
            per["passed" if match.group(1) == "PASSED" else "failed"] += 1
    for i, field in enumerate(TORCH_FIELDS):
        counts[f"TestIgnores_{field}"] = counts.pop(f"TestBroken{i}", {"failed": 0})
    assert counts.get("TestIntact", {}).get("passed", 0) >= 2 * len(TORCH_FIELDS), result.stdout.str()[-3000:]
    _check(counts, TORCH_FIELDS)
