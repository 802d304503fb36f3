"""The command line, checked before anything heavy is imported (no torch, no transformers: a fraction of a second).

A usage error is a command that cannot mean anything: an override Hydra cannot parse, an unknown flag, a misspelt
choice (`model=jamab`), a setting that does not exist (`model.sed=1`), a value of the wrong type (`model.seed=abc`,
`cache.attention.window=abc`), several values without `-m`. It ends the command with one line, `error: ...`, naming
the known choices and the closest one, and exit status 2, before any run starts (in a sweep too). So does a value
out of range (`max_new_tokens=0`, `cache.attention.window=-3`, `model.device=tpu`, an unknown cache type: see
value_checks.py), before Hydra creates the output directory. Whether a device is present, a cache type can serve a
layer or a file matches is each run's own check (`common.preflight`).

Choices come from Hydra's own config search path (configs/, `--config-dir`, `hydra.searchpath=[...]`: presets added
that way are known); types from the composed config itself: a setting takes the type of its default (null takes
anything), and cache size fields (null by default) take integers (`cache_config.SIZE_FIELDS`). Everything that passes
is composed again by Hydra as usual; a check that cannot decide (an unexpected error here) leaves the command to Hydra.
"""

from __future__ import annotations

import difflib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from experiments.core.cache_config import SIZE_FIELDS, size_field_problem
from experiments.core.config_schema import SCHEMA_GROUPS
from experiments.core.value_checks import (
    RENAMED_PARAMETERS,
    RENAMED_SETTINGS,
    config_problems,
    renamed_problem,
    value_problem,
)

#: Settings that are null by default, with a value of the type they take (any other setting: its default's type).
NULL_DEFAULT_TYPES = {"prefill_chunk_size": 1, "oracle_tolerance": 1.0}
#: Choices that an optional extra of ours installs (pyproject.toml), named when they are missing.
EXTRA_CHOICES = {("hydra/launcher", "submitit_slurm"): "cluster", ("hydra/launcher", "submitit_local"): "cluster"}
#: Flags after which Hydra does not run the app (help, completion, info): left to Hydra unchecked.
_NOT_A_RUN = ("help", "hydra_help", "shell_completion", "experimental_rerun")


class UsageError(Exception):
    """A command line that cannot run: one line, exit status 2."""


