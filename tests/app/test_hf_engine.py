"""engine=hf (issue 42 item 5): `python run.py engine=hf model.checkpoint=DIR cache=...` runs HF transformers' own
modeling code with our cache on any HF causal-LM checkpoint, families hybridcache does not implement included, and
states its reference (HF's DynamicCache on the same model) and oracle (HF's forward without a cache, each attention
layer masked with its pattern) in the output and in results.json. Tiny checkpoints, two prompts, a few tokens."""

from __future__ import annotations

import pytest

from tests.app.test_app_runs import app  # noqa: F401 - the in-process run.py fixture

SHORT = [
    "prompts.texts=[hello there,a much longer prompt that goes on and on for a while so that windows matter here]",
    "max_new_tokens=5",
    "logger.mode=disabled",
]


@pytest.fixture(scope="module")
def hf_only(tmp_path_factory):
    """Tiny random checkpoints of families hybridcache.models does not implement, built with HF's own classes."""
    from hybridcache.hf.tiny_hf import our_family, tiny_model
    from hybridcache.models import model_class

    out = {}
    for model_type in ("llama", "cohere2"):  # cohere2: sliding layers and a full one
        assert our_family(model_type) is None
        with pytest.raises(ValueError):
            model_class(model_type)
        path = tmp_path_factory.mktemp(model_type)
        tiny_model(model_type).save_pretrained(path)
        out[model_type] = str(path)
    return out


def test_a_lossy_strategy_on_an_hf_only_family_states_its_reference_and_differs_by_design(app, hf_only):  # noqa: F811
    code, results, out, err = app("engine=hf", f"model.checkpoint={hf_only['llama']}", "cache=snapkv", *SHORT)
    assert code == 0, err
    engine = results["engine"]
    assert engine["name"] == "hf" and engine["model_class"] == "LlamaForCausalLM"
    assert "DynamicCache" in engine["reference"] and "without a cache" in engine["oracle"]
    assert all(f"{k}: {engine[k]}" in out for k in ("ours", "reference", "oracle"))
    summary = results["summary"]
    assert summary["engine"] == "hf" and not summary["plan_exact"]
    assert {p["type"] for p in results["plan"]} == {"snapkv"}
    assert summary["agreement"] < 1.0 and "differs by design" in out  # measured, and said to be by design
    assert results["reference"]["label"].startswith("HF's own DynamicCache")
    assert results["title"].startswith(f"{hf_only['llama'].rsplit('/', 1)[-1]} (HF)")


def test_the_native_plan_gives_hf_own_tokens_and_passes_the_oracle(app, hf_only):  # noqa: F811
    code, results, _, err = app("engine=hf", f"model.checkpoint={hf_only['llama']}", *SHORT)
    assert code == 0, err
    s = results["summary"]
    assert s["plan_exact"] and s["oracle_pass"] and s["agreement"] == 1.0 and not s["plan_changed_layers"]
    ours, ref = results["generations"]["ours"], results["generations"]["reference"]
    assert [g["tokens"] for g in ours] == [g["tokens"] for g in ref]


def test_a_retyped_exact_plan_passes_its_oracle_and_the_oracle_sees_a_wrong_pattern(app, hf_only, monkeypatch):  # noqa: F811
    args = ["engine=hf", f"model.checkpoint={hf_only['cohere2']}", "cache.sliding.type=chunked"]
    code, results, _, err = app(*args, "cache.sliding.chunk_size=8", *SHORT)
    assert code == 0, err
    assert results["summary"]["plan_exact"] and results["summary"]["oracle_pass"]
    assert {p["type"] for p in results["plan"]} == {"chunked", "full"}
    # the oracle asked for the native patterns instead: the chunked cache no longer matches it (exit status 1)
    import experiments.correctness.hf_oracle as hf_oracle

    native = hf_oracle.patterns_of
    monkeypatch.setattr(
        hf_oracle,
        "patterns_of",
        lambda plan: {i: {"type": "full"} if p["type"] == "chunked" else p for i, p in native(plan).items()},
    )
    code, results, _, _ = app(*args, "cache.sliding.chunk_size=8", *SHORT)
    assert code == 1 and results["status"] == "oracle_failed" and not results["summary"]["oracle_pass"]


