"""The ``twinkle`` command, run as a user runs it: a subprocess of the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Literal

import attrs
import click
import pytest

from twinkle_core import SamplingParams
from twinkle_core.cli import sampling_options
from twinkle_core.testing import build_tiny_model

TWINKLE = shutil.which("twinkle", path=str(Path(sys.executable).parent)) or "twinkle"


def run(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([TWINKLE, *args], input=stdin, capture_output=True, text=True, timeout=300, env=full_env)


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(build_tiny_model("llama"))


def test_engines_table_lists_first_party_engines():
    out = run("engines")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # the column says what was checked: installed, not imported
    assert lines[0].split() == ["name", "distribution", "version", "installed", "error"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["torch"][1:4] == ["twinkle-torch", "0.1.0", "yes"]
    js = json.loads(run("engines", "--json").stdout)
    torch_row = {"name": "torch", "distribution": "twinkle-torch", "version": "0.1.0", "available": "yes"}
    assert {**torch_row, "checked": "installed", "error": ""} in js


def test_engines_imports_no_engine():
    code = textwrap.dedent(
        """
        import json, sys
        from twinkle_core.cli import cli
        cli(["engines"], standalone_mode=False)
        heavy = ("torch", "vllm", "transformers")
        engines = ("twinkle_torch.sampler", "twinkle_vllm.sampler")
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy or m.startswith(engines))))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "torch " in proc.stdout and "vllm " in proc.stdout  # both were listed
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_engines_import_checks_by_importing():
    out = run("engines", "--import", "--json", env={"TWINKLE_PLUGINS": "torch"})
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["name"] == "torch" and row["available"] == "yes" and row["checked"] == "imported"
    assert run("engines", "--import", env={"TWINKLE_PLUGINS": "torch"}).stdout.split()[3] == "imports"


def test_every_sampling_params_field_is_an_option():
    help_text = run("sample", "--help").stdout
    for field in attrs.fields(SamplingParams):
        assert f"--{field.name.replace('_', '-')}" in help_text, field.name
    assert "--param" in help_text


def test_a_new_sampling_params_field_becomes_an_option_with_its_type():
    @attrs.frozen(kw_only=True)
    class Extended(SamplingParams):
        """More knobs.

        Attributes:
            frequency_penalty: penalise tokens by how often they appeared.
            bad_words: words never to generate.
            mode: one of two modes.
            extra: anything else.
        """

        frequency_penalty: float = 0.0
        bad_words: tuple[str, ...] = ()
        mode: Literal["a", "b"] = "a"
        extra: dict[str, int] = attrs.field(factory=dict)

    options = {o.name: o for o in sampling_options(Extended)}
    freq = options["sp_frequency_penalty"]
    assert freq.opts == ["--frequency-penalty"] and freq.type is click.FLOAT and not freq.multiple
    assert freq.help == "Penalise tokens by how often they appeared."
    assert options["sp_bad_words"].multiple and options["sp_bad_words"].type is click.STRING
    assert isinstance(options["sp_mode"].type, click.Choice) and list(options["sp_mode"].type.choices) == ["a", "b"]
    assert options["sp_extra"].type.convert('{"x": 1}', None, None) == {"x": 1}
    assert options["sp_num_samples"].opts == ["--num-samples", "-n"]
    assert options["sp_ignore_eos"].secondary_opts == ["--no-ignore-eos"]


