"""The engine contract is closed: engines are ``twinkle_core.engine`` objects, and ``Sampler`` is final.

An engine (the first-party plugins, the echo example, the Ray engine) is an
``Engine`` the ``Sampler`` holds; it imports only the contract, and nothing
reaches into the ``Sampler``'s private state but the Ray replica host's two
documented calls. These tests read the source of every engine in the
repository, so a new engine (or a new private attribute of the sampler)
cannot slip past them.
"""

from __future__ import annotations

import ast
import inspect
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import twinkle_core
from twinkle_core import InputFeature, NamedSampler, Sampler, SampleResponse, SamplingParams
from twinkle_core.engine import BatchEngine, EngineContext, EngineInfo
from twinkle_core.errors import (
    ConfigError,
    IncompleteUpdateError,
    InvalidInputError,
    InvalidSamplingParams,
    UnknownAdapterError,
    UnsupportedFeatureError,
    WeightUpdateError,
)

ROOT = Path(__file__).resolve().parents[1]

#: What the Ray replica host calls on the sampler it hosts (``ReplicaHost.stream_shard`` and ``replay``).
HOST_CALLS = {"_sample", "_restore_version"}

ENGINE_SOURCES = [
    *sorted((ROOT / "plugins").glob("twinkle_*/twinkle_*/**/*.py")),
    *sorted((ROOT / "examples" / "twinkle_echo" / "twinkle_echo").glob("*.py")),
    *sorted((ROOT / "twinkle_core" / "remote").glob("*.py")),
]


def _base_private_names() -> set[str]:
    """Every single-underscore name the base class defines: its methods and the attributes its code sets."""
    names = {n for n in vars(Sampler) if n.startswith("_") and not n.startswith("__")}
    tree = ast.parse(inspect.getsource(inspect.getmodule(Sampler)))  # type: ignore[arg-type]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Store)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            names.add(node.attr)
    return names


def test_sampler_is_final() -> None:
    with pytest.raises(TypeError, match=r"overrides Sampler's _generate, max_model_len: Sampler is final"):

        class OldStyle(Sampler):
            @property
            def max_model_len(self) -> int:
                return 8

            def _generate(self, prompts, params, adapter_name):  # type: ignore[no-untyped-def]
                return []

    with pytest.raises(TypeError, match="overrides Sampler's sample"):

        class Wrapper(Sampler):
            def sample(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                return []

    # naming an engine and adding accessors is what a subclass may do
    class Named(Sampler):
        def __init__(self, **options: Any) -> None:
            super().__init__(Recorder, **options)

        @property
        def seen(self) -> list[SamplingParams]:
            return self.engine.seen  # type: ignore[attr-defined, no-any-return]

    named = Named(concurrent=True)
    named.engine.gate.set()  # type: ignore[attr-defined]
    named.sample(InputFeature(input_ids=[1]), {"max_tokens": 1})
    assert named.concurrent_samples and len(named.seen) == 1


def test_a_named_sampler_takes_its_engines_arguments() -> None:
    class RecorderSampler(NamedSampler):
        engine_class = Recorder

    # help() and Ray's argument check see the engine's constructor, after its context, and remote_group
    params = inspect.signature(RecorderSampler).parameters
    engine_params = list(inspect.signature(Recorder.__init__).parameters)[2:]
    assert list(params) == [*engine_params, "remote_group"] == ["concurrent", "fields", "remote_group"]
    with RecorderSampler(concurrent=True) as s:
        assert type(s) is RecorderSampler and isinstance(s.engine, Recorder) and s.concurrent_samples
    with pytest.raises(TypeError, match="must set engine_class"):

        class Nameless(NamedSampler):
            pass

    with pytest.raises(ConfigError, match="Engine subclass"):

        class NotAnEngine(NamedSampler):
            engine_class = dict  # type: ignore[assignment]


def _sampler_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """Names of the classes in ``trees`` that derive from ``Sampler``, directly or through each other."""
    bases = {
        node.name: {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    found = {"Sampler", "NamedSampler"}
    while True:
        more = {name for name, parents in bases.items() if parents & found} - found
        if not more:
            return found - {"Sampler", "NamedSampler"}
        found |= more


def test_engines_use_only_the_engine_api() -> None:
    private = _base_private_names() - HOST_CALLS
    assert {"_policy", "_templates", "_calls"} <= private  # the scan knows the internals
    trees = {path: ast.parse(path.read_text(), str(path)) for path in ENGINE_SOURCES}
    engines = _sampler_classes(trees)
    assert {"TorchSampler", "vLLMSampler", "RemoteSampler"} <= engines
    offences = []
    for path, tree in trees.items():
        where = str(path.relative_to(ROOT))
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in engines]:
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef) and node.name in private:
                    offences.append(f"{where}:{node.lineno}: {cls.name} overrides {node.name}")
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in private
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls", "super")
                ):
                    offences.append(f"{where}:{node.lineno}: {cls.name} uses self.{node.attr}")
        # code that holds an engine (the Ray host's ``self._target``, a local ``engine``) uses the API too
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private:
                holder = node.value
                name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", "")
                if name in ("_target", "engine", "sampler"):
                    offences.append(f"{where}:{node.lineno}: {name}.{node.attr}")
    assert not offences, "engines reach into Sampler's private state:\n" + "\n".join(offences)


