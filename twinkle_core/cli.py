"""The ``twinkle`` command: list engines, sample from the command line."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import click

from twinkle_core.data_format import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import TwinkleError
from twinkle_core.factory import get_sampler_class, list_samplers, load_config

__all__ = ["main", "cli"]

DEFAULT_ENGINE = "torch"


class _Cli(click.Group):
    """Turns twinkle's own errors into one clear line and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TwinkleError as exc:
            click.echo(f"twinkle: error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="twinkle-core")
def cli() -> None:
    """Sample from language models for RL post-training."""


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def engines(as_json: bool) -> None:
    """List the sampler engines found (installed plugins and in-process ones)."""
    infos = list_samplers()
    rows = [
        {
            "name": i.name,
            "distribution": i.distribution or "-",
            "version": i.version or "-",
            "available": "yes" if i.available else "no",
            "error": i.error or "",
        }
        for i in infos
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    headers = ["name", "distribution", "version", "available", "error"]
    widths = {h: max([len(h)] + [len(r[h]) for r in rows]) for h in headers[:-1]}
    click.echo("  ".join(h.ljust(widths.get(h, 0)) for h in headers).rstrip())
    for r in rows:
        click.echo("  ".join(r[h].ljust(widths.get(h, 0)) for h in headers).rstrip())


def _read_inputs(prompts: tuple[str, ...], input_file: TextIO | None, system: str | None) -> list[Any]:
    """Prompts from flags, else from a JSONL file or stdin (one input per line).

    A line is a JSON object with ``messages`` (a trajectory), ``input_ids`` or
    ``prompt`` (a user message), or plain text (a user message).
    """
    lines: list[str] = list(prompts)
    raw: list[Any] = []
    if input_file is not None:
        for n, line in enumerate(input_file, 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise click.UsageError(f"line {n} of {input_file.name} is not valid JSON: {exc}") from exc
                raw.append(obj)
            else:
                lines.append(line)
    out: list[Any] = []
    for obj in raw:
        if "prompt" in obj and "messages" not in obj:
            lines.append(str(obj["prompt"]))
        elif "input_ids" in obj:
            out.append(InputFeature.from_dict(obj))
        else:
            out.append(Trajectory.from_dict(obj))
    for text in lines:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        out.append(Trajectory(messages=messages))
    return out


_PARAM_FLAGS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "logprobs_mode",
    "num_samples",
]


@cli.command()
@click.option("--engine", "-e", default=None, help=f"Engine name (default: the config's, else {DEFAULT_ENGINE}).")
@click.option("--model", "-m", "model_id", default=None, help="Model id: a folder, hf://, ms://, builtin:// (default: the built-in SmolLM2-135M-Instruct).")
@click.option("--prompt", "-p", "prompts", multiple=True, help="A user message to sample from (repeatable).")
@click.option("--input", "-i", "input_file", type=click.File("r"), default=None, help="JSONL inputs ('-' for stdin): {messages}, {prompt}, {input_ids} or plain text lines.")
@click.option("--system", default=None, help="A system message put before each --prompt.")
@click.option("--config", "-c", "config_path", default=None, help="YAML/JSON config: sampler, model_id, sampling_params, and engine options.")
@click.option("--max-tokens", type=int, default=None)
@click.option("--temperature", type=float, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--min-p", type=float, default=None)
@click.option("--repetition-penalty", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stop-token-ids", "stop_token_ids", type=int, multiple=True, help="Stop token id (repeatable).")
@click.option("--ignore-eos/--no-ignore-eos", default=None)
@click.option("--logprobs", type=int, default=None, help="0: sampled token's log-prob; k: also the top k.")
@click.option("--prompt-logprobs", type=int, default=None)
@click.option("--logprobs-mode", type=click.Choice(["processed", "raw"]), default=None)
@click.option("--num-samples", "-n", type=int, default=None, help="Completions per prompt.")
@click.option("--adapter", default=None, help="A PEFT LoRA adapter folder to sample with.")
@click.option("--template", default=None, help="A registered chat template name (e.g. chatml).")
@click.option("--output", "-o", type=click.File("w"), default="-", help="Where to write JSONL (default stdout).")
@click.option("--batch-size", type=int, default=16, show_default=True, help="Inputs per sample() call (progress granularity).")
@click.option("--full", is_flag=True, help="Also write token-level training features (JSONL only).")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "text"]), default="jsonl", show_default=True,
              help="jsonl: one JSON record per input; text: each prompt and its completions, for reading.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def sample(
    engine: str | None,
    model_id: str | None,
    prompts: tuple[str, ...],
    input_file: TextIO | None,
    system: str | None,
    config_path: str | None,
    adapter: str | None,
    template: str | None,
    output: TextIO,
    batch_size: int,
    full: bool,
    fmt: str,
    no_progress: bool,
    **param_flags: Any,
) -> None:
    """Sample completions and write one JSON line per input (or readable text with --format text)."""
    from tqdm import tqdm

    config: dict[str, Any] = load_config(config_path) if config_path else {}
    if not isinstance(config.get("sampling_params", {}) or {}, dict):
        raise click.UsageError("The config's sampling_params must be a mapping.")
    params_cfg = dict(config.pop("sampling_params", {}) or {})
    engine_name = engine or config.pop("sampler", None) or config.pop("engine", None) or DEFAULT_ENGINE
    config.pop("sampler", None)
    config.pop("engine", None)
    for key, value in param_flags.items():
        if value is None or value == ():
            continue
        params_cfg[key] = list(value) if isinstance(value, tuple) else value
    params = SamplingParams.from_dict(params_cfg)
    engine_cls = get_sampler_class(engine_name)  # fail fast, before any model is fetched
    if input_file is None and not prompts and not sys.stdin.isatty():
        input_file = sys.stdin
    inputs = _read_inputs(prompts, input_file, system)
    if not inputs:
        raise click.UsageError("No inputs: give --prompt, --input FILE, or JSONL on stdin.")
    if batch_size < 1:
        raise click.BadParameter(f"{batch_size} (expected >= 1)", param_hint="--batch-size")
    if full and fmt != "jsonl":
        raise click.UsageError("--full writes token-level features, which only --format jsonl carries.")
    if model_id is not None:
        config["model_id"] = model_id
    elif "model_id" not in config:
        from twinkle_core.hub import DEFAULT_MODEL

        config["model_id"] = DEFAULT_MODEL
    if template is not None:
        config["template"] = template
    sampler = engine_cls(**config)
    with sampler:
        adapter_name = ""
        if adapter:
            adapter_name = "cli"
            sampler.add_adapter_to_model(adapter_name, adapter)
        bar = tqdm(total=len(inputs) * params.num_samples, unit="seq", disable=no_progress or None, file=sys.stderr)
        index = 0
        for start in range(0, len(inputs), batch_size):
            chunk = inputs[start : start + batch_size]
            for item, resp in zip(chunk, sampler.sample(chunk, params, adapter_name)):
                if fmt == "text":
                    output.write(_as_text(index, item, resp))
                    output.flush()
                    index += 1
                    continue
                record: dict[str, Any] = {"index": index}
                if isinstance(item, Trajectory):
                    record["messages"] = [m.to_hf() for m in item.messages]
                record.update(resp.to_dict())
                if not full:
                    for seq in record["sequences"]:
                        seq.pop("training_feature", None)
                output.write(json.dumps(record) + "\n")
                output.flush()
                index += 1
            bar.update(len(chunk) * params.num_samples)
        bar.close()


def _as_text(index: int, item: Any, resp: Any) -> str:
    """One input and its completions, for a human reader."""
    if isinstance(item, Trajectory):
        prompt = item.messages[-1].content if item.messages else ""
        prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
    else:
        prompt = f"<{len(item.input_ids)} prompt tokens>"
    lines = [f"[{index}] {prompt}"]
    many = len(resp.sequences) > 1
    for k, seq in enumerate(resp.sequences):
        head = f"  ({k + 1}) " if many else "  "
        indent = " " * len(head)
        body = "\n".join(indent + line if line.strip() else "" for line in seq.text.strip().split("\n")).lstrip()
        lines.append(f"{head}{body}  [{seq.stop_reason}, {len(seq.tokens)} tokens]")
    return "\n".join(lines) + "\n\n"


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="twinkle")


if __name__ == "__main__":  # pragma: no cover
    main()
