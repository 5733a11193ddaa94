"""Engine and template registries: in-process registration, string targets, errors."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from twinkle_core import create_sampler, get_sampler_class, list_samplers, register_sampler
from twinkle_core.engine import Engine, EngineContext, EngineInfo
from twinkle_core.errors import (
    ConfigError,
    DuplicateSamplerError,
    PluginLoadError,
    UnknownSamplerError,
    UnknownTemplateError,
)
from twinkle_core.factory import load_config
from twinkle_core.plugins import Registry, reset_plugins
from twinkle_core.plugins.engines import sampler_registry
from twinkle_core.sampler import Sampler
from twinkle_core.template import ChatMLTemplate, get_template, register_template, template_registry


class _Engine(Engine):
    """Smallest possible engine: enough to be built by the factory."""

    def __init__(self, context: EngineContext, model_id: str = "m", **kwargs: object) -> None:
        super().__init__(context)
        self.info = EngineInfo(name="unit", max_model_len=16)
        self.model_id = model_id
        self.kwargs = kwargs

    def run(self, run):  # type: ignore[no-untyped-def]
        return []


@pytest.fixture
def registered():
    names = []

    def reg(name, target=None, **kw):
        names.append(name)
        return register_sampler(name, target, **kw)

    yield reg
    for n in names:
        sampler_registry.unregister(n)


@pytest.fixture
def in_process_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No entry-point plugins, so ``list_samplers(load=True)`` imports only the test's engines."""
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugins()
    yield
    monkeypatch.delenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD")
    reset_plugins()


def test_register_class_and_create(registered):
    registered("unit", _Engine)
    s = create_sampler("unit", model_id="x", foo=1)
    assert isinstance(s, Sampler) and isinstance(s.engine, _Engine)
    assert s.engine.model_id == "x" and s.engine.kwargs == {"foo": 1}
    assert "unit" in [i.name for i in list_samplers()]
    # The model may come second, as in most libraries' factories; given twice, it is an error.
    s = create_sampler("unit", "y", foo=2)
    assert s.engine.model_id == "y" and s.engine.kwargs == {"foo": 2}
    s = create_sampler({"sampler": "unit", "model_id": "from-config"}, "z")
    assert s.engine.model_id == "z"
    with pytest.raises(TypeError, match="model twice"):
        create_sampler("unit", "y", model_id="x")


def test_register_as_decorator(registered):
    @registered("unit-deco")
    class Deco(_Engine):
        pass

    assert get_sampler_class("unit-deco") is Deco


def test_register_lazy_string_target(registered):
    registered("unit-lazy", f"{__name__}:_Engine")
    assert get_sampler_class("unit-lazy") is _Engine


def test_module_colon_class_string_resolves_without_registration():
    assert get_sampler_class(f"{__name__}:_Engine") is _Engine
    with pytest.raises(PluginLoadError, match="no_such_module"):
        get_sampler_class("no_such_module:Thing")


def test_duplicate_in_process_registration_raises(registered):
    registered("unit-dup", _Engine)
    with pytest.raises(DuplicateSamplerError, match="already registered"):
        registered("unit-dup", f"{__name__}:_Engine")
    registered("unit-dup", f"{__name__}:_Engine", replace=True)


def test_unknown_engine_error_has_did_you_mean_and_available():
    with pytest.raises(UnknownSamplerError) as info:
        create_sampler("vlm")
    msg = str(info.value)
    assert "Unknown sampler 'vlm'" in msg
    assert "Did you mean 'vllm'?" in msg
    assert "Available:" in msg
    assert isinstance(info.value, LookupError)
    # a LookupError, but its message is not mangled like a KeyError's
    assert str(info.value).startswith("Unknown sampler")


def test_unknown_name_of_a_first_party_engine_not_installed_gives_the_install_hint():
    reg = Registry("sampler", "register_samplers", UnknownSamplerError, {"fancy": 'pip install "twinkle-core[fancy]"'})
    try:
        with pytest.raises(UnknownSamplerError) as info:
            reg.get("fancy")
        assert 'To install it: pip install "twinkle-core[fancy]"' in str(info.value)
        assert "Did you mean" not in str(info.value)
        with pytest.raises(UnknownSamplerError, match=r"Did you mean 'fancy'\?.*twinkle-core\[fancy\]"):
            reg.get("fanzy")
    finally:
        Registry.all_registries.remove(reg)