#: What a module holding an engine object may import of the core (``twinkle_core.engine``'s rule).
# ``weights``: the update checks the contract re-exports, and the bucket checksum transports share with engines
ENGINE_IMPORTS = {
    "twinkle_core.engine",
    "twinkle_core.errors",
    "twinkle_core.data_format",
    "twinkle_core.hub",
    "twinkle_core.weights",
    # the one table between a trainer's weight names and a checkpoint's, which every engine's updates apply
    "twinkle_core.names",
    # the routers of the MoE families: the engine records by the same table the trainer's replay reads
    "twinkle_core.rl",
}


#: Modules of an engine's package that are not the engine: the entry points (twinkle's; vLLM's general plugin,
#: which runs in vLLM's own processes and may build a template's processor there) and the users' constructor.
NOT_ENGINE = {"plugin.py", "_plugin.py", "_vllm_plugin.py", "sampler.py", "__init__.py"}


def _engine_object_modules() -> dict[Path, ast.Module]:
    """Every module of a shipped package that defines an ``Engine`` (or ``BatchEngine``) subclass, bar NOT_ENGINE."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in ENGINE_SOURCES}
    packages = {
        path.parent
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases} & {"Engine", "BatchEngine"}
    }
    core = ROOT / "twinkle_core"  # the Ray engine is part of the core, which it may import
    return {
        path: tree
        for path, tree in trees.items()
        if path.parent in packages and path.name not in NOT_ENGINE and not path.is_relative_to(core)
    }


def test_an_engine_object_imports_only_the_engine_contract() -> None:
    modules = _engine_object_modules()
    assert ROOT / "examples" / "twinkle_echo" / "twinkle_echo" / "engine.py" in modules
    assert ROOT / "plugins" / "twinkle_torch" / "twinkle_torch" / "decoding.py" in modules
    assert ROOT / "plugins" / "twinkle_vllm" / "twinkle_vllm" / "engine.py" in modules
    assert ROOT / "plugins" / "twinkle_vllm" / "twinkle_vllm" / "_weights.py" in modules
    offences = []
    for path, tree in modules.items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = (
                    [node.module] if node.module != "twinkle_core" else [f"twinkle_core.{a.name}" for a in node.names]
                )
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.split(".")[0] == "twinkle_core" and ".".join(name.split(".")[:2]) not in ENGINE_IMPORTS:
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
    assert not offences, "engine objects import core modules outside the contract:\n" + "\n".join(offences)


def test_the_engine_contract_is_small_and_public() -> None:
    import twinkle_core.engine as contract

    assert all(not name.startswith("_") for name in contract.__all__)
    assert len(contract.__all__) <= 12
    # every optional method of Engine is public; the one required one is ``run`` (``generate`` for a BatchEngine)
    assert contract.Engine.__abstractmethods__ == {"run"}
    assert contract.BatchEngine.__abstractmethods__ == {"generate"}
    assert not [n for n in vars(contract.Engine) if n.startswith("_") and not n.startswith("__") and n != "_abc_impl"]


def test_public_errors_and_model_ids_are_importable_from_documented_places() -> None:
    from twinkle_core import EngineDeadError, UnsupportedFeatureError, WeightUpdateError, resolve_model_id
    from twinkle_core.errors import __all__ as error_names

    for name in error_names:
        if name[0].isupper():
            assert getattr(twinkle_core, name) is getattr(twinkle_core.errors, name), name
    assert callable(resolve_model_id)
    assert issubclass(UnsupportedFeatureError, NotImplementedError)
    assert issubclass(WeightUpdateError, ValueError) and issubclass(EngineDeadError, RuntimeError)


# -- the base owns the checks and the locking: a minimal engine shows it ---------------------------
class Recorder(BatchEngine):
    """Generates ``prompt[-1] + 1``; records what reached it and how many ran at once."""

    def __init__(
        self, context: EngineContext, *, concurrent: bool = False, fields: frozenset[str] = frozenset()
    ) -> None:
        super().__init__(context)
        self.info = EngineInfo(
            name="recorder",
            max_model_len=32,
            vocab_size=50,
            supported_params=fields or frozenset({"max_tokens", "num_samples", "temperature"}),
            concurrent=concurrent,
        )
        self.seen: list[SamplingParams] = []
        self.running = 0
        self.peak = 0
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.guard = threading.Lock()
        self.shifts: dict[str, int] = {}

    def generate(self, prompts, params, adapter_name):  # type: ignore[no-untyped-def]
        with self.guard:
            self.running += 1
            self.peak = max(self.peak, self.running)
        self.entered.release()
        self.gate.wait(10)
        self.seen.append(params)
        shift = self.shifts.get(adapter_name, 0)
        out = [
            SampleResponse(
                prompt_token_ids=p.input_ids,
                sequences=[
                    self.context.make_sequence(
                        p.input_ids,
                        [p.input_ids[-1] + 1 + shift],
                        stop_reason="length",
                        adapter_name=adapter_name,
                        text="x",
                    )
                ],
            )
            for p in prompts
        ]
        with self.guard:
            self.running -= 1
        return out

    def load_adapter(self, adapter, *, version, **kwargs):  # type: ignore[no-untyped-def]
        self.shifts[adapter.name] = int(adapter.state_dict()["shift"])
        return adapter.source

    def remove_adapter(self, name: str) -> None:
        del self.shifts[name]


def recorder(**options: Any) -> Any:
    """A sampler around a :class:`Recorder` (its state is ``sampler.engine``'s)."""
    return Sampler(Recorder, **options)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 0.5),
        ("top_k", 3),
        ("min_p", 0.1),
        ("repetition_penalty", 1.2),
        ("seed", 1),
        ("stop", ["x"]),
        ("logprobs", 0),
        ("logprobs_mode", "raw"),
        ("ignore_eos", True),
    ],
)
def test_a_field_the_engine_does_not_declare_is_refused_before_any_work(field: str, value: object) -> None:
    eng = recorder()
    eng.engine.gate.set()
    with pytest.raises(UnsupportedFeatureError, match=rf"SamplingParams\.{field}=.*recorder engine"):
        eng.sample(InputFeature(input_ids=[1]), {field: value})
    assert eng.engine.seen == []
    # its default value is fine, and declared fields pass
    eng.sample(InputFeature(input_ids=[1]), {"temperature": 0.5, "max_tokens": 1})
    assert len(eng.engine.seen) == 1


