"""Remote execution on a real local Ray cluster (CPU): replicas, balancing, state, failures, validation.

One cluster serves the whole module. The main behaviour runs on two real
TorchSampler replicas of the tiny model; the failure paths that need an
engine to misbehave on purpose use ``EchoEngine(...)``: a ``Sampler`` around
``Echo``, a small, real engine defined here.

Threads and replicas are ordered by what can be observed, never by sleeping:
a test that needs a call in flight arms a :class:`Hold`, and the armed replica
says (with a file) that it has started its share and waits until the test
lets it go.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("twinkle_torch")

import twinkle_core as tw  # noqa: E402
import twinkle_core.sampler.policy  # noqa: E402
from twinkle_core import DeviceGroup, DeviceMesh, InputFeature, Sampler, SampleResponse, Trajectory  # noqa: E402
from twinkle_core.engine import BatchEngine, EngineContext, EngineInfo  # noqa: E402
from twinkle_core.errors import (  # noqa: E402
    ConfigError,
    InvalidMeshError,
    InvalidSamplingParams,
    PromptTooLongError,
    SamplerClosedError,
    UnknownAdapterError,
    UnsupportedFeatureError,
    WeightUpdateError,
)
from twinkle_core.factory import build_sampler  # noqa: E402
from twinkle_core.locks import ReadWriteLock  # noqa: E402
from twinkle_core.remote import (  # noqa: E402
    RemoteSampler,
    RemoteTraceback,
    ReplicaLostError,
    UnknownGroupError,
    current_replica,
    dispatch,
    get_group,
    remote_class,
)
from twinkle_core.remote._balance import split_by_cost  # noqa: E402
from twinkle_core.template import Template  # noqa: E402
from twinkle_core.testing import TINY_CHAT_PROMPTS, build_tiny_model  # noqa: E402
from twinkle_core.testing.faults import kill_and_wait  # noqa: E402
from twinkle_core.testing.tokenizers import CharTokenizer  # noqa: E402
from twinkle_torch.engine import TorchEngine  # noqa: E402
from twinkle_torch.sampler import TorchSampler  # noqa: E402

GREEDY = {"temperature": 0.0, "max_tokens": 24}
DEADLINE_S = 120.0  # only stops a broken test from hanging the run; nothing waits this long when it works


def wait_until(condition: Any, what: str) -> None:
    """Poll an observable ``condition`` until it holds."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {DEADLINE_S} s")
        time.sleep(0.01)


