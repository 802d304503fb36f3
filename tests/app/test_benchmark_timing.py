"""The benchmark's timing and table code on forged timings: no rate or ratio from an invalid timing, the reason
said; the timing loop's structure (turns, separate phases, repeats until stable) under a fake clock."""

import math

from rich.console import Console

from experiments.benchmark.table import print_tables, summarize, throughput_table, timed_row
from experiments.benchmark.timing import Phases, Timing, judge, ratio, time_phases


class FakeClock:
    """Time advances only when a fake system 'works' for a scripted duration."""

    def __init__(self):
        self.now = 0.0  # exact sums of the scripted durations below

    def __call__(self) -> float:
        return self.now


def scripted(clock: FakeClock, log: list, label: str, prefill: list[float], decode: list[float]) -> Phases:
    pre, dec = iter(prefill), iter(decode)

    def timed(phase, durations):
        def run(c):
            assert c is clock
            start = c()
            log.append((label, phase))
            clock.now += next(durations)
            return c() - start

        return run

    return Phases(timed("prefill", pre), timed("decode", dec), lambda: log.append((label, "warmup")))


def test_phases_are_timed_apart_in_turns_and_stop_when_stable():
    clock, log = FakeClock(), []
    systems = {
        "ours": scripted(clock, log, "ours", [0.1, 0.1, 0.1], [1.0, 1.0, 1.0]),
        "hf": scripted(clock, log, "hf", [0.2, 0.2, 0.2], [3.0, 3.0, 3.0]),
    }
    out = time_phases(systems, repeats=1, max_repeats=9, max_spread=0.25, clock=clock)
    # warm-ups first, then 3 rounds (the fewest that show a spread), the systems taking turns, prefill before decode
    assert log[:2] == [("ours", "warmup"), ("hf", "warmup")]
    assert log[2:] == [("ours", "prefill"), ("ours", "decode"), ("hf", "prefill"), ("hf", "decode")] * 3
    assert math.isclose(out["ours"]["prefill"].median_s, 0.1) and math.isclose(out["ours"]["decode"].median_s, 1.0)
    assert math.isclose(out["hf"]["decode"].median_s, 3.0) and out["hf"]["decode"].spread < 1e-9
    assert all(t.reliable for ph in out.values() for t in ph.values())


def test_rounds_continue_while_spread_too_wide_then_say_unreliable():
    clock, log = FakeClock(), []
    wild = [1.0, 3.0, 0.5, 2.5, 0.7, 4.0]  # wide from round 3 on (quartiles 0.775 .. 2.875 around 1.75 after 6)
    systems = {"ours": scripted(clock, log, "ours", [0.1] * 6, wild)}
    out = time_phases(systems, repeats=3, max_repeats=6, max_spread=0.25, clock=clock)
    assert log.count(("ours", "decode")) == 6  # kept going up to max_repeats
    t = out["ours"]["decode"]
    assert not t.reliable and "spread" in t.reason and "exceeds 25%" in t.reason
    assert out["ours"]["prefill"].reliable


def test_a_wide_round_that_settles_stops_early():
    clock, log = FakeClock(), []
    # after 3 rounds the spread is wide (1, 1, 3); two steady rounds narrow the quartiles to 0
    systems = {"ours": scripted(clock, log, "ours", [0.1] * 9, [1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])}
    out = time_phases(systems, repeats=3, max_repeats=9, max_spread=0.25, clock=clock)
    assert log.count(("ours", "decode")) == 5
    assert out["ours"]["decode"].reliable and math.isclose(out["ours"]["decode"].median_s, 1.0)


