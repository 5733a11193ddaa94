"""Real entry-point discovery, proven by installing plugin distributions.

``examples/twinkle_echo`` is pip-installed (not editable: a real distribution
with real entry-point metadata) into the running environment once per
session. Throwaway distributions that clash with it or fail to import are
installed into a temporary ``--target`` folder and only ever seen by
subprocesses, so they never leak into the test environment.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twinkle_core import SamplingParams, Trajectory, create_sampler, list_samplers
from twinkle_core.plugins import reset_plugins

ROOT = Path(__file__).resolve().parents[1]
ECHO_SRC = ROOT / "examples" / "twinkle_echo"
SWITCHES = ("TWINKLE_PLUGINS", "TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "TWINKLE_TRACE_PLUGINS")


def _pip_install(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


def _env(**switches: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env.update(switches)
    return env


def _python(code: str, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter of this environment."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env or _env(), cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def echo_dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Install ``twinkle-echo`` into this environment; yield its version.

    It is built from a fresh copy of the sources, so nothing (``build/``,
    ``*.egg-info``) is written into the repository and no stale build output
    is packaged. ``--force-reinstall`` makes re-runs install the current code.
    """
    src = tmp_path_factory.mktemp("echo-src") / "twinkle_echo"
    shutil.copytree(
        ECHO_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache")
    )
    _pip_install("--force-reinstall", str(src))
    # Forget what this process knew before the install: import caches, any
    # stale copy of the package, and the cached entry-point scan.
    importlib.invalidate_caches()
    for name in [m for m in sys.modules if m == "twinkle_echo" or m.startswith("twinkle_echo.")]:
        del sys.modules[name]
    reset_plugins()
    yield importlib.metadata.version("twinkle-echo")
    reset_plugins()


def test_echo_is_listed_with_its_distribution(echo_dist: str) -> None:
    infos = {i.name: i for i in list_samplers()}
    assert "echo" in infos, f"echo not discovered; found {sorted(infos)}"
    echo = infos["echo"]
    assert echo.distribution == "twinkle-echo"
    assert echo.version == echo_dist == "0.1.0"
    assert echo.available and echo.error is None
    assert echo.target == "twinkle_echo.engine:EchoSampler"


def test_create_sampler_by_name_samples_with_the_installed_engine(echo_dist: str) -> None:
    chat = Trajectory(messages=[{"role": "user", "content": "Count to five."}])
    with create_sampler("echo") as sampler:
        module = sys.modules[type(sampler).__module__]
        assert type(sampler).__name__ == "EchoSampler"
        # the installed copy, not the sources in examples/
        assert ECHO_SRC not in Path(module.__file__ or "").resolve().parents
        seq = sampler.sample(chat, SamplingParams(temperature=0.0, max_tokens=32))[0].sequences[0]
    assert seq.text == "Count to five." and seq.stop_reason == "stop"
    with create_sampler({"sampler": "echo", "max_model_len": 64}) as sampler:
        assert sampler.max_model_len == 64


def test_installed_echo_passes_the_conformance_suite(echo_dist: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ECHO_SRC / "tests")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error|skipped", summary), summary


def test_import_loads_no_plugin_and_lookup_loads_only_entry_point_modules(echo_dist: str) -> None:
    proc = _python(
        """
        import json, sys
        def plugins():
            roots = ("twinkle_echo", "twinkle_torch", "twinkle_vllm")
            return sorted(m for m in sys.modules if m.split(".")[0] in roots)
        import twinkle_core
        steps = {"import": plugins()}
        from twinkle_core.plugins.engines import sampler_registry
        steps["names"] = sampler_registry.names()
        steps["lookup"] = plugins()
        twinkle_core.get_sampler_class("echo")
        steps["select"] = plugins()
        print(json.dumps(steps))
        """
    )
    steps = _last_json(proc)
    assert steps["import"] == []
    assert "echo" in steps["names"]
    # the first lookup loads entry-point modules, which register strings only
    assert "twinkle_echo.plugin" in steps["lookup"] and "twinkle_echo.engine" not in steps["lookup"]
    assert "twinkle_torch.sampler" not in steps["lookup"]
    # choosing echo imports echo's engine, and no other engine
    assert "twinkle_echo.engine" in steps["select"] and "twinkle_torch.sampler" not in steps["select"]


LIST = "import json, twinkle_core; print(json.dumps([[s.name, s.distribution] for s in twinkle_core.list_samplers()]))"


