"""Weights into a ``twinkle serve`` in another process, over vLLM's weight-transfer routes (gloo), by the client.

One server process (the torch engine on the tiny model, started by the
``twinkle serve`` command with ``--weight-transfer-config``) for the module;
this process is the trainer. What it samples after each push is compared
with a sampler here that took the same update directly.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("twinkle_torch")

from twinkle_core.client import WeightClient  # noqa: E402
from twinkle_core.errors import ConfigError, WeightUpdateError  # noqa: E402
from twinkle_core.testing import TINY_CHAT_PROMPTS, build_tiny_model  # noqa: E402

PROMPTS = [{"messages": m} for m in TINY_CHAT_PROMPTS[:3]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model_dir: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    twinkle = os.path.join(os.path.dirname(sys.executable), "twinkle")
    proc = subprocess.Popen(
        [twinkle, "serve", model_dir, "--engine", "torch", "--port", str(port), "--served-model-name", "tiny", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"twinkle serve exited: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("twinkle serve did not come up within 120 s")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_tiny_model())


@pytest.fixture(scope="module")
def server(model_dir):
    proc, url = _serve(model_dir, "--weight-transfer-config", '{"backend": "gloo", "timeout_s": 60}')
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def local(model_dir):
    from twinkle_torch.sampler import TorchSampler

    with TorchSampler(model_dir) as s:
        yield s


def served_tokens(url: str, local: Any) -> tuple[list[list[int]], set[int]]:
    """Greedy completions of the prompts (as token ids) from the server, and the weights versions they carry."""
    out, versions = [], set()
    for p in PROMPTS:
        ids = list(local.encode(p).input_ids)
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": ids, "max_tokens": 16, "temperature": 0},
            timeout=60,
        )
        choice = r.json()["choices"][0]
        out.append(choice["token_ids"])
        versions.add(choice["weights_version"])
    return out, versions


def local_tokens(local: Any) -> list[list[int]]:
    params = {"temperature": 0.0, "max_tokens": 16}
    return [r.sequences[0].tokens for r in local.sample(PROMPTS, params)]


def perturbed(model_dir: str, seed: int, names: list[str] | None = None) -> dict[str, Any]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    return {
        n: t + 0.5 * t.std() * torch.randn(t.shape, generator=gen)
        for n, t in state.items()
        if names is None or n in names
    }


def test_a_trainer_in_another_process_pushes_weights_into_the_server(server, local, model_dir):
    info = httpx.get(server + "/server_info").json()
    assert info["vllm_config"]["weight_transfer_config"]["backend"] == "gloo"
    before = info["twinkle"]["weights_version"]
    with WeightClient(server, host="127.0.0.1", timeout_s=60) as client:
        client.init_communicator()
        update = perturbed(model_dir, 1)
        assert client.update_weights(update) == before + 1
        local.update_weights(update)
        got, versions = served_tokens(server, local)
        assert got == local_tokens(local) and versions == {before + 1}
        # a partial update, and a version the trainer picks
        part = perturbed(model_dir, 2, ["lm_head.weight", "model.layers.0.mlp.down_proj.weight"])
        assert client.update_weights(part.items(), version=before + 10) == before + 10
        local.update_weights(part)
        assert served_tokens(server, local)[0] == local_tokens(local)
        assert httpx.get(server + "/server_info").json()["twinkle"]["weights_version"] == before + 10

        # a bad update is refused by the server whole: version and weights unchanged, the group still works
        with pytest.raises(WeightUpdateError, match="no_such"):
            client.update_weights({"no_such.weight": torch.zeros(3)})
        with pytest.raises(WeightUpdateError, match="shape"):
            client.update_weights({"lm_head.weight": torch.zeros(2, 2)})
        assert httpx.get(server + "/server_info").json()["twinkle"]["weights_version"] == before + 10
        assert served_tokens(server, local)[0] == local_tokens(local)
        from safetensors.torch import load_file

        original = load_file(os.path.join(model_dir, "model.safetensors"))
        client.update_weights(original)
        local.update_weights(original)
        assert served_tokens(server, local)[0] == local_tokens(local)


def test_a_trainers_names_reach_a_server_of_the_checkpoints_nested_layout(tmp_path):
    """A trainer's ``AutoModelForCausalLM`` names (``model.layers.*``, ``lm_head.weight``) into a server of
    Qwen3.5's checkpoint layout (``model.language_model.*``, a tower, an MTP block; :mod:`twinkle_core.names`):
    the whole model and a part over the weight routes, a LoRA adapter of the trainer's over
    ``/v1/load_lora_adapter`` (all by the client), each served as a local sampler given it serves it; an MTP
    tensor is a 400 naming it."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from twinkle_core.testing.tiny_layouts import build_tiny_checkpoint_layout
    from twinkle_torch.sampler import TorchSampler

    layout = str(build_tiny_checkpoint_layout())
    trainer = AutoModelForCausalLM.from_pretrained(layout, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    whole = {n: t + 0.3 * t.std() * torch.randn(t.shape, generator=gen) for n, t in trainer.state_dict().items()}
    partial = {n: 2 * whole[n] for n in ("lm_head.weight", "model.layers.3.self_attn.o_proj.weight")}
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["in_proj_qkv", "q_proj"], init_lora_weights=False)
    get_peft_model(trainer, config).save_pretrained(str(tmp_path / "lora"))
    mtp = load_file(os.path.join(layout, "model.safetensors"))["mtp.fc.weight"]
    prompt = PROMPTS[0]
    params = {"temperature": 0.0, "max_tokens": 6, "logprobs": 0}

    def served(model: str = "tiny") -> list[float]:
        """The server's greedy log-probs of the prompt, checked against the local sampler's (same model)."""
        ids = list(local.encode(prompt).input_ids)
        body = {"model": model, "prompt": ids, **params}
        choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        want = local.sample(prompt, params, adapter_name="" if model == "tiny" else model)[0].sequences[0]
        assert choice["token_ids"] == want.tokens
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
        return want.logprobs

    proc, url = _serve(layout, "--weight-transfer-config", '{"backend": "gloo", "timeout_s": 60}')
    try:
        with TorchSampler(layout) as local, WeightClient(url, host="127.0.0.1", timeout_s=60) as client:
            client.init_communicator()
            seen = [served()]
            for update in (whole, partial):
                version = client.update_weights(update)
                assert version == local.update_weights(update)
                seen.append(served())
            with pytest.raises(WeightUpdateError, match=r"'mtp\.fc\.weight' belongs to the multi-token-prediction"):
                client.update_weights({"mtp.fc.weight": mtp})
            assert httpx.get(url + "/server_info").json()["twinkle"]["weights_version"] == version
            assert client.load_adapter("trainer", str(tmp_path / "lora")) == version + 1
            local.add_adapter_to_model("trainer", str(tmp_path / "lora"))
            seen.append(served("trainer"))
        for a, b in itertools.pairwise(seen):  # each change was served
            assert max(abs(x - y) for x, y in zip(a, b)) > 1e-2
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_misuse_of_the_client_and_routes_leaves_the_group_working(server, local, model_dir):
    """A dtype the wire does not carry, a refused re-init, one client pushing from two threads: each is refused
    or serialised, and the trainer's group goes on working (a mismatched broadcast used to kill the server)."""
    import threading

    from safetensors.torch import load_file

    original = load_file(os.path.join(model_dir, "model.safetensors"))
    norm, first = "model.norm.weight", "model.layers.0.input_layernorm.weight"
    with WeightClient(server, host="127.0.0.1", timeout_s=60) as client:
        client.init_communicator()
        for dtype in (torch.complex64, torch.float8_e4m3fn):
            with pytest.raises(WeightUpdateError, match=str(dtype).removeprefix("torch.")):
                client.update_weights({norm: original[norm].to(dtype)})
        init = {"master_address": "127.0.0.1", "master_port": 99999, "world_size": 2}
        r = httpx.post(server + "/init_weight_transfer_engine", json={"init_info": init}, timeout=30)
        assert r.status_code == 400 and "master_port=99999 is invalid" in r.json()["error"]["message"]
        versions: list[Any] = []

        def push(name: str) -> None:
            try:
                versions.append(client.update_weights({name: original[name]}))
            except Exception as exc:  # the test reports it
                versions.append(exc)

        threads = [threading.Thread(target=push, args=(name,)) for name in (norm, first)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(isinstance(v, int) for v in versions) and len(set(versions)) == 2, versions
        local.update_weights(original)
        assert served_tokens(server, local)[0] == local_tokens(local)


def test_route_misuse_is_a_clear_error(server):
    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(server + path, json=body, timeout=30)

    r = post("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]]}})
    assert r.status_code == 400 and "/init_weight_transfer_engine first" in r.json()["error"]["message"]
    r = post("/init_weight_transfer_engine", {"init_info": {"master_port": 1}})
    assert r.status_code == 400 and "master_address" in r.json()["error"]["message"]
    for version in ("v7", "2", 1.9, True):
        r = post("/finish_weight_update", {"weight_version": version})
        assert r.status_code == 400 and "integers" in r.json()["error"]["message"], r.text
    for shape in ([-1], "ab", 5, None, [1.5]):
        info = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [shape]}
        r = post("/update_weights", {"update_info": info})
        assert r.status_code == 400 and "a list of sizes (integers >= 0)" in r.json()["error"]["message"], r.text
    # a declared size the machine cannot hold is refused before anything is allocated (and the server lives)
    for shape in ([2**40], [2**40, 2**40], [2**70]):
        info = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [shape]}
        r = post("/update_weights", {"update_info": info})
        assert r.status_code == 400 and "more than this machine has free" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "update_info"
    assert httpx.get(server + "/health", timeout=30).status_code == 200


