"""vLLM as a live reference, run as a subprocess of a separate interpreter (its own environment), over JSON."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from hybridcache.reference.base import Generation, ReferenceRunner

WORKER = Path(__file__).with_name("vllm_worker.py")


def _root_cause(proc: subprocess.CompletedProcess) -> str:
    """The first exception lines vLLM printed (its workers log them far above the final traceback)."""
    lines = (proc.stderr + proc.stdout).splitlines()
    causes = []
    for line in lines:
        text = re.sub(r"^\([^)]*pid=\d+\) (ERROR|WARNING) [^\]]*\] ", "", line).strip()
        if re.match(r"^[\w.]*(Error|Exception): ", text) and text not in causes:
            causes.append(text)
    return "\n".join(causes[:3]) if causes else "\n".join(lines[-15:])


def find_interpreter(python: str | None) -> str:
    """The vLLM environment's interpreter, or a clear error saying how to set one."""
    if not python:
        raise ValueError("reference=vllm needs reference.python=<the python of a vLLM environment> "
                         "(or HYBRIDCACHE_VLLM_PYTHON); see the README for how to create one")
    resolved = shutil.which(python) or (python if Path(python).is_file() else None)
    if resolved is None:
        raise FileNotFoundError(f"reference.python={python} is not an interpreter on this machine")
    return resolved


class VLLMRunner(ReferenceRunner):
    name = "vllm"

    def __init__(self, python: str | None, checkpoint: str, dtype: str = "float32", max_model_len: int = 2048,
                 eos_token_id: int | None = None, timeout: float = 1800, engine_args: dict | None = None) -> None:
        resolved = find_interpreter(python)
        self.python, self.checkpoint, self.dtype = resolved, str(checkpoint), dtype
        self.max_model_len, self.eos_token_id, self.timeout = max_model_len, eos_token_id, timeout
        self.engine_args = dict(engine_args or {})
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        self.architectures = config.get("architectures") or []
        self.engine_seconds = 0.0

    def generate(self, prompts: list[list[int]], max_new_tokens: int, top_k: int, progress=None) -> list[Generation]:
        request = {"model": self.checkpoint, "dtype": self.dtype, "prompts": prompts, "max_new_tokens": max_new_tokens,
                   "top_k": top_k, "max_model_len": self.max_model_len, "architectures": self.architectures,
                   "stop_token_ids": [self.eos_token_id] if self.eos_token_id is not None else [],
                   "engine_args": self.engine_args}
        with tempfile.TemporaryDirectory() as tmp:
            req, ans = Path(tmp) / "request.json", Path(tmp) / "answer.json"
            req.write_text(json.dumps(request))
            proc = subprocess.run([self.python, str(WORKER), str(req), str(ans)], capture_output=True, text=True,
                                  timeout=self.timeout)
            if not ans.exists():
                raise RuntimeError(f"the vLLM subprocess failed (exit {proc.returncode}):\n{_root_cause(proc)}")
            answer = json.loads(ans.read_text())
        if "error" in answer:
            raise RuntimeError(f"vLLM reference: {answer['error']}")
        self.engine_seconds = answer["engine_seconds"]
        out = [Generation.from_json(r) for r in answer["results"]]
        if progress is not None:
            for _ in out:
                progress()
        return out
