"""Figures a reviewer can read: labels that do not overprint, legend entries with a drawn artist, axes with units,
titles that say model / weights / dtype / machine, one colour per strategy across figures, and W&B copies (images and
native plots). Each figure is drawn by the real plotting code; its Figure is caught at savefig and inspected."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import matplotlib
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.text import Text
from omegaconf import OmegaConf

from experiments.benchmark.plots import bar_value, log_benchmark, scaling_lines, throughput_bars
from experiments.core.figure_style import byte_unit, cfg_context, strategy_color, strategy_key
from experiments.study.report import log_study, pareto_plot
from experiments.train.plot import log_loss_curve, loss_curve
from hybridcache.tools.tracking import Tracker

matplotlib.use("Agg")


@pytest.fixture
def saved(monkeypatch) -> list[Figure]:
    """Every Figure the code under test saves (plt.close keeps the object and its Agg canvas usable)."""
    figures: list[Figure] = []
    original = Figure.savefig

    def capture(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", capture)
    return figures


def render(fig: Figure):
    """A drawn Agg canvas for a closed figure (plt.close leaves a bare canvas) and its renderer."""
    FigureCanvasAgg(fig).draw()
    return fig.canvas.get_renderer()


def strategy(name: str, ratio: float, ppl: float, passkey: float | None, mqar: float | None) -> dict:
    return {
        "name": name,
        "bytes_ratio": ratio,
        "ppl": {"64": ppl},
        "continuation_ppl": {"64": ppl * 0.9},
        "passkey_trials": [{}] if passkey is not None else [],
        "passkey_acc": passkey,
        "mqar_acc": mqar,
        "ruler_mean": None,
    }


# crowded on purpose: equal byte ratios, near-equal values, the long names of the real study side by side
ROWS = [
    strategy("native", 1.0, 3.770, 1.0, 0.90),
    strategy("sliding_256", 0.67, 3.754, 0.5, 0.40),
    strategy("chunked_256", 0.67, 3.846, 0.5, 0.41),
    strategy("int4", 0.45, 3.772, 1.0, 0.88),
    strategy("state_bf16", 0.84, 3.7702, 1.0, 0.90),
    strategy("state_fp8", 0.72, 3.7703, 1.0, 0.89),
    strategy("state_int8", 0.76, 3.7704, 1.0, 0.89),
    strategy("state_int4", 0.72, 3.7710, 1.0, 0.87),
    strategy("snapkv_50", 0.68, 3.7711, None, 0.86),
    strategy("kivi_2", 0.70, 3.7712, None, 0.88),
]
ROWS_ONE_PASSKEY = [dict(r, passkey_trials=[], passkey_acc=None) for r in ROWS]
ROWS_ONE_PASSKEY[0] = dict(ROWS[0], passkey_acc=0.0)  # a probe ran for native only: a one-point front


def text_box(t: Text, renderer):
    return Text.get_window_extent(t, renderer)  # the text alone (an annotation's box would include its leader line)


def test_pareto_labels_do_not_overlap_and_stay_inside(tmp_path, saved):
    pareto_plot(ROWS, [64], tmp_path / "p.png", "study: test", n_cont=16)
    fig = saved[-1]
    renderer = render(fig)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 4  # blockwise, kvpress, passkey, MQAR
    for ax in panels:
        labels = [t for t in ax.texts if t.get_text()]
        named = " ".join(t.get_text() for t in labels)
        shown = ROWS if "passkey" not in ax.get_ylabel() else [r for r in ROWS if r["passkey_trials"]]
        assert all(r["name"] in named for r in shown), (ax.get_ylabel(), named)
        boxes = [text_box(t, renderer) for t in labels]
        for (a, ta), (b, tb) in combinations(zip(boxes, labels), 2):
            assert not a.overlaps(b), f"{ta.get_text()!r} overprints {tb.get_text()!r} in {ax.get_ylabel()!r}"
        frame = ax.get_window_extent(renderer)
        for box, t in zip(boxes, labels):
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, t
        legend = ax.get_legend()
        if legend is not None:
            assert not any(legend.get_window_extent(renderer).overlaps(b) for b in boxes)


def drawn(artist) -> bool:
    """A legend entry's artist shows something: a line with two points, or a marker at one point at least."""
    if isinstance(artist, Line2D):
        n = len(artist.get_xdata())
        line = artist.get_linestyle() not in ("None", "", " ") and n >= 2
        marker = artist.get_marker() not in (None, "None", "", " ") and n >= 1
        return artist.get_visible() and (line or marker)
    return artist.get_visible()


