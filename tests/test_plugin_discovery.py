"""Real entry-point discovery, proven by installing plugin distributions.

``examples/twinkle_echo`` is pip-installed (not editable: a real distribution
with real entry-point metadata) into a temporary ``--target`` folder once per
session, as are throwaway distributions that clash with it, shadow a
first-party name or fail to import. Only subprocesses whose ``PYTHONPATH``
starts with those folders ever see them: nothing is installed into the
environment running the tests.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ECHO_SRC = ROOT / "examples" / "twinkle_echo"
SWITCHES = ("TWINKLE_PLUGINS", "TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "TWINKLE_TRACE_PLUGINS")


def _pip_install(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


def _env(*sites: Path, **switches: str) -> dict[str, str]:
    """This environment with ``sites`` first on the path and only the given plugin switches."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, sites), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(switches)
    return env


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter of this environment."""
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc


def _last_json(proc: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def echo_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding an installed ``twinkle-echo``, for subprocesses' ``PYTHONPATH``.

    It is built from a fresh copy of the sources, so nothing (``build/``,
    ``*.egg-info``) is written into the repository and no stale build output
    is packaged.
    """
    src = tmp_path_factory.mktemp("echo-src") / "twinkle_echo"
    shutil.copytree(ECHO_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    site = tmp_path_factory.mktemp("echo-site")
    _pip_install("--target", str(site), str(src))
    return site


def test_echo_is_not_installed_in_the_test_environment() -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("twinkle-echo")


def test_echo_is_listed_with_its_distribution(echo_site: Path) -> None:
    code = """
        import json, twinkle_core
        print(json.dumps({s.name: [s.distribution, s.version, s.available, s.error, s.target]
                          for s in twinkle_core.list_samplers()}))
        """
    infos = _last_json(_python(code, _env(echo_site)))
    assert "echo" in infos, f"echo not discovered; found {sorted(infos)}"
    assert infos["echo"] == ["twinkle-echo", "0.1.0", True, None, "twinkle_echo.engine:EchoEngine"]


def test_create_sampler_by_name_samples_with_the_installed_engine(echo_site: Path) -> None:
    code = """
        import json, sys
        from twinkle_core import SamplingParams, Trajectory, create_sampler
        chat = Trajectory(messages=[{"role": "user", "content": "Count to five."}])
        with create_sampler("echo") as sampler:
            seq = sampler.sample(chat, SamplingParams(temperature=0.0, max_tokens=32))[0].sequences[0]
            engine = type(sampler.engine)
            out = {"class": type(sampler).__name__, "engine": engine.__name__,
                   "file": sys.modules[engine.__module__].__file__,
                   "text": seq.text, "stop_reason": seq.stop_reason}
        with create_sampler({"sampler": "echo", "max_model_len": 64}) as sampler:
            out["max_model_len"] = sampler.max_model_len
        print(json.dumps(out))
        """
    out = _last_json(_python(code, _env(echo_site)))
    # the user's object is the core's Sampler; the plugin supplies the engine it holds
    assert out["class"] == "Sampler" and out["engine"] == "EchoEngine"
    # the installed copy, not the sources in examples/
    assert echo_site in Path(out["file"]).resolve().parents
    assert out["text"] == "Count to five." and out["stop_reason"] == "stop" and out["max_model_len"] == 64


def test_distribution_qualified_name_selects_an_uncontested_engine(echo_site: Path) -> None:
    # docs/configuration.md documents "<distribution>:<name>"; it must work with one claimant too,
    # from Python and from the CLI, and a wrong distribution gets a message that does not contradict itself
    code = """
        import json
        from twinkle_core import create_sampler
        from twinkle_core.errors import UnknownSamplerError
        out = {}
        for name in ("twinkle-echo:echo", "Twinkle_Echo:echo"):
            with create_sampler(name) as sampler:
                out[name] = sampler.sample({"messages": [{"role": "user", "content": "hi"}]},
                                           {"temperature": 0})[0].sequences[0].text
        try:
            create_sampler("twinkle-other:echo")
        except UnknownSamplerError as exc:
            out["wrong"] = str(exc)
        print(json.dumps(out))
        """
    out = _last_json(_python(code, _env(echo_site)))
    assert out["twinkle-echo:echo"] == out["Twinkle_Echo:echo"] == "hi"
    assert "'twinkle-other'" in out["wrong"] and "twinkle-echo 0.1.0" in out["wrong"], out["wrong"]
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "twinkle_core.cli",
            "sample",
            "-e",
            "twinkle-echo:echo",
            "-m",
            "toy",
            "-p",
            "hey",
            "--temperature",
            "0",
            "--format",
            "text",
        ],
        capture_output=True,
        text=True,
        env=_env(echo_site),
        cwd=ROOT,
    )
    assert cli.returncode == 0 and "hey" in cli.stdout, cli.stderr


