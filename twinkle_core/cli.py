"""The ``twinkle`` command: list engines, sample from the command line."""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import sys
import threading
import time
import types
import typing
from typing import Any, TextIO

import attrs
import click

from twinkle_core.data_format import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import TwinkleError
from twinkle_core.factory import build_sampler, get_sampler_class, list_samplers, load_config

__all__ = ["cli", "main", "sampling_options"]

DEFAULT_ENGINE = "torch"


class _Cli(click.Group):
    """Turns twinkle's own errors into one clear line and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TwinkleError as exc:
            click.echo(f"twinkle: error: {exc}", err=True)
            sys.exit(1)


#: An engine that takes longer than this to start gets a line saying it is starting (seconds).
STARTING_NOTICE_S = 3.0
#: Set to 1 (or pass ``twinkle --engine-logs``) to see the engines' own INFO logs.
ENGINE_LOGS_ENV = "TWINKLE_ENGINE_LOGS"


def _build_sampler(
    engine_name: str, engine_cls: Any, config: dict[str, Any], model_id: str | None, template: str | None
) -> Any:
    """The engine from a config mapping; the ``--model`` and ``--template`` flags win, the built-in model by default.

    An engine that takes more than :data:`STARTING_NOTICE_S` to start (vLLM's
    start is tens of seconds, with its own logs quiet) gets a line on stderr
    saying so, and another when it is ready.
    """
    if model_id is not None:
        config["model_id"] = model_id
    elif "model_id" not in config:
        from twinkle_core.hub import DEFAULT_MODEL

        config["model_id"] = DEFAULT_MODEL
    if template is not None:
        config["template"] = template
    started = time.monotonic()
    said = threading.Event()

    def notice() -> None:
        said.set()
        click.echo(f"twinkle: starting the {engine_name} engine with {config['model_id']} ...", err=True)

    timer = threading.Timer(STARTING_NOTICE_S, notice)
    timer.daemon = True
    timer.start()
    try:
        sampler = build_sampler(engine_cls, **config)
    finally:
        timer.cancel()
    if said.is_set():
        click.echo(f"twinkle: the {engine_name} engine is ready ({time.monotonic() - started:.0f} s)", err=True)
    return sampler


class _EchoHandler(logging.Handler):
    """twinkle's own log lines on the current stderr, as ``twinkle: <message>``."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"twinkle: {self.format(record)}", err=True)


