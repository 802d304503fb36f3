"""vLLM as a live reference, run as a subprocess of a separate interpreter (its own environment), over JSON.

The worker runs in its own session (process group): vLLM starts engine-core processes of its own, and a timeout,
a failure or an interrupt ends the whole group (SIGTERM, then SIGKILL after a grace period), so no engine keeps its
memory after we give up on it. A failure is reported by its root cause (the engine's own exception), first.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from hybridcache.reference.base import Generation, MalformedGeneration, ReferenceAnswerError, ReferenceRunner

WORKER = Path(__file__).with_name("vllm_worker.py")
GRACE_SECONDS = 5.0

# vLLM's log prefix: "(EngineCore_DP0 pid=123) ERROR 01-02 03:04:05 [core.py:700] " (process tag optional).
_PREFIX = re.compile(r"^(\([^)]*pid=\d+\)\s*)?((DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s?)?")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_][\w.]*)?(Error|Exception|Interrupt|Exit|Failure))(: .*)?$")
# Exceptions that only say "look above" (or quote another's message): never the root cause.
_WRAPPERS = (
    "See root cause above",
    "Engine core initialization failed",
    "EngineDeadError",
    "EngineCore encountered an issue",
    "EngineGenerateError",
    "check the stack trace above",
    "See stack trace for root cause",
    "in a background process",
)


def _strip(line: str) -> str:
    return _PREFIX.sub("", line.rstrip(), count=1)


def _traceback_ends(lines: list[str]) -> list[str]:
    """The exception line that ends each traceback, in order of appearance."""
    ends, inside = [], False
    for raw in lines:
        text = _strip(raw)
        if text.startswith("Traceback (most recent call last)"):
            inside = True
        elif inside and not text.startswith((" ", "\t")) and _EXCEPTION.match(text):
            ends.append(text)
            inside = False
    return ends


def root_cause(stderr: str, stdout: str = "") -> str:
    """The engine's own exception first (the last traceback that is not a wrapper saying "see above"), then the
    other distinct exceptions; warnings (a warm-up's, say) are never picked. Falls back to ERROR lines, then the
    tail."""
    lines = (stderr + "\n" + stdout).splitlines()
    ends = _traceback_ends(lines)
    real = [e for e in ends if not any(w in e for w in _WRAPPERS)]
    causes = []
    for e in real[-1:] + real[::-1] + ends[::-1]:
        if e not in causes:
            causes.append(e)
    if not causes:  # no traceback: ERROR-level lines that name an exception
        for raw in lines:
            text = _strip(raw)
            if re.search(r"\bERROR\b", raw) and _EXCEPTION.match(text) and text not in causes:
                causes.append(text)
    if not causes:
        tail = [line for line in lines if line.strip()][-10:]
        return "\n".join(tail) if tail else "(it printed nothing)"
    return causes[0] + "".join(f"\n  (also: {c})" for c in causes[1:3])


def last_output(stderr: str, stdout: str = "") -> str:
    """The last thing the worker printed (vLLM logs to stdout, progress bars to stderr), prefix stripped."""
    for text in (stdout, stderr):
        lines = [_strip(piece) for line in text.splitlines() for piece in line.split("\r")]
        lines = [line.strip() for line in lines if line.strip()]
        if lines:
            return lines[-1][:300]
    return "(nothing yet)"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a member we may not signal: treat as gone
        return False


def _wait_gone(proc: subprocess.Popen, pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        proc.poll()  # reap the worker itself (a zombie still counts as a member of its group)
        if proc.returncode is not None and not _group_alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """End the worker's whole process group: SIGTERM, then SIGKILL to whatever is left after `grace` seconds."""
    pgid = proc.pid  # the worker leads its own session, hence its group
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        if _wait_gone(proc, pgid, wait):
            break
    if proc.poll() is None:
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (uninterruptible sleep)
            pass


def run_worker(
    command: list[str], timeout: float, log_dir: Path, grace: float = GRACE_SECONDS, label: str = "vLLM"
) -> tuple[int, str, str]:
    """Run `command` in its own session with stdout/stderr in files; on timeout, failure or interrupt (and after
    success, for stragglers) end its whole process group. Returns (exit status, stdout, stderr); raises
    TimeoutError (with the root cause so far) when it ran past `timeout`."""
    out_path, err_path = log_dir / "worker.stdout", log_dir / "worker.stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        before_kill = None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # what it printed before we ended it (ending it makes vLLM log errors too)
            before_kill = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
        finally:  # also on KeyboardInterrupt and any other exception
            kill_group(proc, grace)
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    if before_kill is not None:
        out_text, err_text = before_kill
        failed = _traceback_ends((err_text + "\n" + out_text).splitlines())
        state = (
            f"it had failed: {root_cause(err_text, out_text)}"
            if failed
            else f"it had not failed; its last output: {last_output(err_text, out_text)}"
        )
        raise TimeoutError(
            f"the {label} subprocess gave no answer within {timeout:g} s (reference.timeout); its "
            f"process group was ended. Before that, {state}"
        )
    return proc.returncode, stdout, stderr


def find_interpreter(python: str | None) -> str:
    """The vLLM environment's interpreter, or a clear error saying how to set one."""
    if not python:
        raise ValueError(
            "reference=vllm needs reference.python=<the python of a vLLM environment> "
            "(or HYBRIDCACHE_VLLM_PYTHON); see the README for how to create one"
        )
    resolved = shutil.which(python) or (python if Path(python).is_file() else None)
    if resolved is None:
        raise FileNotFoundError(f"reference.python={python} is not an interpreter on this machine")
    return resolved


class VLLMRunner(ReferenceRunner):
    name = "vllm"

    def __init__(
        self,
        python: str | None,
        checkpoint: str,
        dtype: str = "float32",
        max_model_len: int = 2048,
        eos_token_id: int | None = None,
        timeout: float = 1800,
        engine_args: dict | None = None,
        platform: str = "auto",
        worker: str | Path = WORKER,
    ) -> None:
        from hybridcache.models.core.checkpoint_files import read_config  # (regular files inside the directory only)
        from hybridcache.reference.vllm_families import vllm_engine_args

        resolved = find_interpreter(python)
        self.python, self.checkpoint, self.dtype = resolved, str(checkpoint), dtype
        self.max_model_len, self.eos_token_id, self.timeout = max_model_len, eos_token_id, timeout
        self.worker = Path(worker)
        config = read_config(Path(checkpoint))
        self.architectures = config.get("architectures") or []
        # the family's engine arguments (checked: raises VLLMIncompatible when vLLM cannot run it here)
        self.engine_args = vllm_engine_args(config, dtype, dict(engine_args or {}), platform, resolved)
        self.engine_seconds = 0.0

    def generate(self, prompts: list[list[int]], max_new_tokens: int, top_k: int, progress=None) -> list[Generation]:
        request = {
            "model": self.checkpoint,
            "dtype": self.dtype,
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "top_k": top_k,
            "max_model_len": self.max_model_len,
            "architectures": self.architectures,
            "stop_token_ids": [self.eos_token_id] if self.eos_token_id is not None else [],
            "engine_args": self.engine_args,
        }
        answer = self._ask(request)
        out = generations_from_answer(answer, prompts, max_new_tokens)
        self.engine_seconds = _seconds(answer, "engine_seconds")
        if progress is not None:
            for _ in out:
                progress()
        return out

    def time_batches(self, batches: list[list[list[int]]], max_new_tokens: int, repeats: int = 1) -> list[dict]:
        """Prefill and decode timings per batch of prompts, all in one engine (its start is `engine_seconds`):
        [{"batch", "prefill_samples", "decode_samples"}], seconds per repeat, each phase timed on its own (the worker's
        `phases`: to every request's first token, then to the last)."""
        request = {
            "model": self.checkpoint,
            "dtype": self.dtype,
            "prompts": [],
            "max_new_tokens": max_new_tokens,
            "top_k": 1,
            "max_model_len": self.max_model_len,
            "architectures": self.architectures,
            "engine_args": self.engine_args,
            "repeats": repeats,
            "timing": [{"prompts": b} for b in batches],
        }
        answer = self._ask(request)
        timings = timings_from_answer(answer, batches, repeats)
        self.engine_seconds = _seconds(answer, "engine_seconds")
        return timings

    def _ask(self, request: dict) -> dict:
        """Run the worker on one request in its own process group; its answer, or the root cause of its failure."""
        with tempfile.TemporaryDirectory() as tmp:
            req, ans = Path(tmp) / "request.json", Path(tmp) / "answer.json"
            req.write_text(json.dumps(request))
            code, stdout, stderr = run_worker(
                [self.python, str(self.worker), str(req), str(ans)], self.timeout, Path(tmp)
            )
            if not ans.exists():
                raise RuntimeError(f"the vLLM subprocess failed (exit {code}): {root_cause(stderr, stdout)}")
            answer = read_answer(ans.read_bytes(), code)
        if "error" in answer:
            raise RuntimeError(f"vLLM reference: {answer['error']}")
        return answer


# -- the worker's answer, checked like any file we read ------------------------------------------------------------
def read_answer(data: bytes, code: int | None = None) -> dict:
    """The worker's answer file as a JSON object; anything else (cut short, not JSON) is a ReferenceAnswerError."""
    exit_note = f", worker exit status {code}" if code is not None else ""
    try:
        answer = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ReferenceAnswerError(
            f"the vLLM worker's answer is not JSON ({len(data)} bytes{exit_note}: {str(e)[:120]}); cut short?"
        ) from None
    if not isinstance(answer, dict):
        raise ReferenceAnswerError(f"the vLLM worker's answer is a JSON {type(answer).__name__}, not an object")
    if "error" in answer and not isinstance(answer["error"], str):
        raise ReferenceAnswerError(f"the vLLM worker's error is a {type(answer['error']).__name__}, not a message")
    return answer


def generations_from_answer(answer: dict, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
    """One checked Generation per prompt, in order: as many results as prompts, each for its own prompt, with at
    most max_new_tokens tokens (Generation.from_json checks types, finite logprobs and lengths)."""
    results = answer.get("results")
    if not isinstance(results, list):
        raise ReferenceAnswerError(f"the vLLM worker's answer has no results list (keys: {sorted(answer)[:8]})")
    if len(results) != len(prompts):
        raise ReferenceAnswerError(f"the vLLM worker answered {len(results)} results for {len(prompts)} prompts")
    out = []
    for i, (result, prompt) in enumerate(zip(results, prompts)):
        try:
            g = Generation.from_json(result)
        except MalformedGeneration as e:
            raise ReferenceAnswerError(f"the vLLM worker's result {i}: {e}") from None
        if g.prompt != list(prompt):
            raise ReferenceAnswerError(f"the vLLM worker's result {i} is for another prompt than prompt {i}")
        if len(g.tokens) > max_new_tokens:
            raise ReferenceAnswerError(
                f"the vLLM worker's result {i} has {len(g.tokens)} tokens, more than max_new_tokens={max_new_tokens}"
            )
        out.append(g)
    return out


def timings_from_answer(answer: dict, batches: list[list[list[int]]], repeats: int) -> list[dict]:
    """The timing answer checked: one entry per batch, its size, `repeats` finite seconds per phase."""
    timings = answer.get("timings")
    if not isinstance(timings, list) or len(timings) != len(batches):
        got = f"{len(timings)} entries" if isinstance(timings, list) else f"no timings list ({type(timings).__name__})"
        raise ReferenceAnswerError(f"the vLLM worker's timing answer has {got} for {len(batches)} batches")
    for i, (t, batch) in enumerate(zip(timings, batches)):
        if not isinstance(t, dict) or t.get("batch") != len(batch) or isinstance(t.get("batch"), bool):
            raise ReferenceAnswerError(f"the vLLM worker's timing {i} is not for a batch of {len(batch)} prompts")
        for phase in ("prefill_samples", "decode_samples"):
            samples = t.get(phase)
            if not isinstance(samples, list) or len(samples) != repeats:
                raise ReferenceAnswerError(f"the vLLM worker's timing {i} needs {repeats} {phase}, got {samples!r:.60}")
            for j in range(len(samples)):
                _seconds(samples, j, f"timing {i} {phase}")
    return timings


def _seconds(container, key, what: str | None = None) -> float:
    value = container[key] if isinstance(container, list) or key in container else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ReferenceAnswerError(
            f"the vLLM worker's {what or key}{f'[{key}]' if what else ''} must be a finite number of seconds >= 0, "
            f"got {value!r:.40}"
        )
    return float(value)
