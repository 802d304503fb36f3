"""Which HF causal LM families the bridge serves, measured: every entry of transformers' CausalLM auto mapping, on a
tiny random checkpoint built with HF's own classes (tiny_hf.py), generated with HF's own cache and with the bridge.

Per family: HF's own `generate` (greedy, a left-padded batch of 2, 7 prompt tokens, 12 new tokens, float32) with
its default cache is the reference; the same call with `cache_for(model)` (native config) must give the same
tokens and logits within `TOLERANCE`. A family HF itself cannot generate with (or that is an encoder-decoder) is
listed with the reason and not counted as a target.

    python -m hybridcache.hf.coverage [--write docs/hf_bridge.md] [model_type ...]
"""

from __future__ import annotations

import argparse
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

TOLERANCE = 1e-4
NOT_RUN = "the tiny checkpoint does not run in HF"  # its config shrink fails or needs inputs beyond text
PROMPT, NEW = 7, 12


@dataclass
class Row:
    family: str
    model_class: str
    hf_runs: bool
    bridge_runs: bool = False
    native_equal: bool = False
    max_dlogit: float | None = None
    layers: str = ""
    note: str = ""

    @property
    def target(self) -> bool:
        return self.hf_runs

    @property
    def covered(self) -> bool:
        return self.hf_runs and self.bridge_runs and self.native_equal


def families() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of two prompts: ids [2, PROMPT] (no pad / eos ids) and its mask (row 0: 2 pads)."""
    ids = torch.randint(3, 300, (2, PROMPT), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


def generate(model, ids, mask, cache=None, **kw):
    with torch.no_grad():
        return model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            **({} if cache is None else {"cache": cache}),
            **kw,
        )


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:150].replace("|", "/")


def holds_cache(cache) -> bool:
    """Whether HF's generate kept a transformers Cache with something in it (a family-specific Cache class counts)."""
    from transformers import Cache, DynamicCache

    if not isinstance(cache, Cache):
        return False
    if type(cache) is not DynamicCache:
        return True
    return any(
        getattr(layer, "keys", None) is not None or any(getattr(layer, "has_previous_state", {}).values())
        for layer in cache.layers
    )


def describe(cache) -> str:
    counts: dict[str, int] = {}
    for p in cache.plan.layers:
        counts[p.type] = counts.get(p.type, 0) + 1
    return ", ".join(f"{t} x{n}" for t, n in counts.items())