def test_a_server_without_the_option_says_how_to_turn_it_on(model_dir):
    proc, url = _serve(model_dir)
    try:
        with pytest.raises(ConfigError, match="--weight-transfer-config"):
            WeightClient(url, host="127.0.0.1").init_communicator()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "twinkle"),
            "serve",
            model_dir,
            "--weight-transfer-config",
            '{"backend": "nccl"}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "not supported by twinkle serve yet" in bad.stderr


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_url": "localhost:8000"}, r"base_url='localhost:8000' is invalid: expected the server's http://"),
        ({"base_url": None}, r"base_url=None is invalid"),
        ({"port": 99999}, r"port=99999 is invalid: expected an integer from 0 to 65535"),
        ({"port": "8000"}, r"port='8000' is invalid"),
        ({"port": True}, r"port=True is invalid"),
        ({"timeout_s": 0}, r"timeout_s=0 is invalid: expected a number of seconds > 0"),
        ({"timeout_s": float("nan")}, r"timeout_s=nan is invalid"),
        ({"timeout_s": "30"}, r"timeout_s='30' is invalid"),
        ({"host": ""}, r"host='' is invalid"),
    ],
)
def test_client_options_are_checked_when_built(kwargs: dict[str, Any], match: str) -> None:
    """A bad option fails when the client is made, not as a hang or a raw error at the first push."""
    with pytest.raises(ConfigError, match=match):
        WeightClient(**{"base_url": "http://127.0.0.1:9", **kwargs})