def exit_on_usage_error(argv: list[str], config_dir: str | Path) -> None:
    """Print `error: <one line>` and exit with status 2 if `argv` is not a usable command line; else return."""
    message = usage_error(argv, config_dir)
    if message:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def usage_error(argv: list[str], config_dir: str | Path) -> str | None:
    """The one-line reason `python run.py ARGV` cannot run, or None (None too when this check cannot decide)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with warnings.catch_warnings():  # Hydra's own warnings (a missing searchpath entry) come when it runs
            warnings.simplefilter("ignore")
            _check(list(argv), Path(config_dir))
    except UsageError as e:
        return str(e)
    except (HydraException, OmegaConfBaseException, ValueError) as e:  # Hydra's own composition errors, on one line
        return _composition_error(e)
    except Exception:  # noqa: BLE001 - not a usage error this check knows: Hydra reports it as it always did
        return None
    return None


# -- the check -----------------------------------------------------------------------------------------------------
def _check(argv: list[str], config_dir: Path) -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path, get_args_parser
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.object_type import ObjectType
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException
    from hydra.types import RunMode

    parser = get_args_parser()
    parser.error = _flag_error  # argparse's multi-line usage message -> one line
    if any(a == "--version" for a in argv):
        return
    args = parser.parse_args(argv)
    if any(getattr(args, name, None) for name in _NOT_A_RUN) or args.info is not None or args.config_path:
        return
    search_path = create_config_search_path(str(config_dir))
    if args.config_dir is not None:  # as hydra.main adds it
        extra = os.path.abspath(args.config_dir)
        if not os.path.isdir(extra):
            raise UsageError(f"--config-dir {extra}: no such directory")
        search_path.prepend(provider="command-line", path=f"file://{extra}", anchor=SearchPathQuery(provider="schema"))
    loader = ConfigLoaderImpl(config_search_path=search_path)
    config_name = args.config_name or "config"
    try:
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(args.overrides)
    except OverrideParseException as e:
        reason = " ".join(" ".join(line for line in e.message.splitlines() if not line.startswith("See")).split())
        raise UsageError(
            f"cannot parse '{e.override}': {reason} (override grammar: "
            "https://hydra.cc/docs/advanced/override_grammar/basic)"
        ) from None
    searchpath = [o.input_line for o in overrides if o.key_or_group == "hydra.searchpath"]

    def options(group: str, kind=ObjectType.CONFIG) -> list[str]:
        return loader.get_group_options(group, results_filter=kind, config_name=config_name, overrides=searchpath)

    groups = set(options("", ObjectType.GROUP))

    def is_group(o) -> bool:
        return "/" in o.key_or_group or o.key_or_group in groups

    # what each override expands to: itself, or one override per value of a sweep (a glob: the options it matches)
    parse = OverridesParser.create(config_loader=loader).parse_overrides
    expanded: list[list[Any]] = []
    for o in overrides:
        if o.is_sweep_override() and not args.multirun:
            raise UsageError(
                f"'{o.input_line}' gives several values: add -m (--multirun) to run each, or write "
                f"a list as {o.get_key_element()}=[...]"
            )
        if not o.is_sweep_override():
            expanded.append([o])
        elif o.is_discrete_sweep():
            expanded.append(parse([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]))
        elif any(x.key_or_group == "hydra/sweeper" for x in overrides):
            expanded.append([])  # an interval, for the chosen sweeper plugin
        else:
            raise UsageError(
                f"'{o.input_line}': Hydra's basic sweeper runs lists and range(); interval() needs a "
                "sweeper plugin (hydra/sweeper=...)"
            )
        if is_group(o) and not o.is_delete():
            known = options(o.key_or_group)
            for x in expanded[-1]:
                for choice in x.value() if isinstance(x.value(), list) else [x.value()]:
                    if not isinstance(choice, str) or choice not in known:
                        raise UsageError(_not_a_choice(x.get_key_element(), choice, known))

    # compose once per distinct choice of the config groups: the first value of every override, then each other
    # value of a group override in turn; every value of a value sweep is checked against the first composition
    first = [x[0] if x else None for x in expanded]
    jobs = [first] + [
        first[:i] + [x] + first[i + 1 :] for i, o in enumerate(overrides) if is_group(o) for x in expanded[i][1:]
    ]
    for n, job in enumerate(jobs):
        job = [x for x in job if x is not None]
        setup = [x.input_line for x in job if is_group(x) or x.is_hydra_override()]
        cfg = loader.load_configuration(config_name, setup, run_mode=RunMode.RUN)
        tree = _tree(cfg)
        settings = [x for x in job if not (is_group(x) or x.is_hydra_override())]
        for x in settings:  # a value sweep: all its values against the first composition, its first after that
            for y in next(xs for xs in expanded if xs and xs[0] is x) if n == 0 else [x]:
                _check_setting(y, tree, groups)
                problem = None if y.is_delete() else value_problem(y.key_or_group, y.value())
                if problem:
                    raise UsageError(problem)
        _apply(settings, cfg)  # whatever Hydra itself would refuse (+key that exists, ~key that does not, ...)
        problems = config_problems(_tree(cfg))  # values in range, the presets' own too (value_checks.py)
        if problems:
            raise UsageError(problems[0])


def _check_setting(o, tree: dict, groups: set[str]) -> None:
    """One `key=value` against the composed config: the key exists (or is added with +), the value has its type."""
    key, value = o.key_or_group, o.value()
    parts = key.split(".")
    if parts[0] == "cache" and parts[-1] in RENAMED_PARAMETERS:
        raise UsageError(renamed_problem(key))
    new = RENAMED_SETTINGS.get(key, "").split(".")
    if len(new) == 2 and isinstance(tree.get(new[0]), dict) and new[1] in tree[new[0]]:  # where the new one exists
        raise UsageError(f"{key} was renamed to {'.'.join(new)}")
    if (
        parts[0] == "cache"
        and parts[-1] in SIZE_FIELDS
        and value is not None
        and (isinstance(value, bool) or not isinstance(value, int))
    ):  # null by default: typed by the cache schema
        raise UsageError(size_field_problem(key.removeprefix("cache."), parts[-1], value))
    node: Any = tree
    for depth, part in enumerate(parts):
        children = (
            node
            if isinstance(node, dict)
            else {str(j): x for j, x in enumerate(node)}
            if isinstance(node, list)
            else None
        )
        if children is None or part not in children:
            if o.is_add() or o.is_force_add():
                return  # a new key (Hydra checks that its parent can hold it)
            parent = ".".join(parts[:depth])
            known = sorted(set(children or {}) | (groups - {"hydra", *SCHEMA_GROUPS} if depth == 0 else set()))
            raise UsageError(_unknown_setting(o, parent, part, known))
        node = children[part]
    if o.is_delete():
        return
    problem = _type_problem(NULL_DEFAULT_TYPES.get(key) if node is None else node, value)
    if problem:
        default = _show(node)
        default = default if len(default) <= 40 else default[:37] + "..."
        raise UsageError(f"{o.input_line}: {key} takes {problem} (its default is {default}), got {_show(value)}")


def _type_problem(default: Any, value: Any) -> str | None:
    """What `value` should be, given the setting's default (null: anything; an interpolation: not checked here)."""
    if default is None or value is None or any(isinstance(x, str) and "${" in x for x in (default, value)):
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if isinstance(default, float):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if isinstance(default, str):
        return None if isinstance(value, (str, int, float)) and not isinstance(value, bool) else "a string"
    if isinstance(default, list):
        return None if isinstance(value, list) else "a list [a,b,...]"
    if isinstance(default, dict):
        return None if isinstance(value, dict) else "a mapping {key: value, ...}"
    return None


