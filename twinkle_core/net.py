"""Network facts the server and the Ray runtime share (no web framework, no Ray)."""

from __future__ import annotations

import ipaddress
import math

from twinkle_core.errors import ConfigError

__all__ = ["check_port", "check_timeout", "is_loopback"]


def check_port(port: object, name: str = "port") -> int:
    """A TCP port to listen on, 0 for a free one.

    Raises:
        ConfigError: not an integer from 0 to 65535.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"{name}={port!r} is invalid: expected an integer from 0 to 65535 (0: a free port).")
    return port


def check_timeout(value: object, name: str = "timeout_s") -> float:
    """A wait in seconds: a finite number > 0.

    Raises:
        ConfigError: anything else (a string, NaN, 0, a negative number).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={value!r} is invalid: expected a number of seconds > 0.")
    return float(value)


def is_loopback(host: str) -> bool:
    """Whether ``host`` binds only to this machine (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
