"""The ``twinkle`` command: list engines, sample from the command line, serve a model.

The group is here; each command is the module named for it (``engines``,
``sample``, ``serve``), and the sampling flags ``twinkle sample`` takes, one
per ``SamplingParams`` field, are made in ``options``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import click

from twinkle_core.cli.engines import engines
from twinkle_core.cli.options import sampling_options
from twinkle_core.cli.sample import sample
from twinkle_core.cli.serve import serve
from twinkle_core.cli.settings import Settings
from twinkle_core.errors import TwinkleError

__all__ = ["cli", "main", "sampling_options"]


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
@click.pass_context
def cli(ctx: click.Context, engine_logs: bool) -> None:
    """Sample from language models for RL post-training."""
    _set_up_logs(engine_logs)
    ctx.obj = Settings(starting_notice_s=STARTING_NOTICE_S)


cli.add_command(engines)
cli.add_command(sample)
cli.add_command(serve)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="twinkle")