@pytest.mark.parametrize("cache", ["native", "hybrid_chunked"])
def test_gemma3_both_engines_give_the_same_tokens(app, tmp_path, cache):  # noqa: F811
    tokens = {}
    for engine in ("ours", "hf"):
        code, results, _, err = app(
            f"engine={engine}", "model=gemma3", f"cache={cache}", "reference=none", *SHORT, out=tmp_path / engine
        )
        assert code == 0 and results["summary"]["oracle_pass"], err
        tokens[engine] = [g["tokens"] for g in results["generations"]["ours"]]
    assert tokens["ours"] == tokens["hf"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["reference=vllm"], "engine=hf compares with HF's own cache"),
        (["experiment=drift"], "engine=hf runs correctness"),
        (["cache=static"], "cache.preallocate=true is engine=ours'"),
    ],
)
def test_what_engine_hf_does_not_take_is_one_line(app, hf_only, args, message):  # noqa: F811
    code, _, _, err = app("engine=hf", f"model.checkpoint={hf_only['llama']}", *args, *SHORT)
    assert code == 2 and message in err


def test_engine_ours_on_a_family_we_do_not_implement_points_to_engine_hf(app, hf_only):  # noqa: F811
    code, _, _, err = app(f"model.checkpoint={hf_only['llama']}", *SHORT)
    assert code == 2 and "unsupported model_type 'llama'" in err and "engine=hf" in err


def test_benchmark_times_the_bridge_against_hf_own_cache(app, hf_only, tmp_path):  # noqa: F811
    import json

    code, _, out, err = app(
        "engine=hf",
        "experiment=benchmark",
        "experiment.smoke=true",
        "experiment.repeats=1",
        f"model.checkpoint={hf_only['cohere2']}",
        "cache=hybrid_sliding",
        "logger.mode=disabled",
        out=tmp_path / "bench",
    )
    assert code == 0, err
    result = json.loads((tmp_path / "bench" / "benchmark.json").read_text())
    assert result["engine"]["name"] == "hf" and "DynamicCache" in result["engine"]["reference"]
    rows = result["throughput"]
    assert {r["system"] for r in rows} == {"ours (hf bridge)", "hf"}
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in rows)
    ours = next(r for r in rows if r["system"] == "ours (hf bridge)")
    hf = next(r for r in rows if r["system"] == "hf")
    assert ours["decode_ratio_vs_hf"] == pytest.approx(ours["decode_tok_s"] / hf["decode_tok_s"])
    assert {p["type"] for p in result["plan"]} == {"sliding"}  # the run's cache config, not the native one
    assert (tmp_path / "bench" / "throughput.png").is_file() and "reference: HF's own DynamicCache" in out


STUDY = [
    "experiment=study",
    "experiment.only=[native,int8,snapkv_50]",
    "experiment.lengths=[48]",
    "experiment.block=16",
    "experiment.greedy_tokens=2",
    "experiment.continuation=4",
    "experiment.controls=false",
    "experiment.passkey.lengths=[]",
    "experiment.mqar.pairs=[]",
    "experiment.ruler.tasks=[]",
    "logger.mode=disabled",
]


def test_study_on_gemma3_gives_the_same_numbers_with_both_engines(app, tmp_path):  # noqa: F811
    import json

    studies = {}
    for engine in ("ours", "hf"):
        code, _, out, err = app(f"engine={engine}", "model=gemma3", *STUDY, out=tmp_path / engine)
        assert code == 0, err
        studies[engine] = json.loads((tmp_path / engine / "study.json").read_text())
    assert studies["hf"]["engine"]["name"] == "hf" and "DynamicCache" in studies["hf"]["engine"]["baseline"]
    assert "engine=hf" in out
    rows = {e: {r["name"]: r for r in s["strategies"]} for e, s in studies.items()}
    assert set(rows["hf"]) == {"native", "int8", "snapkv_50"}
    for name in ("native", "int8"):  # exact, and a codec both engines apply alike: the same perplexity and bytes
        ours, hf = rows["ours"][name], rows["hf"][name]
        assert ours["bytes"] == hf["bytes"]
        assert hf["ppl"]["48"] == pytest.approx(ours["ppl"]["48"], rel=1e-4)
    assert rows["hf"]["native"]["kl"]["48"] == 0.0 and rows["hf"]["int8"]["kl"]["48"] > 0.0