def test_values_beyond_the_vocabulary_are_refused() -> None:
    eng = recorder(fields=frozenset({"max_tokens", "logprobs", "prompt_logprobs", "stop_token_ids"}))
    for bad, pattern in [
        ({"logprobs": 51}, "logprobs=51.*vocabulary size 50"),
        ({"prompt_logprobs": 10**9}, "prompt_logprobs"),
        ({"stop_token_ids": [3, 50]}, r"stop_token_ids contains 50.*\[0, 50\)"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ]:
        with pytest.raises(InvalidSamplingParams, match=pattern):
            eng.sample(InputFeature(input_ids=[1]), bad)
    assert eng.engine.seen == []


def _run_in_threads(eng: Sampler, n: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=eng.sample, args=(InputFeature(input_ids=[i + 1]),)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_the_base_serialises_an_engine_that_is_not_concurrent() -> None:
    eng = recorder(concurrent=False)
    threads = _run_in_threads(eng, 3)
    assert eng.engine.entered.acquire(timeout=10)
    assert not eng.engine.entered.acquire(timeout=0.2), "a second _generate started while the first was running"
    eng.engine.gate.set()
    for t in threads:
        t.join(10)
    assert eng.engine.peak == 1 and len(eng.engine.seen) == 3


def test_a_concurrent_engine_runs_samples_together() -> None:
    eng = recorder(concurrent=True)
    threads = _run_in_threads(eng, 3)
    for _ in range(3):
        assert eng.engine.entered.acquire(timeout=10)
    assert eng.engine.peak == 3
    eng.engine.gate.set()
    for t in threads:
        t.join(10)


def test_an_adapter_removal_waits_for_the_samples_using_it() -> None:
    """The adapter check and the generation are one step: a removal cannot slip between them."""
    eng = recorder(concurrent=True)
    eng.add_adapter_to_model("a", {"r": 1}, weights={"shift": torch.tensor(10.0)})
    results: list[list[SampleResponse]] = []
    sampler_thread = threading.Thread(
        target=lambda: results.append(eng.sample(InputFeature(input_ids=[1]), adapter_name="a"))
    )
    sampler_thread.start()
    assert eng.engine.entered.acquire(timeout=10)  # inside _generate, with adapter "a"
    removed = threading.Event()
    remover = threading.Thread(target=lambda: (eng.remove_adapter("a"), removed.set()))
    remover.start()
    assert not removed.wait(0.2), "remove_adapter must wait for the sample using the adapter"
    eng.engine.gate.set()
    sampler_thread.join(10)
    remover.join(10)
    seq = results[0][0].sequences[0]
    assert seq.adapter_name == "a" and seq.tokens == [12]
    with pytest.raises(UnknownAdapterError):
        eng.sample(InputFeature(input_ids=[1]), adapter_name="a")


def test_only_requests_py_touches_a_handles_private_state() -> None:
    """Whatever runs a call drives it through its ``CallFeed``; nothing outside requests.py reaches into a handle."""
    from twinkle_core.requests import CallFeed, SampleHandle

    private = {n for n in vars(SampleHandle) if n.startswith("_") and not n.startswith("__")}
    tree = ast.parse(inspect.getsource(inspect.getmodule(SampleHandle)))  # type: ignore[arg-type]
    private |= {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
    }
    assert {"_cond", "_future", "_suspended", "_resumer"} <= private  # the scan knows the handle's state
    assert not {n for n in vars(CallFeed) if n.startswith("_") and not n.startswith("__")}
    sources = [
        p
        for p in [*(ROOT / "twinkle_core").rglob("*.py"), *ENGINE_SOURCES]
        if p != ROOT / "twinkle_core" / "requests.py"
    ]
    uses = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}"
        for path in set(sources)
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute)
        and node.attr in private
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    )
    assert uses == [], "SampleHandle's private state used outside twinkle_core/requests.py:\n" + "\n".join(uses)