def test_after_round_runs_once_after_each_rounds_systems():
    """The benchmark samples the read bandwidth there: after every system's turn in that round, before the next."""
    clock, log = FakeClock(), []
    systems = {
        "ours": scripted(clock, log, "ours", [0.1] * 5, [1.0, 1.0, 3.0, 1.0, 1.0]),
        "hf": scripted(clock, log, "hf", [0.2] * 5, [2.0] * 5),
    }
    time_phases(systems, 3, 9, 0.25, clock=clock, after_round=lambda: log.append(("probe", "round")))
    turns = [("ours", "prefill"), ("ours", "decode"), ("hf", "prefill"), ("hf", "decode"), ("probe", "round")]
    assert log[2:] == turns * 5  # (rounds 4 and 5 because ours' spread was wide after 3)


def test_judge_reasons():
    assert "not positive" in judge([0.5, -0.01, 0.5], 0.25).reason
    assert "too few" in judge([0.5], 0.25).reason
    assert "no measurement" in judge([], 0.25).reason
    good = judge([1.0, 1.1, 0.9, 1.0], 0.25)
    assert good.reliable and math.isclose(good.median_s, 1.0)


def _row(system, prefill: Timing, decode: Timing):
    return timed_row(system, 1, 8, 9, prefill, decode)


def test_total_shorter_than_prefill_gives_no_rate_and_no_ratio():
    # the reported failure (a total shorter than its prefill gave a negative decode) cannot arise from phases timed
    # apart; a non-positive or missing decode sample still gives no rate
    bad = timed_row("vllm", 1, 8, 9, judge([0.3, 0.3, 0.3], 0.25), judge([0.2, -0.05, 0.2], 0.25))
    assert bad["decode_tok_s"] is None and "not positive" in bad["decode_unreliable"]
    assert bad["prefill_tok_s"] == 8 / 0.30
    ok = Timing(0.1, 0.05, [0.1] * 3)
    hf_bad = _row("hf", ok, Timing(None, None, [0.2, -0.1, 0.3], "1 of 3 durations not positive (-0.1 s)"))
    ours = _row("ours (eager)", ok, Timing(0.4, 0.1, [0.4] * 3))
    summary = summarize([ours, hf_bad], {}, [], 100.0, 1.0)
    assert summary["decode_speedup_vs_hf/ours_eager/b1"] is None
    assert "HF: 1 of 3 durations not positive" in summary["decode_speedup_vs_hf_unreliable/ours_eager/b1"]
    assert summary["prefill_speedup_vs_hf/ours_eager/b1"] == 1.0  # both prefills reliable
    table, notes = throughput_table([ours, hf_bad], summary)
    text = _render(lambda c: print_tables(c, [ours, hf_bad], {}, [], summary))
    assert "nan" not in text.lower() and "unreliable" in text
    assert any("hf, batch 1, decode: unreliable: 1 of 3 durations not positive" in n for n in notes)
    assert "x" not in _cells(table, "decode vs HF")[0]  # no ratio printed for ours either


def test_spread_too_big_gives_no_ratio_and_states_the_reason():
    wide = judge([1.0, 3.0, 0.5, 2.5], 0.25)
    assert not wide.reliable
    ours = _row("ours (eager)", Timing(0.1, 0.0, [0.1] * 3), wide)
    hf = _row("hf", Timing(0.1, 0.0, [0.1] * 3), Timing(1.0, 0.0, [1.0] * 3))
    summary = summarize([ours, hf], {}, [], 100.0, 1.0)
    assert summary["decode_speedup_vs_hf/ours_eager/b1"] is None
    assert "ours: spread" in summary["decode_speedup_vs_hf_unreliable/ours_eager/b1"]
    text = _render(lambda c: print_tables(c, [ours, hf], {}, [], summary))
    assert "ours (eager), batch 1, decode: unreliable: spread" in text


def test_reliable_ratio_is_the_rate_ratio():
    assert ratio(40.0, None, 10.0, None) == (4.0, None)
    assert ratio(None, "x", 10.0, None) == (None, "unreliable: ours: x")


def _render(draw) -> str:
    import io

    out = io.StringIO()
    draw(Console(file=out, width=250))
    return out.getvalue()


def _cells(table, column: str) -> list[str]:
    return next(c for c in table.columns if c.header == column)._cells
