"""``twinkle serve``: a model behind the OpenAI API (vLLM's command line, where it makes sense)."""

from __future__ import annotations

import json
from typing import Any

import click

from twinkle_core.cli.engines import DEFAULT_ENGINE, start_engine
from twinkle_core.cli.settings import Settings
from twinkle_core.factory import get_sampler_class, load_config

__all__ = ["serve"]


@click.command()
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
    "--allowed-local-media-path",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="The folder requests' images may name local files in (file:// or a path); default: none.",
)
@click.option(
    "--allow-remote-media",
    is_flag=True,
    default=False,
    help="Fetch requests' http(s) image URLs (default: refused with a 400).",
)
@click.option(
    "--weight-transfer-config",
    "weight_transfer",
    default=None,
    metavar="JSON",
    help="Take weights from a trainer in another process over vLLM's weight-transfer routes,"
    """ e.g. '{"backend": "gloo"}'.""",
)
@click.pass_obj
def serve(
    settings: Settings,
    /,
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
    allowed_local_media_path: str | None,
    allow_remote_media: bool,
    weight_transfer: str | None,
) -> None:
    """Serve a model over the OpenAI API (needs: pip install "twinkle-core[server]")."""
    from twinkle_core.server import resolve_key
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
    resolve_key(host, api_key)
    transfer = _weight_transfer(weight_transfer)
    sampler = start_engine(engine_name, engine_cls, config, model_id, template, settings.starting_notice_s)
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
            allowed_local_media_path=allowed_local_media_path,
            allow_remote_media=allow_remote_media,
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