@pytest.mark.parametrize("rows", [ROWS, ROWS_ONE_PASSKEY], ids=["crowded", "one-point-front"])
def test_pareto_legend_entries_have_drawn_artists(tmp_path, saved, rows):
    pareto_plot(rows, [64], tmp_path / "p.png", "study: test", n_cont=0)
    for ax in (ax for ax in saved[-1].axes if ax.get_visible()):
        handles, labels = ax.get_legend_handles_labels()
        assert labels, ax.get_ylabel()
        for h, label in zip(handles, labels):
            assert drawn(h), f"legend entry {label!r} of {ax.get_ylabel()!r} has nothing drawn"


def test_pareto_axes_titles_and_colours(tmp_path, saved):
    context = cfg_context(OmegaConf.create({"model": {"family": "gemma3", "checkpoint": None, "dtype": "bfloat16"}}))
    pareto_plot(ROWS, [64], tmp_path / "p.png", f"study: gemma3\n{context}", n_cont=0)
    fig = saved[-1]
    title = fig._suptitle.get_text()
    assert "gemma3" in title and "RANDOM weights" in title and "bfloat16" in title and "torch thread" in title
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), None)
    if cpu:
        assert cpu in title
    for ax in (ax for ax in fig.axes if ax.get_visible()):
        assert "% of native" in ax.get_xlabel()
        assert ax.get_ylabel()
        colors = [to_hex(c) for c in ax.collections[0].get_facecolors()]  # in the order of the rows shown
        assert len(set(colors)) > 1  # one colour per strategy, not one for all
        assert colors[0] == to_hex(strategy_color("native")) and colors[3] == to_hex(strategy_color("int4"))


def scaling_rows() -> list[dict]:
    rows = []
    for k, name in enumerate(["sliding(64)", "chunked(128)", "full", "recurrent (mamba2)"]):
        for t in (256, 512, 1024):
            rows.append(
                {
                    "strategy": name,
                    "tokens": t,
                    "decode_ms_per_token": 2.0 + k + t / 1024,
                    "peak_rss_mib": 1500.0 + 0.4 * k + t / 1024,  # a 1.5 MiB spread on a 1.5 GiB base
                    "loaded_rss_mib": 1499.8,
                }
            )
    return rows


def test_long_context_rss_axis_is_relative_with_a_unit(tmp_path, saved):
    scaling_lines(scaling_rows(), tmp_path / "l.png", "model tiny gemma3")
    fig = saved[-1]
    render(fig)
    _, rss = fig.axes
    assert "KiB" in rss.get_ylabel() or "MiB" in rss.get_ylabel()
    assert "above the loaded model" in rss.get_ylabel()
    assert rss.yaxis.get_offset_text().get_text() == ""  # no "+1.5e3" offset a reader must add by hand
    lo, hi = rss.get_ylim()
    assert lo == 0 and hi < 10_000  # relative to the loaded model, in a unit of at most four digits
    ticks = [t.get_text() for t in rss.get_yticklabels() if t.get_text()]
    assert ticks and all(len(t) <= 6 for t in ticks), ticks
    highest = max(y for line in rss.get_lines() for y in line.get_ydata())
    assert highest == pytest.approx((1501.2 + 1 - 1499.8) * 1024)  # KiB: 1.5 MiB is shown as 2457.6 KiB
    assert byte_unit(highest * 1024) == (1024.0, "KiB")
    for ax in fig.axes:
        assert ax.get_xlabel() and "tokens" in ax.get_xlabel()
    assert "(ms)" in fig.axes[0].get_ylabel()