def _set_up_logs(engine_logs: bool) -> None:
    """twinkle's INFO lines shown; the engines' own INFO logs quiet unless asked for.

    vLLM reads ``VLLM_LOGGING_LEVEL`` when it is imported, in this process and
    in the engine processes it spawns (which inherit the environment), so it
    is set before any engine is chosen. A value the user set is kept. Its
    logs go to stderr: stdout carries the samples (``twinkle sample > out.jsonl``).
    """
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not engine_logs:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    root = logging.getLogger("twinkle")
    if not any(isinstance(h, _EchoHandler) for h in root.handlers):
        root.addHandler(_EchoHandler())
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="twinkle-core")
@click.option(
    "--engine-logs",
    is_flag=True,
    envvar=ENGINE_LOGS_ENV,
    help=f"Show the engines' own INFO logs (vLLM's are quiet by default; also {ENGINE_LOGS_ENV}=1,"
    " or VLLM_LOGGING_LEVEL=INFO).",
)
def cli(engine_logs: bool) -> None:
    """Sample from language models for RL post-training."""
    _set_up_logs(engine_logs)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--import",
    "do_import",
    is_flag=True,
    help="Import each engine to check it (slow: vLLM takes seconds). Without it no engine is imported.",
)
def engines(as_json: bool, do_import: bool) -> None:
    """List the sampler engines found (installed plugins and in-process ones).

    The column after the version says what was checked: "installed" (the
    engine's module and the modules it declares it needs are on the import
    path; nothing is imported) or, with --import, "imports".
    """
    check = "imports" if do_import else "installed"
    rows = [
        {
            "name": i.name,
            "distribution": i.distribution or "-",
            "version": i.version or "-",
            "available": "yes" if i.available else "no",
            "checked": "imported" if i.imported else "installed",
            "error": i.error or "",
        }
        for i in list_samplers(load=do_import)
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    headers = {"name": "name", "distribution": "distribution", "version": "version", "available": check}
    widths = {k: max([len(h)] + [len(r[k]) for r in rows]) for k, h in headers.items()}
    click.echo("  ".join([*(h.ljust(widths[k]) for k, h in headers.items()), "error"]).rstrip())
    for r in rows:
        click.echo("  ".join([*(r[k].ljust(widths[k]) for k in headers), r["error"]]).rstrip())


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


def _field_docs(cls: type) -> dict[str, str]:
    """``field -> first sentence`` of its entry in the class docstring's ``Attributes:`` section."""
    docs: dict[str, str] = {}
    text = inspect.getdoc(cls) or ""
    body = text.split("Attributes:", 1)[1] if "Attributes:" in text else ""
    current: str | None = None
    for line in body.splitlines():
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            current = m.group(1)
            docs[current] = m.group(2)
        elif current and line.startswith("        "):
            docs[current] += " " + line.strip()
        elif line.strip():
            current = None
    first = {k: v.replace("``", "").split(". ")[0].rstrip(".") for k, v in docs.items()}
    return {k: v[:1].upper() + v[1:] for k, v in first.items()}


def _click_type(hint: Any) -> tuple[click.ParamType[Any, Any] | None, bool]:
    """The click type of one ``SamplingParams`` field and whether the option repeats.

    ``None`` means a flag (a ``bool``). Types not handled here take a JSON value.
    """
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _click_type(args[0])  # Optional[X]: an unset option already means "the default"
    if hint is bool:
        return None, False
    if hint in (int, float, str):
        scalar: dict[Any, click.ParamType[Any, Any]] = {int: click.INT, float: click.FLOAT, str: click.STRING}
        return scalar[hint], False
    if typing.get_origin(hint) is typing.Literal:
        return click.Choice([str(a) for a in typing.get_args(hint)]), False
    if typing.get_origin(hint) in (tuple, list) and args and args[0] in (int, float, str):
        return _click_type(args[0])[0], True
    return _JSON, False


class _JsonValue(click.ParamType):  # type: ignore[type-arg]  # generic only in newer clicks: no [] at run time
    """A value parsed as JSON, or taken as a plain string when it is not JSON."""

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return _json_or_text(value) if isinstance(value, str) else value


_JSON = _JsonValue()


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


#: Extra spellings of some sampling options (kept from earlier releases).
_SHORT_FLAGS = {"num_samples": ["-n"]}
#: Option names taken by ``twinkle sample`` itself: a field so named is set with --param.
_RESERVED = {
    "engine",
    "model",
    "prompt",
    "input",
    "system",
    "config",
    "adapter",
    "template",
    "output",
    "batch_size",
    "full",
    "format",
    "no_progress",
    "param",
    "help",
}
_FIELD_DEST = "sp_"


def sampling_options(params_cls: type = SamplingParams) -> list[click.Option]:
    """One option per field of ``params_cls`` (an attrs class), typed from the field.

    This is where ``twinkle sample`` gets its sampling flags: a field added to
    ``SamplingParams`` becomes an option with no change here. Each option's
    value lands under ``"sp_<field>"``; unset options are ``None``.
    """
    hints = typing.get_type_hints(params_cls)
    docs = _field_docs(params_cls)
    options = []
    for field in attrs.fields(params_cls):
        if field.name in _RESERVED or field.name.startswith("_"):
            continue
        flag = "--" + field.name.replace("_", "-")
        ptype, multiple = _click_type(hints.get(field.name, Any))
        help_text = docs.get(field.name, f"SamplingParams.{field.name}") + (" (repeatable)." if multiple else ".")
        decls = [flag, *_SHORT_FLAGS.get(field.name, []), _FIELD_DEST + field.name]
        if ptype is None:
            decls[0] = f"{flag}/--no-{flag[2:]}"
            options.append(click.Option(decls, default=None, help=help_text))
        else:
            options.append(click.Option(decls, type=ptype, multiple=multiple, default=None, help=help_text))
    return options


def _with_sampling_options(command: click.Command) -> click.Command:
    """Add the generated ``SamplingParams`` options to ``command`` (after its own)."""
    command.params.extend(sampling_options())
    return command


def _params_from(config_params: dict[str, Any], pairs: tuple[str, ...], flags: dict[str, Any]) -> SamplingParams:
    """Merge the config file's ``sampling_params``, ``--param`` pairs and the flags (later wins)."""
    aliases = SamplingParams._aliases  # n, max_new_tokens: each layer names a field its own way
    merged: dict[str, Any] = {}
    for key, value in config_params.items():
        canonical = aliases.get(key, key)
        if canonical in merged:
            raise click.UsageError(f"The config's sampling_params set {canonical} twice (as {key} and its alias).")
        merged[canonical] = value
    from_pairs: dict[str, str] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} (expected KEY=VALUE, e.g. top_p=0.9)", param_hint="--param")
        key = aliases.get(key, key)
        if key in from_pairs:
            raise click.BadParameter(f"{key!r} given twice ({from_pairs[key]!r} and {pair!r})", param_hint="--param")
        from_pairs[key] = pair
        merged[key] = _json_or_text(text)
    for dest, value in flags.items():
        if value is None or value == ():
            continue
        key = dest[len(_FIELD_DEST) :]
        if key in from_pairs:
            flag = "--" + key.replace("_", "-")
            raise click.UsageError(f"{key} is set twice: by {flag} and by --param {from_pairs[key]}.")
        merged[key] = list(value) if isinstance(value, tuple) else value
    # unknown keys get SamplingParams' own error: the did-you-mean and the accepted keys
    return SamplingParams.from_dict(merged)


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