# -- an engine object held by the core's Sampler -------------------------------------------------
def test_a_sampler_needs_a_real_engine_and_says_what_it_got() -> None:
    from twinkle_core.engine import BatchEngine, EngineInfo
    from twinkle_core.errors import ConfigError

    with pytest.raises(TypeError, match="needs an engine class"):
        Sampler()
    with pytest.raises(ConfigError, match=r"expected a twinkle_core\.engine\.Engine subclass"):
        Sampler(dict)  # type: ignore[arg-type]

    closed: list[str] = []

    class NoInfo(BatchEngine):
        def generate(self, prompts, params, adapter_name):  # type: ignore[no-untyped-def]
            return []

        def close(self) -> None:
            closed.append("closed")

    with pytest.raises(ConfigError, match=r"NoInfo did not set self.info to an EngineInfo"):
        Sampler(NoInfo)
    assert closed == ["closed"]  # what it had built is released
    with pytest.raises(ConfigError, match=r"max_model_len=0 is invalid"):
        EngineInfo(name="x", max_model_len=0)
    with pytest.raises(ConfigError, match=r"supported_params='temperature' is invalid"):
        EngineInfo(name="x", max_model_len=8, supported_params="temperature")  # type: ignore[arg-type]


def test_an_engine_object_gets_the_same_checks_locking_and_state_as_a_subclass() -> None:
    from twinkle_core.engine import BatchEngine, EngineInfo
    from twinkle_core.template import Template
    from twinkle_core.testing.tokenizers import CharTokenizer

    calls: list[str] = []

    class Shift(BatchEngine):
        def __init__(self, context, shift: int = 1) -> None:  # type: ignore[no-untyped-def]
            super().__init__(context)
            self.shift = shift
            context.init_template(None, tokenizer=CharTokenizer())
            self.info = EngineInfo(name="shift", max_model_len=8, vocab_size=256, concurrent=True)

        def generate(self, prompts, params, adapter_name):  # type: ignore[no-untyped-def]
            version = self.context.weights_version
            return [
                SampleResponse(
                    prompt_token_ids=p.input_ids,
                    sequences=[
                        self.context.make_sequence(
                            p.input_ids,
                            [p.input_ids[-1] + self.shift + version],
                            stop_reason="length",
                            adapter_name=adapter_name,
                        )
                    ],
                )
                for p in prompts
            ]

        def update_weights(self, named_tensors, *, version):  # type: ignore[no-untyped-def]
            calls.append(f"update {[n for n, _ in named_tensors]} -> v{version}")

        def template_changed(self) -> None:
            calls.append("template")

        def close(self) -> None:
            calls.append("close")

    with Sampler(Shift, shift=2) as s:
        assert s.engine_name == "shift" and s.max_model_len == 8 and s.vocab_size == 256
        assert "Shift" in repr(s) and isinstance(s.engine, Shift)
        out = s.sample(InputFeature(input_ids=[3]), {"max_tokens": 1})[0].sequences[0]
        assert out.tokens == [5] and out.weights_version == 0
        # the sampler's own checks, before the engine sees anything
        with pytest.raises(UnsupportedFeatureError, match=r"SamplingParams\.top_p=.*shift engine"):
            s.sample(InputFeature(input_ids=[3]), {"top_p": 0.5})
        with pytest.raises(InvalidInputError, match="999"):
            s.sample(InputFeature(input_ids=[999]), {"max_tokens": 1})
        with pytest.raises(UnsupportedFeatureError, match="shift engine has no LoRA"):
            s.add_adapter_to_model("a", "/no/such/adapter")
        assert s.update_weights({"w": torch.zeros(1)}) == 1
        assert s.sample(InputFeature(input_ids=[3]), {"max_tokens": 1})[0].sequences[0].weights_version == 1
        s.set_template(Template(s.tokenizer))
        assert calls == ["update ['w'] -> v1", "template"]
    assert calls[-1] == "close" and s.closed