def test_throughput_has_axis_labels_units_and_marks_invalid_timings(tmp_path, saved):
    rows = [
        {"system": "ours (eager)", "batch": 1, "decode_tok_s": 50.0, "prefill_tok_s": 900.0},
        {"system": "hf", "batch": 1, "decode_tok_s": float("nan"), "prefill_tok_s": 800.0},
        {"system": "ours (eager)", "batch": 4, "decode_tok_s": 150.0, "prefill_tok_s": 2000.0},
        {"system": "hf", "batch": 4, "decode_tok_s": 120.0, "prefill_tok_s": 1800.0},
    ]
    throughput_bars(rows, tmp_path / "t.png", "model tiny gemma3 · float32")
    fig = saved[-1]
    assert "model tiny gemma3 · float32" in fig._suptitle.get_text()
    for ax in fig.axes:
        assert "tokens/s" in ax.get_ylabel()
        assert "batch" in ax.get_xlabel()
        assert all(p.get_height() > 0 for p in ax.patches)  # no zero-height bar passing for "0 tokens/s"
    assert "n/a" in [t.get_text() for t in fig.axes[0].texts]


def test_throughput_na_marks_stand_upright_in_their_slots_inside_the_panels(tmp_path, saved):
    # a 100x spread puts the axis on a log scale (no y=0 there); the last slot of each panel has no valid timing
    rows = [
        {"system": "ours (eager)", "batch": 1, "decode_tok_s": 5000.0, "prefill_tok_s": 9000.0},
        {"system": "hf", "batch": 1, "decode_tok_s": 20.0, "prefill_tok_s": 80.0},
        {"system": "ours (eager)", "batch": 4, "decode_tok_s": 9000.0, "prefill_tok_s": 20000.0},
        {"system": "hf", "batch": 4, "decode_tok_s": None, "prefill_tok_s": float("nan")},
    ]
    throughput_bars(rows, tmp_path / "t.png")
    fig = saved[-1]
    renderer = render(fig)
    for ax in fig.axes:
        assert ax.get_yscale() == "log"
        marks = [t for t in ax.texts if t.get_text() == "n/a"]
        assert len(marks) == 1 and marks[0].get_rotation() == 0
        box, panel = text_box(marks[0], renderer), ax.get_window_extent(renderer)
        assert panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1
        # centred on hf's slot at batch 4 (slot 1 of 2 in the second group), which lies inside the x-limits
        width = 0.8 / 2
        x_slot = ax.transData.transform((1 + width, 1))[0]
        assert abs((box.x0 + box.x1) / 2 - x_slot) < 1.0


def test_throughput_legend_shows_each_systems_own_colour_even_without_a_bar_in_the_first_panel(tmp_path, saved):
    """hf has no valid decode timing (the first panel draws no hf bar): its legend entry must still be hf's colour,
    the colour of its prefill bar, not the colour cycle's next one."""
    from matplotlib.colors import to_rgba

    rows = [
        {"system": "ours (eager)", "batch": 1, "decode_tok_s": 50.0, "prefill_tok_s": 900.0},
        {"system": "hf", "batch": 1, "decode_tok_s": None, "prefill_tok_s": 800.0},
    ]
    throughput_bars(rows, tmp_path / "t.png")
    fig = saved[-1]
    entries = {t.get_text(): h for t, h in zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles, strict=True)}
    hf_bar = next(p for p in fig.axes[1].patches if p.get_label() != "ours (eager)" and p.get_height() == 800.0)
    assert to_rgba(entries["hf"].get_facecolor()) == to_rgba(hf_bar.get_facecolor())
    assert to_rgba(entries["hf"].get_facecolor()) == to_rgba(strategy_color("hf"))


