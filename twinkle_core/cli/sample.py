"""``twinkle sample``: sample completions for prompts, written as JSON lines or readable text."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, TextIO

import click

from twinkle_core.cli.engines import DEFAULT_ENGINE, start_engine
from twinkle_core.cli.options import params_from, with_sampling_options
from twinkle_core.cli.settings import Settings
from twinkle_core.data_format import InputFeature, Trajectory
from twinkle_core.factory import get_sampler_class, load_config

__all__ = ["sample"]


def _read_inputs(prompts: tuple[str, ...], input_file: TextIO | None, system: str | None) -> list[Any]:
    """The ``--prompt`` flags, then the lines of a JSONL file or stdin, in that order.

    A line is a JSON object with ``messages`` (a trajectory), ``input_ids``
    (an :class:`InputFeature`) or ``prompt`` (a user message), or plain text
    (a user message). ``--system`` goes before every user message given as
    text. Each input keeps its place: output record ``i`` answers input ``i``.
    """

    def chat(text: str) -> Trajectory:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return Trajectory(messages=messages)

    out: list[Any] = [chat(text) for text in prompts]
    if input_file is None:
        return out
    name = getattr(input_file, "name", "the input")
    for n, line in enumerate(input_file, 1):
        line = line.strip()
        if not line:
            continue
        if not line.startswith("{"):
            out.append(chat(line))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise click.UsageError(f"line {n} of {name} is not valid JSON: {exc}") from exc
        if "messages" in obj:
            out.append(Trajectory.from_dict(obj))
        elif "input_ids" in obj:
            out.append(InputFeature.from_dict(obj))
        elif "prompt" in obj:
            extra = sorted(set(obj) - {"prompt"})
            if extra:
                raise click.UsageError(
                    f"line {n} of {name}: unknown key(s) {extra} beside 'prompt' (a 'prompt' line holds only"
                    " the user message; use 'messages' for a whole conversation)."
                )
            if not isinstance(obj["prompt"], str):
                raise click.UsageError(
                    f"line {n} of {name}: 'prompt' is {obj['prompt']!r:.60}; expected the user message as a string."
                )
            out.append(chat(obj["prompt"]))
        else:
            raise click.UsageError(
                f"line {n} of {name}: a JSON line needs 'messages', 'input_ids' or 'prompt'; got keys {sorted(obj)}."
            )
    return out


def _finite(value: Any) -> Any:
    """``value`` with every infinite or NaN float replaced by ``None``: JSON has neither.

    A log-prob of ``-inf`` is an alternative masked out by top-k, top-p or
    min-p (probability zero); it is written as ``null``.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


@with_sampling_options
@click.command()
@click.option("--engine", "-e", default=None, help=f"Engine name (default: the config's, else {DEFAULT_ENGINE}).")
@click.option(
    "--model",
    "-m",
    "model_id",
    default=None,
    help="Model id: a folder, hf://, ms://, builtin:// (default: the built-in SmolLM2-135M-Instruct).",
)
@click.option("--prompt", "-p", "prompts", multiple=True, help="A user message to sample from (repeatable).")
@click.option(
    "--input",
    "-i",
    "input_file",
    type=click.File("r"),
    default=None,
    help="JSONL inputs ('-' for stdin): {messages}, {prompt}, {input_ids} or plain text lines.",
)
@click.option("--system", default=None, help="A system message put before each --prompt.")
@click.option(
    "--config",
    "-c",
    "config_path",
    default=None,
    help="YAML/JSON config: sampler, model_id, sampling_params, and engine options.",
)
@click.option(
    "--param",
    "-P",
    "param_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any SamplingParams field, VALUE as JSON (else a string), e.g. -P stop='[\"\\n\"]' (repeatable).",
)
@click.option("--adapter", default=None, help="A PEFT LoRA adapter folder to sample with.")
@click.option("--template", default=None, help="A registered chat template name (e.g. chatml).")
@click.option("--output", "-o", type=click.File("w"), default="-", help="Where to write JSONL (default stdout).")
@click.option(
    "--batch-size", type=int, default=16, show_default=True, help="Inputs per sample() call (progress granularity)."
)
@click.option("--full", is_flag=True, help="Also write token-level training features (JSONL only).")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "text"]),
    default="jsonl",
    show_default=True,
    help="jsonl: one JSON record per input; text: each prompt and its completions, for reading.",
)
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@click.pass_obj
def sample(
    settings: Settings,
    /,
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
    param_pairs: tuple[str, ...],
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
    params = params_from(params_cfg, param_pairs, param_flags)
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
    sampler = start_engine(engine_name, engine_cls, config, model_id, template, settings.starting_notice_s)
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
                # allow_nan=False: a non-finite number that slipped past _finite fails loudly
                output.write(json.dumps(_finite(record), allow_nan=False) + "\n")
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