@pytest.mark.parametrize(
    "switches,shown,hidden",
    [
        ({"TWINKLE_PLUGINS": "torch"}, ["torch"], ["echo"]),
        ({"TWINKLE_PLUGINS": "echo"}, ["echo"], ["torch"]),
        ({"TWINKLE_PLUGINS": " twinkle-echo , nothing"}, ["echo"], ["torch"]),
        ({"TWINKLE_DISABLE_PLUGIN_AUTOLOAD": "1"}, [], ["echo", "torch"]),
    ],
    ids=["allow-torch", "allow-echo", "allow-by-distribution", "autoload-disabled"],
)
def test_switches_filter_entry_point_engines(
    echo_dist: str, switches: dict[str, str], shown: list[str], hidden: list[str]
) -> None:
    listed = _last_json(_python(LIST, env=_env(**switches)))
    names = [name for name, _ in listed]
    assert all(n in names for n in shown), names
    assert not any(n in names for n in hidden), names
    if "TWINKLE_DISABLE_PLUGIN_AUTOLOAD" in switches:
        assert all(dist is None for _, dist in listed), listed


def test_trace_switch_logs_the_scan_to_stderr(echo_dist: str) -> None:
    quiet = _python(LIST)
    assert "[twinkle plugins]" not in quiet.stderr
    traced = _python(LIST, env=_env(TWINKLE_TRACE_PLUGINS="1"))
    lines = [line for line in traced.stderr.splitlines() if line.startswith("[twinkle plugins]")]
    assert any("twinkle_echo.plugin" in line and "twinkle-echo" in line for line in lines), traced.stderr
    skipped = _python(LIST, env=_env(TWINKLE_TRACE_PLUGINS="1", TWINKLE_PLUGINS="torch"))
    assert any("echo" in line and "TWINKLE_PLUGINS" in line for line in skipped.stderr.splitlines()), skipped.stderr


def _write_dist(root: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    """A minimal setuptools distribution of top-level modules."""
    folder = root / name
    folder.mkdir()
    eps = "\n".join(f'"{k}" = "{v}"' for k, v in entry_points.items())
    (folder / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{name}"
            version = "9.9.9"
            dependencies = ["twinkle-core"]

            [project.entry-points.twinkle]
            """
        )
        + eps
        + f"\n\n[tool.setuptools]\npy-modules = {json.dumps(sorted(modules))}\n"
    )
    for module, source in modules.items():
        (folder / f"{module}.py").write_text(textwrap.dedent(source))
    return folder


PLUGIN = """\
from twinkle_core.plugins import hookimpl

@hookimpl
def register_samplers(register):
    register({name!r}, {target!r})
"""

PROBE = """
import json, twinkle_core
out = {"listing": {s.name: [s.distribution, s.available, s.error] for s in twinkle_core.list_samplers()}}
for name in ("echo", "broken", "broken-engine"):
    try:
        twinkle_core.create_sampler(name)
        out[name] = None
    except Exception as exc:
        cause = exc.__cause__
        out[name] = [type(exc).__name__, str(exc), None if cause is None else type(cause).__name__, str(cause)]
print(json.dumps(out))
"""


def test_clashing_and_broken_plugins_are_reported(echo_dist: str, tmp_path: Path) -> None:
    root = tmp_path
    clash = _write_dist(
        root,
        "twinkle-echo-clash",
        {"echo": "twinkle_echo_clash"},
        {"twinkle_echo_clash": PLUGIN.format(name="echo", target="twinkle_echo_clash:EchoClash")},
    )
    broken = _write_dist(
        root,
        "twinkle-broken",
        {"broken": "twinkle_broken_plugin", "broken-engine": "twinkle_broken_engine_plugin"},
        {
            # the entry-point module itself fails to import
            "twinkle_broken_plugin": "raise ImportError('twinkle-broken needs libfoo, which is not installed')\n",
            # the entry point loads, but the engine it registers fails to import
            "twinkle_broken_engine_plugin": PLUGIN.format(name="broken-engine", target="twinkle_broken_engine:Engine"),
            "twinkle_broken_engine": "raise ImportError('the broken engine needs libbar')\n",
        },
    )
    site = root / "site"
    _pip_install("--target", str(site), str(clash), str(broken))
    env = _env(PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    result = _last_json(_python(PROBE, env=env))
    listing = result["listing"]

    # two distributions claim "echo": listed as unavailable, selecting it names both
    dist, available, error = listing["echo"]
    both = re.compile(r"twinkle-echo(?!-clash).*twinkle-echo-clash|twinkle-echo-clash.*twinkle-echo(?!-clash)")
    assert not available and both.search(error), error
    kind, message, _, _ = result["echo"]
    assert kind == "DuplicateSamplerError" and both.search(message), message

    # an entry-point module that fails to import: listed with the error, raised with the cause
    dist, available, error = listing["broken"]
    assert dist == "twinkle-broken" and not available and "libfoo" in error
    kind, message, cause, cause_message = result["broken"]
    assert kind == "PluginLoadError" and cause == "ImportError" and "libfoo" in cause_message

    # an engine module that fails to import: the same, through the registered string
    dist, available, error = listing["broken-engine"]
    assert dist == "twinkle-broken" and not available and "libbar" in error
    kind, message, cause, cause_message = result["broken-engine"]
    assert kind == "PluginLoadError" and cause == "ImportError" and "libbar" in cause_message

    # none of it leaked into this environment
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("twinkle-echo-clash")
    assert "echo" in [i.name for i in list_samplers() if i.available]