def test_each_llamacpp_bar_stands_beside_ours_at_its_precision(tmp_path, saved):
    def row(system, fmt, decode):
        return {"system": system, "batch": 1, "weights_format": fmt, "decode_tok_s": decode, "prefill_tok_s": 9.0}

    rows = [
        row("ours (eager)", None, 10.0),
        row("ours (eager, int8 weights)", "int8", 20.0),
        row("hf", None, 5.0),
        row("llama.cpp (q8_0)", "int8", 30.0),
        row("llama.cpp (f32)", None, 12.0),
    ]
    throughput_bars(rows, tmp_path / "t.png")
    fig = saved[-1]
    render(fig)
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [10.0, 12.0, 20.0, 30.0, 5.0]  # ours f32, llama f32, ours int8, llama q8_0, then HF
    bars = fig.axes[0].patches
    assert to_hex(bars[1].get_edgecolor()) == to_hex(bars[0].get_facecolor()) and bars[1].get_hatch()
    assert to_hex(bars[3].get_edgecolor()) == to_hex(bars[2].get_facecolor()) != to_hex(bars[0].get_facecolor())
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["ours (eager)", "llama.cpp (f32)", "ours (eager, int8 weights)", "llama.cpp (q8_0)", "hf"]
    # each llama.cpp legend entry is drawn as its bars are: white, hatched, edged in its partner's colour (a style
    # given as `color` made the legend's patch white on white: an entry with nothing drawn)
    handles = fig.legends[0].legend_handles
    for i in (1, 3):
        assert to_hex(handles[i].get_edgecolor()) == to_hex(bars[i].get_edgecolor()) != "#ffffff"
        assert to_hex(handles[i].get_facecolor()) == "#ffffff" and handles[i].get_hatch()


def test_one_strategy_keeps_its_colour_across_figures(tmp_path, saved):
    pareto_plot(ROWS, [64], tmp_path / "p.png", "study", n_cont=0)
    scaling_lines(scaling_rows(), tmp_path / "l.png")
    pareto, scaling = saved[-2], saved[-1]
    points = pareto.axes[0].collections[0]
    assert points.get_offsets()[1][0] == pytest.approx(67.0)  # ROWS[1]: sliding_256
    pareto_colours = [to_hex(c) for c in points.get_facecolors()]
    lines = {line.get_label(): to_hex(line.get_color()) for line in scaling.axes[0].get_lines()}
    assert lines["sliding(64)"] == pareto_colours[1]
    assert lines["chunked(128)"] == pareto_colours[2] != lines["sliding(64)"]
    assert len(set(lines.values())) == len(lines)


def test_loss_curve_title_units_and_colours(tmp_path, saved):
    histories = {}
    for arch in ("hybrid", "attention"):
        history = [{"tokens": 2048 * i, "bits_per_byte": 8 - i / 20} for i in range(1, 60)]
        probes = [{"tokens": 2048 * i, "eval/shakespeare": 4 - i / 40} for i in (10, 30, 59)]
        histories[arch] = tmp_path / f"{arch}.json"
        histories[arch].write_text(json.dumps({"history": history, "probes": probes}))
    loss_curve(histories, tmp_path / "loss.png", "hybrid vs attention · machine: x")
    ax = saved[-1].axes[0]
    assert "trained" in ax.get_title() and "float32" in ax.get_title()
    assert "bits per byte" in ax.get_ylabel() and "bytes" in ax.get_xlabel()
    colours = {
        line.get_label().split(":")[0]: to_hex(line.get_color())
        for line in ax.get_lines()
        if ":" in str(line.get_label())
    }
    assert colours["hybrid"] == to_hex(strategy_color("hybrid")) != colours["attention"]
    fake = FakeTracker()
    log_loss_curve(fake, histories, tmp_path / "loss.png")
    assert ("image", "loss_curve") in fake.calls and ("line", "loss/train_bits_per_byte") in fake.calls


class FakeTracker:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.points: dict[str, list] = {}

    def image(self, key, path, caption=None):
        assert Path(path).is_file()
        self.calls.append(("image", key))

    def scatter(self, key, points, x, y, title="", label="name"):
        self.calls.append(("scatter", key))
        self.points[key] = points

    def line(self, key, points, x, y, title="", series="series"):
        self.calls.append(("line", key))
        self.points[key] = points

    def bar(self, key, labels, values, label="label", value="value", title=""):
        self.calls.append(("bar", key))
        self.points[key] = list(zip(labels, values))


