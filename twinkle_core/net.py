"""Network facts the server and the Ray runtime share (no web framework, no Ray)."""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` binds only to this machine (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
