"""The app's settings declared once, as dataclasses registered in Hydra's ConfigStore (structured configs).

The YAML files in configs/ give values; these classes give the fields and their types. A YAML file opts in with its
defaults list (`- /schema/benchmark@_here_`; a cache preset `- /cache_schema/base@_here_`, which extends
schema/cache), so a value of the wrong type or a key that does not exist, in a file or on the command line, is an
OmegaConf error naming the key (run.py prints it on one line with exit status 2: experiments/core/usage.py). A preset or
model file that does not opt in (one added by a plugin, or a new family's model with fields of its own) composes
untyped, as before. A new key can still be added on purpose with `+key=value` (a plugin type's own parameter).

A new setting of an experiment is a field here plus its value in the YAML file.

Registered (`register()`, run at `import experiments`, idempotent; no torch):
  schema/cache          every cache preset (via configs/cache_schema/base.yaml): attention / full / sliding /
                        chunked share ONE entry type
  schema/model          every model
  schema/logger, schema/generation
  schema/<experiment>   correctness, benchmark, study, long_context, press_check, train, drift
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# -- cache presets ---------------------------------------------------------------------------------------------------
@dataclass
class AttentionEntry:
    """One attention entry: `attention` (every attention layer) or `full` / `sliding` / `chunked` (only layers whose
    native type is that name). null: not set (the layer keeps its native type and parameters)."""

    type: str | None = None  # full | sliding | chunked | sink | a score-based method | a plugin's type
    window: int | None = None  # sliding, sink: visible tokens
    chunk_size: int | None = None  # chunked
    sinks: int | None = None  # sink: first tokens always kept
    budget: int | None = None  # score-based methods: tokens kept per row (and head)
    compression_ratio: float | None = None  # score-based methods: fraction of the prompt evicted (kvpress's)
    schedule: str | None = None  # score-based methods: prefill | continuous
    storage: str | None = None  # dense | int8 | int4 | offload | kivi | hf_quantized
    q_group_size: int | None = None  # int8 / int4 / kivi / hf_quantized: elements per scale
    residual: int | None = None  # the most recent tokens also kept unquantized
    nbits: int | None = None  # kivi / hf_quantized: 2 or 4 bits
    axis_key: int | None = None  # hf_quantized: quanto's axis for keys, 0 (per token) or -1 (per channel)
    axis_value: int | None = None  # hf_quantized: the same for values


@dataclass
class RecurrentEntry:
    """Every recurrent layer (mamba, mamba2, rglru, conv, gated_delta)."""

    type: str | None = None
    state_dtype: str | None = None  # float32 unless set (conv: the model dtype)
    rollback: int | None = None  # keep the states after each of the last k columns (crop(n) rewinds k)
    state_codec: str | None = None  # dense | float32 | bfloat16 | float16 | float8_* | int8 | int4
    state_group: str | None = None  # scaled codecs: channel (default) | head
    quantize_conv: bool | None = None  # the codec also holds the conv state (default false)
    offload: bool | None = None  # hold the states off the compute device between blocks
    rounding: str | None = None  # nearest (default) | stochastic (docs/state_drift.md)
    rounding_seed: int | None = None  # seed of stochastic rounding (default 0)
    error_feedback: bool | None = None  # hold the quantization residual and add it back before the next encode
    error_codec: str | None = None  # how that residual is held (default: dense)


@dataclass
class CacheSchema:
    """What every cache preset extends (configs/cache/*.yaml). Most specific wins: attention / recurrent < full /
    sliding / chunked < layers.<i> (one decoder layer; "<i>.<member>" inside a group)."""

    preallocate: bool = False  # static storage for prompt + max_new_tokens (ring buffers for sliding / chunked)
    plugins: list[str] = field(default_factory=list)  # modules that register more cache types, imported first
    attention: AttentionEntry = field(default_factory=AttentionEntry)
    full: AttentionEntry = field(default_factory=AttentionEntry)
    sliding: AttentionEntry = field(default_factory=AttentionEntry)
    chunked: AttentionEntry = field(default_factory=AttentionEntry)
    recurrent: RecurrentEntry = field(default_factory=RecurrentEntry)
    layers: Any = field(default_factory=dict)  # per decoder layer: +cache.layers.3.type=sliding (free-form)


# -- model, logger, generation ---------------------------------------------------------------------------------------
@dataclass
class ModelSchema:
    family: str = "???"
    checkpoint: str | None = None  # null: a tiny random model of the family (fixed seed); or a directory / hub id
    seed: int = 0  # seed of the tiny checkpoint
    size: str = "tiny"  # tiny | 20m (jamba) | vllm: the default checkpoint's size
    dtype: str = "float32"
    weights: str | None = None  # null: projections in dtype; bfloat16 | int8 | q8_0: packed
    device: str = "cpu"


@dataclass
class LoggerSchema:
    mode: str = "offline"  # offline | online | disabled
    project: str = "hybridcache"
    group: str | None = None  # null: "sweep-<date>-<time>" in multirun, else none


@dataclass
class GenerationSchema:
    compile: bool = False  # torch.compile the decode step over a preallocated cache


# -- experiments -----------------------------------------------------------------------------------------------------
@dataclass
class CorrectnessSchema:
    name: str = "correctness"


@dataclass
class LongContext:
    tokens: list[int] = field(default_factory=lambda: [1024])
    decode_tokens: int = 16
    prefill_chunk_size: int = 512
    window: int = 64
    chunk_size: int = 64
    recurrent_model: str = "mamba2"


@dataclass
class CacheOps:
    enabled: bool = True
    new_tokens: int = 32
    num_draft_tokens: list[int] = field(default_factory=lambda: [2, 4])
    draft_layers: float = 0.5
    requests: int = 4
    system_tokens: int = 96
    block_size: int = 16


@dataclass
class BenchmarkSchema:
    name: str = "benchmark"
    smoke: bool = False
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    prompt_tokens: int = 128
    new_tokens: int = 32
    warmup: int = 1
    repeats: int = 3
    compile: bool = False
    weights: list[str] = field(default_factory=list)
    bandwidth_probe_mib: int = 1024
    max_spread: float | None = None  # a relative interquartile spread above this is unreliable (null: 0.25)
    max_repeats: int | None = None  # rounds while a spread is too wide (null: 3 x repeats)
    long_context: LongContext = field(default_factory=LongContext)
    cache_ops: CacheOps = field(default_factory=CacheOps)


@dataclass
class DecodingPressCase:
    """One decoding-time case of press_check: ours in `schedule` vs kvpress's DecodingPress / PrefillDecodingPress."""

    method: str = "tova"
    schedule: str = "decoding"  # decoding | prefill_decoding
    budget: int = 256  # kvpress's target_size
    compression_interval: int = 16
    compression_ratio: float | None = None  # the prompt's (prefill_decoding only)


@dataclass
class PressCheckSchema:
    name: str = "press_check"
    methods: list[str] = field(default_factory=list)
    ratios: list[float] = field(default_factory=lambda: [0.5])
    context: int = 400
    continuation: int = 64
    text: str = "pydoc"
    hf_quantized: list[int] = field(default_factory=list)
    decoding: list[DecodingPressCase] = field(default_factory=list)
    decoding_greedy: int = 16  # tokens decoded greedily by both under each decoding-time press


@dataclass
class Passkey:
    lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=list)
    trials: int = 1
    strategies: list[str] | None = None  # null: every strategy
    digits: int = 5
    seed: int = 0


@dataclass
class Mqar:
    pairs: list[int] = field(default_factory=list)
    queries: int = 16
    trials: int = 4
    strategies: list[str] | None = None
    seed: int = 0


@dataclass
class Ruler:
    tasks: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=list)
    trials: int = 1
    max_new_tokens: int | None = None  # null: RULER's own
    strategies: list[str] | None = None
    seed: int = 0


@dataclass
class StudySchema:
    name: str = "study"
    smoke: bool = False
    baseline: str = "native"  # the strategy every other is compared with
    controls: bool = True
    insensitive_kl: float = 1.0e-3
    only: list[str] | None = None  # null: every strategy
    text: str = "pydoc"
    documents: int = 1
    lengths: list[int] = field(default_factory=list)
    block: int = 128
    greedy_tokens: int = 4
    continuation: int = 64
    passkey: Passkey = field(default_factory=Passkey)
    mqar: Mqar = field(default_factory=Mqar)
    ruler: Ruler = field(default_factory=Ruler)
    references: dict[str, Any] = field(default_factory=dict)  # strategy -> {reference, agreement}
    strategies: dict[str, Any] = field(default_factory=dict)  # strategy -> a cache-config mapping (free-form)


@dataclass
class Niah:
    """The needle-in-a-haystack grid of experiment=long_context: one RULER needle task at depth x length."""

    task: str = "niah_single_2"
    lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=list)
    trials: int = 1
    max_new_tokens: int | None = None  # null: RULER's own
    strategies: list[str] | None = None  # null: every strategy
    seed: int = 0


@dataclass
class LongContextSchema(StudySchema):
    """experiment=long_context: the study's strategies (its YAML composes the study first) at long prompt lengths."""

    name: str = "long_context"
    chunk: int = 1024  # prefill chunk in tokens (a compress-after-prefill strategy gets its prompt in one block)
    threads: int = 1  # torch threads of each worker process
    niah: Niah = field(default_factory=Niah)
    reference_scoring: str | None = None  # a RULER checkout whose own scoring code re-scores every answer


@dataclass
class TrainSize:
    hidden: int = 256
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 640
    attention_every: int = 3
    mamba_heads: int = 8
    state: int = 64
    chunk: int = 64
    conv: int = 4  # Mamba2 conv kernel (bytes each conv sees, itself included)
    max_positions: int = 4096


@dataclass
class TrainSchema:
    name: str = "train"
    arch: str = "hybrid"  # hybrid | attention
    threads: int = 1
    run_dir: str | None = None
    stop_at: int | None = None
    seed: int = 0
    steps: int = 450
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2.0e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mix: dict[str, float] = field(default_factory=dict)
    recall_steps: int = 0
    recall_share: float = 0.75
    recall_lr: float = 1.0e-3
    recall_warmup: int = 10
    recall_seq_len: int = 512
    recall_batch_size: int = 4
    recall_max_pairs: int = 24
    attention_window: int | None = None
    ssm_init: str = "hf"
    eval_len: int = 512
    eval_windows: int = 64
    probe_windows: int = 8
    control_windows: int = 8
    eval_every: int = 50
    checkpoint_every: int = 25
    sizes: dict[str, TrainSize] = field(default_factory=dict)


@dataclass
class DriftSchema:
    name: str = "drift"
    smoke: bool = False
    text: str = "pydoc"
    feed: str = "greedy"  # greedy | text
    rows: int = 2
    prompt_tokens: int = 64
    decode_tokens: int = 2048
    windows: list[list[int]] = field(default_factory=lambda: [[0, 500], [500, 1000], [1000, 2000]])
    smooth: int = 64
    seed: int = 0
    variants: list[str] = field(default_factory=list)  # codec[+sr][+ef[:error_codec]]
    controls: list[str] = field(default_factory=list)  # ablate_ssm | ablate_state


SCHEMAS = {
    ("schema", "cache"): CacheSchema,
    ("schema", "model"): ModelSchema,
    ("schema", "logger"): LoggerSchema,
    ("schema", "generation"): GenerationSchema,
    ("schema", "correctness"): CorrectnessSchema,
    ("schema", "benchmark"): BenchmarkSchema,
    ("schema", "press_check"): PressCheckSchema,
    ("schema", "study"): StudySchema,
    ("schema", "long_context"): LongContextSchema,
    ("schema", "train"): TrainSchema,
    ("schema", "drift"): DriftSchema,
}
#: Config groups that hold schemas, not choices a user makes.
SCHEMA_GROUPS = {"schema", "cache_schema"}


def register() -> None:
    """Store every schema in Hydra's ConfigStore (again is harmless)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        store.store(group=group, name=name, node=node)
