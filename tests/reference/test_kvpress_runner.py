"""The kvpress runner: without kvpress, its errors (no interpreter, a crash, a hang, forged or invalid result files);
with HYBRIDCACHE_KVPRESS_PYTHON and the real Gemma 3 270M, live presses whose kept positions must obey invariants."""

import ast
import json
import math
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hybridcache.reference import kvpress_runner
from hybridcache.reference.kvpress_runner import (
    PRESS_NAMES,
    WORKER,
    KvpressTimeout,
    KvpressUnavailable,
    KvpressWorkerError,
    find_kvpress_python,
    read_answer,
    run_press,
)

CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1}
T_CTX, T_CONT = 10, 3


def test_press_names_match_the_worker():
    tree = ast.parse(WORKER.read_text())
    presses = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PRESSES"
    )
    assert tuple(ast.literal_eval(presses)) == PRESS_NAMES


def test_worker_imports_nothing_of_ours():
    imported = set()
    for node in ast.walk(ast.parse(WORKER.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert "hybridcache" not in imported and "experiments" not in imported


def test_positions_are_recovered_exactly_or_refused():
    # the worker's own matching, run in a child (importing the worker edits sys.path and the environment)
    code = textwrap.dedent(f"""
        import importlib.util, torch
        spec = importlib.util.spec_from_file_location("worker", {str(WORKER)!r})
        w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
        k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)  # [B, Hkv, T, D]
        index = torch.tensor([[4, 0, 2], [5, 1, 3]])
        pick = lambda t, i: t.gather(2, i[None, :, :, None].expand(1, -1, -1, 4))
        assert torch.equal(w.kept_slots((k, v), (pick(k, index), pick(v, index))), index)
        for forged in ("tie", "edited"):
            k2, v2 = k.clone(), v.clone()
            if forged == "tie":
                k2[0, 0, 1], v2[0, 0, 1] = k2[0, 0, 4], v2[0, 0, 4]
            kept_k = pick(k2, index) + (forged == "edited") * 1e-3
            try:
                w.kept_slots((k2, v2), (kept_k, pick(v2, index)))
                raise SystemExit(f"{{forged}} was accepted")
            except w.PositionsUnrecoverable as e:
                print(forged, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tie head 0 slot 0: 2 original positions" in out.stdout and "edited head 0 slot 0: the pair" in out.stdout


def test_missing_interpreter_names_the_install_commands(monkeypatch, tmp_path):
    monkeypatch.delenv("HYBRIDCACHE_KVPRESS_PYTHON", raising=False)
    pins = r"HYBRIDCACHE_KVPRESS_PYTHON.*kvpress==0\.5\.5 'transformers==5\.2\.\*'"
    with pytest.raises(KvpressUnavailable, match=pins):
        find_kvpress_python()
    with pytest.raises(KvpressUnavailable, match="not an executable interpreter"):
        find_kvpress_python(str(tmp_path / "nope" / "python"))
    with pytest.raises(KvpressUnavailable):
        run_press(tmp_path, [1, 2, 3], [4], press="snapkv")


def test_unknown_press_and_bad_ids_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown press 'h2o'"):
        run_press(tmp_path, [1], [2], press="h2o", python=sys.executable)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ValueError, match="one row of token ids"):
        run_press(tmp_path, torch.zeros(2, 3, dtype=torch.long), [2], python=sys.executable)
    with pytest.raises(ValueError, match="takes no press arguments"):
        run_press(tmp_path, [1], [2], press="none", python=sys.executable, window_size=4)


# --- forged answers, read as the runner reads them -------------------------------------------------------------


def good_files():
    kept = {i: torch.tensor([[0, 1, 7, 8, 9]]) for i in range(2)}
    tensors = {f"kept.{i}": k for i, k in kept.items()} | {f"slots.{i}": k.flip(-1) for i, k in kept.items()}
    tensors["nll"] = torch.tensor([1.0, 2.0, 0.5])
    meta = {
        "versions": {"kvpress": "0.5.5"},
        "n_kept": {"0": 5, "1": 5},
        "hooked_layers": [0, 1],
        "mean_nll": float(tensors["nll"].mean()),
        "context_len": T_CTX,
    }
    return {"meta": meta}, tensors


def read_forged(tmp_path, answer, tensors, press="snapkv"):
    ans, res = tmp_path / "answer.json", tmp_path / "result.safetensors"
    ans.write_text(json.dumps(answer) if isinstance(answer, dict) else answer)
    if tensors is not None:
        save_file({k: v.clone() for k, v in tensors.items()}, str(res))
    return read_answer(ans, res, press, T_CTX, T_CONT, CONFIG)


def test_a_well_formed_answer_is_read(tmp_path):
    result = read_forged(tmp_path, *good_files())
    assert result.ok and result.compressed_layers == [0, 1]
    assert result.kept[1].tolist() == [[0, 1, 7, 8, 9]] and result.slots[1].tolist() == [[9, 8, 7, 1, 0]]
    assert math.isclose(result.mean_nll, 7 / 6, rel_tol=1e-6)


def forge(change):
    answer, tensors = good_files()
    change(answer, tensors)
    return answer, tensors


FORGERIES = {
    "position out of range": (
        forge(
            lambda a, t: t.update(
                {"kept.0": torch.tensor([[0, 1, 7, 8, 10]]), "slots.0": torch.tensor([[0, 1, 7, 8, 10]])}
            )
        ),
        "in \\[0, 10\\)",
    ),
    "unsorted positions": (forge(lambda a, t: t.update({"kept.0": torch.tensor([[1, 0, 7, 8, 9]])})), "ascending"),
    "float positions": (forge(lambda a, t: t.update({"kept.0": t["kept.0"].float()})), "must be int64"),
    "wrong kv heads": (forge(lambda a, t: t.update({"kept.0": t["kept.0"].repeat(2, 1)})), "int64 \\[1, n_kept\\]"),
    "slots not a permutation": (
        forge(lambda a, t: t.update({"slots.0": torch.tensor([[0, 1, 2, 8, 9]])})),
        "permutation",
    ),
    "layer beyond the model": (
        forge(lambda a, t: t.update({"kept.2": t["kept.0"], "slots.2": t["kept.0"]})),
        "unexpected tensor 'kept.2'",
    ),
    "stray tensor": (forge(lambda a, t: t.update({"__metadata__x": t["nll"]})), "unexpected tensor"),
    "n_kept disagrees": (forge(lambda a, t: a["meta"]["n_kept"].update({"1": 4})), "n_kept disagrees"),
    "missing layer": (forge(lambda a, t: [t.pop("kept.1"), t.pop("slots.1")]), "lacks the kept positions"),
    "nan nll": (forge(lambda a, t: t.update({"nll": torch.tensor([1.0, math.nan, 0.5])})), "non-finite"),
    "short nll": (forge(lambda a, t: t.update({"nll": torch.tensor([1.0, 2.0])})), "float32 \\[3\\]"),
    "mean disagrees": (forge(lambda a, t: a["meta"].update({"mean_nll": 9.0})), "mean_nll disagrees"),
    "worker refusal": (
        forge(lambda a, t: a.update({"error": "dtype 'int8' is not one of", "kind": "worker"})),
        "refused the request",
    ),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_forged_results_are_refused(tmp_path, case):
    (answer, tensors), message = FORGERIES[case]
    with pytest.raises(KvpressWorkerError, match=message):
        read_forged(tmp_path, answer, tensors)


def test_garbage_files_are_refused(tmp_path):
    answer, tensors = good_files()
    with pytest.raises(KvpressWorkerError, match="not JSON"):
        read_forged(tmp_path, "{not json", tensors)
    with pytest.raises(KvpressWorkerError, match="not an object"):
        read_forged(tmp_path, "[1, 2]", tensors)
    (tmp_path / "result.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(KvpressWorkerError, match="not a valid safetensors file"):
        read_forged(tmp_path, answer, None)


def test_wrong_kvpress_or_none_is_unavailable(tmp_path):
    answer, tensors = forge(lambda a, t: a["meta"]["versions"].update({"kvpress": "0.5.2"}))
    with pytest.raises(KvpressUnavailable, match="kvpress 0.5.2, not 0.5.5"):
        read_forged(tmp_path, answer, tensors)
    with pytest.raises(KvpressUnavailable, match="not importable.*pip install kvpress==0.5.5"):
        read_forged(tmp_path, {"error": "kvpress is not importable in this interpreter", "kind": "unavailable"}, None)


def test_a_kvpress_failure_is_a_result(tmp_path):
    answer, tensors = good_files()
    answer.update({"error": "reference failed in the continuation: RuntimeError: size", "kind": "reference"})
    tensors.pop("nll")
    result = read_forged(tmp_path, answer, tensors, press="pyramidkv")
    assert not result.ok and result.nll is None and result.kept[0].shape == (1, 5)
    with pytest.raises(KvpressWorkerError, match="no NLL for press pyramidkv: reference failed"):
        _ = result.mean_nll


# --- a fake interpreter: crash and hang ------------------------------------------------------------------------


def fake_interpreter(tmp_path, body: str) -> str:
    path = tmp_path / "fake-python"
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


def test_a_crash_is_reported_by_its_own_exception(tmp_path):
    python = fake_interpreter(
        tmp_path,
        """
        import sys
        print("loading", file=sys.stderr)
        raise KeyError("past_key_values")
    """,
    )
    with pytest.raises(KvpressWorkerError, match=r"exit 1\): KeyError: 'past_key_values'"):
        run_press(tmp_path, [1, 2, 3], [4], python=python)


def test_a_fake_worker_round_trip(tmp_path):
    python = fake_interpreter(
        tmp_path,
        """
        import json, sys, torch
        from safetensors.torch import save_file
        request = json.load(open(sys.argv[2]))
        assert request["press"] == "snapkv" and request["press_kwargs"] == {"compression_ratio": 0.5, "window_size": 2}
        nll = torch.ones(len(request["continuation_ids"]))
        save_file({"kept.0": torch.tensor([[0, 2]]), "slots.0": torch.tensor([[2, 0]]), "nll": nll}, sys.argv[4])
        json.dump({"meta": {"versions": {"kvpress": "0.5.5"}, "n_kept": {"0": 2}, "hooked_layers": [0],
                            "mean_nll": 1.0}}, open(sys.argv[3], "w"))
    """,
    )
    result = run_press(tmp_path, [1, 2, 3], torch.tensor([[4, 5]]), python=python, window_size=2)
    assert result.ok and result.kept == {0: result.kept[0]} and result.kept[0].tolist() == [[0, 2]]
    assert result.nll.tolist() == [1.0, 1.0] and result.wall_s > 0


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hang_times_out_and_its_group_is_ended(tmp_path):
    pids = tmp_path / "pids"
    python = fake_interpreter(
        tmp_path,
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(600)
    """,
    )
    started = time.monotonic()
    with pytest.raises(KvpressTimeout, match="kvpress subprocess gave no answer within 3 s"):
        run_press(tmp_path, [1, 2, 3], [4], python=python, timeout=3)
    assert time.monotonic() - started < 20
    worker, child = (int(p) for p in pids.read_text().split())
    deadline = time.monotonic() + 5
    while (alive(worker) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker) and not alive(child), "a process of the worker's group survived"


# --- live: kvpress 0.5.5 on Gemma 3 270M -----------------------------------------------------------------------

KVPRESS_PYTHON = os.environ.get(kvpress_runner.ENV_VAR)


def _real_path():
    from hybridcache.checkpoints.real import _target

    path = _target("gemma3_270m")
    return path if (path / "config.json").is_file() else None


REAL = _real_path()
live = pytest.mark.skipif(
    not KVPRESS_PYTHON or REAL is None,
    reason=f"needs {kvpress_runner.ENV_VAR} (a kvpress 0.5.5 environment: "
    f"{kvpress_runner.install_commands()}) and the converted Gemma 3 270M "
    "(real_checkpoint('gemma3_270m'))",
)
CONTEXT, CONTINUATION, RATIO = 400, 64, 0.5


@pytest.fixture(scope="module")
def text_ids():
    import transformers

    from experiments.study.data import documents

    tokenizer = transformers.AutoTokenizer.from_pretrained(REAL)
    doc = documents(tokenizer, "pydoc", CONTEXT + CONTINUATION, 1, 262144)[0]  # English prose, bos first
    return doc[:CONTEXT], doc[CONTEXT:]


@pytest.fixture(scope="module")
def live_runs(text_ids):
    context, continuation = text_ids
    runs = {
        press: run_press(REAL, context, continuation, press=press, compression_ratio=RATIO)
        for press in ("none", "snapkv", "streaming_llm", "pyramidkv")
    }
    runs["pyramidkv per_token"] = run_press(
        REAL, context, continuation, press="pyramidkv", compression_ratio=RATIO, feed="per_token"
    )
    return runs


@live
def test_live_none_matches_a_plain_forward_here(live_runs, text_ids):
    import transformers

    result = live_runs["none"]
    assert result.ok and result.kept == {} and result.nll.shape == (CONTINUATION,)
    model = transformers.AutoModelForCausalLM.from_pretrained(REAL, dtype=torch.float32).eval()
    ids = torch.tensor([text_ids[0] + text_ids[1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, CONTEXT - 1 : -1].float(), dim=-1)  # [T_cont, V]
    ours = -logp.gather(-1, ids[0, CONTEXT:, None])[:, 0]
    torch.testing.assert_close(result.nll, ours, atol=1e-4, rtol=0)  # transformers 5.2 there, ours here (8e-6)


@live
def test_live_snapkv_keeps_its_window_on_every_layer(live_runs):
    result = live_runs["snapkv"]
    assert result.ok and torch.isfinite(result.nll).all()
    # the first continuation token is predicted by the prefill's own last logit, computed before any compression
    torch.testing.assert_close(result.nll[0], live_runs["none"].nll[0], atol=1e-6, rtol=0)
    # kvpress skips sliding layers only for Gemma3ForConditionalGeneration: on Gemma3ForCausalLM all 18 compress
    assert result.compressed_layers == list(range(18))
    window = torch.arange(CONTEXT - 64, CONTEXT)
    for layer, kept in result.kept.items():
        assert kept.shape == (1, int(CONTEXT * (1 - RATIO))), layer
        assert torch.isin(window, kept[0]).all(), f"layer {layer} dropped part of the observation window"


@live
def test_live_streaming_llm_keeps_sinks_and_the_recent_tokens(live_runs):
    result = live_runs["streaming_llm"]
    n_kept = int(CONTEXT * (1 - RATIO))
    expected = list(range(4)) + list(range(CONTEXT - (n_kept - 4), CONTEXT))
    assert result.ok and all(kept[0].tolist() == expected for kept in result.kept.values())


@live
def test_live_pyramidkv_fails_in_one_forward_but_decodes_per_token(live_runs):
    # kvpress 0.5.5 + transformers 5.2: per-layer budgets differ, but the continuation's mask is sized from layer 0
    result = live_runs["pyramidkv"]
    assert not result.ok and result.error.startswith("reference failed in the continuation: RuntimeError")
    sizes = [kept.shape[1] for kept in result.kept.values()]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    # one token per forward sdpa needs no mask, so the same prefill decodes; the budget is the total SnapKV's
    fed = live_runs["pyramidkv per_token"]
    assert fed.ok and torch.isfinite(fed.nll).all()
    assert {i: k.tolist() for i, k in fed.kept.items()} == {i: k.tolist() for i, k in result.kept.items()}
    assert abs(sum(sizes) - len(sizes) * int(CONTEXT * (1 - RATIO))) <= len(sizes)


def test_the_same_request_is_answered_once_per_process(tmp_path):
    python = fake_interpreter(
        tmp_path,
        f"""
        import json, sys, torch
        from safetensors.torch import save_file
        with open({str(tmp_path / "runs")!r}, "a") as f:
            f.write("run\\n")
        save_file({{"kept.0": torch.tensor([[0, 2]]), "slots.0": torch.tensor([[2, 0]]), "nll": torch.ones(1)}},
                  sys.argv[4])
        json.dump({{"meta": {{"versions": {{"kvpress": "0.5.5"}}, "n_kept": {{"0": 2}}, "hooked_layers": [0],
                             "mean_nll": 1.0}}}}, open(sys.argv[3], "w"))
    """,
    )
    first = run_press(tmp_path, [1, 2, 3], [4], python=python)
    first.kept[0].fill_(7)  # a caller's change to its answer is its own
    again = run_press(tmp_path, [1, 2, 3], [4], python=python)
    other = run_press(tmp_path, [1, 2, 3], [5], python=python)  # another request runs kvpress again
    assert (tmp_path / "runs").read_text().count("run") == 2
    assert again.kept[0].tolist() == [[0, 2]] and other.ok
