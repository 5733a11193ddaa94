"""The two hubs: snapshots from the Hugging Face Hub and from ModelScope, and the offline switch.

Both libraries are imported only inside the functions that use them. Their
cache folders and endpoints are read from the environment at call time, so
changing them after the libraries were imported still takes effect. Online, a
ModelScope that cannot be reached falls back to its local cache, and only then fails.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from twinkle_core.errors import HubUnavailableError, InvalidModelIdError, ModelNotFoundError

__all__ = ["download_hf", "download_ms", "is_offline"]

# the name the hub's messages have always been logged under
logger = logging.getLogger("twinkle_core.hub")

_OFFLINE_VARS = ("TWINKLE_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MODELSCOPE_OFFLINE")
_TRUE = {"1", "true", "yes", "on"}


def is_offline() -> bool:
    """Tell whether an offline switch is set in the environment (read now).

    Returns:
        True when any of ``TWINKLE_OFFLINE``, ``HF_HUB_OFFLINE``,
        ``TRANSFORMERS_OFFLINE`` or ``MODELSCOPE_OFFLINE`` is truthy.
    """
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in _OFFLINE_VARS)


def _local_hint(repo_id: str) -> str:
    """Mention the local folder a bare id might have meant.

    Args:
        repo_id: the bare ``org/name`` id.

    Returns:
        A parenthesised remark, with a leading space.
    """
    return f" (no local folder {str(Path(repo_id).absolute())!r} exists either)"


def _hf_cache_dir() -> str:
    """Compute the Hugging Face hub cache folder from the environment, now.

    ``huggingface_hub`` reads ``HF_HUB_CACHE``/``HF_HOME`` when it is imported;
    reading them here too makes later changes (tests, notebooks) take effect.

    Returns:
        The hub cache folder.
    """
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expandvars(os.path.expanduser(os.environ[name]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return os.path.join(os.path.expandvars(os.path.expanduser(home)), "hub")


def download_hf(repo_id: str, revision: str | None, model_id: str) -> Path:
    """Resolve ``hf://org/name`` through ``huggingface_hub.snapshot_download``.

    Args:
        repo_id: ``org/name``.
        revision: branch, tag or commit (``None``: the default branch).
        model_id: the id as given (for messages).

    Returns:
        The snapshot folder in the Hugging Face cache.

    Raises:
        ModelNotFoundError: the repository or revision does not exist (or is gated).
        HubUnavailableError: the Hub is unreachable or offline and the snapshot is not cached.
        InvalidModelIdError: ``huggingface_hub`` rejects the id.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError as error:
        raise HubUnavailableError(
            f"cannot resolve {model_id!r}: huggingface_hub is not installed (pip install huggingface_hub); "
            "or pass a local model folder instead"
        ) from error
    offline = is_offline()
    cache_dir = _hf_cache_dir()
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=offline,
                endpoint=os.environ.get("HF_ENDPOINT") or None,
            )
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        what = f"revision {revision!r} of {repo_id!r}" if isinstance(error, RevisionNotFoundError) else repo_id
        raise ModelNotFoundError(
            f"{model_id!r}: the Hugging Face Hub has no {what} (or it is private/gated: log in with "
            "`hf auth login`); check the id, or pass a local model folder instead"
        ) from error
    except HFValidationError as error:
        raise InvalidModelIdError(f"model id {model_id!r} is not a valid Hub repo id: {error}") from error
    except OSError as error:
        reason = "offline mode is on" if offline else "the Hugging Face Hub could not be reached"
        raise HubUnavailableError(
            f"cannot resolve {model_id!r}: {reason} and no complete snapshot"
            f"{'' if revision is None else f' of revision {revision!r}'} is in the cache {cache_dir!r}. "
            "Download it once with network access, or pass a local model folder instead "
            f"(e.g. resolve_model_id('/path/to/model')). Cause: {type(error).__name__}: {error}"
        ) from error


def download_ms(repo_id: str, revision: str | None, model_id: str) -> Path:
    """Resolve ``ms://org/name`` (or a bare ``org/name``) through ModelScope.

    Online, a network failure falls back to the local cache before failing.

    Args:
        repo_id: ``org/name``.
        revision: branch, tag or commit (``None``: the default branch).
        model_id: the id as given (for messages).

    Returns:
        The snapshot folder in the ModelScope cache.

    Raises:
        ModelNotFoundError: ModelScope says the repository does not exist.
        HubUnavailableError: ModelScope is unreachable or offline and the snapshot is not cached.
        InvalidModelIdError: ModelScope rejects the id.
    """
    bare = "://" not in model_id
    hint = _local_hint(repo_id) if bare else ""
    try:
        from modelscope.hub.snapshot_download import snapshot_download
    except ImportError as error:
        raise HubUnavailableError(
            f"cannot resolve {model_id!r}{hint}: modelscope is not installed (pip install modelscope); "
            "or pass a local model folder instead"
        ) from error
    try:  # modelscope >= 1.38 delegates to the modelscope_hub package
        from modelscope_hub.errors import HubError, InvalidParameter, NotExistError

        hub_errors: tuple[type[BaseException], ...] = (HubError, OSError)
        invalid_errors: tuple[type[BaseException], ...] = (InvalidParameter,)
        missing_errors: tuple[type[BaseException], ...] = (NotExistError,)
    except ImportError:  # pragma: no cover - older modelscope
        from modelscope.hub.errors import NotExistError as LegacyNotExistError

        hub_errors, invalid_errors, missing_errors = (
            (OSError, LegacyNotExistError),
            (),
            (LegacyNotExistError,),
        )
    offline = is_offline()
    # modelscope reads its cache folder and endpoint once per process (a default
    # config singleton): pass the environment's current values explicitly.
    cache = os.path.expanduser(os.environ.get("MODELSCOPE_CACHE") or os.path.join("~", ".cache", "modelscope"))
    options: dict[str, Any] = {"cache_dir": cache}
    if os.environ.get("MODELSCOPE_ENDPOINT"):
        options["endpoint"] = os.environ["MODELSCOPE_ENDPOINT"]

    def not_exist(error: BaseException) -> bool:
        chain: BaseException | None = error
        while chain is not None:
            if isinstance(chain, missing_errors):
                return True
            chain = chain.__cause__ or chain.__context__
        return False

    network_error: BaseException | None = None
    if not offline:
        try:
            return Path(snapshot_download(repo_id, revision=revision, **options))
        except invalid_errors as error:
            raise InvalidModelIdError(f"model id {model_id!r} is not a valid ModelScope id: {error}") from error
        except hub_errors as error:
            if not_exist(error):
                raise ModelNotFoundError(
                    f"{model_id!r}: ModelScope has no model {repo_id!r}"
                    f"{'' if revision is None else f' at revision {revision!r}'} (or it is private){hint}; "
                    "check the id, or pass a local model folder instead"
                ) from error
            network_error = error
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True, **options))
    except hub_errors as error:
        reason = (
            "offline mode is on"
            if offline
            else f"ModelScope could not be reached ({type(network_error).__name__}: {network_error})"
        )
        raise HubUnavailableError(
            f"cannot resolve {model_id!r}{hint}: {reason} and no snapshot"
            f"{'' if revision is None else f' of revision {revision!r}'} is in the cache {cache!r}. "
            "Download it once with network access, or pass a local model folder instead "
            f"(e.g. resolve_model_id('/path/to/model')). Cause: {type(error).__name__}: {error}"
        ) from (network_error or error)
    if network_error is not None:
        logger.warning("ModelScope unreachable (%s); using cached %s", network_error, folder)
    return folder
