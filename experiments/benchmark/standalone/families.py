"""Per-family decode speed: ours (hybridcache.generate) against HF transformers' generate on the same checkpoint.

python -m experiments.benchmark.standalone.families [--families jamba lfm2 ...] [--size tiny|mid] [--repeats 5]

Per family: greedy, batch 1, a 32-token random prompt, 64 new tokens, no eos stop on either side; the two systems
take turns within each round (a slow stretch of the machine hits both alike) and each reports its median over the
rounds of the whole generate call (prefill + decode). The tokens of both are checked equal. One thread. `--size mid`
builds a 100-300M-parameter random config of the family with HF's own classes (MID below) in a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

PROMPT_TOKENS = 32
NEW_TOKENS = 64

# Mid-size configs: the tiny family's config with these overrides (100-300M parameters with the tiny vocabulary).
MID = {
    "jamba": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_dt_rank=64,
    ),
    "bamba": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, mamba_n_heads=32, mamba_d_head=64),
    "lfm2": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=16,
        layer_types=["conv", "conv", "full_attention"] * 4,
    ),
}


@dataclass
class Row:
    family: str
    ours_s: float
    hf_s: float
    equal: bool

    @property
    def ratio(self) -> float:
        return self.hf_s / self.ours_s


def _checkpoint(family: str, size: str, tmp: str):
    from hybridcache.checkpoints.tiny import build_tiny_checkpoint, tiny_checkpoint

    if size == "tiny":
        return tiny_checkpoint(family)
    if family not in MID:
        raise ValueError(f"no mid-size config for {family!r}; known: {', '.join(MID)}")
    return build_tiny_checkpoint(family, os.path.join(tmp, family), **MID[family])


def measure(family: str, size: str = "tiny", repeats: int = 5, tmp: str | None = None) -> Row:
    """Time ours and HF's greedy generate on `family`'s checkpoint, alternating, and compare their tokens."""
    import transformers

    import hybridcache as hc

    path = _checkpoint(family, size, tmp or tempfile.gettempdir())
    ours = hc.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    hf.generation_config.eos_token_id = None  # else HF falls back to the checkpoint's eos and may stop early
    gen_cfg = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None
    )
    ids = torch.randint(3, min(300, ours.vocab_size), (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))

    def run_ours() -> torch.Tensor:
        return hc.generate(ours, ids, max_new_tokens=NEW_TOKENS, output_logits=False).sequences

    def run_hf() -> torch.Tensor:
        return hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)

    with torch.inference_mode():
        a, b = run_ours(), run_hf()  # warm-up (kernels, first-call allocations)
        times_ours, times_hf = [], []
        for _ in range(repeats):
            for fn, times in ((run_ours, times_ours), (run_hf, times_hf)):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
    equal = a.shape == b.shape and bool(torch.equal(a, b))
    return Row(family, statistics.median(times_ours), statistics.median(times_hf), equal)


def table(rows: list[Row]) -> str:
    lines = ["| family | ours ms | HF ms | HF / ours | tokens equal |", "|---|---|---|---|---|"]
    for r in rows:
        equal = "yes" if r.equal else "NO"
        lines.append(f"| {r.family} | {1e3 * r.ours_s:.1f} | {1e3 * r.hf_s:.1f} | {r.ratio:.2f}x | {equal} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from hybridcache.checkpoints.tiny import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=None)
    parser.add_argument("--size", choices=("tiny", "mid"), default="tiny")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    families = args.families or (list(FAMILIES) if args.size == "tiny" else list(MID))
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            try:
                rows.append(measure(family, args.size, args.repeats, tmp))
            except Exception as err:  # one family that fails to load must not hide the others
                print(f"{family}: failed: {type(err).__name__}: {err}", flush=True)
                continue
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(
        f"\n{PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, batch 1, greedy, medians of {args.repeats}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
