"""Typed family configs: HF defaults, type and constraint checks with one error naming every problem."""

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import transformers

from hybridcache.checkpoints.tiny import FAMILIES
from hybridcache.models import MODEL_TYPES, model_class
from hybridcache.models.core.family_config import ConfigError, FamilyConfig, param

HF_CLASSES = {
    "jamba": "JambaConfig",
    "mamba": "MambaConfig",
    "mamba2": "Mamba2Config",
    "recurrentgemma": "RecurrentGemmaConfig",
    "gemma3": "Gemma3TextConfig",
    "gemma4": "Gemma4TextConfig",
    "llama4": "Llama4TextConfig",
    "qwen3_next": "Qwen3NextConfig",
    "bamba": "BambaConfig",
    "falcon_h1": "FalconH1Config",
    "zamba2": "Zamba2Config",
    "zamba": "ZambaConfig",
    "lfm2": "Lfm2Config",
    "nemotron_h": "NemotronHConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "qwen3_5": "Qwen3_5TextConfig",
    "lfm3": "Lfm3Config",
    "kimi_linear": "KimiLinearConfig",
    "bailing_hybrid": "BailingHybridConfig",
    "granite_swa": "GraniteSWAConfig",
    "gpt_oss": "GptOssConfig",
    "olmo_hybrid": "OlmoHybridConfig",
    "glm5_next": "Glm5NextTextConfig",
}


def raw_config(checkpoints, family):
    return json.loads((checkpoints(family) / "config.json").read_text())


MODEL_TYPE = {
    "recurrentgemma": "recurrent_gemma",
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "llama4": "llama4_text",
    "qwen3_5": "qwen3_5_text",
}


def config_class(family):
    return model_class(MODEL_TYPE.get(family, family)).config_class


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_are_hf_defaults(family):
    ours = config_class(family)
    hf = {f.name: f for f in dataclasses.fields(getattr(transformers, HF_CLASSES[family]))}
    compared = 0
    for f in dataclasses.fields(ours):
        if f.name not in hf or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
            continue
        mine = f.default_factory() if f.default is dataclasses.MISSING else f.default
        theirs = hf[f.name].default_factory() if hf[f.name].default is dataclasses.MISSING else hf[f.name].default
        theirs = list(theirs) if isinstance(theirs, tuple) else theirs
        assert mine == theirs, f"{family}.{f.name}: ours {mine!r}, HF {theirs!r}"
        compared += 1
    assert compared >= 8


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_configs_validate_and_keep_extras(checkpoints, family):
    raw = raw_config(checkpoints, family)
    cfg = config_class(family).from_hf(raw)
    assert cfg.family == family and cfg.hidden_size == 64 and cfg.vocab_size == 384
    as_dict = cfg.to_dict()
    assert as_dict["architectures"] == raw["architectures"]  # unknown HF keys are kept, unchecked
    assert as_dict["hidden_size"] == 64 and "extras" not in as_dict
    model = model_class(raw["model_type"])(raw)
    assert model.cfg == cfg and model.config["vocab_size"] == 384
    assert model_class(raw["model_type"])(cfg).cfg is cfg  # a typed config is taken as it is


