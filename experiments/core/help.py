"""`python run.py --help`: what the app does, the choices of each config group, the settings every run takes, and
examples; printed before torch is imported. Hydra's own flags stay under `--hydra-help`; the whole composed config
under `--cfg job` (with any overrides)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from experiments.core.config_schema import SCHEMA_GROUPS

DESCRIPTION = """\
hybridcache: run a hybrid language model (attention + recurrent layers) with a cache strategy you choose per layer,
and check it. The default experiment (correctness) generates greedily with the chosen cache plan, recomputes the
same tokens without a cache under the same plan (the oracle: an exact plan must match it, else the run exits 1),
and compares with a reference (HF transformers by default). A bad setting stops with one line, `error: ...`, and
exit status 2, before anything is loaded."""

USAGE = "usage: python run.py [-m] [group=choice ...] [key=value ...] [+new.key=value ...]"

SETTINGS = """\
  model.checkpoint=DIR|HUB_ID   a real checkpoint (default: a random tiny one of the family, built once)
  model.dtype=float32           float32 | bfloat16 | float16 | float64;  model.device=cpu | cuda[:i] | mps
  engine=ours                   ours: our model code | hf: HF transformers' modeling code with our cache
  max_new_tokens=32 top_k=5     tokens generated per prompt; top-k logprobs kept for the divergence check
  cache.attention.type=...      every attention layer: full | sliding | chunked | sink | snapkv | tova | ...
  cache.attention.window=N      cache.attention.chunk_size=N  cache.attention.storage=dense | int8 | int4 | kivi
  +cache.layers.<i>.type=...    one decoder layer (most specific wins: attention < native type < layers.<i>)
  logger.mode=offline           offline (default, no account) | online | disabled"""

EXAMPLES = """\
  python run.py model=jamba cache=hybrid_chunked          # the main run: the oracle, then agreement with HF
  python run.py model=gemma3 cache=hybrid_sliding cache.full.window=16
  python run.py model=jamba cache.attention.type=full cache.attention.storage=int8   # lossy: int8 keys and values
  python run.py engine=hf model.checkpoint=DIR cache=snapkv   # HF's own modeling code, any HF checkpoint
  python run.py -m model=jamba,gemma3 cache=native,hybrid_chunked   # a sweep: one run each, then a summary table
  python run.py experiment=benchmark experiment.smoke=true   # tokens/s, ours vs HF
  python run.py experiment=study model=gemma3_270m           # strategies vs native: perplexity, passkey, MQAR
  python run.py --cfg job model=gemma3                       # print the composed config and exit"""

FOOTER = """\
Exit status: 0 done | 1 an exact plan failed its oracle (or a crash) | 2 a user error | 3 the reference failed |
4 the operating system refused (disk, permissions). Outputs: outputs/DATE/TIME-.../ (results.json, console.log,
figures, the W&B run). Docs: docs/app.md, docs/experiments.md; Hydra's own flags: python run.py --hydra-help"""


def help_text(config_dir: str | Path) -> str:
    """The whole --help text, with the choices of each group read from `config_dir`."""
    lines = [DESCRIPTION, "", USAGE, "", "config groups (group=choice; * the default):"]
    defaults = _defaults(Path(config_dir))
    for group, choices in _groups(Path(config_dir)).items():
        shown = ", ".join(f"{c}*" if defaults.get(group) == c else c for c in choices)
        lines += textwrap.wrap(f"{group}: {shown}", 118, initial_indent="  ", subsequent_indent="    ")
    lines += ["", "common settings (key=value; a setting that does not exist needs +key=value):", SETTINGS]
    lines += ["", "examples:", EXAMPLES, "", FOOTER]
    return "\n".join(lines)


def _groups(config_dir: Path) -> dict[str, list[str]]:
    """Each user-facing group's choices (configs/<group>/*.yaml), schema groups left out."""
    out = {}
    for sub in sorted(p for p in config_dir.iterdir() if p.is_dir()):
        names = sorted(p.stem for p in sub.glob("*.yaml"))
        if names and sub.name not in SCHEMA_GROUPS:
            out[sub.name] = names
    return out


def _defaults(config_dir: Path) -> dict[str, str]:
    import yaml

    data = yaml.safe_load((config_dir / "config.yaml").read_text()) or {}
    return {k: v for d in data.get("defaults", []) if isinstance(d, dict) for k, v in d.items() if isinstance(v, str)}


def exit_on_help(argv: list[str], config_dir: str | Path) -> None:
    """`-h` / `--help` anywhere on the command line: print the help and exit 0 (Hydra's flags: --hydra-help)."""
    import sys

    if any(a in ("-h", "--help") for a in argv):
        print(help_text(config_dir))
        sys.exit(0)
