"""How the commands start an engine, and ``twinkle engines``: the engines found."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import click

from twinkle_core.factory import build_sampler, list_samplers

__all__ = ["DEFAULT_ENGINE", "engines", "start_engine"]

DEFAULT_ENGINE = "torch"


def start_engine(
    engine_name: str,
    engine_cls: Any,
    config: dict[str, Any],
    model_id: str | None,
    template: str | None,
    notice_after: float,
) -> Any:
    """The engine from a config mapping; the ``--model`` and ``--template`` flags win, the built-in model by default.

    An engine that takes more than ``notice_after`` seconds to start (vLLM's
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

    timer = threading.Timer(notice_after, notice)
    timer.daemon = True
    timer.start()
    try:
        sampler = build_sampler(engine_cls, **config)
    finally:
        timer.cancel()
    if said.is_set():
        click.echo(f"twinkle: the {engine_name} engine is ready ({time.monotonic() - started:.0f} s)", err=True)
    return sampler


@click.command()
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