def test_study_and_benchmark_log_images_and_native_plots(tmp_path):
    png = pareto_plot(ROWS, [64], tmp_path / "study_pareto.png", "study", n_cont=0)
    fake = FakeTracker()
    log_study(fake, ROWS, [64], png)
    assert ("image", "study_pareto") in fake.calls
    assert {"pareto/perplexity", "pareto/passkey_accuracy", "pareto/MQAR_recall"} <= set(fake.points)
    assert [p for p in fake.points["pareto/perplexity"] if p[0] == "int4"] == [("int4", pytest.approx(45.0), 3.772)]
    rows = [{"system": "hf", "batch": 1, "decode_tok_s": float("nan"), "prefill_tok_s": 1.0}]
    rows.append({"system": "ours (eager)", "batch": 1, "decode_tok_s": 10.0, "prefill_tok_s": 2.0})
    plots = [throughput_bars(rows, tmp_path / "throughput.png"), scaling_lines(scaling_rows(), tmp_path / "lc.png")]
    fake = FakeTracker()
    log_benchmark(fake, rows, scaling_rows(), plots)
    assert ("image", "throughput") in fake.calls and ("image", "lc") in fake.calls
    assert fake.points["throughput/decode_tok_s"] == [("ours (eager) b1", 10.0)]  # the invalid timing is left out
    assert len(fake.points["long_context/rss_added_mib"]) == 12


def test_tracker_writes_images_and_native_plots_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    png = throughput_bars([{"system": "hf", "batch": 1, "decode_tok_s": 3.0, "prefill_tok_s": 4.0}], tmp_path / "t.png")
    tracker = Tracker("offline", "figures-test", tmp_path / "run", {"x": 1})
    assert tracker.active, tracker.error
    run_dir = tracker.run_dir
    tracker.image("throughput", png)
    tracker.scatter("pareto/ppl", [("native", 100.0, 3.7), ("int4", 45.0, 3.8)], "bytes %", "ppl")
    tracker.line("lc/ms", [("full", 256, 1.0), ("full", 512, 2.0)], "tokens", "ms")
    tracker.bar("tp", ["hf b1"], [3.0])
    assert tracker.error is None
    tracker.finish()
    media = run_dir / "files" / "media"
    assert list((media / "images").glob("throughput_*.png"))
    tables = sorted(p.name for p in (media / "table").rglob("*.table.json"))
    assert any(n.startswith("pareto/ppl") or "ppl" in n for n in tables) or len(tables) >= 3, tables
    table = json.loads(next((media / "table").rglob("*.table.json")).read_text())
    assert table["data"]  # the rows themselves, for the W&B UI's own charts


def test_tracker_logging_failure_is_recorded_not_raised(tmp_path):
    class Broken:
        Table = staticmethod(lambda **kw: (_ for _ in ()).throw(RuntimeError("no table today")))

    class Run:
        def log(self, values):
            raise AssertionError("not reached")

        def finish(self, exit_code=0):
            pass

    tracker = Tracker("disabled", "p", tmp_path, {})
    tracker.run, tracker.wandb = Run(), Broken()
    tracker.scatter("k", [("a", 1.0, 2.0)], "x", "y")
    assert not tracker.active and "no table today" in tracker.error
    tracker.line("k", [("a", 1.0, 2.0)], "x", "y")  # a no-op once off
    tracker.image("k", tmp_path / "missing.png")


def test_every_study_strategy_has_its_own_colour_and_sizes_share_one():
    study = OmegaConf.load(Path(__file__).parents[2] / "configs" / "experiment" / "study.yaml")
    names = list(study.strategies)  # every strategy the study knows
    assert len(names) > 10
    keys = {strategy_key(n) for n in names}
    assert len({strategy_color(k) for k in keys}) == len(keys), sorted(keys)  # no two strategies share a colour
    assert strategy_color("sliding_256") == strategy_color("sliding(64)") == strategy_color("sliding_1024")
    assert strategy_color("int4") != strategy_color("int4_residual32") != strategy_color("int4_first2_dense")


def test_bar_labels_never_use_exponents():
    assert [bar_value(v) for v in (1000.4, 999.6, 229.0, 59.34, 1.234, 0.0123)] == [
        "1000",
        "1000",
        "229",
        "59.3",
        "1.23",
        "0.0123",
    ]
