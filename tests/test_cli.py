"""The ``twinkle`` command, run as a user runs it: a subprocess of the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_core.testing import build_tiny_model

TWINKLE = shutil.which("twinkle", path=str(Path(sys.executable).parent)) or "twinkle"


def run(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [TWINKLE, *args], input=stdin, capture_output=True, text=True, timeout=300, env=full_env
    )


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(build_tiny_model("llama"))


def test_engines_table_lists_first_party_engines():
    out = run("engines")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["name", "distribution", "version", "available", "error"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["torch"][1:4] == ["twinkle-torch", "0.1.0", "yes"]
    js = json.loads(run("engines", "--json").stdout)
    assert {"name": "torch", "distribution": "twinkle-torch", "version": "0.1.0", "available": "yes", "error": ""} in js


def test_sample_prompts_flags_to_jsonl(tiny):
    out = run(
        "sample", "-e", "torch", "-m", tiny, "-p", "What is the capital of France?", "-p", "Count to five.",
        "-n", "2", "--max-tokens", "12", "--temperature", "0", "--logprobs", "1", "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1]
    assert records[0]["messages"][-1]["content"] == "What is the capital of France?"
    for r in records:
        assert len(r["sequences"]) == 2
        seq = r["sequences"][0]
        assert len(seq["logprobs"]) == len(seq["tokens"]) and len(seq["top_logprobs"][0]) == 1
        assert "training_feature" not in seq
    assert "Paris" in records[0]["sequences"][0]["text"]


def test_sample_as_readable_text(tiny):
    out = run(
        "sample", "-e", "torch", "-m", tiny, "-p", "What is the capital of France?", "-p", "Count to five.",
        "-n", "2", "--max-tokens", "12", "--temperature", "0", "--format", "text", "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    blocks = out.stdout.strip().split("\n\n")
    assert len(blocks) == 2
    first = blocks[0].splitlines()
    assert first[0] == "[0] What is the capital of France?"
    assert first[1].startswith("  (1) ") and "Paris" in first[1] and "tokens]" in first[1]
    assert first[2].startswith("  (2) ")
    assert blocks[1].startswith("[1] Count to five.")
    bad = run("sample", "-e", "torch", "-m", tiny, "-p", "hi", "--format", "text", "--full")
    assert bad.returncode != 0 and "--full" in bad.stderr


def test_sample_reads_jsonl_from_stdin_and_config_file(tiny, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"sampler: torch\nmodel_id: {tiny}\nsampling_params:\n  max_tokens: 5\n  temperature: 0.0\n")
    lines = "\n".join(
        [
            json.dumps({"messages": [{"role": "user", "content": "Hello!"}]}),
            json.dumps({"prompt": "What does the cow say?"}),
            "plain text line",
        ]
    )
    outfile = tmp_path / "out.jsonl"
    out = run("sample", "--config", str(cfg), "--max-tokens", "3", "-o", str(outfile), "--full", stdin=lines)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in outfile.read_text().splitlines()]
    assert len(records) == 3
    # the flag overrides the config file
    assert all(len(r["sequences"][0]["tokens"]) <= 3 for r in records)
    assert "training_feature" in records[0]["sequences"][0]
    assert "it/s" in out.stderr or "seq/s" in out.stderr or "%" in out.stderr  # the progress bar


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sample", "-e", "vlm", "-p", "hi"], "Unknown sampler 'vlm'. Did you mean 'vllm'?"),
        (["sample", "-e", "torch", "-p", "hi", "--top-p", "3"], "SamplingParams.top_p=3.0 is invalid"),
        (["sample", "-e", "torch", "-m", "s3://bucket/model", "-p", "hi"], "s3://bucket/model"),
        (["sample", "-e", "torch", "-m", "/no/such/folder", "-p", "hi"], "/no/such/folder"),
    ],
)
def test_errors_are_one_clear_line_and_non_zero_exit(args, message):
    out = run(*args)
    assert out.returncode != 0
    err_lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(err_lines) == 1, out.stderr
    assert err_lines[0].startswith("twinkle: error: ") and message in err_lines[0]
    assert "Traceback" not in out.stderr


def test_no_inputs_is_a_usage_error(tiny):
    out = run("sample", "-e", "torch", "-m", tiny, stdin="")
    assert out.returncode == 2 and "No inputs" in out.stderr