@_with_sampling_options
@cli.command()
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
    params = _params_from(params_cfg, param_pairs, param_flags)
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
    sampler = _build_sampler(engine_name, engine_cls, config, model_id, template)
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


@cli.command()
@click.argument("model_arg", metavar="[MODEL]", required=False)
@click.option("--engine", "-e", default=None, help=f"Engine name (default: the config's, else {DEFAULT_ENGINE}).")
@click.option(
    "--model",
    "-m",
    "model_id",
    default=None,
    help="Model id: a folder, hf://, ms://, builtin:// (default: the built-in SmolLM2-135M-Instruct);"
    " also accepted as the first argument, as `vllm serve MODEL` takes it.",
)
@click.option(
    "--config", "-c", "config_path", default=None, help="YAML/JSON config: sampler, model_id and engine options."
)
@click.option("--template", default=None, help="A registered chat template name (e.g. chatml).")
@click.option(
    "--adapter",
    "adapters",
    multiple=True,
    metavar="NAME=DIR",
    help="A PEFT LoRA adapter folder, served as model NAME (repeatable).",
)
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind; anything but loopback needs an API key."
)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
@click.option(
    "--api-key",
    default=None,
    envvar="TWINKLE_API_KEY",
    help="Required as 'Authorization: Bearer KEY' (env TWINKLE_API_KEY).",
)
@click.option(
    "--served-model-name",
    "--model-name",
    "model_name",
    default=None,
    help="The name the base model is listed under (default: the model id; 'base' always works).",
)
@click.option(
    "--lora-modules",
    "lora_modules",
    multiple=True,
    metavar="NAME=DIR",
    help="vLLM's spelling of --adapter: NAME=DIR or a JSON object with 'name' and 'path' (repeatable).",
)
@click.option(
    "--enable-lora",
    is_flag=True,
    help="Accepted for vLLM command lines: twinkle engines always take adapters at run time.",
)
@click.option("--max-model-len", type=int, default=None, help="The engine's context window (engine option).")
@click.option("--dtype", default=None, help="Weights dtype: auto, float32, bfloat16, float16 (engine option).")
@click.option(
    "--tensor-parallel-size",
    "-tp",
    type=click.IntRange(min=1),
    default=None,
    help="Devices per engine (a DeviceMesh tp_size; the vllm engine).",
)
@click.option(
    "--tool-parser",
    default="hermes",
    show_default=True,
    help="How tool calls are read from completions (a registered parser).",
)
@click.option(
    "--on-template-mismatch",
    type=click.Choice(["raise", "keep_sampled"]),
    default="raise",
    show_default=True,
    help="What a session does when the chat template is not prefix-preserving.",
)
@click.option(
    "--max-tokens",
    "default_max_tokens",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="max_tokens when a request gives none.",
)
@click.option(
    "--max-logprobs",
    default=20,
    show_default=True,
    type=click.IntRange(min=0),
    help="The most log-prob alternatives a request may ask for per position.",
)
@click.option(
    "--max-body-mib",
    default=32,
    show_default=True,
    type=click.IntRange(min=1),
    help="The largest request body, in MiB (413 past it, checked while the body is read).",
)
@click.option(
    "--max-pending-requests",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="The most sampling calls held at once, running or waiting; one more gets 503 with Retry-After.",
)
@click.option(
    "--max-stored-responses",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="The most /v1/responses replies kept for previous_response_id; the oldest is evicted first.",
)
@click.option(
    "--request-timeout",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds after which a sampling call is aborted; its reply holds what was sampled by then (default: none).",
)
@click.option(
    "--weight-transfer-config",
    "weight_transfer",
    default=None,
    metavar="JSON",
    help="Take weights from a trainer in another process over vLLM's weight-transfer routes,"
    """ e.g. '{"backend": "gloo"}'.""",
)
def serve(
    model_arg: str | None,
    engine: str | None,
    model_id: str | None,
    config_path: str | None,
    template: str | None,
    adapters: tuple[str, ...],
    host: str,
    port: int,
    api_key: str | None,
    model_name: str | None,
    lora_modules: tuple[str, ...],
    enable_lora: bool,
    max_model_len: int | None,
    dtype: str | None,
    tensor_parallel_size: int | None,
    tool_parser: str,
    on_template_mismatch: str,
    default_max_tokens: int,
    max_logprobs: int,
    max_body_mib: int,
    max_pending_requests: int,
    max_stored_responses: int,
    request_timeout: float | None,
    weight_transfer: str | None,
) -> None:
    """Serve a model over the OpenAI API (needs: pip install "twinkle-core[server]")."""
    from twinkle_core.server import _resolve_key
    from twinkle_core.server import serve as run_server
    from twinkle_core.tools import get_tool_parser

    config: dict[str, Any] = load_config(config_path) if config_path else {}
    engine_name = engine or config.pop("sampler", None) or config.pop("engine", None) or DEFAULT_ENGINE
    config.pop("sampler", None)
    config.pop("engine", None)
    config.pop("sampling_params", None)
    if model_arg is not None and model_id is not None and model_arg != model_id:
        raise click.UsageError(f"The model is given twice: {model_arg!r} and --model {model_id!r}.")
    model_id = model_id or model_arg
    pairs = [_adapter_pair(item, "--adapter") for item in adapters]
    pairs += [_adapter_pair(item, "--lora-modules") for item in lora_modules]
    for key, value in (("max_model_len", max_model_len), ("dtype", dtype)):
        if value is not None:
            config[key] = value
    if tensor_parallel_size is not None and tensor_parallel_size > 1:
        from twinkle_core.mesh import DeviceMesh

        config["device_mesh"] = DeviceMesh.from_sizes(tp_size=tensor_parallel_size)
    # Fail fast, before any model is loaded: the engine, the parser and the key.
    engine_cls = get_sampler_class(engine_name)
    get_tool_parser(tool_parser)
    _resolve_key(host, api_key)
    transfer = _weight_transfer(weight_transfer)
    sampler = _build_sampler(engine_name, engine_cls, config, model_id, template)
    with sampler:
        for name, folder in pairs:
            sampler.add_adapter_to_model(name, folder)
        run_server(
            sampler,
            host,
            port,
            api_key=api_key,
            model_name=model_name or str(config["model_id"]),
            tool_parser=tool_parser,
            on_template_mismatch=on_template_mismatch,
            default_max_tokens=default_max_tokens,
            max_logprobs=max_logprobs,
            weight_transfer=transfer,
            max_body_bytes=max_body_mib * 2**20,
            max_pending_requests=max_pending_requests,
            request_timeout=request_timeout,
            max_stored_responses=max_stored_responses,
        )


def _weight_transfer(raw: str | None) -> dict[str, Any] | None:
    """``--weight-transfer-config``: a JSON object, checked before any model loads."""
    if raw is None:
        return None
    from twinkle_core.errors import ConfigError
    from twinkle_core.server.weights import check_config

    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise click.BadParameter(f"{raw!r} is not JSON: {exc}", param_hint="--weight-transfer-config") from exc
    try:
        return check_config(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--weight-transfer-config") from exc


def _adapter_pair(item: str, option: str) -> tuple[str, str]:
    """``NAME=DIR``, or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    if item.lstrip().startswith("{"):
        try:
            spec = json.loads(item)
        except ValueError:
            spec = None
        if isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("path"), str):
            return spec["name"], spec["path"]
        raise click.BadParameter(f"{item!r} (expected a JSON object with 'name' and 'path')", param_hint=option)
    name, sep, folder = item.partition("=")
    if not sep or not name or not folder:
        raise click.BadParameter(f"{item!r} (expected NAME=DIR)", param_hint=option)
    return name, folder


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
