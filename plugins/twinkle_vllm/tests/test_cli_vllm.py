"""``twinkle sample -e vllm`` as a user runs it: the sample on stdout, a few of twinkle's lines on stderr.

No KV-cache size is given (neither an engine option nor ``VLLM_CPU_KVCACHE_SPACE``),
so the engine starts with the size twinkle picks on CPU, which it names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

TWINKLE = shutil.which("twinkle", path=str(Path(sys.executable).parent)) or "twinkle"


def test_vllm_from_the_cli_starts_with_its_own_kv_cache_size_and_quiet_logs(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "vllm.yaml"
    config.write_text("sampler: vllm\nenforce_eager: true\ndtype: float32\n")
    unset = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    args = ["sample", "-c", str(config), "-m", str(tiny_model), "-p", "hi", "--max-tokens", "4", "--no-progress"]
    done = subprocess.run([TWINKLE, *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stdout.splitlines()  # the sample alone: vLLM's own lines go to stderr
    assert len(json.loads(line)["sequences"][0]["tokens"]) == 4
    assert "twinkle: starting the vllm engine with" in done.stderr and "is ready" in done.stderr
    assert re.search(r"twinkle: vLLM on CPU: a KV cache of \d+\.\d\d GiB", done.stderr), done.stderr
    # vLLM's own INFO lines are off by default (twinkle --engine-logs brings them back)
    assert not [row for row in done.stderr.splitlines() if re.search(r"\bINFO\b", row)], done.stderr
