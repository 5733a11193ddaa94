"""Suite-wide: every skipped test named where the run ends, and the docs' code blocks run as tests.

Skipped tests, with their reasons: pytest's own short summary (``-ra``) folds skips that share a location into
one line, so a shared suite skipped on one engine reads like any other skip.
A skip that hides a regression should be visible where the run ends: this
section lists each skipped test by id, just above pytest's closing lines.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "nodeid", "")]
    if not skipped:
        return
    terminalreporter.write_sep("=", f"skipped tests ({len(skipped)}), and why")
    for report in sorted(skipped, key=lambda r: r.nodeid):
        reason = ""
        if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        terminalreporter.write_line(f"SKIPPED {report.nodeid}: {reason}")


# ---------------------------------------------------------------------------------------------------------------
# Executable docs: every ```python and ```bash block of the README, docs/*.md and the example READMEs runs here,
# through Sybil (its Markdown lexers, its Python evaluator, its skip mechanism), one document at a time: the blocks
# of a page share one namespace and one working folder, in page order, as a reader running them one after another.
#
# A block that is not run says so to the reader, on a line of its own just above it:
#     *Not run by the docs tests: <reason>.*
#     *Run only in the docs tests' long set (TWINKLE_DOCS_LONG=1): <reason>.*
# The second kind runs when TWINKLE_DOCS_LONG=1 is set:
#     TWINKLE_DOCS_LONG=1 pytest README.md docs examples/grpo/README.md examples/twinkle_echo/README.md


ROOT = Path(__file__).resolve().parent
#: Set to 1 to run the blocks marked as the long set too.
DOCS_LONG_ENV = "TWINKLE_DOCS_LONG"
#: What a reader running the docs from a clone has at hand: these folders of the repository.
_CLONE_FOLDERS = ("examples", "bench")
_NOT_RUN = re.compile(r"^\*Not run by the docs tests: (?P<reason>[^*\n]+?)\.\*[ \t]*$", re.MULTILINE)
_LONG = re.compile(
    rf"^\*Run only in the docs tests' long set \({DOCS_LONG_ENV}=1\): (?P<reason>[^*\n]+?)\.\*[ \t]*$", re.MULTILINE
)


class _VisibleSkipParser:
    """The visible note above a block, read as Sybil's ``skip: next`` (the reason is what the reader sees)."""

    def __init__(self) -> None:
        self.skipper = Skipper("skip")

    def __call__(self, document: Document) -> Iterable[Region]:
        for match in _NOT_RUN.finditer(document.text):
            yield Region(match.start(), match.end(), ("next", repr(match["reason"])), self.skipper)
        for match in _LONG.finditer(document.text):
            reason = repr(f"long set ({DOCS_LONG_ENV}=1): {match['reason']}")
            yield Region(match.start(), match.end(), ("next", f"if(not _DOCS_LONG, reason={reason})"), self.skipper)


def _run_shell(example: Example) -> None:
    """A ``bash`` block, run by bash in the page's working folder; a failing command fails the block."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", example.parsed],
        cwd=example.namespace["_DOCS_CWD"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"the block exited with status {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n"
            f"--- stderr\n{done.stderr[-4000:]}"
        )


def _setup_page(namespace: dict[str, Any]) -> None:
    """A fresh working folder per page (with the clone's example folders beside it), entered."""
    cwd = Path(tempfile.mkdtemp(prefix="twinkle-docs-"))
    for name in _CLONE_FOLDERS:
        (cwd / name).symlink_to(ROOT / name, target_is_directory=True)
    namespace.update(_DOCS_CWD=cwd, _DOCS_OLD_CWD=os.getcwd(), _DOCS_LONG=os.environ.get(DOCS_LONG_ENV) == "1")
    os.chdir(cwd)


def _teardown_page(namespace: dict[str, Any]) -> None:
    """Close what the page left open (samplers, servers, Ray), leave and remove its folder."""
    from twinkle_core.sampler import Sampler

    for value in list(namespace.values()):
        stop = getattr(value, "close" if isinstance(value, Sampler) else "stop", None)
        if stop is not None and (isinstance(value, Sampler) or type(value).__name__ == "RunningServer"):
            try:
                stop()
            except Exception:
                pass
    if "ray" in sys.modules:
        import twinkle_core

        twinkle_core.shutdown()
    os.chdir(namespace["_DOCS_OLD_CWD"])
    shutil.rmtree(namespace["_DOCS_CWD"], ignore_errors=True)


def _setup_echo_page(namespace: dict[str, Any]) -> None:
    """The echo example's README, after its first block (``pip install examples/twinkle_echo``, not run here).

    What that install gives a reader, ``"echo"`` found by name, is registered in
    process from the sources, as ``examples/twinkle_echo/tests/conftest.py`` does.
    """
    from twinkle_core import list_samplers, register_sampler

    namespace["_DOCS_ECHO_REGISTERED"] = "echo" not in [i.name for i in list_samplers()]
    if namespace["_DOCS_ECHO_REGISTERED"]:
        sys.path.insert(0, str(ROOT / "examples" / "twinkle_echo"))
        register_sampler("echo", "twinkle_echo.engine:EchoEngine")
    _setup_page(namespace)


def _teardown_echo_page(namespace: dict[str, Any]) -> None:
    _teardown_page(namespace)
    if namespace["_DOCS_ECHO_REGISTERED"]:
        from twinkle_core.plugins.engines import sampler_registry

        sampler_registry.unregister("echo")
        sys.path.remove(str(ROOT / "examples" / "twinkle_echo"))


def _docs(patterns: list[str], excludes: list[str], setup: Any, teardown: Any) -> Sybil:
    return Sybil(
        parsers=[_VisibleSkipParser(), PythonCodeBlockParser(), CodeBlockParser("bash", _run_shell)],
        patterns=patterns,
        excludes=excludes,
        setup=setup,
        teardown=teardown,
        name="docs",
    )


pytest_collect_file = (
    _docs(
        ["README.md", "docs/*.md", "examples/*/README.md"],
        ["plugins/*/*.md", "compat/*/*.md", "tests/*.md", "bench/*.md", "examples/twinkle_echo/README.md"],
        _setup_page,
        _teardown_page,
    )
    + _docs(["examples/twinkle_echo/README.md"], [], _setup_echo_page, _teardown_echo_page)
).pytest()