class Weighed(BatchEngine):
    """Generates the sum of its weights; applies an update tensor by tensor, and fails where it is told to."""

    def __init__(self, context: EngineContext, *, streams: bool = False) -> None:
        from twinkle_core.testing.tokenizers import CharTokenizer

        super().__init__(context)
        context.init_template(None, tokenizer=CharTokenizer())
        self.info = EngineInfo(name="weighed", max_model_len=8, vocab_size=1000, streams_weights=streams)
        self.weights = {"a": 1, "b": 2, "c": 3}
        self.fail: tuple[str, BaseException] | None = None  # (before which name, what)

    def generate(self, prompts, params, adapter_name):  # type: ignore[no-untyped-def]
        total = sum(self.weights.values())
        return [
            SampleResponse(
                prompt_token_ids=p.input_ids,
                sequences=[self.context.make_sequence(p.input_ids, [total], stop_reason="length", adapter_name="")],
            )
            for p in prompts
        ]

    def update_weights(self, named_tensors, *, version):  # type: ignore[no-untyped-def]
        for name, value in named_tensors:
            if name not in self.weights:
                raise WeightUpdateError(f"unknown tensor {name!r}; nothing was updated.")
            if self.fail is not None and self.fail[0] == name:
                raise self.fail[1]
            self.weights[name] = int(value)


def _total(s: Sampler) -> int:
    return s.sample(InputFeature(input_ids=[1]), {"max_tokens": 1})[0].sequences[0].tokens[0]


