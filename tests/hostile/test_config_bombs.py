"""Config bombs (issue "Reliability, second pass", item 3): a config.json whose sizes would make from_pretrained
allocate gigabytes or build for minutes (mamba_d_state=2000000 was 12.6 s and 4 GiB, num_hidden_layers=10**6 still
building after 120 s, hidden_size=10**12 a raw overflow error, rms_norm_eps=Infinity loaded). Each is refused by a
named error that names the field, before anything large is allocated, and every family's tiny checkpoint still
loads, before and after the bombs, in the same process.

The loads run in a child process: its peak resident memory (ru_maxrss) after the legitimate loads is the baseline,
and it may grow by at most GROWTH_MB over all the bombs; a build that runs away ends in the child's timeout, not a
hung suite. The generated inputs set each family's int fields (those of its typed config and its tiny config) to
huge, negative, zero or wrongly typed values: each must be refused by name or load (many fields size nothing)."""

import dataclasses
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from hybridcache.checkpoints.tiny import FAMILIES
from hybridcache.models.core.registry import model_class
from tests.hostile.kit import COUNTS, report, rng

ROOT = Path(__file__).resolve().parents[2]
GROWTH_MB = 200
TIMEOUT_S = 400
INF = {"__float__": "Infinity"}  # HF's JSON for float("inf")

# (family, config changes, the field the error must name; None: a named error is enough)
PINNED = [
    ("jamba", {"mamba_d_state": 2_000_000}, "mamba_d_state"),
    ("jamba", {"num_hidden_layers": 10**6}, "num_hidden_layers"),
    ("jamba", {"num_experts": 10**6}, "num_experts"),
    ("jamba", {"hidden_size": 10**12}, "hidden_size"),
    ("jamba", {"intermediate_size": 10**9}, "intermediate_size"),
    ("gemma3", {"rms_norm_eps": INF}, "rms_norm_eps"),
    ("gemma3", {"rms_norm_eps": float("inf")}, "rms_norm_eps"),  # JSON's bare Infinity
    ("gemma3", {"rms_norm_eps": {"__float__": "-Infinity"}}, "rms_norm_eps"),
    ("gemma3", {"rope_theta": INF}, "rope_theta"),
    ("gemma3", {"intermediate_size": 10**12}, "intermediate_size"),
    ("gemma3", {"vocab_size": 10**12}, "vocab_size"),
    ("gemma3", {"num_attention_heads": 10**9, "num_key_value_heads": 1}, "num_attention_heads"),
    ("gemma3", {"head_dim": 10**12}, "head_dim"),
    ("gemma3", {"hidden_size": -64}, "hidden_size"),
    ("gemma3", {"num_hidden_layers": True}, "num_hidden_layers"),
    ("gemma3", {"intermediate_size": 128.5}, "intermediate_size"),
    ("gemma3", {"vocab_size": 2**62}, "vocab_size"),
    ("gpt_oss", {"num_local_experts": 10**6}, "num_local_experts"),
    ("bamba", {"mamba_d_state": 2_000_000}, "mamba_d_state"),
    ("zamba", {"mamba_d_state": 2_000_000}, "mamba_d_state"),
    ("mamba", {"state_size": 2_000_000}, "state_size"),
    ("qwen3_next", {"linear_num_value_heads": 10**9}, "linear_num_value_heads"),
    ("recurrentgemma", {"lru_width": 10**12}, "lru_width"),
    ("nemotron_h", {"layers_block_type": ["mamba"] * 10**5}, "num_hidden_layers"),
    ("kimi_linear", {"num_experts": 0}, None),  # was a plain ValueError from the MoE block
    ("lfm2", {"block_ffn_dim_multiplier": 1e308}, None),  # was OverflowError: the FFN size is infinite
]
VALUES = [10**6, 10**9, 10**12, 2**31, 2**62, -1, -(10**12), 0, True, 1.5, "64", [64]]

# The child: the legitimate loads (must load), the baseline, one JSON line per bomb (kit.outcome's verdict: None
# for a named error with a message), the legitimate loads again, the peak growth.
CHILD = """
import json, resource, sys
import hybridcache as hc
from tests.hostile.kit import outcome
job = json.loads(sys.stdin.read())
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
for d in job["legit"]:
    hc.from_pretrained(d)
base = peak_mb()
for i, d in enumerate(job["bombs"]):
    message = []
    def call(d=d):
        try:
            hc.from_pretrained(d)
        except Exception as e:
            message.append(str(e))
            raise
    print(json.dumps({"i": i, "why": outcome(call), "message": message[0] if message else ""}), flush=True)
for d in job["legit"]:
    hc.from_pretrained(d)
print(json.dumps({"growth_mb": peak_mb() - base}), flush=True)
"""


