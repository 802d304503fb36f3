"""Console summaries and verdicts for experiments, and the sweep summary after `hydra -m` (a Hydra callback).

Imports stay light (no torch at import): Hydra instantiates `SweepSummary` before any job runs.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from rich.console import Console
from rich.table import Table

from experiments.core.results import write_text


def format_bytes(n: int | None) -> str:
    from hybridcache.cache.core.plan import format_bytes as fmt

    return "n/a" if n is None else fmt(n)


def type_bytes(plan, batch: int, tokens: int) -> dict[str, int]:
    """Bytes a plan holds per cache type at (batch, tokens)."""
    out: dict[str, int] = defaultdict(int)
    for p in plan.layers:
        out[p.type] += p.spec.held_nbytes(batch, tokens)
    return dict(out)


def _short(text: str, n: int = 30) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _ref_label(ref: dict[str, Any]) -> str:
    if ref.get("label"):  # engine=hf: HF's own cache on the same modeling code
        return str(ref["label"])
    if ref.get("name") == "file":
        source = ref.get("source", "?")
        if source == "hybridcache":
            return f"our own recording (cache={ref.get('cache', '?')})"
        return f"a recording of {source}"
    return {"hf": "HF transformers", "vllm": "vLLM"}.get(ref.get("name"), str(ref.get("name")))


def verdict(cfg, plan, summary: dict[str, Any], ref: dict[str, Any]) -> tuple[list[str], int]:
    """What the measurements say, in words, and the exit status (1 when an exact plan fails its oracle)."""
    lines: list[str] = []
    tol, dlogit = summary["oracle_tolerance"], summary["oracle_max_dlogit"]
    dtype = cfg.model.dtype
    exit_code = 0
    lossy = [p.address for p in plan.layers if not p.exact]
    if plan.exact and summary["oracle_pass"]:
        lines.append(
            f"oracle (cached == recompute, same strategy): passes, max |Δlogit| {dlogit:.1e} <= {tol:.2g} ({dtype})"
        )
    elif plan.exact:
        exit_code = 1
        lines.append(
            f"oracle (cached == recompute, same strategy): FAILS, max |Δlogit| {dlogit:.1e} > {tol:.2g} "
            f"({dtype}): every layer of this plan is exact, so the cache is wrong (a bug)"
        )
    else:
        effect = "no measurable effect" if dlogit <= tol else "the measured effect of the lossy layers, not a bug"
        lines.append(
            f"oracle: the plan is lossy (layers {', '.join(lossy)}); cached generation differs from the exact "
            f"recompute by max |Δlogit| {dlogit:.1e}: {effect}"
        )
    if "agreement" not in summary:
        return lines, exit_code
    label = _ref_label(ref)
    changed = summary["plan_changed_layers"]
    if summary["agreement"] == 1.0:
        lines.append(f"every token agrees with {label}")
        return lines, exit_code
    if exit_code:
        lines.append(f"the differences from {label} mean little until the cache bug is fixed")
    elif ref.get("source") == "hybridcache":
        if ref.get("same_plan"):
            lines.append(
                f"{label} used the same plan, so the differences are a change in the code, weights or "
                "environment since it was recorded (a regression to check)"
            )
        else:
            lines.append(f"{label} used another plan, so the differences are the effect of switching to this plan")
    elif not changed and ref.get("same_code"):
        lines.append(
            f"the plan is the model's native one and {label} runs the same modeling code, so every difference is "
            "the bridge's (a bug to report)"
        )
    elif not changed:
        lines.append(
            f"the plan is the model's native one, so the differences from {label} are not a cache "
            "strategy's effect: numerics of the two implementations"
            + (
                " (each side's token is in the other's top-k)"
                if summary["pass_rate"] == 1.0
                else ", or a model bug (top-k check fails)"
            )
        )
    elif lossy:
        lines.append(
            f"this plan differs from the model's native one by design (layers {', '.join(changed)} changed, lossy "
            f"layers {', '.join(lossy)}), so its differences from {label} are the plan's measured effect on the "
            "model, not a bug"
        )
    else:
        lines.append(
            f"the oracle passes and this plan differs from the model's native one by design (layers "
            f"{', '.join(changed)} changed), so the differences from {label} are the strategy's effect on the model, "
            "not a cache bug"
        )
    return lines, exit_code


def print_summary(
    console: Console, title: str, rows: list[dict], summary: dict, ref: dict, lines: list[str], tracker, json_path: Path
) -> None:
    from experiments.correctness.table import print_prompt_table

    has_ref = "agreement" in summary
    print_prompt_table(console, title, rows, summary)  # generated vs compared tokens, per prompt
    # the verdict first (the oracle, then what a difference from the reference means), then the number it explains:
    # a changed plan's low agreement reads as its measured effect, not as a failure
    out = list(lines)
    if has_ref:
        dlp = summary["max_abs_dlogprob"]
        by_design = (
            " (differs by design, as said above)"
            if summary.get("plan_changed_layers")
            and ref.get("source") != "hybridcache"
            and (summary.get("oracle_pass") or not summary.get("plan_exact", True))
            and summary["agreement"] < 1.0
            else ""
        )
        out.append(
            f"agreement with {_ref_label(ref)}: {summary['agreement']:.1%}{by_design}   top-k pass rate: "
            f"{summary['pass_rate']:.0%}   max |Δlogprob| over agreed steps: "
            f"{'n/a (no step agreed)' if dlp is None else f'{dlp:.1e}'}"
        )
    speed = (
        f"new tokens/s (batch 1, each prompt's prefill included in the time, after a warm-up): ours "
        f"{summary['tokens_per_s/ours']:.0f}"
    )
    if "tokens_per_s/reference" in summary:
        speed += f", {ref['name']} {summary['tokens_per_s/reference']:.0f} (measured the same way)"
    elif "tokens_per_s/reference_batched" in summary:
        speed += (
            f"; {ref['name']} {summary['tokens_per_s/reference_batched']:.0f} with all prompts in one batch "
            "(not comparable)"
        )
    out.append(speed)
    longest = f"prompt {summary['cache_bytes/prompt'] + 1} of {len(rows)}"
    out.append(
        f"cache bytes held for the longest prompt ({longest}, "
        f"{summary['cache_bytes/tokens']} tokens): {format_bytes(summary['cache_bytes/held'])} vs "
        f"{format_bytes(summary['cache_bytes/native'])} with the native strategy"
    )
    if tracker.sync_command:
        out.append(f"W&B run (offline): {tracker.run_dir}   upload: {tracker.sync_command}")
    elif tracker.run_dir:
        out.append(f"W&B run: {tracker.run_dir}")
    else:
        out.append(f"W&B: {tracker.error or 'disabled'}")
    out.append(f"results: {json_path}")
    for line in out:
        console.print(line, soft_wrap=True)


# -- sweeps -------------------------------------------------------------------------------------------------------
def sweep_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per run of a sweep, from each run's results.json."""
    rows = []
    files = sorted(sweep_dir.glob("*/results.json"), key=lambda p: (len(p.parent.name), p.parent.name))
    plans: dict[str, str] = {}
    for file in files:
        try:
            r = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            rows.append({"run": file.parent.name, "status": f"unreadable ({e})"})
            continue
        s = r.get("summary", {})
        plan_key = json.dumps([{k: v for k, v in p.items() if k != "bytes"} for p in r.get("plan", [])], sort_keys=True)
        config = r.get("config", {})
        plan_key += json.dumps(
            [
                config.get("model_name"),
                config.get("model"),
                config.get("reference"),
                config.get("max_new_tokens"),
                config.get("prompts"),
            ],
            sort_keys=True,
            default=str,
        )
        same = plans.setdefault(plan_key, file.parent.name) if r.get("plan") else file.parent.name
        rows.append(
            {
                "run": file.parent.name,
                "overrides": " ".join(r.get("overrides", [])),
                "override_list": list(r.get("overrides", [])),
                "status": r.get("status", "?"),
                "error": r.get("error"),
                "exit_code": r.get("exit_code", 0),
                "plan_exact": s.get("plan_exact"),
                "changed_layers": len(s.get("plan_changed_layers", [])) if "plan_changed_layers" in s else None,
                "oracle_pass": s.get("oracle_pass"),
                "oracle_max_dlogit": s.get("oracle_max_dlogit"),
                "agreement": s.get("agreement"),
                "pass_rate": s.get("pass_rate"),
                "cache_bytes_held": s.get("cache_bytes/held"),
                "cache_bytes_native": s.get("cache_bytes/native"),
                "tokens_per_s": s.get("tokens_per_s/ours"),
                "same_as": None if same == file.parent.name else same,
                "changes_nothing": s.get("plan_changes_nothing"),
                "results": str(file),
            }
        )
    return rows


