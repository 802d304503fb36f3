"""The lossy/pattern presets (sink, int8, tova, and any later one in configs/cache) compose into plans on every
family, and a new cache type is one Python file plus one YAML preset that names it under `plugins:`."""

from pathlib import Path

import pytest

from experiments.core.cache_config import cache_config_from_hydra
from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.core.plan import flatten_native, resolve_plan
from hybridcache.checkpoints.tiny import FAMILIES
from tests.app.test_app import compose_cfg, native_layers
from tests.app.test_app_runs import SHORT, app  # noqa: F401 - the in-process app fixture

ROOT = Path(__file__).resolve().parents[2]
EXACT_PRESETS = {"native", "hybrid", "full", "static", "hybrid_sliding", "hybrid_chunked"}  # tests/app/test_app.py
OTHER_PRESETS = sorted(p.stem for p in (ROOT / "configs" / "cache").glob("*.yaml") if p.stem not in EXACT_PRESETS)


def test_the_lossy_and_pattern_presets_are_all_covered():
    assert {"sink", "int8", "tova", "snapkv", "h2o"} <= set(OTHER_PRESETS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", OTHER_PRESETS)
def test_every_other_preset_composes_into_a_plan_on_every_family(family, preset):
    cfg = compose_cfg(f"model={family}", f"cache={preset}")
    cache_config, preallocate = cache_config_from_hydra(cfg.cache)
    native = native_layers(family)
    head_dims = {n.params["head_dim"] for _, _, n in flatten_native(native) if n.type in ("full", "sliding", "chunked")}
    if preset == "kivi" and any(d % 32 for d in head_dims):  # real KIVI's groups of 32 along head_dim: a clear refusal
        with pytest.raises(CacheConfigError, match="group_size must be a positive divisor of head_dim"):
            resolve_plan(native, cache_config, None)
        return
    plan = resolve_plan(native, cache_config, 128 if preallocate else None)
    assert [p.native_type for p in plan.layers] == [n.type for _, _, n in flatten_native(native)]
    native_plan = resolve_plan(native)
    for p, q in zip(plan.layers, native_plan.layers):
        if p.kind == "recurrent":  # recurrent states are never touched by an attention preset
            assert p.type == q.type
        elif preset in ("sink", "tova", "h2o") and p.native_type == "full":
            assert p.type == preset
        elif preset == "snapkv":  # every attention layer, natively sliding ones inside their window
            assert p.type == "snapkv" and p.spec.window == getattr(q.spec, "window", None)
        elif preset == "int8":
            assert p.type == q.type and p.spec.storage == "int8"


def test_a_yaml_preset_with_plugins_adds_a_cache_type_end_to_end(app, tmp_path, monkeypatch):  # noqa: F811
    """One file (the type) + one YAML (the preset naming it): `python run.py cache=<preset>` with no other edit."""
    (tmp_path / "hc_yaml_plugin_window.py").write_text(
        "from hybridcache.cache import SlidingWindowLayer, register_cache_layer\n\n\n"
        "@register_cache_layer('yaml_plugin_window')\nclass YamlPluginWindow(SlidingWindowLayer):\n"
        "    '''A sliding window under its own name (a stand-in for a real new pattern).'''\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    presets = tmp_path / "configs" / "cache"
    presets.mkdir(parents=True)
    (presets / "yaml_plugin_preset.yaml").write_text(
        "defaults:\n  - /cache_schema/base@_here_\n  - _self_\n"
        "plugins: [hc_yaml_plugin_window]\nfull:\n  type: yaml_plugin_window\n  window: 8\n"
    )
    code, results, out, _ = app(
        "model=jamba", "cache=yaml_plugin_preset", f"hydra.searchpath=[file://{tmp_path / 'configs'}]", *SHORT
    )
    assert code == 0, out
    types = [r["type"] for r in results["plan"]]
    assert types == ["mamba", "mamba", "yaml_plugin_window", "mamba"], types  # tiny jamba: layer 2 is attention
    assert results["summary"]["oracle_pass"]


def test_kind_wide_fields_reach_every_configurable_type_of_the_kind():
    """`cache.recurrent.<field>` with no type is kept when every recurrent type that takes parameters takes it (a
    type that takes none, such as compressed_kv, a compressor's buffer, vetoes nothing: once it emptied the set and
    every kind-wide recurrent field was dropped as 'no effect'); a field some type lacks is dropped with a note."""
    from experiments.core.cache_config import cache_config_with_notes
    from hybridcache.cache import available_layers, get_layer_class

    names = [get_layer_class(t).spec_cls.tunable_names() for t in available_layers("recurrent")]
    assert any(not n for n in names)  # the case this guards: a registered recurrent type with no parameters
    fields = {"state_codec": "int8", "state_dtype": "float64", "rollback": 2, "error_feedback": True}
    config, _, notes = cache_config_with_notes({"recurrent": fields})
    assert set(config["recurrent"]) == set(fields) and not notes
    config, _, notes = cache_config_with_notes({"attention": {"window": 8}})  # full attention takes no window
    assert "attention" not in config and notes and "cache.attention.type is not set" in notes[0]