def variant(source: Path, target: Path, changes: dict) -> Path:
    """`source` with config.json changed; the other files hard-linked."""
    target.mkdir(parents=True)
    for f in source.iterdir():
        if f.name != "config.json":
            os.link(f, target / f.name)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def int_fields(family_dir: Path) -> list[str]:
    """The int fields of the family's typed config and of its tiny config.json."""
    config = json.loads((family_dir / "config.json").read_text())
    cls = model_class(config["model_type"]).config_class
    hints = typing.get_type_hints(cls)
    typed = {f.name for f in dataclasses.fields(cls) if "int" in str(hints[f.name])}
    given = {k for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
    return sorted(typed | given)


def test_config_bombs_are_refused_by_name_without_allocating(checkpoints, tmp_path):
    sources = {family: Path(checkpoints(family)) for family in FAMILIES}
    cases = [
        (f"{family} {changes}", variant(sources[family], tmp_path / f"p{i}", changes), field)
        for i, (family, changes, field) in enumerate(PINNED)
    ]
    r = rng("config bombs")
    for family in FAMILIES:
        fields = int_fields(sources[family])
        for name in r.sample(fields, min(8, len(fields))):
            changes = {name: r.choice(VALUES)}
            d = variant(sources[family], tmp_path / f"g{len(cases)}", changes)
            cases.append((f"{family} {name}={changes[name]!r}", d, None))
    job = {"legit": [str(s) for s in sources.values()], "bombs": [str(d) for _, d, _ in cases]}
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD],
            cwd=ROOT,
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        lines, failed = done.stdout.splitlines(), done.returncode and done.stderr.strip().splitlines()[-1:]
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        lines, failed = out.splitlines(), [f"the child was still loading after {TIMEOUT_S} s"]
    results = [json.loads(line) for line in lines]
    verdicts = {res["i"]: res for res in results if "i" in res}
    problems = []
    for i, (description, _, field) in enumerate(cases):
        COUNTS["config bombs"] += 1
        res = verdicts.get(i)
        if res is None:
            problems.append(f"{description}: never finished (" + "; ".join(failed or ["the child stopped"]) + ")")
            continue
        pinned = i < len(PINNED)
        why = res["why"]
        if why == "accepted" and not pinned:
            continue  # a field that sizes nothing (a token id, a window): it loads
        if not why and field and field not in res["message"]:
            why = f"the error does not name {field}: {res['message'][:300]}"
        if why:
            problems.append(f"{description}: {why}")
    growth = [res["growth_mb"] for res in results if "growth_mb" in res]
    if not growth:
        problems.append("the legitimate checkpoints did not load again after the bombs: " + "; ".join(failed or []))
    elif growth[0] > GROWTH_MB:
        problems.append(f"peak memory grew by {growth[0]:.0f} MB over the bombs (at most {GROWTH_MB})")
    assert not problems, report(problems, len(cases))


@pytest.mark.parametrize(
    "family, field, value",
    [
        ("gemma3", "rms_norm_eps", float("inf")),
        ("falcon_h1", "embedding_multiplier", float("-inf")),  # a plain float field, no sign constraint
        ("falcon_h1", "attention_in_multiplier", float("inf")),
        ("nemotron_h", "time_step_min", float("inf")),
        ("bamba", "time_step_limit", [0.0, float("-inf")]),
    ],
)
def test_infinite_floats_are_refused_unless_the_field_holds_one_by_default(checkpoints, family, field, value):
    """Every float field is finite, but where its HF default holds an infinity: time_step_limit's [0, inf] loads,
    [0, -inf] does not."""
    from hybridcache.models import ConfigError

    config = json.loads((Path(checkpoints(family)) / "config.json").read_text())
    cls = model_class(config["model_type"]).config_class
    with pytest.raises(ConfigError, match=rf"{field} must be (finite|>= 0), got"):
        cls.from_hf({**config, field: value})
    if field == "time_step_limit":
        assert cls.from_hf({**config, field: [0.0, float("inf")]}).time_step_limit == [0.0, float("inf")]


def test_a_checkpoint_larger_than_the_memory_there_is_is_refused_before_reading(checkpoints, monkeypatch):
    """The weights to read, at the dtype asked for, against the memory available (here made 1 KiB, and every
    size asked about): a CheckpointError saying how much, and no tensor read."""
    import hybridcache as hc
    import hybridcache.models.core.loading as loading
    from hybridcache.models import CheckpointError

    monkeypatch.setattr(loading, "ALWAYS_FITS", 0)
    monkeypatch.setattr(loading, "available_bytes", lambda device: 1024)
    monkeypatch.setattr(loading, "read_tensors", lambda *a, **k: pytest.fail("tensors read before the memory check"))
    with pytest.raises(CheckpointError, match=r"tensors need at least .* of memory on cpu, only 1.0 KiB is available"):
        hc.from_pretrained(checkpoints("gemma3"), dtype=torch.float64)
