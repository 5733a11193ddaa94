"""Where twinkle puts the files of one vLLM engine, named so that nothing is ever orphaned.

Two kinds of files belong to a sampler process (the *driver*):

* the weight-sync staging buffer, ``/dev/shm/twinkle-vllm-<driver pid>-<random>``;
* one private folder (mode 0700) per sync session, holding the ZMQ ``ipc://``
  sockets, ``<session root>/twinkle-vllm-<driver pid>-<random>``;
* one such folder per engine start, where vLLM's own processes bind their ZMQ
  sockets (``VLLM_RPC_BASE_PATH``): vLLM names them by a UUID in the temporary
  folder and leaves them there when the engine stops, seven files a start.

The driver's pid in every name is what lets anyone clean up after a driver that
died without closing (``kill -9``, the OOM killer): the driver's reaper
(:mod:`twinkle_vllm._reaper`) removes that pid's files the moment it dies, and
every new sampler sweeps away the files of pids that are no longer running
(:func:`sweep_stale`), in case the reaper died with it.

The session root is short on purpose: a Unix socket path is limited to about
107 bytes (``sun_path``), so a session folder under a long ``TMPDIR`` would
make every sync fail with ``ZMQError: File name too long``. The root is the
temporary folder when its paths fit, else ``/tmp``, else ``/dev/shm``; the
folders in it are private (0700) either way.

This module imports only the standard library (and twinkle's errors): the reaper process uses it.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator

from twinkle_core.errors import ConfigError

__all__ = [
    "PREFIX",
    "SOCKET_PATH_MAX",
    "driver_files",
    "remove",
    "session_folder",
    "session_root",
    "shm_dir",
    "staging_name",
    "sweep_stale",
]

#: Every file and folder twinkle creates for a vLLM engine starts with this, then ``<driver pid>-``.
PREFIX = "twinkle-vllm-"
#: The longest socket path the kernel takes (``sizeof(sun_path)`` is 108 on Linux, with the NUL).
SOCKET_PATH_MAX = 107
#: The longest socket name in a session folder: vLLM's, a UUID (ours are ``w<rank>.sock``).
_LEAF_MAX = 36
#: The longest session root we accept: room for ``/<prefix><pid>-<8 random>/<leaf>``.
_ROOT_MAX = SOCKET_PATH_MAX - len(f"/{PREFIX}4194304-abcdefgh/") - _LEAF_MAX
_OWNED = re.compile(re.escape(PREFIX) + r"(\d+)-")


def shm_dir() -> str:
    """``/dev/shm`` where it exists (RAM-backed), else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def staging_name(pid: int, tag: str) -> str:
    """The path of a staging buffer of driver ``pid``."""
    return os.path.join(shm_dir(), f"{PREFIX}{pid}-{tag}")


def session_root() -> str:
    """A folder whose session sockets stay within the socket path limit, whatever ``TMPDIR`` is.

    Raises:
        ConfigError: no candidate folder is short enough and writable.
    """
    candidates = [tempfile.gettempdir(), "/tmp", "/dev/shm"]
    for root in candidates:
        if len(root) <= _ROOT_MAX and os.path.isdir(root) and os.access(root, os.W_OK | os.X_OK):
            return root
    raise ConfigError(
        f"No folder for twinkle's weight-sync sockets: the temporary folder {tempfile.gettempdir()!r} is longer than"
        f" {_ROOT_MAX} characters (socket paths are limited to {SOCKET_PATH_MAX} bytes) and neither /tmp nor /dev/shm"
        " is writable. Set TMPDIR to a short writable folder."
    )


def session_folder() -> str:
    """Create a private (0700) session folder of this process under :func:`session_root`; return its path.

    Raises:
        ConfigError: no candidate root is short enough and writable.
    """
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=session_root())


def driver_files(pid: int) -> list[str]:
    """Every staging buffer and session folder of driver ``pid`` that exists now."""
    return sorted(os.path.join(folder, n) for folder, n in _entries() if n.startswith(f"{PREFIX}{pid}-"))


def _entries() -> Iterator[tuple[str, str]]:
    """(folder, name) of every entry in the folders where staging buffers and session folders live."""
    roots = {shm_dir(), tempfile.gettempdir()}
    try:
        roots.add(session_root())
    except ConfigError:
        pass
    for folder in roots:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            yield folder, name


def remove(path: str, *, plain_file: bool = False) -> None:
    """Remove a file or folder of ours (one this user owns); never follow a link.

    Args:
        plain_file: remove ``path`` only if it is a plain file (a path another process named).
    """
    try:
        info = os.lstat(path)
    except OSError:
        return
    if info.st_uid != os.getuid() or (plain_file and not stat.S_ISREG(info.st_mode)):
        return
    try:
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:  # a zombie has exited: its files are orphans too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def sweep_stale() -> list[str]:
    """Remove the staging buffers and session folders of drivers that are no longer running.

    Returns:
        The paths removed.
    """
    removed: list[str] = []
    for folder, name in _entries():
        match = _OWNED.match(name)
        if match is None or _running(int(match.group(1))):
            continue
        path = os.path.join(folder, name)
        remove(path)
        removed.append(path)
    return removed