def test_every_problem_is_reported_at_once_with_family_field_and_value(checkpoints):
    raw = raw_config(checkpoints, "jamba")
    raw.update(
        hidden_size="64",
        num_experts=0,
        mamba_d_conv=2.5,
        mamba_conv_bias="yes",
        vocab_size=None,
        layers_block_type=["mamba", "mamba", "transformer", "mamba"],
    )
    with pytest.raises(ConfigError) as info:
        config_class("jamba").from_hf(raw)
    err = info.value
    assert isinstance(err, ValueError) and err.family == "jamba" and len(err.problems) == 6
    text = str(err)
    for piece in [
        "jamba config is invalid",
        "missing required field vocab_size",
        "hidden_size must be int, got '64'",
        "num_experts must be positive, got 0",
        "mamba_d_conv must be int, got 2.5 (float)",
        "mamba_conv_bias must be bool, got 'yes'",
        "layers_block_type has unknown entry 'transformer'",
    ]:
        assert piece in text


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("jamba", {"attn_layer_offset": 4}, r"attn_layer_offset \(4\) must be < attn_layer_period \(4\)"),
        ("jamba", {"mamba_dt_rank": "big"}, r"mamba_dt_rank must be a positive int or 'auto', got 'big'"),
        (
            "jamba",
            {"num_key_value_heads": 3},
            r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
        ),
        ("mamba", {"time_step_rank": 0}, r"time_step_rank must be positive, got 0"),
        ("mamba2", {"num_heads": 4}, r"expand \* hidden_size \(128\) must equal num_heads \* head_dim \(64\)"),
        ("mamba2", {"chunk_size": 0}, r"chunk_size must be positive, got 0"),
        ("mamba2", {"time_step_limit": [1.0]}, r"time_step_limit must be \[min, max\]"),
        ("recurrentgemma", {"attention_window_size": -1}, r"attention_window_size must be positive, got -1"),
        ("recurrentgemma", {"block_types": []}, r"block_types is empty"),
        ("gemma3", {"sliding_window": None}, r"sliding_window is null but there are sliding_attention layers"),
        ("gemma3", {"rms_norm_eps": "1e-6"}, r"rms_norm_eps must be float, got '1e-6'"),
        ("llama4", {"attention_chunk_size": -8}, r"attention_chunk_size must be positive, got -8"),
        ("llama4", {"no_rope_layers": [1, 1, 2, 0]}, r"no_rope_layers entries must be 0 or 1"),
        ("llama4", {"moe_layers": [1, 4]}, r"moe_layers \[1, 4\] has indices >= num_hidden_layers \(4\)"),
        (
            "llama4",
            {"layer_types": ["chunked_attention"] * 3 + ["linear_attention"]},
            r"layer_types has unknown entry 'linear_attention' \(known: chunked_attention, full_attention\)",
        ),
    ],
)
def test_family_checks(checkpoints, family, change, message):
    raw = {**raw_config(checkpoints, family), **change}
    with pytest.raises(ConfigError, match=f"{family} config is invalid: .*{message}"):
        config_class(family).from_hf(raw)
    with pytest.raises(ConfigError, match=message):  # building the model directly checks the same way
        model_class(raw["model_type"])(raw)


def test_nulls_aliases_and_derived_values(checkpoints):
    raw = raw_config(checkpoints, "jamba")
    raw.pop("num_experts")
    cfg = config_class("jamba").from_hf(
        {**raw, "num_local_experts": 8, "num_key_value_heads": None, "rms_norm_eps": None}
    )
    assert cfg.num_experts == 8 and "num_local_experts" not in cfg.extras  # HF attribute alias
    assert cfg.num_key_value_heads == cfg.num_attention_heads  # None: as many as the query heads (HF)
    assert cfg.rms_norm_eps == 1e-6  # None for a non-optional field: the HF default
    llama = raw_config(checkpoints, "llama4")
    cfg = config_class("llama4").from_hf({**llama, "head_dim": None})
    assert cfg.head_dim == 64 // 4
    gemma = config_class("gemma3").from_hf({**raw_config(checkpoints, "gemma3"), "final_logit_softcapping": 30})
    assert gemma.final_logit_softcapping == 30.0 and isinstance(gemma.final_logit_softcapping, float)


def test_hf_float_encoding_is_decoded(checkpoints):
    raw = raw_config(checkpoints, "mamba2")
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"}  # how transformers 5 writes inf
    cfg = config_class("mamba2").from_hf(raw)
    assert cfg.time_step_limit == [0.0, math.inf]


@pytest.mark.parametrize("bad", [[1, 2], "jamba", None])
def test_config_must_be_a_mapping(bad):
    with pytest.raises(ConfigError, match="jamba config is invalid: the config must be a JSON object"):
        config_class("jamba").from_hf(bad)


def test_generic_mechanism_for_a_new_family():
    @dataclass(kw_only=True)
    class ToyConfig(FamilyConfig):
        family: ClassVar[str] = "toy"
        widths: list[int] = param([8, 8], positive=True)
        kinds: list[str] | None = param(None, choices=("a", "b"))
        scale: float = 1.0
        window: int | None = param(16, positive=True)

    base = {"vocab_size": 10, "hidden_size": 4, "num_hidden_layers": 2, "future_key": {"x": 1}}
    cfg = ToyConfig.from_hf(base)
    assert cfg.widths == [8, 8] and cfg.window == 16 and cfg.extras == {"future_key": {"x": 1}}
    assert ToyConfig.from_hf({**base, "window": None}).window is None  # optional: null is a value
    assert ToyConfig.from_hf({**base, "scale": 2}).scale == 2.0
    with pytest.raises(ConfigError) as info:
        ToyConfig.from_hf({**base, "widths": [8, 0], "kinds": ["a", "c"], "scale": True, "window": 0}, family="toy2")
    assert info.value.problems == [
        "widths must be positive, got [8, 0]",
        "kinds has unknown entry 'c' (known: a, b)",
        "scale must be float, got True (bool)",
        "window must be positive, got 0",
    ]
    assert str(info.value).startswith("toy2 config is invalid")


def test_every_model_type_has_a_config_class():
    for model_type in MODEL_TYPES:
        assert issubclass(model_class(model_type).config_class, FamilyConfig)
