"""Find the echo engine for these tests without installing anything.

Installed (``pip install examples/twinkle_echo``, or a ``--target`` folder on
``PYTHONPATH``, as ``tests/test_plugin_discovery.py`` does), ``"echo"`` comes
from the distribution's entry point. Otherwise it is registered in process
from these sources for the session and unregistered afterwards. The report
header says which one ran.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from twinkle_core import list_samplers, register_sampler
from twinkle_core.plugins.engines import sampler_registry

if importlib.util.find_spec("twinkle_echo") is None:
    # Not installed: import it from its sources (the folder holding the twinkle_echo package).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pytest_report_header(config: pytest.Config) -> str:
    """One line: where ``"echo"`` came from."""
    found = {i.name: i for i in list_samplers()}.get("echo")
    if found is not None and found.distribution is not None:
        return f"echo engine: the entry point of {found.distribution} {found.version}"
    return "echo engine: registered in process from the sources (twinkle-echo is not installed)"


@pytest.fixture(scope="session", autouse=True)
def echo_engine() -> Iterator[None]:
    """Register ``"echo"`` in process when no installed distribution provides it."""
    if "echo" in [i.name for i in list_samplers()]:
        yield
        return
    register_sampler("echo", "twinkle_echo.engine:EchoEngine")
    yield
    sampler_registry.unregister("echo")