def test_installed_echo_passes_the_conformance_suite(echo_site: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", str(ECHO_SRC / "tests")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(echo_site),
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error", summary), summary
    # the only skips: the suites' tests of what the echo engine does not declare or refuses as unsupported
    allowed = ("does not declare", "(UnsupportedFeatureError)", "takes no adapter options")
    skips = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all(any(reason in line for reason in allowed) for line in skips), skips
    # the suite's conftest says which "echo" it ran: here, the installed entry point
    assert "echo engine: the entry point of twinkle-echo 0.1.0" in proc.stdout, proc.stdout[:2000]


def test_import_loads_no_plugin_and_lookup_loads_only_entry_point_modules(echo_site: Path) -> None:
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
        """,
        _env(echo_site),
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
    echo_site: Path, switches: dict[str, str], shown: list[str], hidden: list[str]
) -> None:
    listed = _last_json(_python(LIST, _env(echo_site, **switches)))
    names = [name for name, _ in listed]
    assert all(n in names for n in shown), names
    assert not any(n in names for n in hidden), names
    if "TWINKLE_DISABLE_PLUGIN_AUTOLOAD" in switches:
        assert all(dist is None for _, dist in listed), listed


def test_allow_list_blocks_plugins_through_pluggy_before_importing_them(echo_site: Path) -> None:
    code = """
        import json, sys
        from twinkle_core.plugins.registry import plugin_manager
        pm = plugin_manager()
        name = "twinkle-echo:echo"
        print(json.dumps({"blocked": pm.is_blocked(name), "registered": pm.has_plugin(name),
                          "imported": "twinkle_echo.plugin" in sys.modules}))
        """
    assert _last_json(_python(code, _env(echo_site, TWINKLE_PLUGINS="torch"))) == {
        "blocked": True,
        "registered": False,
        "imported": False,
    }
    assert _last_json(_python(code, _env(echo_site))) == {"blocked": False, "registered": True, "imported": True}


def test_trace_switch_logs_the_scan_to_stderr(echo_site: Path) -> None:
    quiet = _python(LIST, _env(echo_site))
    assert "[twinkle plugins]" not in quiet.stderr
    traced = _python(LIST, _env(echo_site, TWINKLE_TRACE_PLUGINS="1"))
    lines = [line for line in traced.stderr.splitlines() if line.startswith("[twinkle plugins]")]
    assert any("twinkle_echo.plugin" in line and "twinkle-echo" in line for line in lines), traced.stderr
    skipped = _python(LIST, _env(echo_site, TWINKLE_TRACE_PLUGINS="1", TWINKLE_PLUGINS="torch"))
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
from twinkle_core.engine import BatchEngine
from twinkle_core.plugins import hookimpl

class Engine(BatchEngine):
    \"\"\"Never built: only resolved by name.\"\"\"

@hookimpl
def register_samplers(register):
    register({name!r}, {target!r}{extra})
"""


def _plugin(name: str, target: str, extra: str = "") -> str:
    return PLUGIN.format(name=name, target=target, extra=extra)


PROBE = """
import json, sys, warnings
import twinkle_core

def outcome(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cls = call()
            result = {"class": f"{cls.__module__}:{cls.__qualname__}"}
        except Exception as exc:
            cause = exc.__cause__
            result = {"error": type(exc).__name__, "message": str(exc),
                      "cause": None if cause is None else f"{type(cause).__name__}: {cause}"}
    result["warnings"] = [str(w.message) for w in caught]
    return result

out = {"listing": {s.name: [s.distribution, s.available, s.error, s.target] for s in twinkle_core.list_samplers()}}
out["imported_by_listing"] = sorted({"twinkle_needy_engine", "twinkle_broken_engine"} & set(sys.modules))
for name in ("echo", "twinkle-echo:echo", "twinkle-echo-clash:echo", "no-such-dist:echo", "torch",
             "twinkle-evil:torch", "broken", "broken-engine", "needy"):
    out[name] = outcome(lambda: twinkle_core.get_sampler_class(name))
print(json.dumps(out))
"""


def test_clashing_shadowing_and_broken_plugins_are_reported(echo_site: Path, tmp_path: Path) -> None:
    root = tmp_path
    clash = _write_dist(
        root,
        "twinkle-echo-clash",
        {"echo": "twinkle_echo_clash"},
        {"twinkle_echo_clash": _plugin("echo", "twinkle_echo_clash:Engine")},
    )
    # a third party claiming a first-party name, and an engine whose heavy dependency is missing
    evil = _write_dist(
        root,
        "twinkle-evil",
        {"evil": "twinkle_evil", "needy": "twinkle_needy"},
        {
            "twinkle_evil": _plugin("torch", "twinkle_evil:Engine"),
            "twinkle_needy": _plugin("needy", "twinkle_needy_engine:Engine", ", requires=['no_such_heavy_lib']"),
            "twinkle_needy_engine": "import no_such_heavy_lib\n",
        },
    )
    broken = _write_dist(
        root,
        "twinkle-broken",
        {"broken": "twinkle_broken_plugin", "broken-engine": "twinkle_broken_engine_plugin"},
        {
            # the entry-point module itself fails to import
            "twinkle_broken_plugin": "raise ImportError('twinkle-broken needs libfoo, which is not installed')\n",
            # the entry point loads, but the engine it registers fails to import
            "twinkle_broken_engine_plugin": _plugin("broken-engine", "twinkle_broken_engine:Engine"),
            "twinkle_broken_engine": "raise ImportError('the broken engine needs libbar')\n",
        },
    )
    site = root / "site"
    _pip_install("--target", str(site), str(clash), str(evil), str(broken))
    result = _last_json(_python(PROBE, _env(site, echo_site)))
    listing = result["listing"]

    # two distributions claim "echo": listed as unavailable; the error names both, with
    # their class paths, and says how to select one
    dist, available, error, _ = listing["echo"]
    assert not available
    for text in (
        "twinkle-echo 0.1.0 (twinkle_echo.engine:EchoEngine)",
        "twinkle-echo-clash 9.9.9 (twinkle_echo_clash:Engine)",
        "'twinkle-echo:echo'",
        "'twinkle-echo-clash:echo'",
    ):
        assert text in error, error
    assert result["echo"]["error"] == "DuplicateSamplerError" and result["echo"]["message"] == error
    # ... and each can be selected by the distribution-qualified name the message shows
    assert listing["twinkle-echo:echo"][:2] == ["twinkle-echo", True]
    assert result["twinkle-echo:echo"]["class"] == "twinkle_echo.engine:EchoEngine"
    assert result["twinkle-echo-clash:echo"]["class"] == "twinkle_echo_clash:Engine"
    unknown = result["no-such-dist:echo"]
    assert unknown["error"] == "UnknownSamplerError" and "twinkle-echo-clash" in unknown["message"]

    # a third party cannot take "torch" away: the first-party engine wins, with a warning
    # that says how to select the other one
    assert listing["torch"][:2] == ["twinkle-torch", True]
    torch = result["torch"]
    assert torch["class"] == "twinkle_torch.sampler:TorchSampler"
    assert any("twinkle-evil" in w and "'twinkle-evil:torch'" in w for w in torch["warnings"]), torch
    assert result["twinkle-evil:torch"]["class"] == "twinkle_evil:Engine"

    # an entry-point module that fails to import: listed with the error, raised with the cause
    dist, available, error, _ = listing["broken"]
    assert dist == "twinkle-broken" and not available and "libfoo" in error
    assert result["broken"]["error"] == "PluginLoadError" and "ImportError: " in result["broken"]["cause"]
    assert "libfoo" in result["broken"]["cause"]

    # an engine that is installed but fails at import: the listing runs no engine code, so it
    # is listed (as installed); selecting it raises with the cause
    assert listing["broken-engine"][:3] == ["twinkle-broken", True, None]
    assert result["broken-engine"]["error"] == "PluginLoadError" and "libbar" in result["broken-engine"]["cause"]

    # a declared dependency that is missing is found without importing anything
    dist, available, error, _ = listing["needy"]
    assert dist == "twinkle-evil" and not available and "no_such_heavy_lib" in error
    assert result["imported_by_listing"] == []

    # none of it leaked into this environment
    for name in ("twinkle-echo-clash", "twinkle-evil", "twinkle-broken"):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(name)