def test_broken_string_target_is_listed_and_raises_with_cause(registered, in_process_only):
    registered("unit-broken", "twinkle_core.no_such_module:Engine")
    # the listing looks the module up without importing it
    info = {i.name: i for i in list_samplers()}["unit-broken"]
    assert not info.available and not info.imported
    assert "twinkle_core.no_such_module" in (info.error or "")
    loaded = {i.name: i for i in list_samplers(load=True)}["unit-broken"]
    assert not loaded.available and loaded.imported and "ModuleNotFoundError" in (loaded.error or "")
    with pytest.raises(PluginLoadError) as exc:
        create_sampler("unit-broken")
    assert isinstance(exc.value.__cause__, ModuleNotFoundError)


def test_engine_that_fails_at_import_is_found_by_the_listing_and_caught_by_loading(
    registered, in_process_only, tmp_path, monkeypatch
):
    (tmp_path / "unit_explodes.py").write_text("raise ImportError('unit_explodes needs libzzz')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registered("unit-explodes", "unit_explodes:Engine")
    found = {i.name: i for i in list_samplers()}["unit-explodes"]
    # installed, and honestly reported as not imported: listing runs no engine code
    assert found.available and not found.imported and found.error is None
    assert "unit_explodes" not in sys.modules
    loaded = {i.name: i for i in list_samplers(load=True)}["unit-explodes"]
    assert not loaded.available and "libzzz" in (loaded.error or "")
    with pytest.raises(PluginLoadError, match="libzzz") as exc:
        create_sampler("unit-explodes")
    assert isinstance(exc.value.__cause__, ImportError)


def test_non_sampler_target_is_rejected(registered):
    registered("unit-notasampler", "collections:OrderedDict")
    with pytest.raises(PluginLoadError, match="not a twinkle Sampler"):
        get_sampler_class("unit-notasampler")


def test_create_from_config_mapping_and_files(registered, tmp_path):
    registered("unit", _Engine)
    s = create_sampler({"sampler": "unit", "model_id": "cfg"}, extra=2)
    assert s.engine.model_id == "cfg" and s.engine.kwargs == {"extra": 2}
    yml = tmp_path / "s.yaml"
    yml.write_text("sampler: unit\nmodel_id: from-yaml\nenable_x: false\n")
    s = create_sampler(str(yml))
    assert s.engine.model_id == "from-yaml" and s.engine.kwargs == {"enable_x": False}
    js = tmp_path / "s.json"
    js.write_text('{"sampler": "unit", "model_id": "from-json"}')
    assert create_sampler(str(js)).engine.model_id == "from-json"
    with pytest.raises(ConfigError, match="no 'sampler' key"):
        create_sampler({"model_id": "x"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        create_sampler(str(bad))
    with pytest.raises(ConfigError, match="Cannot read"):
        create_sampler(str(tmp_path / "missing.yaml"))
    bad.write_text("sampler: unit\n1: 2\n")
    with pytest.raises(ConfigError, match="key 1 is not a name"):
        create_sampler(str(bad))
    with pytest.raises(ConfigError, match="key 1 is not a name"):
        create_sampler({"sampler": "unit", 1: 2})
    # the CLI's config file (sampling_params beside the engine's options) points to its Python equivalent
    cli_config = tmp_path / "sampler.yaml"
    cli_config.write_text("sampler: unit\nsampling_params:\n  temperature: 0.5\n")
    with pytest.raises(ConfigError, match=r"twinkle sample --config. reads them.*config.pop\('sampling_params'\)"):
        create_sampler(str(cli_config))
    config = load_config(cli_config)
    params = config.pop("sampling_params")
    assert create_sampler(config).engine.model_id == "m" and params == {"temperature": 0.5}


def test_templates_registry():
    assert get_template("chatml") is ChatMLTemplate
    with pytest.raises(UnknownTemplateError, match=r"Did you mean 'chatml'"):
        get_template("chatm")

    @register_template("unit-tmpl")
    class Mine(ChatMLTemplate):
        pass

    try:
        assert get_template("unit-tmpl") is Mine
    finally:
        template_registry.unregister("unit-tmpl")