# -- holding a replica's call, across processes ----------------------------------------------------
class Hold:
    """Holds chosen replicas inside their next ``_generate`` call, through files in one folder.

    ``arm(i)`` marks replica ``i``; its next call claims the mark (an atomic
    rename to ``started-i``, which the test waits for), then waits until
    ``release()``. A replica rebuilt after a kill finds no mark and runs freely.
    Files work across the actor processes of this one-machine cluster.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def arm(self, replica: int) -> None:
        (self.folder / f"started-{replica}").unlink(missing_ok=True)
        (self.folder / f"armed-{replica}").touch()

    def wait_started(self, replica: int) -> None:
        wait_until((self.folder / f"started-{replica}").exists, f"replica {replica} starting its held call")

    def release(self) -> None:
        (self.folder / "go").touch()


def hold_here(folder: str | None) -> None:
    """Called by the test engines as ``_generate`` starts: wait there if this replica is armed."""
    if folder is None:
        return
    index = current_replica().index
    try:
        os.rename(os.path.join(folder, f"armed-{index}"), os.path.join(folder, f"started-{index}"))
    except FileNotFoundError:
        return  # not armed, or already claimed by the call a rebuilt replica now retries
    wait_until(lambda: os.path.exists(os.path.join(folder, "go")), f"the test releasing replica {index}")


class HeldTorchEngine(TorchEngine):
    """The real torch engine, whose calls a :class:`Hold` can stop in flight."""

    def __init__(
        self,
        context: EngineContext,
        model_id: str,
        device_mesh: DeviceMesh | None = None,
        *,
        hold: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(context, model_id, device_mesh, **kwargs)
        self.hold = hold

    def run(self, run):  # type: ignore[no-untyped-def]
        hold_here(self.hold)
        return super().run(run)


# -- a small real engine for the failure paths ------------------------------------------------
class Echo(BatchEngine):
    """Counts up from the last prompt token (+ a weight offset, + an adapter shift); text = its pid.

    ``fail_if_exists``: the constructor fails while that file exists (a model that went missing).
    ``hold``: a :class:`Hold` folder, to keep a call in flight until the test releases it.
    """

    def __init__(
        self,
        context: EngineContext,
        model_id: str = "echo",
        device_mesh: DeviceMesh | None = None,
        *,
        hold: str | None = None,
        fail_if_exists: str | None = None,
    ) -> None:
        super().__init__(context)
        if fail_if_exists and os.path.exists(fail_if_exists):
            raise FileNotFoundError(f"model files missing: {fail_if_exists}")
        self.mesh = device_mesh
        self.hold = hold
        self.offset = 0
        self.shifts: dict[str, int] = {}
        context.init_template(Template(CharTokenizer()))
        self.info = EngineInfo(name="echo", max_model_len=64, vocab_size=256)

    def generate(self, prompts, params, adapter_name):  # type: ignore[no-untyped-def]
        hold_here(self.hold)
        shift = self.shifts.get(adapter_name, 0)
        out = []
        for p in prompts:
            base = p.input_ids[-1] + self.offset + shift
            seqs = [
                self.context.make_sequence(
                    p.input_ids,
                    [(base + s + i) % 256 for i in range(params.max_tokens)],
                    stop_reason="length",
                    adapter_name=adapter_name,
                    text=str(os.getpid()),
                )
                for s in range(params.num_samples)
            ]
            out.append(SampleResponse(prompt_token_ids=p.input_ids, sequences=seqs))
        return out

    def update_weights(self, named_tensors, *, version):  # type: ignore[no-untyped-def]
        """``offset``; ``fail_on_replica``: this update fails on that replica only (a broken device, say)."""
        tensors = dict(named_tensors)
        if set(tensors) - {"offset", "fail_on_replica"}:
            raise WeightUpdateError(f"unknown weight names {sorted(set(tensors) - {'offset', 'fail_on_replica'})}")
        if tensors.get("fail_on_replica") == current_replica().index:
            raise WeightUpdateError(f"replica {current_replica().index} cannot take this update")
        self.offset = int(tensors["offset"])

    def load_adapter(self, adapter, **kwargs):  # type: ignore[no-untyped-def]
        self.shifts[adapter.name] = int(adapter.state_dict()["shift"])
        return adapter.source

    def remove_adapter(self, name: str) -> None:
        del self.shifts[name]


def EchoEngine(*args: Any, **kwargs: Any) -> Any:
    """The test engine as users build one: ``build_sampler(Echo, ...)`` (``remote_group=`` included)."""
    return build_sampler(Echo, *args, **kwargs)


@remote_class
class Scorer:
    """A user class run as replicas with @remote_class."""

    def __init__(self, bonus: int, device_mesh: DeviceMesh | None = None) -> None:
        self.bonus = bonus
        self.mesh = device_mesh
        self.closed = False

    @dispatch("split")
    def score(self, texts: list[str]) -> list[tuple[int, int]]:
        return [(len(t) + self.bonus, current_replica().index) for t in texts]

    def where(self) -> tuple[int, int, int, int]:
        ctx = current_replica()
        return ctx.index, self.mesh.dp_size, os.getpid(), os.nice(0)

    @dispatch("one")
    def layout(self) -> dict[str, Any]:
        ctx = current_replica()
        return {
            "bundles": ctx.bundle_indices,
            "tp_size": self.mesh.tp_size,
            "dp_size": self.mesh.dp_size,
            "vllm_bundles": os.environ.get("VLLM_RAY_BUNDLE_INDICES"),
            "pg": ctx.placement_group is not None,
        }

    @dispatch("one")
    def fail(self) -> None:
        raise KeyError("no such row")


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    # Classes defined in this file travel to the actors by value (the workers cannot import tests/).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    session = tw.initialize(
        "ray",
        groups=[
            DeviceGroup(name="pair", ranks=2, device_type="cpu"),
            DeviceGroup(name="aux", ranks=3, device_type="cpu", cpus_per_rank=0.5),
        ],
        num_cpus=4,
    )
    yield session
    tw.shutdown()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_tiny_model("llama"))


@pytest.fixture(scope="module")
def local(model_dir):

    with TorchSampler(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def torch_hold(tmp_path_factory) -> Hold:
    return Hold(tmp_path_factory.mktemp("hold"))


@pytest.fixture(scope="module")
def remote(cluster, model_dir, torch_hold):
    with tw.create_sampler(
        HeldTorchEngine,
        model_id=model_dir,
        device_mesh=DeviceMesh.from_sizes(dp_size=2),
        remote_group="pair",
        hold=str(torch_hold.folder),
    ) as s:
        yield s


def chats() -> list[Trajectory]:
    return [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS]


def uneven_inputs(local_sampler: Sampler) -> list[Any]:
    """Conversations and token-id prompts of very different lengths, mixed."""
    feats = [local_sampler.template.encode(t) for t in chats()]
    long = InputFeature(input_ids=[t for f in feats[:6] for t in f.input_ids][:300])
    return [
        feats[0],
        chats()[3],
        long,
        chats()[1],
        InputFeature(input_ids=feats[2].input_ids[-5:]),
        chats()[7],
        feats[5],
        chats()[9],
        long,
        chats()[0],
    ]


def tokens(responses: list[SampleResponse]) -> list[list[list[int]]]:
    return [[s.tokens for s in r.sequences] for r in responses]


def perturbed_weights(model_dir: str, scale: float = 2.0) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    names = ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
    return [(n, state[n] + scale * state[n].std() * torch.randn(state[n].shape, generator=gen)) for n in names]


def original_weights(model_dir: str) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    return [(n, state[n]) for n in ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"]]


@pytest.fixture(scope="module")
def lora_dir(model_dir, tmp_path_factory) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    out = tmp_path_factory.mktemp("lora")
    peft_model.save_pretrained(str(out))
    return str(out)


# -- pure logic -------------------------------------------------------------------------------------
def test_split_by_cost_groups_similar_lengths_in_balanced_runs():
    costs = [1, 9, 1, 1, 5, 4]
    assert split_by_cost(costs, 2) == [[0, 2, 3, 4, 5], [1]]  # 12 | 9: the 9 alone
    assert split_by_cost([3.0], 3) == [[], [0], []]
    rng = random.Random(0)
    for bins in (2, 3, 5):
        costs = [rng.randint(100, 900) for _ in range(40)]
        shards = split_by_cost(costs, bins)
        assert sorted(i for s in shards for i in s) == list(range(40)) and all(s == sorted(s) for s in shards)
        mean = sum(costs) / bins
        assert all(abs(sum(costs[i] for i in s) - mean) <= max(costs) for s in shards)
        # runs: every input of one shard costs no more than every input of the next
        for a, b in itertools.pairwise(shards):
            if a and b:
                assert max(costs[i] for i in a) <= min(costs[i] for i in b)


# -- TorchSampler replicas --------------------------------------------------------------------------
def test_greedy_matches_local_and_keeps_order_with_uneven_prompts(remote, local):
    assert remote.num_replicas == 2 and len({r.pid for r in remote.replicas}) == 2
    inputs = uneven_inputs(local)
    expected = local.sample(inputs, GREEDY)
    got = remote.sample(inputs, GREEDY)
    assert [r.prompt_token_ids for r in got] == [r.prompt_token_ids for r in expected]
    assert tokens(got) == tokens(expected)
    assert [r.sequences[0].text for r in got] == [r.sequences[0].text for r in expected]
    assert all(r.sequences[0].text for r in got)  # real text, whatever the model says
    # a single Trajectory is one input
    one = remote.sample(chats()[1], GREEDY)
    assert len(one) == 1 and one[0].sequences[0].tokens == local.sample(chats()[1], GREEDY)[0].sequences[0].tokens
    assert remote.sample([], GREEDY) == []


def test_seeded_requests_give_the_same_tokens_on_any_replica(remote, local):
    params = {"temperature": 1.5, "max_tokens": 24, "seed": 1234, "ignore_eos": True}
    expected = local.sample(chats(), params, num_samples=2)
    assert sum(r.sequences[0].tokens != r.sequences[1].tokens for r in expected) >= 5  # really random
    crowd = remote.sample(chats() * 2, params, num_samples=2)  # each prompt twice: on either replica
    assert tokens(crowd) == tokens(expected) * 2
    alone = remote.sample(chats()[6], params, num_samples=2)
    assert tokens(alone) == tokens([expected[6]])


def test_constraints_and_prompt_truncation_reach_the_replicas(remote, local):
    params = {
        "temperature": 1.2,
        "max_tokens": 12,
        "seed": 9,
        "min_tokens": 12,
        "allowed_token_ids": list(range(3, 300)),
        "bad_words": ["the"],
        "logit_bias": {"40": 2.0},
        "presence_penalty": 0.5,
        "truncate_prompt_tokens": 9,
        "include_stop_str_in_output": True,
    }
    expected = local.sample(chats(), params)
    got = remote.sample(chats(), params)
    assert tokens(got) == tokens(expected)
    assert [r.prompt_token_ids for r in got] == [r.prompt_token_ids for r in expected]
    assert all(len(r.prompt_token_ids) == 9 and len(r.sequences[0].tokens) == 12 for r in got)
    assert all(set(r.sequences[0].tokens) <= set(range(3, 300)) for r in got)


def test_errors_come_back_as_their_own_type_naming_the_replica(remote, local):
    with pytest.raises(InvalidSamplingParams, match="temperature"):
        remote.sample(chats()[0], {"temperature": -1})
    with pytest.raises(UnknownAdapterError, match="Unknown adapter 'nope'"):
        remote.sample(chats()[0], GREEDY, adapter_name="nope")
    too_long = InputFeature(input_ids=[5] * (local.max_model_len + 10))
    inputs = [*chats()[:5], too_long]
    with pytest.raises(PromptTooLongError, match=r"inputs\[5\] has 522 prompt tokens") as info:
        remote.sample(inputs, GREEDY)
    # checked in the driver, with the replicas' template, before any replica works
    assert info.value.index == 5 and type(info.value) is PromptTooLongError
    skipped = remote.sample(inputs, GREEDY, on_invalid="skip")
    assert skipped[5].error and "inputs[5]" in skipped[5].error and not skipped[5].sequences
    assert tokens(skipped[:5]) == tokens(local.sample(chats()[:5], GREEDY))
    version = remote.weights_version
    with pytest.raises(WeightUpdateError, match=r"no_such\.weight") as info:
        remote.update_weights({"no_such.weight": torch.zeros(2)})
    assert type(info.value) is WeightUpdateError and remote.weights_version == version
    assert any("Raised in replica" in n for n in info.value.__notes__)
    assert isinstance(info.value.__cause__, RemoteTraceback) and "check_update" in info.value.__cause__.text
    assert tokens(remote.sample(chats()[:2], GREEDY)) == tokens(local.sample(chats()[:2], GREEDY))


@pytest.fixture
def changed(remote, local, model_dir, lora_dir):
    """Adapter 'lora' and perturbed weights on both samplers; both put back afterwards."""
    for s in (remote, local):
        s.add_adapter_to_model("lora", lora_dir)
        s.update_weights(perturbed_weights(model_dir))
    yield
    for s in (remote, local):
        s.remove_adapter("lora")
        s.update_weights(original_weights(model_dir))


def test_template_reaches_every_replica(remote, local):
    many = chats() * 2  # each prompt served by both replicas

    class Briefly(Template):
        chat_template = (
            "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )

    remote.set_template(Briefly)
    local.set_template(Briefly)
    try:
        got = remote.sample(many, GREEDY)
        assert [r.prompt_token_ids for r in got] == [r.prompt_token_ids for r in local.sample(many, GREEDY)]
        assert tokens(got) == tokens(local.sample(many, GREEDY))
        assert remote.template.encode(chats()[0]).input_ids == local.template.encode(chats()[0]).input_ids
    finally:
        remote.set_template(Template)
        local.set_template(Template)
    assert remote.template.encode(chats()[0]).input_ids == local.template.encode(chats()[0]).input_ids


def test_adapters_and_weights_reach_every_replica(remote, local, model_dir, lora_dir):
    base = tokens(local.sample(chats(), GREEDY))
    many = chats() * 2  # each prompt served by both replicas
    v0 = remote.weights_version
    assert remote.add_adapter_to_model("lora", lora_dir) == v0 + 1
    local.add_adapter_to_model("lora", lora_dir)
    assert set(remote.adapters) == {"lora"} and remote.adapters["lora"].version == v0 + 1
    with_lora = tokens(local.sample(chats(), GREEDY, adapter_name="lora"))
    assert with_lora != base
    got = remote.sample(many, GREEDY, adapter_name="lora")
    assert tokens(got) == with_lora * 2
    assert {(s.weights_version, s.adapter_name) for r in got for s in r.sequences} == {(v0 + 1, "lora")}

    new = perturbed_weights(model_dir)
    assert remote.update_weights(new) == v0 + 2
    local.update_weights(new)
    updated = tokens(local.sample(chats(), GREEDY))
    assert updated != base
    got = remote.sample(many, GREEDY)
    assert tokens(got) == updated * 2
    assert {s.weights_version for r in got for s in r.sequences} == {v0 + 2}
    assert (
        tokens(remote.sample(many, GREEDY, adapter_name="lora"))
        == tokens(local.sample(chats(), GREEDY, adapter_name="lora")) * 2
    )

    remote.remove_adapter("lora")
    local.remove_adapter("lora")
    assert dict(remote.adapters) == {}
    with pytest.raises(UnknownAdapterError):
        remote.sample(chats()[0], GREEDY, adapter_name="lora")
    assert remote.update_weights(original_weights(model_dir), version=v0 + 10) == v0 + 10
    local.update_weights(original_weights(model_dir), version=v0 + 10)
    out = remote.sample(many, GREEDY)
    assert [r.sequences[0].text for r in out] == [r.sequences[0].text for r in local.sample(many, GREEDY)]
    assert tokens(out) == base * 2


def test_killed_replica_is_rebuilt_with_its_state_and_the_work_retried(remote, local, changed, torch_hold):
    work = [c for c in chats() for _ in range(2)]
    params = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
    expected = local.sample(work, params)
    victim = remote.actors[1]
    restarts = [r.restarts for r in remote.replicas]
    version = remote.weights_version
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["out"] = remote.sample(work, params)
        except BaseException as exc:  # pragma: no cover - reported below
            result["err"] = exc

    torch_hold.arm(1)
    t = threading.Thread(target=run)
    t.start()
    torch_hold.wait_started(1)  # replica 1 holds its share: the kill lands while the call runs
    ray.kill(victim)
    t.join(timeout=DEADLINE_S)
    assert not t.is_alive() and "err" not in result, result.get("err")
    assert tokens(result["out"]) == tokens(expected)  # replica 1's share was retried on its rebuild
    assert remote.weights_version == version
    # the rebuilt replica has the adapter and the updated weights
    got = remote.sample(chats() * 2, GREEDY, adapter_name="lora")
    assert tokens(got) == tokens(local.sample(chats(), GREEDY, adapter_name="lora")) * 2
    assert {s.weights_version for r in got for s in r.sequences} == {version}
    assert tokens(remote.sample(chats() * 2, GREEDY)) == tokens(local.sample(chats(), GREEDY)) * 2
    assert [r.restarts for r in remote.replicas] == [restarts[0], restarts[1] + 1]
    assert remote.actors[1] is not victim


def test_weight_refs_kept_for_rebuilds_are_only_the_current_ones(remote, model_dir):
    full = original_weights(model_dir)
    remote.update_weights(full)
    assert len(remote.engine._weight_ops) == 1  # an update of every name supersedes all earlier refs
    remote.update_weights(full[:1])
    assert sorted(sorted(names) for _, names in remote.engine._weight_ops.values()) == sorted(
        [[full[0][0]], [full[1][0]]]
    )
    remote.update_weights(full)
    ((ref, names),) = remote.engine._weight_ops.values()
    assert isinstance(ref, ray.ObjectRef) and names == {n for n, _ in full}


# -- the machinery, on EchoEngine ---------------------------------------------------------------------
class PidEngine(BatchEngine):
    """An engine object (the ``twinkle_core.engine`` contract): counts up from the last token; text = its pid."""

    def __init__(self, context: EngineContext, step: int = 1, device_mesh: DeviceMesh | None = None) -> None:
        super().__init__(context)
        self.step = step
        self.mesh = device_mesh
        context.init_template(Template(CharTokenizer()))
        self.info = EngineInfo(name="pid", max_model_len=64, vocab_size=256, supported_params={"temperature"})

    def max_prompt_len(self, params):  # type: ignore[no-untyped-def]
        return 40 if params.max_tokens > 0 else 50  # its own limits, not max_model_len's

    def generate(self, prompts, params, adapter_name):  # type: ignore[no-untyped-def]
        where = self.context.placement
        text = f"{os.getpid()}:{None if where is None else where.index}:{self.mesh.dp_size if self.mesh else None}"
        return [
            SampleResponse(
                prompt_token_ids=p.input_ids,
                sequences=[
                    self.context.make_sequence(
                        p.input_ids,
                        [p.input_ids[-1] + self.step * (k + 1) for k in range(params.max_tokens)],
                        stop_reason="length",
                        adapter_name=adapter_name,
                        text=text,
                    )
                ],
            )
            for p in prompts
        ]


def test_an_engine_object_runs_as_replicas_like_a_sampler_subclass(cluster):
    inputs = [InputFeature(input_ids=[i + 1]) for i in range(6)]
    with Sampler(PidEngine, step=2) as local:
        expected = [r.sequences[0].tokens for r in local.sample(inputs, {"max_tokens": 3})]
        assert local.engine_name == "pid" and local.engine.context.placement is None
    # a typo in the engine's own arguments fails in the driver, before any actor starts
    with pytest.raises(TypeError):
        tw.create_sampler(PidEngine, stepp=2, remote_group="aux")
    # so does what is not an engine at all
    with pytest.raises(ConfigError, match="Engine subclass"):
        build_sampler(Sampler, dict, remote_group="aux")
    # Sampler(...) itself runs its engine here: asked for replicas, it names the factory that builds them
    with pytest.raises(ConfigError, match=r"create_sampler\(PidEngine"):
        Sampler(PidEngine, step=2, remote_group="aux")
    mesh = DeviceMesh.from_sizes(dp_size=2)
    with tw.create_sampler(PidEngine, step=2, device_mesh=mesh, remote_group="aux") as s:
        assert isinstance(s, RemoteSampler) and "PidEngine" in repr(s)
        # what the engine's info says, read from a replica: the fields it declares are honoured, others refused
        assert s.engine_name == "pid" and "temperature" in s.supported_params
        with pytest.raises(UnsupportedFeatureError, match="top_p"):
            s.sample(inputs[0], {"top_p": 0.5})
        out = s.sample(inputs, {"max_tokens": 3, "temperature": 0.5})
        assert [r.sequences[0].tokens for r in out] == expected
        # each replica's engine is told where it runs, and gets a one-replica mesh
        served = {r.sequences[0].text for r in out}
        assert {t.split(":", 1)[1] for t in served} == {"0:1", "1:1"}
        assert {int(t.split(":")[0]) for t in served} == {r.pid for r in s.replicas}
        # the driver checks prompts against the engine's own limits, read from a replica
        long = InputFeature(input_ids=[1] * 45)
        with pytest.raises(PromptTooLongError, match="at most 40") as info:
            s.sample([inputs[0], long], {"max_tokens": 1})
        assert info.value.index == 1
        skipped = s.sample([inputs[0], long], {"max_tokens": 1}, on_invalid="skip")
        assert "at most 40" in (skipped[1].error or "") and skipped[0].sequences
        assert s.sample(long, {"max_tokens": 0})[0].sequences[0].tokens == []  # scoring may use 50


def test_work_is_balanced_across_replicas_and_order_kept(cluster):
    with EchoEngine(device_mesh=DeviceMesh.from_sizes(dp_size=3), remote_group="aux") as s:
        pids = {r.pid for r in s.replicas}
        inputs = [InputFeature(input_ids=[i] * (1 + (i * 7) % 30)) for i in range(30)]
        out = s.sample(inputs, {"max_tokens": 2})
        assert [r.sequences[0].tokens for r in out] == [[i, i + 1] for i in range(30)]
        served = [r.sequences[0].text for r in out]
        assert {int(p) for p in served} == pids
        # balanced by tokens x samples, not by count: the three loads are within one input of each other
        loads = {p: sum(len(inputs[i]) + 2 for i in range(30) if served[i] == str(p)) for p in pids}
        assert max(loads.values()) - min(loads.values()) <= 32


def test_updates_wait_for_running_samples_so_no_call_mixes_versions(cluster, tmp_path, monkeypatch):
    # Record the lock the driver's front end is built with, to see the update waiting on it.
    locks: list[ReadWriteLock] = []

    def recorded_lock() -> ReadWriteLock:
        locks.append(ReadWriteLock())
        return locks[-1]

    monkeypatch.setattr(twinkle_core.sampler.policy, "ReadWriteLock", recorded_lock)
    hold = Hold(tmp_path / "hold")
    with EchoEngine(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="aux", hold=str(hold.folder)) as s:
        (driver_lock,) = locks  # the replicas build theirs in their own processes
        inputs = [InputFeature(input_ids=[i]) for i in range(8)]
        finished: list[str] = []
        result: dict[str, Any] = {}

        def call(name: str, fn: Any) -> threading.Thread:
            def run() -> None:
                try:
                    result[name] = fn()
                finally:
                    finished.append(name)

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        hold.arm(0)
        hold.arm(1)
        sampling = call("in flight", lambda: s.sample(inputs, {"max_tokens": 1}))
        hold.wait_started(0)
        hold.wait_started(1)  # both replicas are inside their share of the call
        updating = call("update", lambda: s.update_weights({"offset": 50}))
        wait_until(lambda: driver_lock.writers_waiting == 1, "the update waiting for the call in flight")
        # a call made now waits for the update (writers go first), so it sees only the new weights
        later = call("later", lambda: s.sample(inputs, {"max_tokens": 1}))
        assert finished == [], "nothing can end while the first call is held"
        hold.release()
        for thread in (sampling, updating, later):
            thread.join(DEADLINE_S)
        assert sorted(finished) == ["in flight", "later", "update"] and result["update"] == 1

        def stamps(out: list[SampleResponse]) -> set[tuple[int, int]]:
            """(weights_version, weight offset) of every sequence of a call."""
            return {(r.sequences[0].weights_version, r.sequences[0].tokens[0] - i) for i, r in enumerate(out)}

        assert stamps(result["in flight"]) == {(0, 0)}
        assert stamps(result["later"]) == {(1, 50)}
        assert stamps(s.sample(inputs, {"max_tokens": 1})) == {(1, 50)}


def test_a_rebuilt_replica_carries_the_same_state_and_version(cluster):
    with EchoEngine(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="aux") as s:
        s.update_weights({"offset": 10})
        s.add_adapter_to_model("gone", {"r": 1}, weights={"shift": torch.tensor(1.0)})
        s.add_adapter_to_model("kept", {"r": 1}, weights={"shift": torch.tensor(100.0)})
        s.remove_adapter("gone")
        assert s.weights_version == 3
        kill_and_wait(s.actors[0])
        out = s.sample([InputFeature(input_ids=[i]) for i in range(8)], {"max_tokens": 1}, adapter_name="kept")
        assert [r.sequences[0].tokens for r in out] == [[i + 110] for i in range(8)]
        assert {r.sequences[0].weights_version for r in out} == {3}
        assert [r.restarts for r in s.replicas] == [1, 0]
        with pytest.raises(UnknownAdapterError):
            s.sample(InputFeature(input_ids=[1]), adapter_name="gone")


def test_lost_replica_is_reported_and_the_others_keep_serving(cluster, tmp_path):
    marker = tmp_path / "gone"
    with EchoEngine(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="aux", fail_if_exists=str(marker)) as s:
        s.update_weights({"offset": 3})
        marker.write_text("the model folder went away")
        kill_and_wait(s.actors[0])
        with pytest.raises(
            ReplicaLostError,
            match=r"Replica 0 .* could not be restarted: FileNotFoundError.*"
            r"the 1 surviving replica\(s\) keep serving",
        ) as info:
            s.sample([InputFeature(input_ids=[i]) for i in range(6)], {"max_tokens": 1})
        assert info.value.replica == 0 and info.value.survivors == 1
        assert s.num_replicas == 1 and [r.alive for r in s.replicas] == [False, True]
        out = s.sample([InputFeature(input_ids=[i]) for i in range(6)], {"max_tokens": 1})
        assert [r.sequences[0].tokens for r in out] == [[i + 3] for i in range(6)]
        assert s.update_weights({"offset": 5}) == 2
        assert get_group("aux").free == [0, 2]  # the lost replica's device went back to the group
    assert get_group("aux").free == [0, 1, 2]


def test_an_update_only_some_replicas_take_is_kept_and_the_others_rebuilt(cluster):
    with EchoEngine(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="aux") as s:
        with pytest.raises(WeightUpdateError, match="unknown weight names"):
            s.update_weights({"offset": 1, "bogus": 0})  # every replica rejects it: nothing changes
        assert s.weights_version == 0 and s.num_replicas == 2
        with pytest.raises(WeightUpdateError, match="replica 1 cannot take this update") as info:
            s.update_weights({"offset": 4, "fail_on_replica": 1})
        notes = "\n".join(info.value.__notes__)
        assert "Replicas [0] applied update_weights (version 1); replicas [1] failed and were rebuilt" in notes
        # replica 1 cannot take it on a rebuild either, so it is out of service: no replica serves old weights
        assert "could not be restarted" in notes and [r.alive for r in s.replicas] == [True, False]
        out = s.sample([InputFeature(input_ids=[i]) for i in range(4)], {"max_tokens": 1})
        assert [r.sequences[0].tokens for r in out] == [[i + 4] for i in range(4)]
        assert s.weights_version == 1 and {r.sequences[0].weights_version for r in out} == {1}


def test_mesh_and_group_validation(cluster):
    aux = get_group("aux")
    with pytest.raises(InvalidMeshError, match=r"needs 4 devices but group 'aux' has 3"):
        EchoEngine(device_mesh=DeviceMesh.from_sizes(dp_size=2, tp_size=2), remote_group="aux")
    with pytest.raises(UnknownGroupError, match=r"remote_group='smapler'.*initialised groups: 'pair', 'aux'"):
        EchoEngine(device_mesh=DeviceMesh.from_sizes(dp_size=1), remote_group="smapler")
    with pytest.raises(TypeError, match="colour"):
        EchoEngine(colour="red", remote_group="aux")
    with pytest.raises(InvalidMeshError, match="device_mesh="):
        EchoEngine(device_mesh=4, remote_group="aux")
    with EchoEngine(device_mesh={"dp_size": 2}, remote_group="aux") as held:
        assert held.num_replicas == 2
        with pytest.raises(InvalidMeshError, match=r"needs 2 devices of group 'aux', but only 1 of its 3 are free"):
            EchoEngine(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="aux")
    assert aux.free == [0, 1, 2]
    # constructor errors reach the driver as their own type, and nothing is left holding devices
    with pytest.raises(FileNotFoundError, match="model files missing"):
        EchoEngine(fail_if_exists=__file__, remote_group="aux")
    assert aux.free == [0, 1, 2]


def test_initialize_twice(cluster):
    same = tw.initialize(
        "ray",
        groups=[DeviceGroup(name="pair", ranks=2, device_type="cpu")],
        num_cpus=4,
    )
    assert same is cluster  # same options, same group: nothing changes
    with pytest.raises(InvalidMeshError, match="'pair' is already initialised"):
        tw.initialize("ray", groups=[DeviceGroup(name="pair", ranks=1, device_type="cpu")], num_cpus=4)
    with pytest.raises(ConfigError, match="num_cpus differ"):
        tw.initialize("ray", num_cpus=3)
    with pytest.raises(ConfigError, match="already initialised in mode 'ray'"):
        tw.initialize("local")
    more = tw.initialize(
        "ray", groups=[DeviceGroup(name="extra", ranks=1, device_type="cpu", cpus_per_rank=0.1)], num_cpus=4
    )
    assert more is cluster and set(cluster.groups) == {"pair", "aux", "extra"}
    with pytest.raises(Exception, match="needs 1 x"):
        tw.initialize("ray", groups=[DeviceGroup(name="gpus", ranks=1, device_type="cuda")], num_cpus=4)
    assert "gpus" not in cluster.groups


def test_remote_class_dispatch(cluster):
    with Scorer(10, remote_group="aux", device_mesh=DeviceMesh.from_sizes(dp_size=3)) as scorer:
        where = scorer.where()
        assert [w[:2] for w in where] == [(0, 1), (1, 1), (2, 1)] and len({w[2] for w in where}) == 3
        assert {w[3] for w in where} == {0}  # replicas run at the driver's priority, not Ray's niceness 15
        texts = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g"]
        scored = scorer.score(texts)
        assert [s for s, _ in scored] == [len(t) + 10 for t in texts]
        assert [r for _, r in scored] == [0, 0, 0, 1, 1, 2, 2]
        with pytest.raises(KeyError, match="no such row") as info:
            scorer.fail()
        assert "Raised in replica" in info.value.__notes__[0]
        with pytest.raises(AttributeError, match="bonus is not a method"):
            scorer.bonus  # noqa: B018
        kill_and_wait(scorer.actors[2])
        assert [s for s, _ in scorer.score(texts)] == [len(t) + 10 for t in texts]  # rebuilt and retried
        assert scorer.replicas[2].restarts == 1
    plain = Scorer(1)  # without remote_group: an ordinary object
    assert isinstance(plain, Scorer) and plain.bonus == 1


def test_tensor_parallel_replicas_get_their_bundles(cluster):
    with Scorer(0, remote_group="aux", device_mesh=DeviceMesh.from_sizes(dp_size=1, tp_size=2)) as tp:
        assert tp.layout() == {"bundles": (0, 1), "tp_size": 2, "dp_size": 1, "vllm_bundles": "0,1", "pg": True}
        assert get_group("aux").free == [2]
        with pytest.raises(InvalidMeshError, match="needs 2 devices of group 'aux', but only 1"):
            Scorer(0, remote_group="aux", device_mesh=DeviceMesh.from_sizes(dp_size=1, tp_size=2))


def test_close_releases_actors_and_devices(cluster):
    s = EchoEngine(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="aux")
    actors = s.actors
    assert len(get_group("aux").free) == 1
    s.close()
    s.close()  # harmless
    assert get_group("aux").free == [0, 1, 2]
    with pytest.raises(SamplerClosedError):
        s.sample(InputFeature(input_ids=[1]))
    # ray.kill is asynchronous: the actor may answer a call or two before it is gone
    deadline = time.monotonic() + 30
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(actors[0].ready.remote(), timeout=30)
            time.sleep(0.2)


def test_a_second_driver_joins_by_address_and_exits_cleanly(cluster, tmp_path):
    """A driver that leaves a remote sampler open still exits at once, and frees what it held."""
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import ray
        import twinkle_core as tw
        import test_remote
        ray.cloudpickle.register_pickle_by_value(test_remote)
        tw.initialize("ray", groups=[tw.DeviceGroup(name="d", ranks=1, device_type="cpu", cpus_per_rank=0.1)],
                      address={ray.get_runtime_context().gcs_address!r})
        s = test_remote.EchoEngine(remote_group="d")
        print(s.sample(tw.InputFeature(input_ids=[7]), {{"max_tokens": 2}})[0].sequences[0].tokens)
    """)
    )
    before = ray.available_resources().get("CPU", 0.0)
    # A driver that hangs at exit (the bug this guards against) never ends: the timeout catches it.
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[7, 8]" in proc.stdout
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ray.available_resources().get("CPU", 0.0) < before - 1e-6:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0.0) >= before - 1e-6  # its group and actor are gone


