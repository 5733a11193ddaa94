"""A short run of the tool-agent GRPO tutorial: every step's trained tokens are the sampled ones.

The full run (the rising reward) is documented in docs/agents.md; here two
small steps prove the loop works end to end: rollouts through the real
server, the token-exactness and version assertions inside the script, a
policy step, and the adapter pushed back while the server runs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parents[1] / "tool_grpo.py"


def test_short_run_trains_on_exactly_the_sampled_tokens(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("tool_grpo", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [
        "--model",
        "tiny",
        "--steps",
        "2",
        "--prompts",
        "2",
        "--group",
        "4",
        "--max-tokens",
        "32",
        "--out",
        str(tmp_path),
    ]
    history = module.main(argv)
    assert [r["step"] for r in history] == [0, 1]
    # Each step pushed a new adapter version, and the rollouts of the next step were sampled with it
    # (the script asserts every turn's version against the one it pushed).
    assert history[1]["weights_version"] == history[0]["weights_version"] + 1
    # Same tokens, same float32 model: the sampler's and the trainer's log-probs agree.
    assert max(r["mismatch_max"] for r in history) < 1e-3
    assert all(0.0 <= r["success"] <= r["called"] <= 1.0 and r["shaped"] <= 1.0 for r in history)
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written == history
    assert (tmp_path / "curves.png").stat().st_size > 0