# -- helpers ---------------------------------------------------------------------------------------------------------
def _flag_error(message: str):
    raise UsageError(f"{message} (python run.py --help)")


def _tree(cfg) -> dict:
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False)
    tree.pop("hydra", None)
    return tree


def _apply(settings: list, cfg) -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(settings, cfg)


def _closest(word: str, known: list[str]) -> str | None:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.0)
    return close[0] if close else None


def _not_a_choice(key: str, value: Any, known: list[str]) -> str:
    group = key.lstrip("+~")
    extra = EXTRA_CHOICES.get((group, value)) if isinstance(value, str) else None
    if extra:
        return f"{key}={value} needs the '{extra}' extra: pip install -e \".[{extra}]\" (known now: {', '.join(known)})"
    closest = _closest(str(value), known) if isinstance(value, str) else None
    hint = f"did you mean {group}={closest}? " if closest else ""
    shown = value if isinstance(value, str) else _show(value)
    return f"{key}={shown}: no such {group} ({hint}known: {', '.join(known)})"


def _unknown_setting(o, parent: str, part: str, known: list[str]) -> str:
    closest = _closest(part, known)
    where = f"'{parent}' has no setting '{part}'" if parent else f"there is no setting '{part}'"
    hint = f"did you mean {parent + '.' if parent else ''}{closest}? " if closest else ""
    add = "" if o.is_delete() else f"; to add a new one: +{o.key_or_group}=..."
    return f"{o.input_line}: {where} ({hint}known: {', '.join(known) or 'none'}{add})"


def _show(value: Any) -> str:
    """A value as it is written on the command line (strings quoted, so 'abc' reads as a string)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value) if isinstance(value, str) else str(value)


def _composition_error(e: BaseException) -> str:
    """Hydra's error with its cause: a structured config's type error (experiments/core/config_schema.py) reads
    `cache.recurrent.offload=maybe: Value 'maybe' is not a valid bool (type str)`."""
    message = _one_line(e)
    cause = e.__cause__
    prefix = "Error merging override "  # Hydra says only which override; its cause says why
    if message.startswith(prefix) and cause is not None and str(cause).strip():
        message = f"{message.removeprefix(prefix)}: {_one_line(cause)}"
    return message


def _one_line(e: BaseException) -> str:
    """Hydra's or OmegaConf's message without its indented details and pointers to docs."""
    noise = (
        "full_key:",
        "object_type=",
        "reference_type=",
        "See https",
        "Set the environment variable",
        "Config search path",
        "provider=",
    )
    text = str(e).strip() or str(e.__cause__ or "")
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.startswith(("\t", "  ")) and not line.strip().startswith(noise)
    ]
    return " ".join(" ".join(lines).split()) or type(e).__name__
