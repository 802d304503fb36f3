"""What the plugin-family tests share: install a plugin package the way a user would (`pip install --target`, from a
copy so the repo tree stays clean), save a tiny random HF checkpoint, and run a check script in a fresh interpreter
that has only the install target (and the repo, for hybridcache) on its path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hybridcache.checkpoints.tiny import reinit_weights_

ROOT = Path(__file__).resolve().parents[2]


def install_plugin(tmp_path_factory, name: str) -> Path:
    """pip-installs examples/plugins/<name> (its pyproject.toml and entry point) into a fresh target directory."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("src") / name
    subprocess.run(["cp", "-r", str(ROOT / "examples" / "plugins" / name), str(build)], check=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", target]
    subprocess.run([*cmd, str(build)], check=True, capture_output=True)
    return target


def save_tiny(model_class, config, path: Path) -> Path:
    """An HF model of `model_class` with weights drawn like the in-tree tiny models, saved (safetensors) at `path`."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        reinit_weights_(model, config, seed=0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def run_fresh(installed: Path, script: str, *args: str, timeout: int = 600) -> dict:
    """Runs `script` in a fresh interpreter; the JSON object its last output line prints."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print({k: v for k, v in out.items() if k != "families"})
    return out