def common_overrides(rows: list[dict[str, Any]]) -> list[str]:
    """The overrides every run of a sweep shares (said once, in the title, instead of on every row)."""
    lists = [r["override_list"] for r in rows if "override_list" in r]
    if len(lists) < 2:
        return []
    return [o for o in lists[0] if all(o in other for other in lists[1:])]


def sweep_table(rows: list[dict[str, Any]], title: str) -> Table:
    shared = common_overrides(rows)
    t = Table(title=title + (f"\nevery run: {' '.join(shared)}" if shared else ""))
    for col in (
        "run",
        "overrides",
        "status",
        "changed",
        "oracle",
        "agree",
        "top-k",
        "cache held",
        "native",
        "tok/s",
        "note",
    ):
        t.add_column(col, justify="left" if col in ("overrides", "status", "note", "oracle") else "right")
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    for r in rows:
        if r.get("plan_exact") is False:
            oracle = f"lossy {r['oracle_max_dlogit']:.1e}"
        else:
            oracle = "-" if r.get("oracle_pass") is None else ("pass" if r["oracle_pass"] else "[red]FAIL[/]")
        note = r.get("error") or (f"same plan as run {r['same_as']}" if r.get("same_as") else "")
        if r.get("changes_nothing") and not r.get("error"):
            note = "; ".join(filter(None, ["the native plan (the preset changes no layer)", note]))
        status = r["status"] if r["status"] == "ok" else f"[red]{r['status']}[/]"
        own = " ".join(o for o in r.get("override_list", []) if o not in shared)
        t.add_row(
            r["run"],
            own,
            status,
            "-" if r.get("changed_layers") is None else str(r["changed_layers"]),
            oracle,
            pct(r.get("agreement")),
            pct(r.get("pass_rate")),
            format_bytes(r.get("cache_bytes_held")),
            format_bytes(r.get("cache_bytes_native")),
            "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.0f}",
            note,
        )
    return t