def test_local_mode_runs_remote_code_in_process(tmp_path):
    """``initialize('local')`` (and no initialize at all) never imports Ray; remote_group builds in process."""
    code = textwrap.dedent("""
        import sys
        import twinkle_core as tw
        import twinkle_core.engine
        from twinkle_core.remote import UnknownGroupError
        from twinkle_core.errors import InvalidMeshError
        class E(tw.engine.BatchEngine):
            def __init__(self, context, device_mesh=None):
                super().__init__(context)
                self.mesh = device_mesh
                self.info = tw.engine.EngineInfo(name="e", max_model_len=8)
            def generate(self, prompts, params, adapter_name):
                return []
        try:
            tw.create_sampler(E, remote_group="sampler")
        except UnknownGroupError as exc:
            assert "initialize() was never called" in str(exc), exc
        tw.initialize("local", groups=[tw.DeviceGroup(name="sampler", ranks=2, device_type="cpu")])
        e = tw.create_sampler(E, device_mesh=tw.DeviceMesh.from_sizes(dp_size=2), remote_group="sampler")
        assert type(e) is tw.Sampler and type(e.engine) is E and e.engine.mesh.dp_size == 2
        try:
            tw.create_sampler(E, device_mesh=tw.DeviceMesh.from_sizes(dp_size=3), remote_group="sampler")
        except InvalidMeshError as exc:
            assert "needs 3 devices but group 'sampler' has 2" in str(exc)
        tw.shutdown()
        assert "ray" not in sys.modules
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_routed_experts_come_back_from_replicas(cluster, tmp_path):
    """MoE routes cross Ray with their sequences: each replica's are what a local engine returns."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for path in build_tiny_model("llama").iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy2(path, tmp_path / path.name)
    params = {"max_tokens": 5, "seed": 3, "num_samples": 2, "ignore_eos": True, "return_routed_experts": True}
    with TorchSampler(str(tmp_path)) as s:
        local = s.sample(chats()[:2], params)
    with TorchSampler(str(tmp_path), device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="aux") as s:
        remote = s.sample(chats()[:2], params)
    for here, there in zip(local, remote):
        for a, b in zip(here.sequences, there.sequences):
            assert b.routed_experts.shape == (len(there.prompt_token_ids) + len(b.tokens) - 1, 2, 2)
            assert (a.tokens, a.routed_experts.tolist()) == (b.tokens, b.routed_experts.tolist())


def test_image_prompts_sample_on_replicas_and_their_media_cross_once(cluster):
    """Prompts with images on two torch replicas: the local sampler's greedy outputs, and each prompt's media
    come back once, shared by its samples' training features as locally (not one copy per sample)."""
    import numpy as np
    from PIL import Image

    from twinkle_core.testing.tiny_vlm import build_tiny_vlm

    def chat(seed: int) -> Trajectory:
        image = Image.frombytes("RGB", (40, 32), bytes((seed * 53 + i * 11) % 256 for i in range(40 * 32 * 3)))
        content = [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]
        return Trajectory(messages=[{"role": "user", "content": content}])

    vlm = str(build_tiny_vlm())
    inputs = [chat(1), chats()[0], chat(2), chat(3)]
    params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "num_samples": 4, "logprobs": 0}
    with TorchSampler(vlm, dtype="float32") as s:
        local = s.sample(inputs, params)
    with TorchSampler(vlm, dtype="float32", device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="aux") as s:
        assert s.engine.info.media == {"image"}
        remote = s.sample(inputs, params)
    assert tokens(remote) == tokens(local)
    for here, there in zip(local, remote):
        assert there.prompt_token_ids == here.prompt_token_ids
        features = [seq.training_feature for seq in there.sequences]
        for a, b in zip(here.sequences, there.sequences):
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        if here.sequences[0].training_feature.multimodal is None:  # the text prompt
            assert all(f.multimodal is None and not f.images for f in features)
            continue
        expected = here.sequences[0].training_feature
        for feature in features:
            assert feature.multimodal.keys() == expected.multimodal.keys()
            assert all(np.array_equal(feature.multimodal[k], expected.multimodal[k]) for k in expected.multimodal)
            assert [im.tobytes() for im in feature.images] == [im.tobytes() for im in expected.images]
            # the prompt's arrays and images, once: every sample holds the same objects
            assert feature.multimodal["pixel_values"] is features[0].multimodal["pixel_values"]
            assert feature.images[0] is features[0].images[0]