def check_family(model_type: str, model_class: str) -> Row:
    """Build, generate with HF's cache, generate with the bridge, compare."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hybridcache.hf import cache_for
    from hybridcache.hf.tiny_hf import tiny_model

    row = Row(model_type, model_class, hf_runs=False)
    try:
        if getattr(CONFIG_MAPPING[model_type](), "is_encoder_decoder", False):
            row.note = "encoder-decoder (not a decoder-only family)"
            return row
    except Exception as e:  # noqa: BLE001 - the default config itself does not build
        row.note = f"{NOT_RUN}: its default config does not build: {_short(e)}"
        return row
    try:
        model = tiny_model(model_type, causal_lm_class=model_class)
        ids, mask = inputs()
        ref = generate(model, ids, mask)
    except Exception as e:  # noqa: BLE001 - HF cannot build or generate with this tiny checkpoint: not measured
        row.note = f"{NOT_RUN}: {_short(e)}"
        return row
    if not holds_cache(ref.get("cache")):
        row.note = "HF's generate keeps no Cache for it (it recomputes every step, or keeps state elsewhere)"
        return row
    row.hf_runs = True
    try:
        cache = cache_for(model)
        row.layers = describe(cache.hybrid if cache.hybrid is not None else cache)
        out = generate(model, ids, mask, cache=cache)
        row.bridge_runs = True
        row.max_dlogit = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits))
        same = torch.equal(ref.sequences, out.sequences)
        row.native_equal = same and row.max_dlogit <= TOLERANCE
        if not same:
            row.note = "tokens differ from HF's own cache"
        if not row.native_equal:  # is it the bridge, or any cache handed in by the caller?
            from transformers import DynamicCache

            given = generate(model, ids, mask, cache=DynamicCache(config=model.config.get_text_config(decoder=True)))
            if not torch.equal(given.sequences, ref.sequences) or any(
                float((a - b).abs().max()) > TOLERANCE for a, b in zip(ref.logits, given.logits)
            ):
                row.note = (
                    f"{row.note}; HF's own DynamicCache handed in by the caller differs from HF's default run too "
                    "(the model keeps state outside its cache)"
                ).lstrip("; ")
    except Exception as e:  # noqa: BLE001 - the bridge's failure is the finding
        row.note = _short(e)
    return row


def table(rows: list[Row]) -> str:
    targets = [r for r in rows if r.target]
    covered = [r for r in targets if r.covered]
    unmeasured = [r for r in rows if r.note.startswith(NOT_RUN)]
    lines = [
        f"{len(covered)} of {len(targets)} families HF itself generates with are covered (native config: the same "
        f"tokens as HF's own cache, logits within {TOLERANCE:g}); {len(rows)} entries in transformers "
        f"{_tf_version()}'s CausalLM mapping, {len(unmeasured)} of them not measured ({NOT_RUN}).",
        "",
        "| family | HF class | HF runs | bridge runs | native == HF's own cache | max abs d logit | our layers "
        "| notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: "no"}
    for r in rows:
        d = "" if r.max_dlogit is None else f"{r.max_dlogit:.1e}"
        bridge = yes[r.bridge_runs] if r.hf_runs else "-"
        equal = yes[r.native_equal] if r.bridge_runs else "-"
        lines.append(
            f"| {r.family} | {r.model_class} | {yes[r.hf_runs]} | {bridge} | {equal} | {d} | {r.layers} | {r.note} |"
        )
    return "\n".join(lines) + "\n"


def _tf_version() -> str:
    import transformers

    return transformers.__version__


class _Timeout(Exception):
    pass


def run(selected: list[str] | None = None, seconds: int = 120, progress=None) -> list[Row]:
    rows = []
    mapping = families()
    for model_type in selected or list(mapping):

        def alarm(*_):
            raise _Timeout(f"over {seconds} s")

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.alarm(seconds)
        t = time.perf_counter()
        try:
            row = check_family(model_type, mapping[model_type])
        except _Timeout as e:
            row = Row(model_type, mapping[model_type], hf_runs=False, note=f"timed out ({e})")
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        rows.append(row)
        if progress is not None:
            progress(row, time.perf_counter() - t)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="model types (default: every CausalLM family)")
    parser.add_argument("--write", type=Path, help="write the table (markdown) into this page, between its markers")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers.utils.logging as hf_logging
    from rich.progress import Progress

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    selected = args.families or list(families())
    with Progress() as bar:
        task = bar.add_task("families", total=len(selected))

        def progress(row: Row, seconds: float) -> None:
            state = "covered" if row.covered else ("not a target" if not row.target else "NOT covered")
            bar.console.print(f"{row.family}: {state} ({seconds:.1f} s) {row.note}")
            bar.advance(task)

        rows = run(selected, progress=progress)
    text = table(rows)
    if args.write:
        write_table(args.write, text)
    print(text.splitlines()[0])


START, END = "<!-- coverage:start -->", "<!-- coverage:end -->"


def write_table(path: Path, text: str) -> None:
    """Write the table into `path` between its START / END markers (a docs page), or as the whole file."""
    page = path.read_text() if path.exists() else ""
    if START in page and END in page:
        head, rest = page.split(START, 1)
        text = f"{head}{START}\n{text}{END}{rest.split(END, 1)[1]}"
    path.write_text(text)


if __name__ == "__main__":
    main()