class SweepSummary(Callback):
    """After `python run.py -m ...`: a table over every run's results.json (console, sweep_summary.json in the
    sweep directory, a W&B run named "sweep summary" in the sweep's group), and a non-zero exit status when any run
    failed (a user error, a crash, or an exact plan failing its oracle)."""

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        from experiments import EXIT
        from experiments.core.common import make_console

        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = sweep_rows(sweep_dir)
        if not rows:
            return
        console = make_console()
        group = config.logger.get("group") or f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}"
        console.print(sweep_table(rows, f"sweep {group}: {len(rows)} runs ({sweep_dir})"))
        path = sweep_dir / "sweep_summary.json"
        write_text(path, json.dumps(rows, indent=2, default=str))
        failed = [r for r in rows if r["status"] != "ok"]
        if any(r.get("same_as") for r in rows):
            console.print(
                "[yellow]some runs have the same plan and settings as an earlier one (an override their "
                "preset does not use): see the note column[/]"
            )
        try:
            from hybridcache.tools.tracking import Tracker

            tracker = Tracker(
                config.logger.mode,
                config.logger.project,
                sweep_dir,
                {"sweep_dir": str(sweep_dir)},
                group=group,
                name="sweep summary",
                job_type="sweep-summary",
            )
            columns = [c for c in rows[0] if c not in ("error", "override_list")]
            tracker.table(
                "sweep",
                columns,
                [
                    [json.dumps(r.get(c)) if isinstance(r.get(c), (list, dict)) else r.get(c) for c in columns]
                    for r in rows
                ],
            )
            tracker.summary({"runs": len(rows), "failed": len(failed)})
            sync = tracker.sync_command
            tracker.finish()
            if sync:
                console.print(f"W&B sweep summary (offline): upload with {sync}")
        except Exception as e:  # noqa: BLE001 - the summary file is already written
            console.print(f"[yellow]W&B sweep summary not logged ({type(e).__name__}: {e})[/]")
        console.print(f"sweep summary: {path}")
        if failed:
            console.print(f"[bold red]{len(failed)} of {len(rows)} runs failed[/]")
            EXIT.fail(max(int(r.get("exit_code") or 1) for r in failed))