def test_a_trainers_names_reach_replicas_serving_a_checkpoints_nested_layout(cluster):
    """A trainer's ``AutoModelForCausalLM`` names (``model.layers.*``, ``lm_head.weight``) into replicas of
    Qwen3.5's checkpoint layout (``model.language_model.*``, a tower, an MTP block; :mod:`twinkle_core.names`):
    the whole model, a part, a LoRA adapter of the trainer's, then the checkpoint's own nested names, each served
    as a local sampler given the same update serves it; an MTP tensor is refused with its type and message intact."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from twinkle_core.testing.tiny_layouts import build_tiny_checkpoint_layout

    layout = str(build_tiny_checkpoint_layout())
    trainer = AutoModelForCausalLM.from_pretrained(layout, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    whole = [(n, t + 0.3 * t.std() * torch.randn(t.shape, generator=gen)) for n, t in trainer.state_dict().items()]
    assert {n.split(".")[1] for n, _ in whole if n.startswith("model.")} == {"embed_tokens", "layers", "norm"}
    partial = [(n, 2 * t) for n, t in whole if n in ("lm_head.weight", "model.layers.3.self_attn.o_proj.weight")]
    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=16, target_modules=["in_proj_qkv", "out_proj", "q_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(trainer, config)
    lora = get_peft_model_state_dict(peft_model)
    assert any(k.startswith("base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A") for k in lora)
    checkpoint = load_file(os.path.join(layout, "model.safetensors"))
    nested = [(n, t) for n, t in checkpoint.items() if n.startswith("model.language_model.") or n == "lm_head.weight"]
    params = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, "logprobs": 0}
    prompts = chats()[:2]  # one per replica

    def served(adapter_name: str = "") -> list[SampleResponse]:
        got = remote.sample(prompts, params, adapter_name=adapter_name)
        want = local.sample(prompts, params, adapter_name=adapter_name)
        assert tokens(got) == tokens(want)
        for here, there in zip(want, got):
            assert there.sequences[0].logprobs == pytest.approx(here.sequences[0].logprobs, abs=1e-5)
        return want

    def moved(a: list[SampleResponse], b: list[SampleResponse]) -> float:
        return max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r.sequences[0].logprobs, s.sequences[0].logprobs))

    with (
        TorchSampler(layout) as local,
        TorchSampler(layout, device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="aux") as remote,
    ):
        base = served()
        steps = []
        for update in (whole, partial):
            assert remote.update_weights(update) == local.update_weights(update)
            steps.append(served())
        for s in (remote, local):
            s.add_adapter_to_model("trainer", config, weights=lora)
        tuned = served("trainer")
        assert min(moved(base, steps[0]), moved(*steps), moved(steps[1], tuned)) > 1e-2  # each change was served
        remote.update_weights(nested)  # the checkpoint's own spelling puts its weights back
        assert len(remote.engine._weight_ops) == 1  # and supersedes the trainer's pushes kept for rebuilds
        back = remote.sample(prompts, params)
        assert tokens(back) == tokens(base) and moved(back, base) < 1e-5
        errors = []
        for s in (remote, local):
            version = s.weights_version
            with pytest.raises(WeightUpdateError, match="multi-token-prediction") as info:
                s.update_weights({"mtp.fc.weight": checkpoint["mtp.fc.weight"]})
            errors.append(info.value)
            assert s.weights_version == version
        assert type(errors[0]) is WeightUpdateError and str(errors[0]) == str(errors[1])
        assert "'mtp.fc.weight'" in str(errors[0]) and any("Raised in replica" in n for n in errors[0].__notes__)
