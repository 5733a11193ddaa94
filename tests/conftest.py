"""Fixtures the server tests share: the tiny Llama on the torch engine, served, and an ``openai`` client.

Each is module-scoped, so every test module gets its own engine and server, as
when each module defined them. A module that wants another engine or other
server options defines a fixture of the same name, which pytest prefers.
Heavy and optional packages are imported inside the fixtures: a module that
uses them skips on their absence first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from twinkle_core.server import RunningServer


@pytest.fixture(scope="module")
def sampler() -> Iterator[Any]:
    from twinkle_core.testing import build_tiny_model
    from twinkle_torch.sampler import TorchSampler

    with TorchSampler(build_tiny_model("llama"), device="cpu") as s:
        yield s


@pytest.fixture(scope="module")
def server(sampler: Any) -> Iterator[RunningServer]:
    from twinkle_core.server import start_server

    with start_server(sampler, model_name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