def test_sample_prompts_flags_to_jsonl(tiny):
    out = run(
        "sample",
        "-e",
        "torch",
        "-m",
        tiny,
        "-p",
        "What is the capital of France?",
        "-p",
        "Count to five.",
        "-n",
        "2",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--logprobs",
        "1",
        "--no-progress",
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


def test_token_constraints_and_bias_from_flags(tiny):
    out = run(
        "sample", "-e", "torch", "-m", tiny, "-p", "Count to five.", "--max-tokens", "6", "--temperature", "0",
        "--allowed-token-ids", "5", "--allowed-token-ids", "6", "--allowed-token-ids", "7",
        "--logit-bias", '{"7": 100}', "--min-tokens", "6", "--no-progress",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (record,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert record["sequences"][0]["tokens"] == [7] * 6


def test_sample_as_readable_text(tiny):
    out = run(
        "sample",
        "-e",
        "torch",
        "-m",
        tiny,
        "-p",
        "What is the capital of France?",
        "-p",
        "Count to five.",
        "-n",
        "2",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--format",
        "text",
        "--no-progress",
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


def test_later_layers_win_whichever_name_they_use(tiny, tmp_path):
    """Config, then --param, then flags: an alias (max_new_tokens, n) in one layer is the same field as the
    canonical name in another, not a clash."""
    cfg = tmp_path / "alias.yaml"
    cfg.write_text(f"sampler: torch\nmodel_id: {tiny}\nsampling_params:\n  max_new_tokens: 5\n  n: 3\n")
    out = run("sample", "-c", str(cfg), "-p", "hi", "-P", "num_samples=2", "--max-tokens", "2", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    [record] = [json.loads(line) for line in out.stdout.splitlines()]
    assert [len(q["tokens"]) for q in record["sequences"]] == [2, 2]
    cfg.write_text(f"sampler: torch\nmodel_id: {tiny}\nsampling_params:\n  max_new_tokens: 5\n  max_tokens: 4\n")
    out = run("sample", "-c", str(cfg), "-p", "hi")
    assert out.returncode == 2 and "set max_tokens twice" in out.stderr


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["sample", "-e", "torch", "-m", "TINY"], '{"prompt": null}', "'prompt' is None; expected the user message"),
        (["sample", "-e", "torch", "-m", "TINY", "--max-batch-token", "9"], "", "No such option"),
        (["serve", "TINY", "--port", "99999"], "", "99999 is not in the range 0<=x<=65535"),
        (["serve", "TINY", "--max-tokens", "-5"], "", "-5 is not in the range x>=1"),
    ],
)
def test_bad_command_lines_are_refused_before_any_work(tiny, args, stdin, message):
    out = run(*[tiny if a == "TINY" else a for a in args], stdin=stdin)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_an_engine_option_from_a_config_that_nothing_takes_is_one_clear_line(tiny, tmp_path):
    cfg = tmp_path / "typo.yaml"
    cfg.write_text(f"sampler: torch\nmodel_id: {tiny}\nmax_batch_token: 100\n")
    out = run("sample", "-c", str(cfg), "-p", "hi")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "max_batch_token=100 is unknown" in out.stderr and "Did you mean 'max_batch_tokens'" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sample", "-e", "vlm", "-p", "hi"], "Unknown sampler 'vlm'. Did you mean 'vllm'?"),
        (["sample", "-e", "torch", "-p", "hi", "--top-p", "3"], "SamplingParams.top_p=3.0 is invalid"),
        (["sample", "-e", "torch", "-m", "s3://bucket/model", "-p", "hi"], "s3://bucket/model"),
        (["sample", "-e", "torch", "-m", "/no/such/folder", "-p", "hi"], "/no/such/folder"),
        (["sample", "-e", "torch", "-p", "hi", "--param", "tmperature=0.5"], "Did you mean 'temperature'?"),
        (["sample", "-e", "torch", "-p", "hi", "-P", "top_k=0"], "SamplingParams.top_k=0 is invalid"),
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


def _strict(line: str) -> dict:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


MIXED = [
    {"prompt": "What is the capital of France?"},
    {"messages": [{"role": "user", "content": "Count to five."}]},
    {"input_ids": [1, 2, 3, 4]},
    "a plain text line",
    {"prompt": "Hello!"},
]


@pytest.fixture(scope="module")
def mixed_run(tiny, tmp_path_factory):
    """One run over a JSONL file mixing every kind of input line, top-k 2 with 3 alternatives."""
    infile = tmp_path_factory.mktemp("mixed") / "in.jsonl"
    infile.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in MIXED) + "\n")
    out = run(
        "sample",
        "-e",
        "torch",
        "-m",
        tiny,
        "-i",
        str(infile),
        "--top-k",
        "2",
        "--logprobs",
        "3",
        "--seed",
        "0",
        "-P",
        "max_tokens=4",
        "--param",
        "ignore_eos=true",
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_output_order_is_input_order(mixed_run):
    records = [_strict(line) for line in mixed_run.splitlines()]
    assert [r["index"] for r in records] == list(range(len(MIXED)))
    texts = ["What is the capital of France?", "Count to five.", None, "a plain text line", "Hello!"]
    for record, text in zip(records, texts):
        if text is None:
            assert "messages" not in record and record["prompt_token_ids"] == [1, 2, 3, 4]
        else:
            assert record["messages"][-1] == {"role": "user", "content": text}
    # the --param values were parsed as JSON: 4 tokens, EOS ignored
    assert all(len(r["sequences"][0]["tokens"]) == 4 for r in records)


def test_masked_alternatives_are_null_and_the_output_is_strict_json(mixed_run):
    assert "Infinity" not in mixed_run and "NaN" not in mixed_run
    for record in map(_strict, mixed_run.splitlines()):
        seq = record["sequences"][0]
        assert all(isinstance(lp, float) for lp in seq["logprobs"])
        for top in seq["top_logprobs"]:
            # top-k 2: two alternatives have a probability, the third is masked out
            assert [lp is None for _, lp in top] == [False, False, True]


def test_a_slow_engine_start_is_announced_and_engine_logs_are_quiet_unless_asked(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from twinkle_core import cli as cli_module

    monkeypatch.setattr(cli_module, "STARTING_NOTICE_S", 0.0)  # every start counts as slow here
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "unset")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    monkeypatch.delenv(cli_module.ENGINE_LOGS_ENV, raising=False)
    args = ["sample", "-e", "torch", "-m", tiny, "-p", "hi", "--max-tokens", "2", "--no-progress"]
    done = CliRunner().invoke(cli_module.cli, args)
    assert done.exit_code == 0, done.output
    assert f"twinkle: starting the torch engine with {tiny} ..." in done.stderr
    assert "twinkle: the torch engine is ready" in done.stderr
    # vLLM reads this when it is imported, here and in the engine processes it spawns
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    done = CliRunner().invoke(cli_module.cli, ["--engine-logs", *args])
    assert done.exit_code == 0 and "VLLM_LOGGING_LEVEL" not in os.environ
