"""Generated bad command lines for `python run.py`: misspelt choices, unknown settings, values of the wrong type,
broken override grammar, unknown flags. In-process, experiments.core.usage.usage_error must give one line for each;
a seeded sample of 30 runs the real CLI in subprocesses (tests/app/test_cli_usage.run_cli): exit status 2, one
line `error: ...`, no run started."""

from concurrent.futures import ThreadPoolExecutor

from experiments.core.usage import usage_error
from tests.app.test_cli_usage import CONFIGS, run_cli
from tests.hostile.kit import COUNTS, report, rng

GROUPS = {
    g: sorted(p.stem for p in (CONFIGS / g).glob("*.yaml")) for g in ("model", "cache", "experiment", "reference")
}
#: top-level settings and their kinds (the defaults' types, see configs/config.yaml)
INT_SETTINGS = [
    "seed",
    "max_new_tokens",
    "model.seed",
    "top_k",
    "prefill_chunk_size",
    "cache.attention.window",
    "cache.attention.chunk_size",
]
BOOL_SETTINGS = ["generation.compile"]
KNOWN = {
    "seed",
    "max_new_tokens",
    "top_k",
    "model",
    "cache",
    "experiment",
    "reference",
    "prompts",
    "generation",
    "logger",
    "home",
    "oracle_tolerance",
    "prefill_chunk_size",
    "model_name",
    "cache_name",
}
LETTERS = "abcdefghijklmnopqrstuvwxyz_"


def misspell(r, word, known):
    """`word` with one or two random edits that is not in `known` (and not empty)."""
    for _ in range(100):
        w = list(word)
        for _ in range(r.choice([1, 1, 2])):
            op, at = r.randrange(4), r.randrange(len(w) + 1)
            if op == 0 and len(w) > 1:
                del w[min(at, len(w) - 1)]
            elif op == 1:
                w.insert(at, r.choice(LETTERS))
            elif op == 2 and len(w) > 1:
                i = min(at, len(w) - 2)
                w[i], w[i + 1] = w[i + 1], w[i]
            else:
                w[min(at, len(w) - 1)] = r.choice(LETTERS)
        out = "".join(w)
        if out and out not in known and out.strip("_") == out:
            return out
    return word + "zz"


def bad_argv(r):
    kind = r.randrange(7)
    if kind == 0:
        group = r.choice(sorted(GROUPS))
        return [f"{group}={misspell(r, r.choice(GROUPS[group]), GROUPS[group])}"]
    if kind == 1:
        setting = r.choice(INT_SETTINGS)
        return [f"{setting}={r.choice(['abc', '1.5', '1e3', '[1]', '{a:1}', 'true', 'x1', '0x', '--'])}"]
    if kind == 2:
        return [f"{r.choice(BOOL_SETTINGS)}={r.choice(['maybe', '2', 'abc', '[true]'])}"]
    if kind == 3:
        return [f"{misspell(r, r.choice(sorted(KNOWN - {'model', 'cache', 'experiment', 'reference'})), KNOWN)}=1"]
    if kind == 4:
        return [f"model.{misspell(r, 'seed', {'seed', 'size'})}=1"]
    if kind == 5:
        return [
            r.choice(
                [
                    "model=[",
                    "model=jamba,gemma3",
                    "=x",
                    "model={",
                    "seed=1)",
                    "model=jamba]",
                    "+=3",
                    "cache.attention.window=${oops",
                    "seed=",
                    "~",
                    "model==jamba",
                ]
            )
        ]
    flag = misspell(r, r.choice(["multirun", "config-dir", "cfg", "info", "help"]), FLAGS)
    if any(f.startswith(flag) for f in FLAGS):
        flag += "zz"  # argparse takes an unambiguous prefix of a flag (--he: --help) as that flag
    return [f"--{flag}"]


FLAGS = {
    "multirun",
    "cfg",
    "info",
    "help",
    "config-dir",
    "config-name",
    "resolve",
    "package",
    "run",
    "hydra-help",
    "version",
    "config-path",
    "shell-completion",
    "experimental-rerun",
}


def _cases(n):
    r = rng("cli")
    seen, out = set(), []
    while len(out) < n:
        argv = bad_argv(r)
        if tuple(argv) not in seen:
            seen.add(tuple(argv))
            out.append(argv)
    return out


CASES = _cases(100)


def test_generated_bad_command_lines_are_one_line_usage_errors():
    problems = []
    for argv in CASES:
        COUNTS["cli (in-process)"] += 1
        try:
            message = usage_error(argv, CONFIGS)
        except BaseException as e:  # noqa: BLE001 - reported
            problems.append(f"{argv}: {type(e).__name__}: {e}")
            continue
        if not message or "\n" in message.strip():
            problems.append(f"{argv}: {message!r}")
    assert not problems, report(problems, len(CASES))


def test_a_sample_of_them_exits_2_with_one_line_in_a_subprocess(tmp_path):
    sample = rng("cli sample").sample(CASES, 30)

    def one(i_argv):
        i, argv = i_argv
        where = tmp_path / f"r{i}"
        where.mkdir()
        code, err, _ = run_cli(where, *argv, importtime=False)
        ok = code == 2 and len(err) == 1 and err[0].startswith("error: ") and not (where / "out").exists()
        return None if ok else f"{argv}: exit {code}, stderr {err[:3]}"

    with ThreadPoolExecutor(2) as pool:
        problems = [p for p in pool.map(one, enumerate(sample)) if p]
    COUNTS["cli (subprocess)"] += len(sample)
    assert not problems, report(problems, len(sample))