@pytest.mark.parametrize(
    "failure", [RuntimeError("worker lost"), IncompleteUpdateError("2 of 3 applied"), KeyboardInterrupt()]
)
def test_an_update_an_engine_applies_part_way_refuses_sampling_until_its_tensors_come_again(
    failure: BaseException,
) -> None:
    """Any engine: an update that fails after changing some tensors (the engine says so, or fails in a way that
    is not a twinkle refusal) leaves weights no version names. The sampler refuses to sample on them."""
    with Sampler(Weighed) as s:
        assert _total(s) == 6
        s.engine.fail = ("c", failure)
        with pytest.raises(type(failure)):
            s.update_weights({"a": torch.tensor(10), "b": torch.tensor(20), "c": torch.tensor(30)})
        assert s.engine.weights == {"a": 10, "b": 20, "c": 3} and s.weights_version == 0
        with pytest.raises(IncompleteUpdateError, match=r"version 1 failed part-way.*'a', 'b', 'c'"):
            _total(s)
        with pytest.raises(IncompleteUpdateError):  # submit refuses too, before anything runs
            s.submit(InputFeature(input_ids=[1]), {"max_tokens": 1})
        s.engine.fail = None
        with pytest.raises(WeightUpdateError, match="unknown"):  # a refusal changes nothing, the doubt included
            s.update_weights({"z": torch.tensor(0)})
        s.update_weights({"a": torch.tensor(10), "b": torch.tensor(20)})
        with pytest.raises(IncompleteUpdateError, match=r"'c'\.$"):
            _total(s)
        assert s.update_weights({"c": torch.tensor(30)}) == 2
        assert _total(s) == 60
        out = s.sample(InputFeature(input_ids=[1]), {"max_tokens": 1})[0].sequences[0]
        assert out.weights_version == 2


def test_an_update_streamed_to_an_engine_that_fails_doubts_only_what_it_read() -> None:
    with Sampler(Weighed, streams=True) as s:
        s.engine.fail = ("b", RuntimeError("stream broke"))
        read: list[str] = []

        def pairs():  # type: ignore[no-untyped-def]
            for name, value in (("a", 7), ("b", 8), ("c", 9)):
                read.append(name)
                yield name, torch.tensor(value)

        with pytest.raises(RuntimeError, match="stream broke"):
            s.update_weights(pairs())
        assert read == ["a", "b"]
        with pytest.raises(IncompleteUpdateError, match=r": 'a', 'b'\.$"):
            _total(s)
        s.engine.fail = None
        s.update_weights(iter([("b", torch.tensor(8)), ("a", torch.tensor(7))]))
        assert _total(s) == 7 + 8 + 3


# -- the plugin guide documents the contract it ships ----------------------------------------------
def _guide_table(heading: str) -> set[str]:
    """The names in the first column of the table under ``heading`` in docs/writing-a-plugin.md."""
    text = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    assert heading in text, f"docs/writing-a-plugin.md has no {heading!r} section"
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {re.match(r"\| `([a-z_A-Z]+)", row).group(1) for row in rows}  # type: ignore[union-attr]


def test_the_plugin_guide_documents_exactly_what_the_engine_module_exports() -> None:
    import twinkle_core.engine as contract

    assert _guide_table("### The contract: `twinkle_core.engine`") == set(contract.__all__)
    engine_methods = {n for n, v in vars(contract.Engine).items() if callable(v) and not n.startswith("_")}
    assert _guide_table("### `Engine`: what you implement") == engine_methods
    context_members = {n for n in vars(contract.EngineContext) if not n.startswith("_")}
    assert _guide_table("### `EngineContext`: what you may use") == context_members
    # the echo example follows the page: an Engine object, registered by its class path
    guide = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    assert 'register("echo", "twinkle_echo.engine:EchoEngine")' in guide
    echo = ast.parse((ROOT / "examples" / "twinkle_echo" / "twinkle_echo" / "engine.py").read_text())
    bases = {n.name: [getattr(b, "id", "") for b in n.bases] for n in ast.walk(echo) if isinstance(n, ast.ClassDef)}
    assert bases["EchoEngine"] == ["BatchEngine"]
