"""Structured configs (experiments/core/config_schema.py): every setting declared once as a dataclass in Hydra's
ConfigStore; a typo'd key or a value of the wrong type is one line naming the key, exit status 2."""

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.core.config_schema import AttentionEntry, CacheSchema, ModelSchema
from tests.app.test_app import compose_cfg

ROOT = Path(__file__).resolve().parents[2]


def cli(tmp_path, *args):
    """`python run.py ARGS` in a subprocess -> (exit status, stderr lines)."""
    result = subprocess.run(
        [sys.executable, "run.py", *args, f"hydra.run.dir={tmp_path / 'out'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled", "HYBRIDCACHE_HOME": str(tmp_path / "home")},
    )
    return result.returncode, result.stderr.strip().splitlines()


@pytest.mark.parametrize(
    "args,key",
    [
        (["experiment=benchmark", "experiment.new_tokns=3"], "experiment.new_tokns"),  # a typo'd key
        (["experiment=benchmark", "experiment.new_tokens=abc"], "experiment.new_tokens"),  # a wrong type
        (["cache.recurrent.offload=maybe"], "cache.recurrent.offload"),  # typed only by the schema (null default)
        (["cache.attention.compression_ratio=abc"], "cache.attention.compression_ratio"),
    ],
)
def test_typos_and_wrong_types_are_one_line_naming_the_key_and_exit_2(tmp_path, args, key):
    code, err = cli(tmp_path, *args)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: ") and key in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_schema_types_the_composed_config():
    """Hydra/OmegaConf itself refuses what the schema forbids (not only run.py's pre-check)."""
    cfg = compose_cfg("experiment=benchmark", "model=gemma3", "cache=int8")
    assert OmegaConf.get_type(cfg.cache.full) is AttentionEntry
    assert OmegaConf.get_type(cfg.model) is ModelSchema
    for bad in ("experiment.new_tokens=abc", "experiment.new_tokns=3", "cache.full.window=abc", "model.seed=x"):
        with pytest.raises(Exception, match=bad.split("=")[0].split(".")[-1]):
            compose_cfg("experiment=benchmark", bad)
    with pytest.raises(Exception, match="logger.group"):
        compose_cfg("logger.group=[1,2]")


def test_one_attention_entry_for_the_four_attention_keys():
    """The 13 attention fields are declared once: attention, full, sliding and chunked are the same type."""
    kinds = {f.name: f.type for f in fields(CacheSchema)}
    assert {kinds[k] for k in ("attention", "full", "sliding", "chunked")} == {"AttentionEntry"}
    yaml = (ROOT / "configs" / "cache_schema" / "base.yaml").read_text()
    assert "window:" not in yaml  # the YAML no longer repeats the fields


def test_a_new_key_can_still_be_added_explicitly():
    """`+cache.full.<name>=...` adds a parameter (a plugin type's own), as before; the library names it if unknown."""
    cfg = compose_cfg("model=jamba", "+cache.full.my_param=3", "+cache.layers.2.type=sliding")
    assert cfg.cache.full.my_param == 3 and cfg.cache.layers["2"].type == "sliding"


def test_every_experiment_and_model_yaml_extends_its_schema():
    for path in sorted((ROOT / "configs" / "experiment").glob("*.yaml")):
        cfg = compose_cfg(f"experiment={path.stem}")
        assert OmegaConf.get_type(cfg.experiment).__name__.endswith("Schema"), path.name
    for path in sorted((ROOT / "configs" / "model").glob("*.yaml")):
        text = path.read_text()
        if "/schema/model@_here_" in text:  # a family's new model file may also compose untyped
            assert OmegaConf.get_type(compose_cfg(f"model={path.stem}").model) is ModelSchema, path.name
